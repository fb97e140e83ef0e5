"""``dora run --ray``: the rollout's stages as Ray actors on a simulated multi-node cluster
(``ray.cluster_utils.Cluster``, every node on 127.0.0.1). Each generator asks for a custom
``engine`` resource that only the worker nodes have, so the engines land on distinct nodes;
mid-run the node of one engine is removed and, separately, another actor's process gets
SIGKILL. Ray restarts both actors (the engine on the spare node), NATS redelivers what they
held, and the run completes with the rollout invariants read from its record."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_run_resume import check_invariants, children, gone, start
from tests.integration.test_stage_processes import finish, split_pipeline, steps_done, wait_until

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.ray]

STEPS = 40
"""Long enough that the lost engine is back on the spare node before the run ends (the
other engine alone keeps the steps coming meanwhile). At 30 steps, with Ray's default node
health check (a lost node declared dead after ~15 s), a quiet machine finished the run first
in 1 of 4 tries."""
NODE_HEALTH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}
"""A lost node is declared dead in ~5 s (Ray's default: ~15 s). Not faster: a node whose
raylet is slow on two busy cores must not be declared dead while it lives."""
LOOPBACK = {"node_ip_address": "127.0.0.1", "include_dashboard": False}
LOOPBACK_DRIVER = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""The driver joins a cluster whose every node is on 127.0.0.1: without this, Ray rewrites a
loopback address to the machine's outward IP, where the cluster does not listen."""


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A head and three worker nodes with one ``engine`` each: two for the
    generators, one spare for an engine whose node goes away."""
    head = {**LOOPBACK, "num_cpus": 2, "_system_config": NODE_HEALTH}
    c = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(3):
        c.add_node(**LOOPBACK, num_cpus=1, resources={"engine": 1})
    c.wait_for_nodes()
    try:
        yield c
    finally:
        c.shutdown()


def engines_pinned(path: Path) -> Path:
    """The split rollout pipeline with each generator placed on a node with an engine."""
    text = path.read_text().replace(
        "  - type: generator\n    replicas: 2\n",
        "  - type: generator\n    replicas: 2\n"
        "    resources: {num_cpus: 0, custom: {engine: 1}}\n"
        "    placement: spread\n",
    )
    assert "custom: {engine: 1}" in text
    path.write_text(text)
    return path


def actors(run_dir: Path) -> dict[str, dict]:
    try:
        return json.loads((run_dir / "actors.json").read_text())
    except (OSError, ValueError):
        return {}


def test_stages_run_as_ray_actors_across_nodes_and_survive_node_and_process_loss(
    tmp_path: Path, cluster: Cluster
) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    pipeline = engines_pinned(split_pipeline(tmp_path, STEPS))
    args = ["run", str(pipeline), "--run-dir", str(run_dir), "--ray", "--ray-address"]
    # the embedded server where the "nodes" reach it: another loopback address, so every
    # actor's connection goes to the address given, not a default
    args = [*args, cluster.address, "--nats-host", "127.0.0.2"]
    proc = start(args, log, env=LOOPBACK_DRIVER)
    workers = {node.node_id: node for node in cluster.worker_nodes}
    try:
        wait_until(lambda: steps_done(run_dir) >= 2, "step 2", proc, log)
        placed = actors(run_dir)
        engine_nodes = {placed[f"generator-{i}"]["node_id"] for i in (0, 1)}
        assert len(engine_nodes) == 2 and engine_nodes <= set(workers), placed
        # a stage's process is killed: Ray restarts the actor in a new process (the run
        # cannot finish without its dispatcher, so the restart is seen before the end)
        pid = placed["dispatcher-0"]["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_until(
            lambda: actors(run_dir)["dispatcher-0"].get("pid") not in (pid, None),
            "dispatcher-0 restarted",
            proc,
            log,
        )
        # an engine's node goes away mid-run: its actor comes back on the spare node
        lost = placed["generator-0"]["node_id"]
        cluster.remove_node(workers[lost], allow_graceful=False)
        wait_until(
            lambda: actors(run_dir)["generator-0"].get("node_id") not in (lost, None),
            "generator-0 on another node",
            proc,
            log,
        )
        url = json.loads((run_dir / "run.json").read_text())["url"]
        assert url.startswith("nats://127.0.0.2:")
        assert actors(run_dir)["generator-0"]["node_id"] in set(workers) - engine_nodes
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finish(proc, log)
    check_invariants(run_dir, steps=STEPS)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] is True
    assert summary["stages"]["generator"]["replicas"] == 2  # the restarted one drained too
    assert set(summary["actors"]) == set(actors(run_dir))
    engines = {json.loads(line)["engine_id"] for line in (run_dir / "events/status.jsonl").open()}
    assert engines == {"engine-0", "engine-1"}


def descendants(pid: int) -> set[int]:
    found, frontier = set(), [pid]
    while frontier:
        kids = children(frontier.pop())
        found.update(kids)
        frontier += kids
    return found


def test_ctrl_c_drains_the_actors_and_leaves_no_process(tmp_path: Path, repo_root: Path) -> None:
    """``--ray`` without an address: a local Ray instance on loopback, started and stopped by
    the run. A Ctrl-C mid-run drains every actor, writes the summary, exits 130, and leaves
    neither actors nor Ray's own processes behind."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    endless = ["--set", "prompts.count=1000000", "--set", "sink.expect=1000000"]
    pipeline = str(repo_root / "pipelines" / "echo.yaml")
    proc = start(["run", pipeline, "--ray", "--run-dir", str(run_dir), *endless], log)
    try:
        wait_until(
            lambda: (
                len(actors(run_dir)) == 5 and all(a.get("pid") for a in actors(run_dir).values())
            ),
            "every actor serving",
            proc,
            log,
        )
        spawned = descendants(proc.pid)
        assert any(info["pid"] in spawned for info in actors(run_dir).values())
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert code == 130, log.read_text()[-3000:]
    left = [pid for pid in spawned if not gone(pid)]
    assert not left, f"still running after the run: {left}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] is False
    assert set(summary["stages"]) == {"prompts", "generator", "verifier", "sink"}
    assert summary["stages"]["sink"]["stats"]["processed"] > 0, summary["stages"]
