"""The retail environment: tools over one episode's orders database, scored on its final state.

The task (``dora.tasks.retail``) says what the customer wants; here the agent finds the order
with ``find_customer`` and ``list_orders`` and makes the change with ``cancel_order``,
``change_address`` or ``return_items``. A tool refuses what the store would refuse (a
delivered order cannot be cancelled) with a message the agent can read. Reward 1.0 when the
final database equals the initial one with exactly the goal applied, else 0.0.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from dora.envs.base import AssistantTurn, ChatMessage, StepResult
from dora.envs.registry import EnvironmentConfig
from dora.envs.tool_env import ToolEnvironment
from dora.envs.tools import Tool, ToolSet
from dora.events import Prompt
from dora.tasks.retail import Database, Order, apply_goal, build_database

SYSTEM = "You are a store's support agent. Use the tools to do what the customer asks."


class RetailTools:
    """The tools of one episode, bound to its database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def find_customer(self, name: str) -> dict[str, str]:
        """Find a customer by full name.

        Args:
            name: The customer's full name, e.g. "Ana Silva".
        """
        for cid, full in self.db.customers.items():
            if full.lower() == name.strip().lower():
                return {"customer_id": cid, "name": full}
        raise KeyError(f"no customer named {name!r}")

    def list_orders(self, customer_id: str) -> list[dict[str, Any]]:
        """List a customer's orders with their items, status and address.

        Args:
            customer_id: The id find_customer returned, e.g. "C101".
        """
        return [asdict(o) for o in self.db.orders.values() if o.customer_id == customer_id]

    def _order(self, order_id: str, status: str) -> Order:
        order = self.db.orders.get(order_id)
        if order is None:
            raise KeyError(f"no order {order_id!r}")
        if order.status != status:
            raise ValueError(f"order {order_id} is {order.status}, not {status}")
        return order

    def cancel_order(self, order_id: str) -> str:
        """Cancel a pending order.

        Args:
            order_id: The order's id, e.g. "W1042".
        """
        self._order(order_id, "pending").status = "cancelled"
        return f"order {order_id} cancelled"

    def change_address(self, order_id: str, address: str) -> str:
        """Change the delivery address of a pending order.

        Args:
            order_id: The order's id.
            address: The new address.
        """
        self._order(order_id, "pending").address = address
        return f"order {order_id} will go to {address}"

    def return_items(self, order_id: str, item_ids: list[str]) -> str:
        """Return items of a delivered order.

        Args:
            order_id: The order's id.
            item_ids: Ids of the items to return (keys of the order's items).
        """
        order = self._order(order_id, "delivered")
        unknown = sorted(set(item_ids) - set(order.items))
        if unknown or not item_ids:
            raise ValueError(f"not items of {order_id}: {unknown or 'none given'}")
        order.status, order.returned = "returned", sorted(item_ids)
        return f"return of {sorted(item_ids)} from {order_id} accepted"

    def toolset(self) -> ToolSet:
        names = ("find_customer", "list_orders", "cancel_order", "change_address", "return_items")
        return ToolSet(Tool.from_function(getattr(self, n)) for n in names)


class RetailEnvironment:
    """One retail episode: the tools act on a fresh database; scored on its final state."""

    def __init__(self, max_turns: int = 8) -> None:
        self.max_turns = max_turns
        self.inner: ToolEnvironment | None = None
        self.db: Database | None = None
        self.expected: dict[str, Any] = {}

    async def reset(self, prompt: Prompt, seed: int) -> list[ChatMessage]:
        self.db = build_database(int(prompt.metadata["db_seed"]))
        self.expected = apply_goal(self.db, json.loads(prompt.answer)).state()
        self.inner = ToolEnvironment(
            RetailTools(self.db).toolset(),
            system=SYSTEM,
            score=lambda _prompt, _answer: self._score(),
            max_turns=self.max_turns,
        )
        return await self.inner.reset(prompt, seed)

    async def step(self, turn: AssistantTurn) -> StepResult:
        assert self.inner is not None, "reset first"
        return await self.inner.step(turn)

    async def close(self) -> None:
        self.inner = self.db = None

    def _score(self) -> float:
        return float(self.db is not None and self.db.state() == self.expected)


class RetailEnvConfig(EnvironmentConfig):
    pass


def make_retail_environment(config: RetailEnvConfig) -> RetailEnvironment:
    return RetailEnvironment(max_turns=config.max_turns)
