"""Read a dora run's trajectories (or scored trajectories) from any program: plain nats-py and
the published JSON Schemas. It imports nothing from dora, on purpose; it relies only on the
wire contract in ``schemas/CONTRACT.md``:

- subjects are ``dora.<run>.<family>``, in the JetStream stream ``DORA_<RUN>_<FAMILY>`` (run id
  upper-cased, ``-`` turned into ``_``); ``trajectories`` and ``scored`` are *interest*
  streams: a message is kept only for the consumers that existed when it was published;
- a pipeline with a ``replay:`` block also keeps a copy on ``dora.<run>.replay.<family>``
  (stream ``DORA_<RUN>_REPLAY``), which a late or restarted reader reads from the start;
- each payload is one JSON object described by ``schemas/<Type>.json``.

Find the run by its folder (``runs/<id>/run.json`` holds the NATS URL and run id once the run
has started) or by ``--nats`` and ``--run``. Started before the run, it waits for the run's
stream; it attaches its own durable pull consumer (taking nothing away from the pipeline),
validates every message against the schema, prints one line per message and acks it. With
``--live`` it listens instead (a core subscription: it sees what is published while it runs).

A run on dora's embedded server admits only logged-in clients: with ``--run-dir`` this program
logs in with the run's read-only credentials (``credentials/reader.json``, named in
``run.json``), which may attach consumers to the replay stream only, so use ``--replay`` or
``--live`` there; ``--creds FILE`` names another login.

    python examples/external_consumer.py --run-dir runs/myrun --replay --max 100
    python examples/external_consumer.py --run-dir runs/myrun --live --max 100
    python examples/external_consumer.py --nats nats://127.0.0.1:4222 --run myrun

Exit status: 0 when every message validated, 1 when any did not, 2 on bad arguments, 3 when
there is no server, the server refused the login or a consumer, or the run's stream did not
appear within ``--wait`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import nats
from nats.js import api
from nats.js.errors import NotFoundError

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"
TYPES = {"trajectories": "Trajectory", "scored": "ScoredTrajectory"}
NO_SERVER, INVALID = 3, 1


class Unavailable(Exception):
    """No server, or the run's stream never appeared: the message says which."""


def stream_name(run: str, family: str) -> str:
    return f"DORA_{run}_{family}".upper().replace("-", "_")


def load_validator(path: Path) -> jsonschema.protocols.Validator:
    schema = json.loads(path.read_text(encoding="utf-8"))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def check(validator: jsonschema.protocols.Validator, data: bytes) -> str | None:
    """None when ``data`` is valid, else the first problem found."""
    try:
        doc = json.loads(data)
    except ValueError as exc:
        return f"not JSON: {exc}"
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"{where}: {error.message}"


def find_run(run_dir: Path, wait_s: float) -> tuple[str, str, dict[str, Any]]:
    """(NATS URL, run id, login) from ``run_dir/run.json``, waiting for the run to write its
    URL. A run on its embedded server names its credential files there; this program logs in
    as ``reader``."""
    path = run_dir / "run.json"
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text(encoding="utf-8"))
            if record.get("url") and record.get("run_id"):
                creds = (record.get("credentials") or {}).get("reader")
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


async def connect(url: str, login: dict[str, Any], refused: list[str]) -> nats.NATS:
    async def quiet(exc: Exception) -> None:  # one line at exit instead of a traceback each
        if "permissions violation" in str(exc).lower():  # the server's refusals come this way
            refused.append(str(exc).removeprefix("nats: "))

    try:
        return await nats.connect(
            url,
            connect_timeout=2,
            max_reconnect_attempts=5,
            reconnect_time_wait=1,
            allow_reconnect=True,
            error_cb=quiet,
            **login,
        )
    except Exception as exc:  # nats-py raises several unrelated types for "nobody there"
        raise Unavailable(f"cannot connect to {url} ({type(exc).__name__}: {exc})") from exc


async def attach(js: Any, run: str, args: argparse.Namespace, refused: list[str]) -> Any:
    """This program's own durable pull consumer on the family's (or the replay) stream."""
    stream_family = "replay" if args.replay else args.family
    subject = f"dora.{run}.{'replay.' if args.replay else ''}{args.family}"
    await wait_for_stream(js, run, stream_family, args.wait)
    try:
        sub = await js.pull_subscribe(
            subject,
            durable=args.durable,
            stream=stream_name(run, stream_family),
            config=api.ConsumerConfig(
                ack_policy=api.AckPolicy.EXPLICIT, deliver_policy=api.DeliverPolicy.ALL
            ),
        )
    except TimeoutError:
        if not refused:
            raise
        raise Unavailable(
            f"the server refused: {refused[-1]} (a read-only login attaches consumers to the "
            "replay stream only: use --replay, or --live)"
        ) from None
    print(f"attached to {subject} as {args.durable}", file=sys.stderr, flush=True)
    return sub


