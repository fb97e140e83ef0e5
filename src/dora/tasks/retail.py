"""The retail task (Tau-style): a customer's goal over an in-memory orders database.

Each problem is one database (built from ``db_seed``) and one goal: cancel a pending order,
change a pending order's address, or return items of a delivered order. The customer's
message says what they want, in words; the agent must find the order with the lookup tools
and make the one right change. Reward 1.0 when the final database equals the initial one with
exactly the goal applied (as Tau-bench scores), else 0.0: a wrong order cancelled, an extra
change or no change all score 0.

``RetailTask`` (task ``retail``) makes the prompts; the environment ``retail``
(``dora.envs.retail``) runs an episode with the tools. ``solve`` gives a reference transcript:
the tool calls that reach the goal, one per turn.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import Field

from dora.events import Prompt
from dora.tasks.base import BaseTask, Split, TaskConfig, check_split, rng_for, split_of

FIRST = ("Ana", "Ben", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun")
LAST = ("Silva", "Okafor", "Li", "Novak", "Haddad", "Berg", "Moreau", "Sato")
ITEMS = ("lamp", "kettle", "scarf", "mug", "chair", "blanket", "clock", "teapot", "rug")
STREETS = ("Elm St", "Oak Ave", "Pine Rd", "Lake Dr", "Hill Ln")
Goal = Literal["cancel", "address", "return"]


@dataclass
class Order:
    order_id: str
    customer_id: str
    items: dict[str, str]  # item id -> item name
    status: str  # pending, delivered, cancelled, returned
    address: str
    returned: list[str] = field(default_factory=list)


@dataclass
class Database:
    customers: dict[str, str]  # customer id -> full name
    orders: dict[str, Order]

    def state(self) -> dict[str, Any]:
        return {
            "customers": self.customers,
            "orders": {k: asdict(o) for k, o in self.orders.items()},
        }


def build_database(db_seed: int) -> Database:
    rng = rng_for("retail-db", db_seed)
    names = rng.sample([f"{f} {s}" for f in FIRST for s in LAST], 6)
    customers = {f"C{100 + i}": name for i, name in enumerate(names)}
    orders: dict[str, Order] = {}
    for n in range(14):
        oid = f"W{1000 + rng.randrange(9000)}"
        while oid in orders:
            oid = f"W{1000 + rng.randrange(9000)}"
        items = {f"I{n}{k}": rng.choice(ITEMS) for k in range(rng.randint(1, 3))}
        address = f"{rng.randint(1, 99)} {rng.choice(STREETS)}"
        status = rng.choice(("pending", "delivered"))
        orders[oid] = Order(oid, rng.choice(list(customers)), items, status, address)
    return Database(customers, orders)


def apply_goal(db: Database, goal: dict[str, Any]) -> Database:
    """The database with exactly ``goal`` applied (what a perfect agent leaves behind)."""
    done = copy.deepcopy(db)
    order = done.orders[goal["order_id"]]
    if goal["kind"] == "cancel":
        order.status = "cancelled"
    elif goal["kind"] == "address":
        order.address = goal["address"]
    else:
        order.status = "returned"
        order.returned = sorted(goal["item_ids"])
    return done


class RetailConfig(TaskConfig):
    eval_percent: int = Field(default=10, ge=1, le=50)


class RetailTask(BaseTask):
    """Prompts of the retail task (see module docstring)."""

    name = "retail"

    def __init__(self, config: RetailConfig | None = None) -> None:
        self.config = config or RetailConfig()

    def prompt(self, split: Split, index: int) -> Prompt:
        check_split(split)
        for attempt in range(1000):
            db_seed = index * 1000 + attempt
            if split_of(f"retail-{self.config.seed}-{db_seed}", self.config.eval_percent) == split:
                break
        db = build_database(db_seed)
        rng = rng_for("retail-goal", self.config.seed, db_seed)
        kind: Goal = rng.choice(("cancel", "address", "return"))
        wanted = "delivered" if kind == "return" else "pending"
        candidates = [o for o in db.orders.values() if o.status == wanted]
        order = rng.choice(candidates) if candidates else next(iter(db.orders.values()))
        if order.status != wanted:
            kind = "cancel" if order.status == "pending" else "return"
        name = db.customers[order.customer_id]
        things = ", ".join(sorted(set(order.items.values())))
        goal: dict[str, Any] = {"kind": kind, "order_id": order.order_id}
        if kind == "cancel":
            text = f"Hi, I'm {name}. Please cancel my order with the {things}; I no longer need it."
        elif kind == "address":
            goal["address"] = f"{rng.randint(100, 999)} {rng.choice(STREETS)}"
            text = (
                f"Hello, this is {name}. My order with the {things} has not shipped yet; "
                f"please send it to {goal['address']} instead."
            )
        else:
            item_id = rng.choice(sorted(order.items))
            goal["item_ids"] = [item_id]
            text = f"Hi, {name} here. I want to return the {order.items[item_id]} I received."
        return Prompt(
            prompt_id=self.prompt_id(self.config.seed, split, index),
            task=self.name,
            split=split,
            text=text,
            answer=json.dumps(goal, sort_keys=True),
            metadata={"db_seed": db_seed},
        )

    def solve(self, prompt: Prompt) -> str:
        """The reference: find the customer, list their orders, make the one change."""
        goal = json.loads(prompt.answer)
        db = build_database(int(prompt.metadata["db_seed"]))
        order = db.orders[goal["order_id"]]
        calls = [
            ("find_customer", {"name": db.customers[order.customer_id]}),
            ("list_orders", {"customer_id": order.customer_id}),
        ]
        if goal["kind"] == "cancel":
            calls.append(("cancel_order", {"order_id": order.order_id}))
        elif goal["kind"] == "address":
            calls.append(
                ("change_address", {"order_id": order.order_id, "address": goal["address"]})
            )
        else:
            calls.append(
                ("return_items", {"order_id": order.order_id, "item_ids": goal["item_ids"]})
            )
        turns = [
            f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls
        ]
        return "\n".join([*turns, "Done."])
