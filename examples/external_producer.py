"""Feed prompts into a running dora pipeline from any program: plain nats-py and the published
JSON Schema of ``Prompt``. It imports nothing from dora, on purpose; see ``schemas/CONTRACT.md``.

Prompts go to ``dora.<run>.prompts`` (a work-queue stream: the pipeline's dispatcher or
generator takes each one once). Every prompt is validated against ``schemas/Prompt.json``
before it is sent, and carries its ``event_id`` as the ``Nats-Msg-Id`` header, so running the
producer again (or retrying a publish) never duplicates a prompt within the stream's 2-minute
duplicate window.

Prompts come from a JSON-lines file (one ``Prompt`` object per line) or, with ``--count N``,
N arithmetic problems in the built-in format (``Q: 3+4\\nA:\\n``, answer ``7``):

    python examples/external_producer.py --run-dir runs/myrun --count 32
    python examples/external_producer.py --nats nats://127.0.0.1:4222 --run myrun prompts.jsonl

A run on dora's embedded server admits only logged-in clients: with ``--run-dir`` the producer
logs in with the run's producer credentials (``credentials/producer.json``, named in
``run.json``), which may publish prompts and nothing else; ``--creds FILE`` names another.

Exit status: 0 when every prompt was stored, 1 when a prompt failed validation (nothing is sent
then), 2 on bad arguments, 3 when there is no server, the server refused the login or a
publish, or the run's prompt stream did not appear within ``--wait`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import nats
from nats.js.errors import NotFoundError

SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "Prompt.json"
NO_SERVER, INVALID = 3, 1


class Unavailable(Exception):
    """No server, or the run's stream never appeared: the message says which."""


def arithmetic_prompts(count: int, seed: int) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    for i in range(count):
        terms = [rng.randint(0, 9) for _ in range(rng.randint(2, 4))]
        expr = "+".join(map(str, terms))
        yield {
            "event_id": f"ext-{seed}-{i}",
            "prompt_id": f"ext-{seed}-{i}",
            "text": f"Q: {expr}\nA:\n",
            "answer": str(sum(terms)),
            "task": "arithmetic",
            "metadata": {"terms": expr, "num_terms": len(terms)},
        }


def file_prompts(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc


def invalid_reason(validator: jsonschema.protocols.Validator, doc: Any) -> str | None:
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"{where}: {error.message}"


def find_run(run_dir: Path, wait_s: float) -> tuple[str, str, dict[str, Any]]:
    """(NATS URL, run id, login) from ``run_dir/run.json``, waiting for the run to write its
    URL. A run on its embedded server names its credential files there; this program logs in
    as ``producer``."""
    path = run_dir / "run.json"
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text(encoding="utf-8"))
            if record.get("url") and record.get("run_id"):
                creds = (record.get("credentials") or {}).get("producer")
                login = read_login(run_dir / creds) if creds else {}
                return str(record["url"]), str(record["run_id"]), login
        if time.monotonic() >= deadline:
            raise Unavailable(f"{path} names no running server after {wait_s:g}s")
        time.sleep(0.2)


def read_login(path: Path) -> dict[str, Any]:
    """``nats.connect`` options from a dora credential file (user, password, inbox prefix)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        login = {"user": record["user"], "password": record["password"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise Unavailable(f"cannot read the login in {path}: {exc}") from exc
    if record.get("inbox_prefix"):
        login["inbox_prefix"] = record["inbox_prefix"]  # the replies this login may read
    return login


async def produce(
    prompts: list[dict[str, Any]], url: str, run: str, login: dict[str, Any], wait_s: float
) -> int:
    refused: list[str] = []

    async def quiet(exc: Exception) -> None:  # the server's refusals come only this way
        if "permissions violation" in str(exc).lower():
            refused.append(str(exc).removeprefix("nats: "))

    try:
        nc = await nats.connect(
            url, connect_timeout=2, max_reconnect_attempts=5, error_cb=quiet, **login
        )
    except Exception as exc:  # nats-py raises several unrelated types for "nobody there"
        raise Unavailable(f"cannot connect to {url} ({type(exc).__name__}: {exc})") from exc
    try:
        js = nc.jetstream()
        stream = f"DORA_{run}_PROMPTS".upper().replace("-", "_")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                await js.stream_info(stream)
                break
            except TimeoutError:
                if refused:
                    raise Unavailable(f"the server refused: {refused[-1]}") from None
                raise
            except NotFoundError:
                if time.monotonic() >= deadline:
                    raise Unavailable(f"run {run} has no prompt stream after {wait_s:g}s") from None
                await asyncio.sleep(0.5)
        stored = duplicates = 0
        for doc in prompts:
            try:
                ack = await js.publish(
                    f"dora.{run}.prompts",
                    json.dumps(doc).encode(),
                    headers={"Nats-Msg-Id": doc["event_id"]},
                    timeout=60,  # a full work queue makes the publisher wait: backpressure
                )
            except TimeoutError:
                if refused:
                    raise Unavailable(f"the server refused: {refused[-1]}") from None
                raise
            duplicates += bool(ack.duplicate)
            stored += not ack.duplicate
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    print(f"published {stored} prompts to run {run} ({duplicates} already there)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    where = parser.add_argument_group("which run (a run folder, or --nats and --run)")
    where.add_argument("--run-dir", type=Path, help="the run's folder (reads its run.json)")
    where.add_argument("--nats", help="NATS URL of the run's server")
    where.add_argument("--run", help="run id (`dora run --run-id ID` sets it)")
    where.add_argument(
        "--creds", type=Path, help="login file (JSON user/password); default: the run folder's"
    )
    parser.add_argument("file", type=Path, nargs="?", help="JSON lines of Prompt objects")
    parser.add_argument("--count", type=int, default=0, help="generate N arithmetic prompts")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    parser.add_argument(
        "--wait", type=float, default=300.0, help="seconds to wait for the run to start"
    )
    args = parser.parse_args(argv)
    if args.run_dir is None and not (args.nats and args.run):
        parser.error("give --run-dir, or both --nats and --run")
    if (args.file is None) == (args.count <= 0):
        parser.error("give a prompts FILE or --count N (one of them)")
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text(encoding="utf-8")))
    try:
        prompts = list(
            file_prompts(args.file) if args.file else arithmetic_prompts(args.count, args.seed)
        )
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return INVALID
    for number, doc in enumerate(prompts, 1):
        reason = invalid_reason(validator, doc)
        if reason is None and not doc.get("event_id"):
            reason = "event_id: required here (it deduplicates a retried publish)"
        if reason is not None:
            print(f"error: prompt {number} is not a valid Prompt: {reason}", file=sys.stderr)
            return INVALID
    try:
        if args.run_dir:
            url, run, login = find_run(args.run_dir, args.wait)
        else:
            url, run, login = args.nats, args.run, {}
        if args.creds:
            login = read_login(args.creds)
        return asyncio.run(produce(prompts, url, run, login, args.wait))
    except Unavailable as exc:
        hint = " (an embedded server stops when its run ends)" if args.run_dir else ""
        print(f"error: {exc}{hint}", file=sys.stderr, flush=True)
        return NO_SERVER
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
