"""Dispatcher core: groups, seeds, version tags, admission/backpressure, urgency, modes."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.events import Prompt, SamplingParams
from dora.rollout.dispatcher import Dispatcher, DispatcherConfig, PromptRefused, sample_seed


def prompt(i: int) -> Prompt:
    return Prompt(prompt_id=f"p{i}", text=f"what is {i}+1?", answer=str(i + 1))


def make(**kw) -> Dispatcher:
    tokenize = kw.pop("tokenize", None)
    return Dispatcher(DispatcherConfig(**kw), tokenize=tokenize)


def finish_group(d: Dispatcher, requests) -> None:
    for r in requests:
        d.on_finished(r.request_id)


# ---------------------------------------------------------------------- groups and seeds


def test_prompt_becomes_a_tagged_grpo_group() -> None:
    d = make(
        group_size=4,
        sampling=SamplingParams(max_tokens=77, temperature=0.7),
        seed=9,
        tokenize=lambda text: [ord(c) for c in text],
    )
    adm = d.admit(prompt(1), assigned_versions=[0])
    assert adm.admitted and adm.version == 0 and adm.reason == ""
    reqs = adm.requests
    assert [r.group_index for r in reqs] == [0, 1, 2, 3]
    assert {r.group_id for r in reqs} == {"p1"} and {r.group_size for r in reqs} == {4}
    assert {r.version for r in reqs} == {0}
    assert len({r.request_id for r in reqs}) == 4
    assert reqs[0].prompt_token_ids == tuple(ord(c) for c in "what is 1+1?")
    assert {r.sampling.max_tokens for r in reqs} == {77}
    assert {r.sampling.temperature for r in reqs} == {0.7}
    seeds = [r.sampling.seed for r in reqs]
    assert len(set(seeds)) == 4
    assert seeds == [sample_seed(9, "p1", 0, i) for i in range(4)]


def test_seeds_are_deterministic_per_run_seed() -> None:
    a = make(group_size=2, seed=1).admit(prompt(3), [0]).requests
    b = make(group_size=2, seed=1).admit(prompt(3), [0]).requests
    c = make(group_size=2, seed=2).admit(prompt(3), [0]).requests
    assert [r.sampling.seed for r in a] == [r.sampling.seed for r in b]
    assert [r.sampling.seed for r in a] != [r.sampling.seed for r in c]
    assert all(0 <= r.sampling.seed < 2**63 for r in a + c)


def test_repeated_prompt_gets_a_new_group_and_new_seeds() -> None:
    d = make(group_size=2, batch_groups=8)
    first = d.admit(prompt(1), [0]).requests
    again = d.admit(prompt(1), [0]).requests
    assert first[0].group_id != again[0].group_id
    assert first[0].sampling.seed != again[0].sampling.seed


# ---------------------------------------------------------------------- tags


def test_dora_tags_the_newest_version_with_an_assigned_engine() -> None:
    d = make(batch_groups=8, staleness_bound=2)
    d.observe_weights(3)
    d.observe_learner_step(3)
    assert d.admit(prompt(0), [1, 2, None, 2]).version == 2  # 3 has no engine yet
    assert d.admit(prompt(1), [3, 2]).version == 3
    refused = d.admit(prompt(2), [None, None])
    assert not refused.admitted and refused.reason == "no-engine"


@pytest.mark.parametrize("mode", ["partial", "one_step_off"])
def test_baselines_tag_the_newest_published_version(mode: str) -> None:
    d = make(mode=mode, batch_groups=8)
    d.observe_weights(1)
    d.observe_learner_step(1)
    assert d.admit(prompt(0), [0]).version == 1


# ---------------------------------------------------------------------- backpressure


def test_admission_refuses_beyond_capacity_then_reopens() -> None:
    d = make(group_size=2, batch_groups=2, staleness_bound=1)
    admitted = [d.admit(prompt(i), [0]) for i in range(6)]
    assert [a.admitted for a in admitted] == [True] * 4 + [False] * 2  # (K+1)*B = 4
    assert admitted[-1].reason == "staleness-budget"
    assert d.in_flight() == 4
    for a in admitted[:2]:
        finish_group(d, a.requests)
    d.on_consumed([a.requests[0].group_id for a in admitted[:2]], learner_step=1)
    d.observe_weights(1)
    assert d.admit(prompt(10), [1]).admitted  # step 1 opened B more slots
    assert d.admit(prompt(11), [1]).admitted
    assert not d.admit(prompt(12), [1]).admitted


def test_sync_admits_one_batch_per_version_and_waits_for_it() -> None:
    d = make(mode="sync", group_size=1, batch_groups=3)
    batch = [d.admit(prompt(i), []) for i in range(5)]
    assert [a.admitted for a in batch] == [True, True, True, False, False]
    assert batch[-1].reason == "sync-barrier"
    for a in batch[:3]:
        finish_group(d, a.requests)
    d.on_consumed([a.requests[0].group_id for a in batch[:2]], learner_step=1)
    d.observe_weights(1)
    assert not d.admit(prompt(9), []).admitted  # one group of the batch is not consumed yet
    d.on_consumed([batch[2].requests[0].group_id])
    assert d.admit(prompt(9), []).version == 1


def test_one_step_off_generates_the_next_batch_with_the_previous_version() -> None:
    d = make(mode="one_step_off", group_size=1, batch_groups=2, staleness_bound=5)
    first = [d.admit(prompt(i), []) for i in range(3)]
    assert [a.version for a in first if a.admitted] == [0, 0]  # batch 0
    assert first[-1].reason == "sync-barrier"  # batch 1 waits for batch 0 to be generated
    for a in first[:2]:
        finish_group(d, a.requests)
    second = [d.admit(prompt(5 + i), []) for i in range(3)]
    assert [a.version for a in second if a.admitted] == [0, 0]  # batch 1, while step 0 trains
    for a in second[:2]:
        finish_group(d, a.requests)
    assert not d.admit(prompt(9), []).admitted  # batch 2 needs version 1
    d.on_consumed([a.requests[0].group_id for a in first[:2]], learner_step=1)
    d.observe_weights(1)
    nxt = [d.admit(prompt(10 + i), []) for i in range(3)]
    assert [a.version for a in nxt if a.admitted] == [1, 1]  # batch 2, by version 1
    assert d.ledger().staleness_bound == 1


# ---------------------------------------------------------------------- urgency, ledger


def test_urgent_groups_are_reported_not_retagged() -> None:
    d = make(group_size=3, batch_groups=2, staleness_bound=1)
    old = d.admit(prompt(0), [0]).requests
    d.on_finished(old[0].request_id)
    d.observe_learner_step(1)
    d.observe_weights(1)
    urgent = d.urgent()
    assert [(u.group_id, u.version, u.deadline_step, u.steps_left) for u in urgent] == [
        ("p0", 0, 1, 0)
    ]
    assert urgent[0].pending_request_ids == (old[1].request_id, old[2].request_id)
    assert d.urgent_request_ids() == {old[1].request_id, old[2].request_id}
    assert all(r.version == 0 for r in old)  # the dispatched requests keep their tag


def test_ledger_counts_groups_per_version() -> None:
    d = make(group_size=2, batch_groups=2, staleness_bound=1)
    a = d.admit(prompt(0), [0]).requests
    d.admit(prompt(1), [0])
    finish_group(d, a)
    finish_group(d, a)  # duplicates are ignored
    d.on_consumed([a[0].group_id], learner_step=1)
    led = d.ledger()
    assert (led.learner_step, led.staleness_bound, led.batch_groups) == (1, 1, 2)
    (v0,) = led.versions
    assert (v0.version, v0.dispatched, v0.finished, v0.consumed) == (0, 2, 1, 1)


def test_unknown_ids_and_bad_config_are_loud() -> None:
    d = make()
    with pytest.raises(KeyError, match="request_id"):
        d.on_finished("nope")
    with pytest.raises(KeyError, match="group_id"):
        d.on_consumed(["nope"])
    with pytest.raises(ValueError, match="mode"):
        DispatcherConfig(mode="eventually")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group_size"):
        DispatcherConfig(group_size=0)


# ---------------------------------------------------------------------- closed-loop property


def run_loop(k: int, b: int, seed: int, prompts: int, strict: bool) -> list[tuple[int, int]]:
    """Dispatcher + a learner consuming B groups per step, random completions and tag lag.

    ``strict``: the learner takes exactly the B earliest-deadline groups each step, waiting for
    them (the EDF schedule admission reserves). Otherwise it behaves like ``BatchSelector``:
    B oldest *finished* groups, but it waits for, and includes, every group due this step.
    Returns (step, version) of every consumed group.
    """
    rnd = random.Random(seed)
    d = make(group_size=1, batch_groups=b, staleness_bound=k)
    order: list[tuple[int, int, str]] = []  # (version, seq, gid) of unconsumed groups
    finished: set[str] = set()
    consumed: list[tuple[int, int]] = []
    step, sent, seq = 0, 0, 0
    for _ in range(100_000):
        if sent == prompts and not order:
            break
        # engines: some subset of the recent versions is assigned (tag may lag)
        assigned = [v for v in range(max(0, step - k), step + 1) if rnd.random() < 0.6]
        for _ in range(rnd.randint(0, 3)):
            if sent < prompts:
                adm = d.admit(prompt(sent), assigned)
                if adm.admitted:
                    order.append((adm.version, seq, adm.requests[0].group_id))
                    sent, seq = sent + 1, seq + 1
        pending = [g for _, _, g in order if g not in finished]
        for gid in rnd.sample(pending, min(len(pending), rnd.randint(0, 2))):
            d.on_finished(f"{gid}/0")
            finished.add(gid)
        order.sort()
        if strict:
            batch = order[:b]
            if len(batch) < b and sent < prompts:
                continue
            if not batch or any(g not in finished for _, _, g in batch):
                continue
        else:
            due = [x for x in order if x[0] + k <= step]
            if any(g not in finished for _, _, g in due):
                continue
            ready = [x for x in order if x[2] in finished]
            if len(ready) < b and sent < prompts:
                continue
            batch = due if len(due) > b else ready[:b]
            if not batch:
                continue
        for item in batch:
            order.remove(item)
            consumed.append((step, item[0]))
        d.on_consumed([g for _, _, g in batch], learner_step=step + 1)
        step += 1
        d.observe_weights(step)
    assert sent == prompts and not order, "the loop stalled"
    assert not d.ledger_state.late()
    return consumed


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(0, 3),
    b=st.integers(1, 5),
    seed=st.integers(0, 10_000),
    strict=st.booleans(),
)
def test_every_admitted_group_is_consumed_within_k(k: int, b: int, seed: int, strict: bool) -> None:
    prompts = 12 * b
    consumed = run_loop(k, b, seed, prompts, strict)
    assert len(consumed) == prompts  # nothing dropped
    assert all(0 <= s - u <= k for s, u in consumed)
    if strict:  # the EDF schedule admission reserved never needs an oversize batch
        per_step: dict[int, int] = {}
        for s, _ in consumed:
            per_step[s] = per_step.get(s, 0) + 1
        assert max(per_step.values()) <= b


def test_revision_moves_with_every_ledger_change() -> None:
    d = make(group_size=1, batch_groups=2)
    seen = [d.revision]
    reqs = d.admit(prompt(0), [0]).requests
    seen.append(d.revision)
    d.on_finished(reqs[0].request_id)
    seen.append(d.revision)
    d.on_consumed([reqs[0].group_id], learner_step=1)
    seen.append(d.revision)
    assert seen == sorted(set(seen))
    before = d.revision
    d.admit(prompt(1), [None])  # refused: nothing changed
    assert d.revision == before


def test_a_consumption_report_may_overtake_the_last_scored_sample() -> None:
    """``scored`` and ``metrics`` are separate subjects: the learner may report a group consumed
    before the dispatcher has seen its last sample; that sample is then a no-op, not an error,
    and the group counts as finished once."""
    d = make(group_size=2, batch_groups=4)
    reqs = d.admit(prompt(1), assigned_versions=[0]).requests
    d.on_finished(reqs[0].request_id, reqs[0].group_id)
    d.on_consumed([reqs[0].group_id])
    assert d.on_finished(reqs[1].request_id, reqs[1].group_id) is False
    (v0,) = d.ledger().versions
    assert (v0.dispatched, v0.finished, v0.consumed) == (1, 1, 1)
    with pytest.raises(KeyError, match="request_id"):
        d.on_finished("p9/0/0", "p9/0")  # never dispatched: still loud


def test_a_restored_dispatcher_continues_where_the_snapshot_left_off() -> None:
    """A restart (crash, ``--resume``) restores groups, counts, tombstones and the last prompt:
    redelivered observations are no-ops, a redelivered prompt is not admitted twice, and new
    group ids never reuse an old one."""
    d = make(group_size=2, batch_groups=4, staleness_bound=2)
    a = d.admit(prompt(1), assigned_versions=[0]).requests
    b = d.admit(prompt(2), assigned_versions=[0]).requests
    finish_group(d, a)
    d.on_finished(b[0].request_id)
    d.on_consumed([a[0].group_id], learner_step=1)
    d.observe_weights(1)
    snap = d.snapshot()
    assert snap.unpublished == list(b)  # the service had not confirmed b's publication

    e = make(group_size=2, batch_groups=4, staleness_bound=2)
    e.restore(type(snap).model_validate_json(snap.model_dump_json()))
    assert (e.ledger().versions, e.ledger().learner_step) == (d.ledger().versions, 1)
    assert e.groups_admitted == 2 and e.in_flight() == 1
    assert e.admitted_before(prompt(2).model_copy(update={"event_id": b[0].prompt.event_id}))
    assert e.on_finished(a[1].request_id, a[1].group_id) is False  # consumed already
    assert e.on_finished(b[0].request_id) is False  # scored twice: counted once
    assert e.on_finished(b[1].request_id) is True
    again = e.admit(prompt(1), assigned_versions=[1]).requests  # the same prompt, later
    assert again[0].group_id not in {a[0].group_id, b[0].group_id}
    with pytest.raises(ValueError, match="mode=dora group_size=2"):
        make(group_size=3).restore(snap)


def test_a_prompt_longer_than_the_context_is_refused_before_a_group_exists() -> None:
    calls: list[str] = []

    def tokenize(text: str) -> list[int]:
        calls.append(text)
        return [1] * len(text)

    d = Dispatcher(DispatcherConfig(group_size=2, max_prompt_tokens=8), tokenize=tokenize)
    long = Prompt(event_id="long", prompt_id="long", text="x" * 9)
    with pytest.raises(PromptRefused, match=r"'long' has 9 tokens; .* at most 8"):
        d.check_prompt(long)
    short = Prompt(event_id="short", prompt_id="short", text="x" * 8)
    d.check_prompt(short)
    admission = d.admit(short, [0])
    assert admission.admitted and all(len(r.prompt_token_ids) == 8 for r in admission.requests)
    assert calls == ["x" * 9, "x" * 8]  # each prompt tokenized once
    assert d.ledger().versions[0].dispatched == 1  # the long one left no group behind


def test_a_request_an_engine_refused_abandons_its_group() -> None:
    """A refused request's group can never finish: it leaves the staleness budget (admission
    reopens), the ledger counts and lists it for the learner, its siblings' late samples are
    no-ops, and a restart keeps all of that."""
    d = make(group_size=2, batch_groups=2, staleness_bound=1)
    groups = [d.admit(prompt(i), [0]).requests for i in range(4)]
    assert not d.admit(prompt(9), [0]).admitted  # (K+1)*B = 4 in flight
    doomed = groups[0]
    d.on_finished(doomed[1].request_id)  # a sibling finished before the refusal
    assert d.on_abandoned(doomed[0].request_id) == doomed[0].group_id
    assert d.on_abandoned(doomed[0].request_id) is None  # a second letter changes nothing
    assert d.on_abandoned("forged/0") is None
    assert d.on_abandoned(groups[1][0].request_id) is not None
    d.on_finished(groups[2][0].request_id)
    assert d.on_abandoned(groups[2][0].request_id) is None  # its result exists already

    ledger = d.ledger()
    (v0,) = ledger.versions
    assert (v0.dispatched, v0.abandoned, v0.consumed) == (4, 2, 0)
    assert ledger.abandoned_groups == (doomed[0].group_id, groups[1][0].group_id)
    assert d.in_flight() == 2 and d.admit(prompt(10), [0]).admitted
    assert d.on_finished(doomed[1].request_id, doomed[1].group_id) is False  # settled
    assert not any(u.group_id == doomed[0].group_id for u in d.urgent(horizon=10))

    e = make(group_size=2, batch_groups=2, staleness_bound=1)
    e.restore(type(d.snapshot()).model_validate_json(d.snapshot().model_dump_json()))
    after = d.ledger()
    assert (e.ledger().versions, e.ledger().abandoned_groups) == (
        after.versions,
        after.abandoned_groups,
    )
    assert e.on_finished(doomed[1].request_id, doomed[1].group_id) is False


def test_one_step_off_does_not_wait_for_an_abandoned_group() -> None:
    d = make(mode="one_step_off", group_size=1, batch_groups=2)
    first = [d.admit(prompt(i), [0]).requests for i in range(2)]
    d.on_finished(first[0][0].request_id)
    assert d.capacity(0) == 0  # batch 0 is still generating
    d.on_abandoned(first[1][0].request_id)
    assert d.capacity(0) == 2  # it never will finish: the next batch may start


def test_a_snapshot_from_before_abandonment_still_restores() -> None:
    d = make(group_size=2, batch_groups=2)
    d.admit(prompt(1), [0])
    raw = d.snapshot().model_dump(mode="json")
    raw["counts"] = {v: c[:3] for v, c in raw["counts"].items()}
    del raw["abandoned"]
    e = make(group_size=2, batch_groups=2)
    e.restore(type(d.snapshot()).model_validate_json(json.dumps(raw)))
    assert e.ledger().versions == d.ledger().versions
