"""The emulated fleet on a real nats-server: every mode runs the real stages to completion.

Small and fast: 4 paced timing engines (dense-7b, so each engine fits many requests), 2
learner steps, B=4 groups of G=4, at 2000x (a 7B decode step of ~8 ms is 4 us of wall time).
The dispatcher stops after ``B * steps`` prompts, so every dispatched request must come back
as exactly one trajectory and be consumed by the learner stand-in.
"""

from __future__ import annotations

import pytest

from dora.bus.server import NatsServer
from dora.testing.emulated_fleet import EmulatedConfig, run_emulated, summarize

pytestmark = [pytest.mark.nats]

B, G, STEPS = 4, 4, 2


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial", "dora"])
async def test_mode_completes_with_one_trajectory_per_request(
    mode: str, nats_server: NatsServer
) -> None:
    cfg = EmulatedConfig(
        mode=mode,  # type: ignore[arg-type]
        engines=4,
        steps=STEPS,
        batch_groups=B,
        group_size=G,
        preset="dense-7b",
        time_scale=2000.0,
        max_prompts=B * STEPS,
        processes=0,
        timeout_s=120.0,
    )
    run = await run_emulated(cfg, nats_server.url)
    assert run.failures == []
    assert run.dispatched == B * G * STEPS
    assert len(run.samples) == run.dispatched  # one trajectory per request, none lost
    assert run.duplicates == 0
    consumed = [rid for st in run.steps for rid in st.request_ids]
    assert sorted(consumed) == sorted(run.samples)  # all consumed, each once
    assert [st.step for st in run.steps] == list(range(STEPS))
    for st in run.steps:  # staleness bound (sync: on-policy)
        bound = 0 if mode == "sync" else cfg.staleness
        assert all(st.step - v <= bound for v in st.versions)
    summary = summarize(run)
    assert summary["tokens_per_s"] > 0
    assert summary["consumed_tokens"] == sum(s.completion_tokens for s in run.samples.values())
    if mode == "partial":
        assert summary["migrations"] == 0
    else:
        assert summary["reprefilled_tokens"] == 0


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="mode"):
        EmulatedConfig(mode="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="time_scale"):
        EmulatedConfig(time_scale=0)
    with pytest.raises(ValueError, match="preset"):
        EmulatedConfig(preset="dense-9000b")


def test_admission_and_relief_reach_the_simulator_settings() -> None:
    from dora.testing.emulated_fleet import simulator_settings

    cfg = EmulatedConfig(admission="kv", relieve_preempted=False)
    max_seqs, policy = simulator_settings(cfg)
    assert max_seqs == cfg.sim_config().kv_max_seqs and not policy.relieve_preempted
    assert cfg.sim_config().admission == "kv"
    with pytest.raises(ValueError, match="admission"):
        EmulatedConfig(admission="greedy")
