"""Subject names: run-prefixed, token-checked, resolvable from what a person types."""

from __future__ import annotations

import pytest

from dora.subjects import DURABLE_FAMILIES, LIVE_FAMILIES, Subjects


def test_names_are_prefixed_by_the_run() -> None:
    s = Subjects("r-1")
    assert s.requests(3) == "dora.r-1.requests.v3"
    assert s.trajectories == "dora.r-1.trajectories"
    assert s.status("e0") == "dora.r-1.status.e0"
    assert s.control("e0") == "dora.r-1.control.e0"
    assert s.rpc("echo") == "dora.r-1.rpc.echo"
    assert s.stream("trajectories") == "DORA_R_1_TRAJECTORIES"
    assert "." not in s.blob_bucket and "." not in s.kv_bucket


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "x*", "y>"])
def test_bad_tokens_are_named(bad: str) -> None:
    with pytest.raises(ValueError, match="run id"):
        Subjects(bad)
    with pytest.raises(ValueError, match="engine id"):
        Subjects("r").status(bad)


def test_family_of() -> None:
    s = Subjects("r")
    assert s.family_of(s.requests(2)) == "requests"
    assert s.family_of(s.requests_all) == "requests"
    assert s.family_of(s.deadletter) == "deadletter"
    with pytest.raises(ValueError, match=r"not under dora\.r\."):
        s.family_of("dora.other.scored")


def test_resolve() -> None:
    s = Subjects("r")
    assert s.resolve("trajectories") == s.trajectories
    assert s.resolve("deadletter") == s.deadletter
    assert s.resolve("requests") == s.requests_all
    assert s.resolve("requests.v3") == s.requests(3)
    assert s.resolve("status") == s.status_all
    assert s.resolve("status.e1") == s.status("e1")
    assert s.resolve("dora.r.scored") == s.scored
    for family in (*DURABLE_FAMILIES, *LIVE_FAMILIES):
        assert s.family_of(s.resolve(family)) == family
    with pytest.raises(ValueError, match="bogus"):
        s.resolve("bogus")
