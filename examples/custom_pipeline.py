"""Compose a small dora pipeline in Python: a built-in source, a decorator stage, a class stage.

    python examples/custom_pipeline.py [COUNT]

Runs on an embedded nats-server (JetStream under ``runs/<run_id>/``) and prints a summary.
"""

from __future__ import annotations

import ast
import asyncio
import operator
import sys
from pathlib import Path
from typing import Any

from dora.events import Prompt, RolloutRequest, Trajectory
from dora.models import CharTokenizer
from dora.pipeline import Pipeline
from dora.stage import Context, Reject, Stage, derived_id, stage
from dora.stages import PromptSource

_TOKENIZER = CharTokenizer.build()
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def safe_eval(expr: str) -> int:
    """Integer + - * only; anything else is refused (never ``eval``)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"unsupported expression {ast.dump(node)[:60]}")

    return walk(ast.parse(expr, mode="eval").body)


@stage(consumes="prompts", emits={Trajectory: "trajectories"}, concurrency=4)
async def calculator(prompt: Prompt, ctx: Context) -> Trajectory:
    """A decorator stage: the input model (Prompt) comes from the annotation."""
    terms = str(prompt.metadata.get("terms", ""))
    try:
        answer = safe_eval(terms)
    except (ValueError, SyntaxError) as exc:
        raise Reject(f"cannot evaluate {terms!r}: {exc}") from exc  # dead-lettered, not retried
    completion = f"answer: {answer}"
    ids = tuple(_TOKENIZER.encode(completion, add_eos=True))
    prompt_ids = tuple(_TOKENIZER.encode(prompt.text, add_bos=True))
    request = RolloutRequest(
        request_id=prompt.prompt_id,
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        group_id=prompt.prompt_id,
        group_index=0,
        version=0,
    )
    return Trajectory(
        event_id=derived_id(prompt.event_id, "calc"),  # redelivery republishes the same id
        request=request,
        version=0,
        prompt_token_ids=prompt_ids,
        completion_token_ids=ids,
        logprobs=(0.0,) * len(ids),
        loss_mask=(1,) * len(ids),
        text=completion,
        finish_reason="stop",
    )


class Tally(Stage):
    """A class stage: a sink that checks answers and ends the run after ``expect`` events."""

    consumes = "trajectories"
    finite = True

    def __init__(self, expect: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.expect = expect
        self.right: set[str] = set()
        self.wrong: set[str] = set()

    async def handle(self, traj: Trajectory, ctx: Context) -> None:
        given = traj.text.rsplit(":", 1)[-1].strip()
        ok = given == traj.request.prompt.answer
        (self.right if ok else self.wrong).add(traj.event_id)
        if len(self.right) + len(self.wrong) >= self.expect:
            ctx.complete()

    def progress_total(self) -> int | None:
        return self.expect

    def summary(self) -> dict[str, Any]:
        return {"right": len(self.right), "wrong": len(self.wrong)}


async def main(count: int = 20, run_dir: Path | None = None) -> dict[str, Any]:
    pipeline = Pipeline(name="custom", run_dir=run_dir)  # no bus, no URL: embedded nats-server
    pipeline.add(PromptSource(task="arithmetic", task_config={"max_terms": 6}, count=count))
    pipeline.add(calculator, replicas=2)
    pipeline.add(Tally(expect=count))
    return await pipeline.run()  # returns when Tally completes; writes summary.json


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    result = asyncio.run(main(n))
    tally = result["stages"]["tally"]
    print(f"run {result['run_id']}: {tally['right']} right, {tally['wrong']} wrong")
