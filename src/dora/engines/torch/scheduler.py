"""Continuous batching: which pending tokens of which sequences the next step computes.

Each step has a token budget (``max_num_batched_tokens``). Running sequences are served
first in priority order (a decode costs one token, an unfinished prefill continues in a
chunk), then waiting sequences are admitted in priority order while budget, sequence slots
and KV blocks last. When blocks run out, the lowest-priority running sequence is preempted
recompute-style: its blocks are freed and it waits to be prefilled again (those tokens are
counted as re-prefilled).

Multi-turn episodes parked at a turn boundary (waiting for their environment) keep their KV
but are not scheduled. Under KV pressure a parked episode's KV is evicted before any running
sequence is preempted (the oldest parked first): it is prefilled again when its reply comes,
on this engine (which serves its version), and those tokens count as re-prefilled.
"""

from __future__ import annotations

import time

import structlog

from dora.engines.torch.block_manager import BlockManager
from dora.engines.torch.config import EngineConfig
from dora.engines.torch.model_runner import ScheduledSeq
from dora.engines.torch.sequence import SeqStatus, Sequence

log = structlog.get_logger(__name__)


class Scheduler:
    """Owns the waiting and running sets and the block tables of their sequences."""

    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []
        self.preemptions = 0
        self.evictions = 0
        """Parked episodes whose KV was freed under pressure."""
        self.cached_tokens = 0  # context tokens admitted with KV from the prefix cache

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in its blocks (imported or restored)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the scheduler (its blocks stay as they are)."""
        for pool in (self.running, self.waiting, self.parked):
            if seq in pool:
                pool.remove(seq)
                return

    def park(self, seq: Sequence) -> None:
        """A turn boundary: keep its KV (while there is room), stop scheduling it."""
        self.remove(seq)
        seq.status = SeqStatus.PARKED
        seq.parked_at = seq.parked_at or time.time()  # an imported one keeps its time
        self.parked.append(seq)

    def unpark(self, seq: Sequence) -> None:
        """Its reply was appended: decode on, or be prefilled again if its KV was evicted."""
        self.remove(seq)
        seq.parked_at = 0.0
        if seq.block_table:
            self.add_running(seq)
        else:
            self.add(seq)

    def _evict_parked(self) -> bool:
        """Free the KV of the oldest parked episode that holds some; False: none does."""
        for seq in self.parked:
            if seq.block_table:
                seq.recompute_hw = max(seq.recompute_hw, seq.num_computed)
                self._release(seq)
                self.evictions += 1
                log.debug("parked_kv_evicted", request_id=seq.request_id)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.blocks.blocks_needed(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.blocks.num_free:
            return False
        seq.block_table.extend(self.blocks.allocate(need))
        return True

    def _release(self, seq: Sequence) -> None:
        self.blocks.free_blocks(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    def preempt(self, seq: Sequence) -> None:
        """Free a sequence's KV and send it back to waiting (it will be re-prefilled)."""
        seq.recompute_hw = max(seq.recompute_hw, seq.num_computed)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self.preemptions += 1
        log.debug("preempted", request_id=seq.request_id, tokens=len(seq.token_ids))

    def schedule(self) -> list[ScheduledSeq]:
        """This step's batch; mutates running/waiting (admissions, preemptions)."""
        budget = self.config.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        queue = sorted(self.running, key=Sequence.sort_key)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            if budget <= 0:
                kept.append(seq)
                continue
            n = min(seq.num_pending, budget)
            fits = self._grow(seq, seq.num_computed + n)
            while not fits and self._evict_parked():  # idle KV goes first
                fits = self._grow(seq, seq.num_computed + n)
            while not fits and queue:
                self.preempt(queue.pop())  # lowest priority not yet scheduled
                fits = self._grow(seq, seq.num_computed + n)
            if not fits:
                self.preempt(seq)
                continue
            kept.append(seq)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        self.running = kept
        self.waiting.sort(key=Sequence.sort_key)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = 0
            if not seq.block_table:
                hits, hashes = self.blocks.match_prefix(seq.token_ids)
                seq.block_table, seq.block_hashes = hits, hashes
                seq.num_computed = cached = len(hits) * self.blocks.block_size
            n = min(seq.num_pending, budget)
            fits = self._grow(seq, seq.num_computed + n)
            while not fits and not self.running and self._evict_parked():
                fits = self._grow(seq, seq.num_computed + n)  # else nothing would run at all
            if not fits:
                self._release(seq)
                break
            self.waiting.pop(0)
            self.cached_tokens += cached  # counted once, when the admission sticks
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch
