"""Warm start: supervised fine-tuning of the tiny model on a task's reference solutions.

RL needs a policy that already solves some problems (so rewards within a GRPO group differ)
but not all (so there is room to improve). ``warmstart`` trains for a fixed, small budget on
``task.solve`` demonstrations (loss on completion tokens only, packed rows, AdamW with warmup
and cosine decay), measures greedy accuracy on the eval split, and caches the resulting HF
directory under a hash of its config so every later run reuses it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import structlog
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dora import interrupt
from dora.events import Prompt
from dora.logs import notice
from dora.models.checkpoint import build_model, save_pretrained
from dora.models.llama import LlamaModel
from dora.models.tokenizer import CharTokenizer
from dora.tasks import Task, make_task
from dora.training.evaluate import evaluate_task

log = structlog.get_logger(__name__)

NOTE_EVERY_S = 30.0
"""Off a terminal, a warm-start progress line this often (a live bar shows only its end)."""

FORMAT_VERSION = 2
"""Bump when training code changes what a config produces (invalidates caches)."""
RESULT_FILE = "warmstart.json"


class WarmstartConfig(BaseModel):
    """Everything that determines the warm-start checkpoint (hashed into the cache key)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str = "tiny"
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    task: str = "arithmetic"
    task_config: dict[str, Any] = Field(default_factory=dict)
    steps: int = Field(default=150, ge=0)
    batch_tokens: int = Field(default=2048, ge=64, description="Tokens per optimizer step.")
    row_tokens: int = Field(default=512, ge=32, description="Length of a packed row.")
    long_examples: Literal["cut", "windows"] = Field(
        default="cut",
        description="An example longer than a row: 'cut' keeps its first row_tokens; "
        "'windows' keeps its prompt and a window of whole lines drawn from anywhere in the "
        "completion, at their true positions, so a long solution's middle and end are trained "
        "in rows of the short ones' cost.",
    )
    lr: float = Field(default=3e-3, gt=0.0)
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    warmup_steps: int = Field(default=15, ge=0)
    weight_decay: float = Field(default=0.01, ge=0.0)
    shortcut_fraction: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="Share of demonstrations that give only an answer line, no scratchpad.",
    )
    shortcut: Literal["answer", "guess"] = Field(
        default="answer",
        description="What a shortcut demonstration answers: the right answer, or a guess.",
    )
    shortcut_start: int = Field(
        default=0,
        ge=0,
        description="First step whose demonstrations include shortcuts: a late start lets the "
        "policy learn to solve on the whole early budget, then pick up the habit of answering "
        "without working, as a base model tuned on a little lazy data.",
    )
    easy_task_config: dict[str, Any] | None = Field(
        default=None,
        description="A curriculum: the first easy_steps draw problems from the task with this "
        "config (e.g. short problems only) before the full distribution.",
    )
    easy_steps: int = Field(default=0, ge=0)
    tool_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of demonstrations that call the calculator tool instead of working "
        "the problem out (multi-turn episodes: the call, the tool's reply as the environment "
        "renders it, the answer). The task must name its expression (``expression(prompt)``).",
    )
    seed: int = 0
    eval_prompts: int = Field(default=128, ge=0)
    group_prompts: int = Field(default=16, ge=0, description="Prompts for the group-of-8 check.")
    group_size: int = Field(default=8, ge=1)
    threads: int = Field(default=2, ge=1)

    @model_validator(mode="after")
    def _tool_task(self) -> WarmstartConfig:
        if self.tool_fraction and not hasattr(
            make_task(self.task, **self.task_config), "expression"
        ):
            raise ValueError(
                f"tool_fraction: task {self.task!r} names no calculator expression "
                "(it needs an expression(prompt) method)"
            )
        return self

    def key(self) -> str:
        """Cache key: hash of the config and the training-code version."""
        data = self.model_dump()
        added_later = {
            "shortcut_fraction": 0.0,
            "shortcut": "answer",
            "shortcut_start": 0,
            "easy_task_config": None,
            "easy_steps": 0,
            "tool_fraction": 0.0,
            "long_examples": "cut",
        }
        for name, default in added_later.items():
            if data[name] == default:  # fields added later: defaults keep cache keys valid
                del data[name]
        canon = json.dumps({"v": FORMAT_VERSION, **data}, sort_keys=True)
        return hashlib.sha256(canon.encode()).hexdigest()[:16]


def cache_root() -> Path:
    """``$DORA_CACHE/warmstart`` (default ``.dora-cache/warmstart``)."""
    return Path(os.environ.get("DORA_CACHE", ".dora-cache")) / "warmstart"


