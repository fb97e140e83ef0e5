"""Shared fixtures: a real nats-server per test session, and bus factories for both transports."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from dora.bus import Bus, MemoryBroker, MemoryBus, NatsBus, StreamSpec
from dora.bus.server import NatsServer
from dora.subjects import Subjects


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One real nats-server (JetStream on disk) for the whole session; tests isolate by run id."""
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def run_id() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def subjects(run_id: str) -> Subjects:
    return Subjects(run_id)


BusFactory = Callable[..., Bus]


@pytest.fixture(params=["memory", "nats"])
def bus_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_bus(
    bus_kind: str, subjects: Subjects, request: pytest.FixtureRequest
) -> Iterator[BusFactory]:
    """Factory of connected-to-be clients of ONE server (memory broker or nats-server)."""
    broker = MemoryBroker()

    def factory(streams: tuple[StreamSpec, ...] | None = None) -> Bus:
        if bus_kind == "memory":
            return MemoryBus(subjects, broker=broker, streams=streams)
        server: NatsServer = request.getfixturevalue("nats_server")
        return NatsBus(subjects, server.url, streams=streams)

    yield factory


@pytest.fixture
async def bus(make_bus: BusFactory) -> AsyncIterator[Bus]:
    client = make_bus()
    await client.connect()
    yield client
    await client.close()


@pytest.fixture
async def nats_bus(nats_server: NatsServer, subjects: Subjects) -> AsyncIterator[NatsBus]:
    client = NatsBus(subjects, nats_server.url)
    await client.connect()
    yield client
    await client.close()


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]
