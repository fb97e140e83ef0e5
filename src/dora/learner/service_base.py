"""The state every part of the learner service shares: model, trainer, buffer, held messages.

``LearnerService`` is assembled from small parts (intake, training step, checkpoints) that
each live in their own module; they all read and write the same fields, so those fields are
created once here.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from pathlib import Path

from dora.bus.base import Bus, Message
from dora.events import Ledger
from dora.learner.batching import Batch, BatchSelector, GroupBuffer
from dora.learner.checkpoint import CheckpointManager
from dora.learner.config import LearnerConfig
from dora.learner.journal import StepJournal
from dora.learner.metrics import MetricsWriter
from dora.learner.trainer import Trainer
from dora.learner.weights import (
    DirectoryTransport,
    ObjectStoreTransport,
    WeightPublisher,
    WeightTransport,
)
from dora.models import CharTokenizer, LlamaModel

HISTORY_STEPS = 1_000

StepHook = Callable[[int, Batch, dict[str, float]], None]


class LearnerBase:
    """Shared fields of ``LearnerService``; not used on its own."""

    def __init__(
        self,
        bus: Bus,
        model: LlamaModel,
        config: LearnerConfig,
        run_dir: Path,
        *,
        tokenizer: CharTokenizer | None = None,
        ref_model: LlamaModel | None = None,
        transport: WeightTransport | None = None,
        on_step: StepHook | None = None,
    ) -> None:
        self.bus = bus
        self.model = model
        self.config = config
        self.run_dir = Path(run_dir)
        self.tokenizer = tokenizer
        self.on_step = on_step
        self.trainer = Trainer(model, config.grpo, config.optim, ref_model)
        self.buffer = GroupBuffer(
            config.staleness_bound,
            max_seq_len=model.config.max_position_embeddings,
            vocab_size=model.config.vocab_size,
        )
        self.selector = BatchSelector(self.buffer, config.batch_groups, config.max_urgent_wait_s)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", config.keep_checkpoints)
        self.journal = StepJournal(self.run_dir / "checkpoints" / "journal.jsonl")
        if transport is None:
            if config.weight_store == "directory":
                transport = DirectoryTransport(config.weight_dir or self.run_dir / "weights")
            else:
                transport = ObjectStoreTransport(bus)
        self.publisher = WeightPublisher(bus, transport, config.weight_versions_kept)
        self.step = 0
        self.resumed_from: int | None = None
        self.history: deque[tuple[int, list[str]]] = deque(maxlen=HISTORY_STEPS)
        """(step, request ids) of the last steps this process trained, in order."""
        self._held: list[Message] = []
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()
        """Set once the durable consumer exists (publishing to ``scored`` is safe from then)."""
        self._last_checkpoint_step = -1
        self._ledger: Ledger | None = None
        self._ledger_read_at = 0.0
        self._ledger_warned = False
        self._writer: MetricsWriter | None = None

    def stop(self) -> None:
        """Ask ``run`` to finish: it checkpoints (acking what it holds) and returns."""
        self._stop.set()
