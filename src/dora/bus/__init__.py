"""Transports: the Bus protocol, JetStream (``NatsBus``), in-process (``MemoryBus``)."""

from dora.bus.base import (
    BlobNotFound,
    Bus,
    BusError,
    Consumer,
    ConsumerSpec,
    ConsumerState,
    Message,
    NoResponders,
    PublishResult,
    PublishTimeout,
    RequestError,
    RequestTimeout,
    StartAt,
    StoredMessage,
    StreamSpec,
    StreamState,
    Subscription,
    default_streams,
)
from dora.bus.memory import MemoryBroker, MemoryBus
from dora.bus.nats import NatsBus

__all__ = [
    "BlobNotFound",
    "Bus",
    "BusError",
    "Consumer",
    "ConsumerSpec",
    "ConsumerState",
    "MemoryBroker",
    "MemoryBus",
    "Message",
    "NatsBus",
    "NoResponders",
    "PublishResult",
    "PublishTimeout",
    "RequestError",
    "RequestTimeout",
    "StartAt",
    "StoredMessage",
    "StreamSpec",
    "StreamState",
    "Subscription",
    "default_streams",
]