def is_complete(directory: Path) -> bool:
    """A finished warm-start directory (weights and result file present)."""
    return (directory / RESULT_FILE).is_file() and (directory / "model.safetensors").is_file()


_TOOL_REPLY = re.compile(r"(<tool>.*?</tool>\n?)", re.DOTALL)


def tool_reply_spans(tokenizer: CharTokenizer, completion: str) -> list[tuple[int, int]]:
    """Token spans of a demonstration's tool replies (``<tool>...</tool>``): the environment
    writes them in an episode, so, as there, they are context and carry no loss."""
    if "<tool>" not in completion:
        return []
    spans, at = [], 0
    for piece in _TOOL_REPLY.split(completion):
        n = len(tokenizer.encode(piece))
        if _TOOL_REPLY.fullmatch(piece):
            spans.append((at, at + n))
        at += n
    return spans


def encode_example(tokenizer: CharTokenizer, prompt: str, completion: str) -> tuple[list[int], int]:
    """``<bos> prompt completion <eos>`` and the index where the completion starts."""
    head = tokenizer.encode(prompt, add_bos=True)
    return head + tokenizer.encode(completion, add_eos=True), len(head)


def demonstration(
    task: Task,
    prompt: Prompt,
    shortcut_fraction: float,
    seed: int,
    shortcut: Literal["answer", "guess"] = "answer",
    tool_fraction: float = 0.0,
) -> str:
    """The reference solution or, with probability ``shortcut_fraction``, a bare answer line
    (or, with probability ``tool_fraction``, a calculator call: ``tool_demonstration``).

    A teacher that sometimes answers without showing its work gives a policy that holds both
    behaviours, so RL has a behaviour worth selecting (working the problem out), the situation
    of a real base model that often answers off the cuff. ``answer`` shortcuts state the right
    answer (a tiny model learns to sum short problems in one go about as well as with the
    scratchpad, so there is little to select); ``guess`` shortcuts state a made-up answer of
    the right size, so the bare answer is almost always wrong and the scratchpad is the only
    way to be right.
    """
    full = task.solve(prompt)
    rng = random.Random(f"{seed}:{prompt.prompt_id}")
    if tool_fraction and random.Random(f"tool:{seed}:{prompt.prompt_id}").random() < tool_fraction:
        return tool_demonstration(task, prompt, full)
    if rng.random() >= shortcut_fraction:
        return full
    last = full.rsplit("\n", 1)[-1]
    return last if shortcut == "answer" else guess_line(task, prompt, last, rng)


