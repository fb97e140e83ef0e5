"""Tool-call rate and accuracy of a tool-use run, per block of policy versions.

Reads only what the recorder wrote (``RUN_DIR/events/scored.jsonl``), as an outside observer
would: each scored trajectory's version, its episode's tool calls and whether it was correct.

    python examples/tool_use_by_version.py runs/tools-s1 [--every 10]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def rows(run_dir: Path, every: int) -> list[dict[str, float]]:
    blocks: dict[int, list[tuple[bool, bool]]] = defaultdict(list)
    with (run_dir / "events" / "scored.jsonl").open() as f:
        for line in f:
            scored = json.loads(line)
            traj = scored["trajectory"]
            calls = (traj.get("episode") or {}).get("tool_calls", 0)
            blocks[traj["version"] // every].append((calls > 0, bool(scored["correct"])))
    out = []
    for b in sorted(blocks):
        items = blocks[b]
        used = [ok for tool, ok in items if tool]
        unused = [ok for tool, ok in items if not tool]
        out.append(
            {
                "versions": f"{b * every}-{b * every + every - 1}",
                "n": len(items),
                "tool_call_rate": len(used) / len(items),
                "accuracy": sum(ok for _, ok in items) / len(items),
                "acc_with_tool": sum(used) / len(used) if used else float("nan"),
                "acc_without": sum(unused) / len(unused) if unused else float("nan"),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--every", type=int, default=10, help="versions per row")
    args = parser.parse_args()
    print("| versions | n | tool-call rate | accuracy | with tool | without |")
    print("|---|---|---|---|---|---|")
    for r in rows(args.run_dir, args.every):
        print(
            f"| {r['versions']} | {r['n']} | {r['tool_call_rate']:.2f} | {r['accuracy']:.2f} "
            f"| {r['acc_with_tool']:.2f} | {r['acc_without']:.2f} |"
        )


if __name__ == "__main__":
    main()