class Live:
    """Live mode: a core subscription. Nothing is stored for this reader, so it sees what is
    published while it listens (start it before the run to see everything)."""

    def __init__(self, sub: Any) -> None:
        self.sub = sub

    async def fetch(self, want: int, timeout: float) -> list[Any]:
        try:
            return [await self.sub.next_msg(timeout=timeout)]
        except TimeoutError:
            return []


async def listen(nc: nats.NATS, run: str, family: str) -> Live:
    subject = f"dora.{run}.{family}"
    sub = await nc.subscribe(subject)
    await nc.flush()
    print(f"listening on {subject}", file=sys.stderr, flush=True)
    return Live(sub)


async def wait_for_stream(js: nats.js.JetStreamContext, run: str, family: str, wait_s: float):
    """The stream's info once the run has created it (a run creates its streams at start)."""
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            return await js.stream_info(stream_name(run, family))
        except NotFoundError:
            if time.monotonic() >= deadline:
                hint = " (does the pipeline have a `replay:` block?)" if family == "replay" else ""
                raise Unavailable(
                    f"run {run} has no {family} stream after {wait_s:g}s{hint}"
                ) from None
            if not told:
                print(f"waiting for run {run}'s {family} stream...", file=sys.stderr, flush=True)
                told = True
            await asyncio.sleep(0.5)


async def consume(args: argparse.Namespace, url: str, run: str, login: dict[str, Any]) -> int:
    validator = load_validator(args.schema or SCHEMAS / f"{TYPES[args.family]}.json")
    refused: list[str] = []
    nc = await connect(url, login, refused)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    valid = invalid = 0
    try:
        if args.live:
            sub = await listen(nc, run, args.family)
        else:
            sub = await attach(nc.jetstream(), run, args, refused)
        idle_since = time.monotonic()
        while not stop.is_set() and (not args.max or valid + invalid < args.max):
            want = 64 if not args.max else min(64, args.max - valid - invalid)
            try:
                msgs = await sub.fetch(want, timeout=1.0)
            except TimeoutError:  # nats-py raises its own subclass or the builtin one
                msgs = []
            except nats.errors.ConnectionClosedError:
                print(f"the server at {url} went away", file=sys.stderr, flush=True)
                break
            if not msgs:
                if args.idle_timeout and time.monotonic() - idle_since >= args.idle_timeout:
                    break
                continue
            idle_since = time.monotonic()
            for msg in msgs:
                event_id = (msg.headers or {}).get("Nats-Msg-Id", "?")
                problem = check(validator, msg.data)
                if problem is None:
                    valid += 1
                    print(f"valid {event_id}", flush=True)
                else:
                    invalid += 1
                    print(f"INVALID {event_id}: {problem}", flush=True)
                if not args.live:
                    await msg.ack()
    finally:
        with contextlib.suppress(Exception):
            await nc.flush(timeout=2)  # the acks
        with contextlib.suppress(Exception):
            await nc.close()
    print(f"validated {valid}, invalid {invalid}", flush=True)
    return 0 if invalid == 0 else INVALID


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    where = parser.add_argument_group("which run (a run folder, or --nats and --run)")
    where.add_argument("--run-dir", type=Path, help="the run's folder (reads its run.json)")
    where.add_argument("--nats", help="NATS URL of the run's server")
    where.add_argument("--run", help="run id (`dora run --run-id ID` sets it)")
    where.add_argument(
        "--creds", type=Path, help="login file (JSON user/password); default: the run folder's"
    )
    parser.add_argument("--family", choices=sorted(TYPES), default="trajectories")
    parser.add_argument(
        "--replay", action="store_true", help="read the run's replay copy from its start"
    )
    parser.add_argument(
        "--live", action="store_true", help="a live subscription instead of a durable consumer"
    )
    parser.add_argument("--max", type=int, default=0, help="stop after N messages (0: never)")
    parser.add_argument("--durable", default="external-audit", help="this consumer's name")
    parser.add_argument("--schema", type=Path, help="schema file; default: the family's type")
    parser.add_argument(
        "--idle-timeout", type=float, default=0.0, help="stop after this many idle seconds"
    )
    parser.add_argument(
        "--wait", type=float, default=300.0, help="seconds to wait for the run to start"
    )
    args = parser.parse_args(argv)
    if args.live and args.replay:
        parser.error("--live and --replay exclude each other")
    if args.schema is not None and not args.schema.is_file():
        parser.error(f"--schema {args.schema} is not a file")
    if args.run_dir is None and not (args.nats and args.run):
        parser.error("give --run-dir, or both --nats and --run")
    try:
        if args.run_dir is not None:
            url, run, login = find_run(args.run_dir, args.wait)
        else:
            url, run, login = args.nats, args.run, {}
        if args.creds:
            login = read_login(args.creds)
        return asyncio.run(consume(args, url, run, login))
    except Unavailable as exc:
        hint = " (an embedded server stops when its run ends)" if args.run_dir else ""
        print(f"error: {exc}{hint}", file=sys.stderr, flush=True)
        return NO_SERVER
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
