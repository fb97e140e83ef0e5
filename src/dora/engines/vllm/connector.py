"""``DoraKVConnector``: moves a running request's KV blocks out of and into vLLM.

A ``KVConnectorBase_V1`` loaded by vLLM from this module (``kv_transfer_config`` with
``kv_connector_module_path``), so dora needs no vLLM fork. It has two halves, as every vLLM
connector does:

- **Scheduler side** (vLLM's engine-core process). Export: when a request the front end
  ordered exported finishes (the front end aborts it), ``request_finished`` keeps its blocks
  (delayed free) and schedules a save. Import: a request added with
  ``kv_transfer_params={"dora_import": ...}`` reports its context as externally cached
  (``get_num_new_matched_tokens``), so vLLM allocates its blocks, computes only the last
  token, and has the worker fill the blocks first.
- **Worker side** (the process holding the KV tensors). Before the step's forward it gathers
  the blocks of each save into the exchange directory and scatters each import's blocks into
  the blocks vLLM allocated; a finished save is reported through ``get_finished`` so the
  scheduler frees the source blocks.

The block layout is whatever the attention backend allocates (found at registration: the
dimension of each layer's tensor that has ``num_blocks`` entries); the front end records it in
the snapshot header, so a snapshot only loads into an engine of the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from dora.engines.vllm.exchange import Exchange, read_json, write_json

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

IMPORT_KEY = "dora_import"
"""Key of ``kv_transfer_params`` that marks an imported request (value: the blocks' file)."""


@dataclass
class Save:
    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class Load:
    request_id: str
    block_ids: list[int]  # target blocks, in order, for the snapshot's blocks [first, ...)
    first_block: int  # index of the snapshot's first block to load (local prefix-cache hit)
    path: str
    shape: list[int]  # the snapshot payload's shape (layers first, then one layer's gather)
    dtype: str


@dataclass
class DoraConnectorMetadata(KVConnectorMetadata):
    saves: list[Save] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DoraKVConnector(KVConnectorBase_V1):
    """Export (abort with blocks held) and import (context supplied as cached KV)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.exchange = Exchange(extra["exchange_dir"])
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        # scheduler side
        self._saves: list[Save] = []
        self._loads: dict[str, tuple[int, dict[str, Any]]] = {}  # rid -> (external tokens, params)
        self._imported: set[str] = set()
        # worker side
        self._layers: list[tuple[str, torch.Tensor, int]] = []  # name, tensor, block dim
        self._sent: set[str] = set()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = (request.kv_transfer_params or {}).get(IMPORT_KEY)
        if params is None or request.request_id in self._imported:
            return 0, False  # a resumed preempted request recomputes (vLLM counts it)
        return max(0, int(params["num_tokens"]) - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            params = request.kv_transfer_params[IMPORT_KEY]
            self._loads[request.request_id] = (num_external_tokens, params)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = DoraConnectorMetadata(saves=self._saves)
        self._saves = []
        for new in scheduler_output.scheduled_new_reqs:
            pending = self._loads.pop(new.req_id, None)
            if pending is None:
                continue
            external, params = pending
            local = new.num_computed_tokens - external  # block-aligned local prefix hit
            first = local // self.block_size
            last = -(-new.num_computed_tokens // self.block_size)
            meta.loads.append(
                Load(
                    request_id=new.req_id,
                    block_ids=list(new.block_ids[0][first:last]),
                    first_block=first,
                    path=params["path"],
                    shape=list(params["shape"]),
                    dtype=params["dtype"],
                )
            )
            self._imported.add(new.req_id)
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._imported.discard(rid)
        self._loads.pop(rid, None)
        order = read_json(self.exchange.export_order(rid))
        if order is None:
            return False, None
        wanted = int(order["num_tokens"])
        if request.num_computed_tokens < wanted:  # preempted meanwhile: its KV is gone
            write_json(
                self.exchange.accepted(rid),
                {
                    "ok": False,
                    "reason": f"{request.num_computed_tokens} tokens have KV, "
                    f"{wanted} were asked for (preempted)",
                },
            )
            return False, None
        used = -(-wanted // self.block_size)
        self._saves.append(Save(rid, list(block_ids[:used]), wanted))
        write_json(self.exchange.accepted(rid), {"ok": True})
        return True, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name in sorted(kv_caches):
            tensor = kv_caches[name]
            dims = [d for d, n in enumerate(tensor.shape) if n == self.num_blocks]
            if not dims:
                raise ValueError(f"KV cache of {name} has no dimension of {self.num_blocks} blocks")
            self._layers.append((name, tensor, dims[0]))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DoraConnectorMetadata)
        for save in meta.saves:
            self._save(save)
        for load in meta.loads:
            self._load(load)

    def _save(self, save: Save) -> None:
        index = torch.tensor(save.block_ids, dtype=torch.long)
        parts = [t.index_select(d, index.to(t.device)).cpu() for _, t, d in self._layers]
        kv = torch.stack(parts).contiguous()
        path = self.exchange.kv_data(save.request_id)
        kv.view(torch.uint8).numpy().tofile(path)
        dtype = str(kv.dtype).removeprefix("torch.")
        meta = {"shape": list(kv.shape), "dtype": dtype, "num_tokens": save.num_tokens}
        write_json(self.exchange.kv_meta(save.request_id), meta)
        self._sent.add(save.request_id)

    def _load(self, load: Load) -> None:
        raw = np.fromfile(load.path, dtype=np.uint8)
        kv = torch.from_numpy(raw).view(_DTYPES[load.dtype]).view(load.shape)
        target = torch.tensor(load.block_ids, dtype=torch.long)
        source = torch.arange(load.first_block, load.first_block + len(load.block_ids))
        for i, (_, tensor, dim) in enumerate(self._layers):
            blocks = kv[i].index_select(dim, source).to(tensor.device, tensor.dtype)
            tensor.index_copy_(dim, target.to(tensor.device), blocks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, self._sent = self._sent, set()
        return (sent or None), None