def tool_demonstration(task: Task, prompt: Prompt, solution: str) -> str:
    """The calculator called on the problem's expression, its reply exactly as an episode
    appends it (``dora.envs.chat.ChatFormat``'s default tool template), then the answer line:
    the tokens a live episode holds, so what is learnt here is what RL samples."""
    from dora.envs.calculator import calculator
    from dora.envs.chat import ChatFormat
    from dora.events import ChatMessage

    expression = task.expression(prompt)  # type: ignore[attr-defined]
    call = json.dumps(
        {"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":")
    )
    reply = ChatFormat().render([ChatMessage(role="tool", content=calculator(expression))])
    return f"<tool_call>{call}</tool_call>{reply}{solution.rsplit(chr(10), 1)[-1]}"


def guess_line(task: Task, prompt: Prompt, last_line: str, rng: random.Random) -> str:
    """The answer line with a made-up answer: the task's own ``guess`` if it has one, else the
    reference line with every digit redrawn (same length, no new leading zero)."""
    own = getattr(task, "guess", None)
    if own is not None:
        return str(own(prompt, rng))

    def redraw(match: re.Match[str]) -> str:
        digits = match.group(0)
        first = str(rng.randint(1, 9)) if len(digits) > 1 else str(rng.randint(0, 9))
        return first + "".join(str(rng.randint(0, 9)) for _ in digits[1:])

    return re.sub(r"\d+", redraw, last_line)


class Batch(NamedTuple):
    """``rows x row_tokens`` of packed examples."""

    ids: torch.Tensor
    segments: torch.Tensor
    """Which example each token belongs to: attention stays inside one."""
    loss_mask: torch.Tensor
    positions: torch.Tensor
    """Each token's position in its example (a window keeps the positions it has there)."""


def window(
    seq: list[int], start: int, row_tokens: int, newline: int, rng: random.Random
) -> tuple[list[int], list[int], int]:
    """``(tokens, positions, first_loss_index)`` of an example longer than ``row_tokens``: its
    prompt, then whole completion lines from a line start drawn uniformly (clamped so the
    window reaches the end: the end is drawn about as often as the room it takes). The
    window's first line is context only (its own previous line is not in the row)."""
    room = row_tokens - start
    if room <= 0:
        raise ValueError(f"a prompt of {start} tokens leaves no room in a row of {row_tokens}")
    completion = seq[start:]
    line_starts = [0] + [i + 1 for i, t in enumerate(completion[:-1]) if t == newline]
    last = next((o for o in line_starts if len(completion) - o <= room), len(completion) - room)
    offset = min(rng.choice(line_starts), last)
    piece = completion[offset : offset + room]
    positions = list(range(start)) + list(range(start + offset, start + offset + len(piece)))
    if offset == 0:
        return seq[:start] + piece, positions, start
    first_line = piece.index(newline) + 1 if newline in piece else len(piece)
    return seq[:start] + piece, positions, start + first_line


def packed_batches(
    task: Task,
    tokenizer: CharTokenizer,
    rows: int,
    row_tokens: int,
    shortcut_fraction: float = 0.0,
    seed: int = 0,
    shortcut: Literal["answer", "guess"] = "answer",
    shortcut_start: int = 0,
    easy: tuple[Task, int] | None = None,
    tool_fraction: float = 0.0,
    long_examples: Literal["cut", "windows"] = "cut",
) -> Iterator[Batch]:
    """Endless batches of ``rows x row_tokens`` tokens.

    Whole examples are packed greedily into rows (an example never spans two rows); one
    longer than a row is cut to its first ``row_tokens`` or, with ``long_examples="windows"``,
    becomes its prompt and one window of its completion (``window``). The loss mask marks
    completion tokens, so prompts and padding carry no loss. Batches before ``shortcut_start``
    draw no shortcut demonstrations; with ``easy = (task, steps)`` the first ``steps`` batches
    draw their problems from that easier task (a curriculum).
    """
    index = 0
    newline = tokenizer.encode("\n")[0]
    rng = random.Random(f"windows:{seed}")
    Pending = tuple[list[int], list[int], int, list[tuple[int, int]]]
    pending: Pending | None = None
    for batch in itertools.count():
        fraction = shortcut_fraction if batch >= shortcut_start else 0.0
        source = easy[0] if easy is not None and batch < easy[1] else task
        ids = torch.full((rows, row_tokens), tokenizer.pad_token_id, dtype=torch.long)
        seg = torch.zeros((rows, row_tokens), dtype=torch.long)
        mask = torch.zeros((rows, row_tokens), dtype=torch.bool)
        pos = torch.zeros((rows, row_tokens), dtype=torch.long)
        for r in range(rows):
            used, segment = 0, 0
            while True:
                if pending is None:
                    p = source.prompt("train", index)
                    index += 1
                    text = demonstration(source, p, fraction, seed, shortcut, tool_fraction)
                    seq, start = encode_example(tokenizer, p.text, text)
                    replies = tool_reply_spans(tokenizer, text)
                    if len(seq) <= row_tokens or long_examples == "cut":
                        seq = seq[:row_tokens]
                        pending = (seq, list(range(len(seq))), start, replies)
                    else:  # a tool demonstration (a call, an answer) always fits a row
                        pending = (*window(seq, start, row_tokens, newline, rng), [])
                seq, positions, start, replies = pending
                if used + len(seq) > row_tokens:
                    if used == 0:  # pragma: no cover - truncated above
                        raise AssertionError("example longer than a row")
                    break
                ids[r, used : used + len(seq)] = torch.tensor(seq)
                seg[r, used : used + len(seq)] = segment
                pos[r, used : used + len(seq)] = torch.tensor(positions)
                mask[r, used + start : used + len(seq)] = True
                for a, b in replies:  # tool replies: context, no loss
                    mask[r, used + start + a : used + start + b] = False
                used += len(seq)
                segment += 1
                pending = None
            seg[r, used:] = segment  # padding: its own segment, no loss
        yield Batch(ids, seg, mask, pos)


def lr_lambda(config: WarmstartConfig) -> Any:
    """Linear warmup then cosine decay to ``min_lr_ratio``."""

    def fn(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        span = max(1, config.steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / span)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (
            1 + math.cos(math.pi * progress)
        )

    return fn


def train(
    model: LlamaModel, tokenizer: CharTokenizer, task: Task, config: WarmstartConfig, progress: bool
) -> dict[str, Any]:
    """The SFT loop; returns training statistics."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    rows = max(1, config.batch_tokens // config.row_tokens)
    easy = None
    if config.easy_task_config is not None and config.easy_steps:
        easy_task = make_task(config.task, seed=config.seed, **config.easy_task_config)
        easy = (easy_task, config.easy_steps)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=config.lr,
        betas=(0.9, 0.98),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(config))
    batches = packed_batches(
        task,
        tokenizer,
        rows,
        config.row_tokens,
        config.shortcut_fraction,
        config.seed,
        config.shortcut,
        config.shortcut_start,
        easy,
        config.tool_fraction,
        config.long_examples,
    )
    model.train()
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    columns = (
        TextColumn("[bold]warm start"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
        TextColumn("{task.fields[tps]:.0f} tok/s"),
        TimeElapsedColumn(),
    )
    plain = progress and not sys.stderr.isatty()  # a live bar shows nothing until the end
    noted = start
    with Progress(*columns, disable=not progress or plain, transient=False) as bar:
        job = bar.add_task("train", total=config.steps, loss=float("nan"), tps=0.0)
        for step in range(config.steps):
            interrupt.check()  # Ctrl-C stops a warm start within one step
            ids, seg, mask, pos = next(batches)
            logits = model(ids, position_ids=pos, segment_ids=seg)
            target_mask = mask[:, 1:]
            loss = F.cross_entropy(logits[:, :-1][target_mask], ids[:, 1:][target_mask])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            tokens += int(ids.numel())
            elapsed = time.perf_counter() - start
            bar.update(job, advance=1, loss=float(np.mean(losses[-10:])), tps=tokens / elapsed)
            if plain and (time.perf_counter() - noted >= NOTE_EVERY_S or step == 4):
                noted = time.perf_counter()
                left = elapsed / (step + 1) * (config.steps - step - 1)
                notice(
                    f"warm start: step {step + 1}/{config.steps}, "
                    f"loss {np.mean(losses[-10:]):.3f}, about {left / 60:.1f} min left"
                )
    model.eval()
    seconds = time.perf_counter() - start
    return {
        "steps": config.steps,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0,
        "final_loss": float(np.mean(losses[-10:])) if losses else float("nan"),
        "first_loss": losses[0] if losses else float("nan"),
        # mean loss per 10 steps: shows when the copying circuit forms (the loss drop that a
        # too-small budget never reaches), which final_loss alone hides
        "loss_curve": [
            round(float(np.mean(losses[i : i + 10])), 4) for i in range(0, len(losses), 10)
        ],
    }


def completion_lengths(task: Task, tokenizer: CharTokenizer, n: int = 2000) -> dict[str, float]:
    """Percentiles of reference completion lengths (tokens, with eos) on the train split."""
    lengths = np.array([len(tokenizer.encode(task.solve(p))) + 1 for p in task.prompts("train", n)])
    qs = {f"p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 99)}
    return {**qs, "mean": float(lengths.mean()), "max": float(lengths.max()), "n": n}


def warmstart(
    config: WarmstartConfig | None = None,
    *,
    cache_dir: Path | None = None,
    out: Path | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """The warm-start checkpoint directory of ``config`` (trained once, then cached).

    ``out`` additionally copies the result there. ``force`` retrains even when cached.
    """
    config = config or WarmstartConfig()
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / config.key()
    if force or not is_complete(target):
        _build(config, target, progress)
    else:
        log.info("warmstart_cached", path=str(target))
    if out is not None:
        shutil.copytree(target, out, dirs_exist_ok=True)
        return Path(out)
    return target


def _build(config: WarmstartConfig, target: Path, progress: bool) -> None:
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0
    wall = time.perf_counter()
    model, tokenizer = build_model(config.preset, seed=config.seed, **config.model_overrides)
    task = make_task(config.task, seed=config.seed, **config.task_config)
    log.info("warmstart_training", steps=config.steps, task=config.task, target=str(target))
    if progress:
        notice(
            f"warm start: training {config.steps} supervised steps on {config.task} "
            f"(once; later runs reuse {target})"
        )
    stats = train(model, tokenizer, task, config, progress)
    ev = evaluate_task(
        model,
        tokenizer,
        task,
        eval_prompts=config.eval_prompts,
        group_prompts=config.group_prompts,
        group_size=config.group_size,
        seed=config.seed,
    )
    result = {
        "config": config.model_dump(),
        "config_hash": config.key(),
        "train": stats,
        "eval": ev,
        "lengths": completion_lengths(task, tokenizer),
        "threads": config.threads,
        "loadavg_1m_at_start": load,
        "wall_seconds": round(time.perf_counter() - wall, 2),
        "parameters": model.num_parameters(),
    }
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tmp, tokenizer)
    (tmp / RESULT_FILE).write_text(json.dumps(result, indent=2, default=float) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(target)
    log.info("warmstart_done", path=str(target), accuracy=ev.get("accuracy"), **stats)


def read_result(directory: Path) -> dict[str, Any]:
    """The ``warmstart.json`` of a warm-start directory."""
    return json.loads((Path(directory) / RESULT_FILE).read_text())
