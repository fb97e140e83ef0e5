"""Read a dora run's trajectories from any program: plain nats-py + the published JSON Schema.

This script imports nothing from dora, on purpose. All it relies on is the wire contract:

- subjects are ``dora.<run>.<family>``; trajectories go to ``dora.<run>.trajectories``;
- that subject lives in the JetStream stream ``DORA_<RUN>_TRAJECTORIES`` (run id upper-cased,
  ``-`` turned into ``_``), an *interest* stream: a message is kept until every consumer that
  existed when it was published has acked it;
- each payload is one JSON object described by ``schemas/Trajectory.json``.

It attaches a durable pull consumer of its own (so it takes nothing away from the learner),
validates every trajectory against the schema, prints one line per message and acks it.

    python examples/external_consumer.py --nats nats://127.0.0.1:4222 --run myrun --max 100

Exit status: 0 when every message validated, 1 when any did not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import jsonschema
import nats
from nats.js import api

DEFAULT_SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "Trajectory.json"


def stream_name(run: str) -> str:
    return f"DORA_{run}_TRAJECTORIES".upper().replace("-", "_")


def load_validator(path: Path) -> jsonschema.protocols.Validator:
    schema = json.loads(path.read_text(encoding="utf-8"))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def check(validator: jsonschema.protocols.Validator, data: bytes) -> str | None:
    """None when ``data`` is a valid trajectory, else the first problem found."""
    try:
        doc = json.loads(data)
    except ValueError as exc:
        return f"not JSON: {exc}"
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"{where}: {error.message}"


async def consume(args: argparse.Namespace) -> int:
    validator = load_validator(args.schema)
    nc = await nats.connect(args.nats)
    js = nc.jetstream()
    subject = f"dora.{args.run}.trajectories"
    sub = await js.pull_subscribe(
        subject,
        durable=args.durable,
        stream=stream_name(args.run),
        config=api.ConsumerConfig(
            ack_policy=api.AckPolicy.EXPLICIT, deliver_policy=api.DeliverPolicy.ALL
        ),
    )
    valid = invalid = 0
    try:
        while not args.max or valid + invalid < args.max:
            want = 64 if not args.max else min(64, args.max - valid - invalid)
            try:
                msgs = await sub.fetch(want, timeout=args.idle_timeout or 5.0)
            except TimeoutError:  # nats-py raises its own subclass or the builtin one
                if args.idle_timeout:
                    break
                continue
            for msg in msgs:
                event_id = (msg.headers or {}).get("Nats-Msg-Id", "?")
                problem = check(validator, msg.data)
                if problem is None:
                    valid += 1
                    print(f"valid {event_id}", flush=True)
                else:
                    invalid += 1
                    print(f"INVALID {event_id}: {problem}", flush=True)
                await msg.ack()
    finally:
        await nc.flush()  # the acks
        await nc.close()
    print(f"validated {valid}, invalid {invalid}", flush=True)
    return 0 if invalid == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nats", required=True, help="NATS URL of the run's server")
    parser.add_argument("--run", required=True, help="run id")
    parser.add_argument("--max", type=int, default=0, help="stop after N messages (0: never)")
    parser.add_argument("--durable", default="external-audit", help="this consumer's name")
    parser.add_argument("--schema", type=Path, default=DEFAULT_SCHEMA, help="Trajectory.json")
    parser.add_argument(
        "--idle-timeout", type=float, default=0.0, help="stop after this many idle seconds"
    )
    args = parser.parse_args(argv)
    if not args.schema.is_file():
        parser.error(f"--schema {args.schema} is not a file")
    return asyncio.run(consume(args))


if __name__ == "__main__":
    sys.exit(main())
