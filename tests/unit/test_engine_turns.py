"""Multi-turn episodes in the engine: a request parks at the end of an assistant turn with its
KV, the environment's reply is appended, and decoding goes on without re-prefilling any earlier
turn; the trajectory is exactly the concatenation, masked where the environment wrote."""

from __future__ import annotations

import time

import pytest
import torch

from dora.engines.base import EngineError
from dora.engines.snapshot import decode_snapshot
from dora.engines.torch import TorchEngine
from tests.unit.test_engine_support import make_engine, make_request

TURN_END = tuple("etaoinshrdlu#%&?!=:;")  # the random tiny model writes one within a few tokens
REPLIES = ["<r>42</r>", "<r>ok, done</r>", "<r>x</r>"]


def play(engine: TorchEngine, rid: str, replies: list[str], max_tokens: int = 200) -> tuple:
    """Run one episode, answering each parked turn with the next reply; (trajectory, turns,
    appended token lists)."""
    engine.add_request(
        make_request(
            rid, max_tokens=max_tokens, temperature=1.0, seed=7, turn_stop_strings=TURN_END
        )
    )
    turns, appended, pending = [], [], list(replies)
    while True:
        finished = engine.step()
        for end in engine.take_turn_ends():
            turns.append(end)
            if not pending:  # the environment ends the episode after this turn
                return engine.end_episode(end.request_id), turns, appended
            ids = engine.tokenizer.encode(pending.pop(0), add_bos=False)
            appended.append(ids)
            engine.append(end.request_id, ids)
        if finished:
            return finished[0], turns, appended


def test_the_trajectory_is_prompt_then_each_turn_then_each_reply_and_nothing_is_reprefilled() -> (
    None
):
    engine = make_engine()
    traj, turns, appended = play(engine, "ep", REPLIES)
    assert traj.finish_reason == "stop" and len(turns) == len(REPLIES) + 1
    expected: list[int] = []
    for turn, reply in zip(turns, [*appended, []], strict=True):
        assert any(s in turn.text for s in TURN_END)
        expected += [*turn.token_ids, *reply]
    final = list(traj.completion_token_ids[len(expected) :])
    assert final == []
    assert list(traj.completion_token_ids) == expected + final  # exactly the concatenation
    mask = [1] * len(expected) + [1] * len(final)
    at = 0
    for turn, reply in zip(turns, [*appended, []], strict=True):
        at += len(turn.token_ids)
        mask[at : at + len(reply)] = [0] * len(reply)
        at += len(reply)
    assert list(traj.loss_mask) == mask  # 1 exactly where the engine sampled
    assert [t.role for t in traj.turns] == ["assistant", "tool"] * len(REPLIES) + ["assistant"]
    prompt = len(traj.prompt_token_ids)
    # prefill: the prompt once, then per reply its tokens plus the turn's last sampled token
    assert engine.counters.prefill_tokens == prompt + sum(len(r) + 1 for r in appended)
    assert traj.reprefilled_tokens == 0 and engine.counters.reprefilled_tokens == 0


def test_logprobs_after_a_resume_equal_a_fresh_forward_over_the_same_tokens() -> None:
    engine = make_engine()
    traj, _, _ = play(engine, "ep", REPLIES[:2])
    ids = [*traj.prompt_token_ids, *traj.completion_token_ids]
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids]))[0].float()
    fresh = torch.log_softmax(logits, dim=-1)
    prompt = len(traj.prompt_token_ids)
    sampled = [i for i, m in enumerate(traj.loss_mask) if m]
    after_first_reply = [i for i in sampled if i > traj.turns[1].start]
    assert after_first_reply
    for i in sampled:
        expected = float(fresh[prompt + i - 1, ids[prompt + i]])
        assert traj.logprobs[i] == pytest.approx(expected, abs=2e-4), i


def test_a_parked_episode_holds_its_kv_and_its_version() -> None:
    engine = make_engine()
    engine.add_request(
        make_request("ep", max_tokens=200, temperature=1.0, seed=7, turn_stop_strings=TURN_END)
    )
    ends: list = []
    while not ends:
        engine.step()
        ends = engine.take_turn_ends()
    assert ends[0].request_id == "ep"
    assert not engine.has_work() and engine.num_requests() == 1  # parked: not scheduled
    used = engine.blocks.num_used
    assert used > 0  # its KV stays resident
    with pytest.raises(EngineError, match="holds 1 request"):
        engine.load_weights(1, engine.model.state_dict())
    with pytest.raises(EngineError, match="not a token id"):
        engine.append("ep", [10**6])
    with pytest.raises(EngineError, match="does not fit in the context"):
        engine.append("ep", [5] * engine.max_model_len)
    engine.append("ep", engine.tokenizer.encode("<r>1</r>", add_bos=False))
    with pytest.raises(EngineError, match="not parked"):
        engine.append("ep", [5])
    assert engine.has_work() and engine.blocks.num_used >= used
    engine.abort("ep")
    assert engine.blocks.num_used == 0 and engine.num_requests() == 0


def test_a_single_turn_request_is_unchanged() -> None:
    engine2 = make_engine()
    engine2.add_request(make_request("r", max_tokens=30))
    out = []
    while engine2.has_work():
        out += engine2.step()
    assert out[0].turns == () and out[0].loss_mask == (1,) * len(out[0].completion_token_ids)
    assert engine2.take_turn_ends() == []


def test_a_parked_episode_moves_with_its_kv_and_stays_parked() -> None:
    """Export at a turn boundary, import elsewhere: still parked there, the reply is appended
    on the target with only it (and the turn's last token) computed, and a failed move
    restores it parked on the source."""
    source, target = make_engine("src"), make_engine("dst")
    source.add_request(
        make_request("ep", max_tokens=200, temperature=1.0, seed=7, turn_stop_strings=TURN_END)
    )
    first = engine_turn(source)
    reply = source.tokenizer.encode("<r>1</r>", add_bos=False)
    source.append("ep", reply)
    engine_turn(source)  # parked again, now with one reply in its history
    assert source.episode_state("ep")[1:] == (True, 1)
    snapshot = source.export_request("ep")
    source.restore_exported("ep")  # a failed move: parked again on the source
    assert source.episode_state("ep")[1:] == (True, 1) and not source.has_work()
    snapshot = source.export_request("ep")
    parked_at = decode_snapshot(snapshot)[0].parked_at
    assert 0 < parked_at <= time.time()  # when it parked: the target keeps that time
    target.import_request(snapshot)
    source.release_exported("ep")
    assert target._get("ep").parked_at == parked_at
    assert target.episode_state("ep")[1:] == (True, 1) and not target.has_work()
    before = target.counters.prefill_tokens
    second = target.tokenizer.encode("<r>2</r>", add_bos=False)
    target.append("ep", second)
    end = engine_turn(target)
    assert target.counters.prefill_tokens - before == len(second) + 1
    traj = target.end_episode(end.request_id)
    assert traj.engines == ("src", "dst") and traj.reprefilled_tokens == 0
    assert [t.role for t in traj.turns] == ["assistant", "tool"] * 2 + ["assistant"]
    assert traj.completion_token_ids[: len(first.token_ids)] == first.token_ids


def engine_turn(engine: TorchEngine):
    """Step until the one request parks; its turn end."""
    while True:
        engine.step()
        ends = engine.take_turn_ends()
        if ends:
            return ends[0]


def test_under_kv_pressure_a_parked_episode_is_evicted_and_reprefilled_counted() -> None:
    """A parked episode's idle KV goes before any running request is preempted; its reply
    then brings a prefill of the whole history, on this engine, counted as re-prefilled."""
    engine = make_engine(num_blocks=12, max_model_len=192)
    engine.add_request(
        make_request("ep", max_tokens=120, temperature=1.0, seed=7, turn_stop_strings=TURN_END)
    )
    engine_turn(engine)
    held = engine.blocks.num_used
    computed = engine._get("ep").num_computed
    assert held > 0 and computed > 0
    engine.add_request(make_request("big", max_tokens=170, temperature=0.0))  # no early stop
    while engine.counters.parked_evictions == 0 and engine.has_work():
        engine.step()
    assert engine.counters.parked_evictions == 1 and engine.counters.preemptions == 0
    assert engine.episode_state("ep")[1] and engine._get("ep").block_table == []
    while engine.has_work():  # the long request runs to its end
        engine.step()
    reply = engine.tokenizer.encode("<r>1</r>", add_bos=False)
    cached = engine.counters.cached_tokens
    engine.append("ep", reply)
    end = engine_turn(engine)
    traj = engine.end_episode(end.request_id)
    hit = engine.counters.cached_tokens - cached  # blocks the prefix cache still held
    # the history computed again (what the prefix cache did not still hold), counted
    assert traj.reprefilled_tokens == computed - hit > 0
    assert traj.engines == ("e0",) and [t.role for t in traj.turns][:2] == ["assistant", "tool"]
