"""``VllmEngine``: the Engine protocol on vLLM's ``LLMEngine`` (token ids in, tokens out).

vLLM's engine core runs in its own process and steps on its own; ``step()`` here takes the
next batch of outputs it produced. Everything dora needs goes through vLLM's supported seams:

- sampling: ``DoraSampling`` (a logits processor) draws dora's per-position tokens, so a
  request continues identically wherever it runs;
- weights: ``DoraWorkerExtension.dora_load_weights`` through ``collective_rpc`` loads a new
  version in place;
- migration: ``DoraKVConnector`` hands an aborted request's KV blocks to this process
  (export) and supplies an imported request's context as cached KV, so the target computes
  only the last token (import).

The front end keeps what vLLM does not (the dora request, its version, the tokens and
logprobs it has received, the engines and migrations so far). An export snapshots the request
at the tokens this front end has received: tokens the engine core sampled beyond them are
dropped and drawn again (identically) by the target.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from dora.engines.admission import admit
from dora.engines.base import EngineError, PartialOutput, VersionMismatch
from dora.engines.rate import TokenRate
from dora.engines.vllm.config import KIND, VllmEngineConfig
from dora.engines.vllm.connector import IMPORT_KEY
from dora.engines.vllm.exchange import Exchange
from dora.engines.vllm.held import HeldRequest
from dora.engines.vllm.migration import export_held, held_from_snapshot
from dora.engines.vllm.sampling import EXTRA_KEY, dora_args
from dora.events import (
    EngineStatus,
    RolloutRequest,
    RunningRequest,
    Timings,
    Trajectory,
)

log = structlog.get_logger(__name__)


class _LatestStats:
    """A vLLM stat logger that keeps the latest scheduler stats (running, waiting, KV use)."""

    def __init__(self, sink: dict[str, Any]) -> None:
        self.sink = sink

    def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any) -> None:
        if scheduler_stats is not None:
            self.sink["scheduler"] = scheduler_stats

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
        pass


def _exchange_root(engine_id: str) -> Path:
    shm = Path("/dev/shm")
    base = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)
    return Path(tempfile.mkdtemp(prefix=f"dora-vllm-{safe}-", dir=base))


class VllmEngine:
    """A vLLM replica implementing ``dora.engines.base.Engine``."""

    kind = KIND

    def __init__(
        self,
        directory: Path,
        config: VllmEngineConfig | None = None,
        engine_id: str = "engine-0",
        version: int | None = 0,
    ) -> None:
        # vLLM logs every engine-core step at INFO; a run's console shows what a person needs
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.config = config or VllmEngineConfig()
        self.engine_id = engine_id
        self.directory = Path(directory)
        self.model_config = json.loads((self.directory / "config.json").read_text())
        self.tokenizer = _load_tokenizer(self.directory)
        self.exchange = Exchange(_exchange_root(engine_id))
        cfg = self.config
        args: dict[str, Any] = dict(
            model=str(self.directory),
            dtype=cfg.dtype,
            skip_tokenizer_init=True,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enforce_eager=cfg.enforce_eager,
            kv_cache_memory_bytes=int(cfg.kv_cache_gib * 2**30),
            seed=0,
            async_scheduling=False,  # outputs in step order: an abort sees consistent state
            logprobs_mode="raw_logprobs",
            logits_processors=["dora.engines.vllm.sampling:DoraSampling"],
            worker_extension_cls="dora.engines.vllm.worker.DoraWorkerExtension",
            disable_log_stats=False,
        )
        if cfg.kv_connector:
            args["kv_transfer_config"] = {
                "kv_connector": "DoraKVConnector",
                "kv_connector_module_path": "dora.engines.vllm.connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"exchange_dir": str(self.exchange.root)},
            }
        if cfg.block_size is not None:
            args["block_size"] = cfg.block_size
        args.update(cfg.engine_args)
        started = time.monotonic()
        self._stats: dict[str, Any] = {}

        def stats(vllm_config: Any, engine_index: int = 0) -> _LatestStats:
            return _LatestStats(self._stats)

        self.llm = LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=[stats])
        vc = self.llm.vllm_config
        self.block_size = vc.cache_config.block_size
        self.max_model_len = vc.model_config.max_model_len
        self.dtype = str(vc.model_config.dtype).removeprefix("torch.")
        layout = self.llm.collective_rpc("dora_kv_layout")[0]
        self.layout = f"vllm:{layout['backend']}"
        self.layer_shape: list[int] = layout["shape"]  # one layer's KV tensor
        self.block_dim: int = layout["block_dim"]
        self.num_layers: int = layout["layers"]
        self.num_blocks: int = layout["num_blocks"]
        self.eos_token_id = None if cfg.ignore_eos else self.model_config.get("eos_token_id")
        self._version = version
        self._held: dict[str, HeldRequest] = {}
        self._by_external: dict[str, str] = {}
        self._ids = itertools.count()
        self._rate = TokenRate()
        self.counters = {"exported": 0, "imported": 0, "fallback_exports": 0, "finished": 0}
        log.info(
            "vllm_engine_started",
            engine=engine_id,
            seconds=round(time.monotonic() - started, 1),
            block_size=self.block_size,
            kv_blocks=self.num_blocks,
            layout=self.layout,
        )

    # ------------------------------------------------------------------ identity

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def model_fingerprint(self) -> str:
        """Architecture + dtype + KV layout + weights version: what a snapshot must match."""
        arch = json.dumps(self.model_config, sort_keys=True)
        raw = f"{arch}:{self.dtype}:{self.layout}:{self._version}"
        return hashlib.sha256(raw.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ requests

    def add_request(self, request: RolloutRequest) -> None:
        """Validate and submit a request; EngineError (naming the field) on bad input."""
        rid = request.request_id
        if self._version is None:
            raise EngineError(f"engine {self.engine_id} has no weights loaded")
        if request.version != self._version:
            raise VersionMismatch(
                f"request {rid} is for version {request.version}, "
                f"engine {self.engine_id} serves version {self._version}"
            )
        if rid in self._held:
            raise EngineError(f"request_id {rid!r} is already in this engine")
        sp = request.sampling
        if sp.turn_stop_strings or sp.park_on_stop:
            raise EngineError(
                f"request {rid}: multi-turn episodes (turn_stop_strings, park_on_stop) run on "
                "the built-in engine; the vLLM engine does not park requests"
            )
        vocab = int(self.model_config["vocab_size"])
        a = admit(request, self.tokenizer, vocab, self.max_model_len, self.engine_id)
        resume = a.request.resume
        held = HeldRequest(
            request=a.request,
            prompt=a.prompt,
            tokens=a.resumed,
            logprobs=a.resumed_logprobs,
            token_versions=a.versions,
            track_versions=bool(a.resumed),
            engines=a.engines,
            reprefilled=resume.reprefilled_tokens if resume else 0,
            recompute_mark=a.context if resume is not None else 0,
            added_at=time.time(),
        )
        self._submit(held)

    def _submit(self, held: HeldRequest, kv: dict[str, Any] | None = None) -> None:
        """Add ``held`` to vLLM with its whole context as the prompt (KV from ``kv``)."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = held.request.sampling
        extra: dict[str, Any] = {}
        if sp.temperature > 0:
            extra[EXTRA_KEY] = dora_args(sp, len(held.tokens))
        if kv is not None:
            extra["kv_transfer_params"] = {IMPORT_KEY: kv}
        params = VllmSamplingParams(
            temperature=0.0 if sp.temperature == 0 else 1.0,
            top_p=1.0,
            top_k=0,
            # no vLLM seed: dora's draw is the logits processor's, and a per-request
            # generator breaks vLLM's CPU chunked prefill (``set_offset`` unsupported)
            seed=None,
            max_tokens=sp.max_tokens - len(held.tokens),
            stop_token_ids=list(sp.stop_token_ids),
            ignore_eos=self.config.ignore_eos,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra or None,
        )
        held.exact = sp.temperature == 0 or (
            sp.temperature == 1.0 and sp.top_k == 0 and sp.top_p >= 1.0
        )
        held.external_id = f"{held.request.request_id}#{next(self._ids)}"
        context = held.prompt + held.tokens
        try:
            held.vllm_id = self.llm.add_request(
                held.external_id, {"prompt_token_ids": context}, params
            )
        except (ValueError, TypeError) as exc:  # vLLM's input checks (e.g. too long)
            raise EngineError(f"vLLM refused request {held.request.request_id}: {exc}") from exc
        held.snapshot = None
        self._held[held.request.request_id] = held
        self._by_external[held.external_id] = held.request.request_id

    def has_work(self) -> bool:
        return any(h.snapshot is None for h in self._held.values())

    def num_requests(self) -> int:
        return len(self._held)

    def _get(self, request_id: str) -> HeldRequest:
        held = self._held.get(request_id)
        if held is None:
            raise EngineError(f"unknown request_id {request_id!r} in engine {self.engine_id}")
        return held

    def _forget(self, held: HeldRequest) -> None:
        self._held.pop(held.request.request_id, None)
        self._by_external.pop(held.external_id, None)
        if held.import_file is not None:
            held.import_file.unlink(missing_ok=True)
        self.exchange.clear(held.vllm_id)

    def abort(self, request_id: str) -> PartialOutput:
        held = self._get(request_id)
        if held.snapshot is None:
            self.llm.abort_request([held.vllm_id], internal=True)
        self._forget(held)
        return PartialOutput(
            request=held.request,
            token_ids=tuple(held.tokens),
            logprobs=tuple(held.logprobs),
            engines=tuple(held.engines),
        )

    def set_priority(self, request_id: str, priority: int) -> None:
        """Kept on the request (a migration carries it), but vLLM's first-come scheduler does
        not reorder a running request: on vLLM, priorities do not change the order."""
        held = self._get(request_id)
        held.request = held.request.model_copy(update={"priority": priority})

    # ------------------------------------------------------------------ weights

    def load_weights(self, version: int, weights: Mapping[str, Any] | Path) -> None:
        others = [h.request.request_id for h in self._held.values() if h.request.version != version]
        if others:
            raise VersionMismatch(
                f"engine {self.engine_id} holds {len(others)} request(s) of version "
                f"{self._version} (e.g. {others[0]}); cannot load version {version}"
            )
        path = self._weights_file(version, weights)
        try:
            self.llm.collective_rpc("dora_load_weights", args=(str(path),))
        except Exception as exc:  # vLLM re-raises the worker's error
            raise EngineError(f"cannot load weights of version {version}: {exc}") from exc
        finally:
            if path.parent == self.exchange.root:
                path.unlink(missing_ok=True)
        self.llm.reset_prefix_cache()
        self.llm.set_weight_version(str(version))
        self._version = version
        log.info("weights_loaded", engine=self.engine_id, version=version)

    def _weights_file(self, version: int, weights: Mapping[str, Any] | Path) -> Path:
        """A safetensors file of HF-named tensors the workers can read."""
        if isinstance(weights, str | Path):
            directory = Path(weights)
            if directory.is_file():
                return directory
            files = sorted(directory.glob("*.safetensors"))
            if len(files) != 1:
                raise EngineError(
                    f"cannot load weights of version {version}: expected one .safetensors file "
                    f"in {directory}, found {len(files)}"
                )
            return files[0]
        from safetensors.torch import save_file

        path = self.exchange.root / f"weights-v{version}.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(path))
        return path

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[Trajectory]:
        """The trajectories that finished in the engine core's next batch of outputs."""
        finished: list[Trajectory] = []
        if not self.has_work():
            return finished
        now = time.time()
        produced = 0
        for out in self.llm.step():
            rid = self._by_external.get(out.request_id)
            held = self._held.get(rid) if rid is not None else None
            if held is None or held.snapshot is not None:
                continue  # exported: the target draws these tokens again
            produced += self._take(held, out, now, finished)
        self._rate.add(now, produced)
        return finished

    def _take(self, held: HeldRequest, out: Any, now: float, finished: list[Trajectory]) -> int:
        """Append one output's new tokens; finish the request when it is done."""
        if not held.seen:
            held.seen = True
            held.started_at = held.started_at or now
            cached = out.num_cached_tokens or 0
            held.reprefilled += max(0, held.recompute_mark - cached)
            if held.import_file is not None:
                held.import_file.unlink(missing_ok=True)
                held.import_file = None
        completion = out.outputs[0]
        logprobs = completion.logprobs or []
        reason: str | None = None
        taken = 0
        for i, token in enumerate(completion.token_ids):
            lp = logprobs[i][token].logprob if i < len(logprobs) else 0.0
            held.tokens.append(int(token))
            held.logprobs.append(float(lp))
            held.token_versions.append(held.request.version)
            taken += 1
            if not held.first_token_at:
                held.first_token_at = now
            reason = self._stop(held)
            if reason is not None:
                break
        if reason is None and completion.finish_reason is not None:
            reason = "stop" if completion.finish_reason == "stop" else "length"
        if reason is not None:
            if completion.finish_reason is None:  # a stop string: vLLM would go on
                self.llm.abort_request([held.vllm_id], internal=True)
            finished.append(self._finish(held, reason, now))
        return taken

    def _stop(self, held: HeldRequest) -> str | None:
        sp = held.request.sampling
        last = held.tokens[-1]
        if (self.eos_token_id is not None and last == self.eos_token_id) or (
            last in sp.stop_token_ids
        ):
            return "stop"
        if sp.stop_strings and self.tokenizer is not None:
            longest = max(len(s) for s in sp.stop_strings)
            tail = self.tokenizer.decode(held.tokens[-(longest + 8) :])
            if any(s in tail for s in sp.stop_strings):
                return "stop"
        if len(held.tokens) >= sp.max_tokens or held.context >= self.max_model_len:
            return "length"
        return None

    def _finish(self, held: HeldRequest, reason: str, now: float) -> Trajectory:
        self._forget(held)
        self.counters["finished"] += 1
        req = held.request
        text = self.tokenizer.decode(held.tokens) if self.tokenizer is not None else ""
        return Trajectory(
            request=req,
            version=req.version,
            prompt_token_ids=tuple(held.prompt),
            completion_token_ids=tuple(held.tokens),
            logprobs=tuple(held.logprobs),
            loss_mask=(1,) * len(held.tokens),
            token_versions=tuple(held.token_versions) if held.track_versions else (),
            text=text,
            finish_reason=reason,  # type: ignore[arg-type]
            engines=tuple(held.engines),
            migrations=tuple(held.migrations),
            reprefilled_tokens=held.reprefilled,
            logprobs_exact=held.exact,
            timings=Timings(
                dispatched_at=req.dispatched_at,
                started_at=held.started_at,
                first_token_at=held.first_token_at,
                finished_at=now,
                queue_s=max(0.0, held.started_at - held.added_at),
            ),
        )

    # ------------------------------------------------------------------ migration

    def export_request(self, request_id: str) -> bytes:
        """Abort the request in vLLM with its blocks held by the connector, and return it as
        a snapshot (the KV of every token the front end has received but the last)."""
        held = self._get(request_id)
        if held.snapshot is not None:
            raise EngineError(f"request {request_id} is already exported")
        return export_held(self, held)

    def _exported(self, request_id: str) -> HeldRequest:
        held = self._held.get(request_id)
        if held is None or held.snapshot is None:
            raise EngineError(f"request {request_id!r} is not exported from {self.engine_id}")
        return held

    def release_exported(self, request_id: str) -> None:
        self._forget(self._exported(request_id))

    def restore_exported(self, request_id: str) -> None:
        """The migration failed: continue the request here from its own snapshot."""
        held = self._exported(request_id)
        snapshot, held.snapshot = held.snapshot, None
        self._held.pop(request_id)
        assert snapshot is not None
        self._submit(*held_from_snapshot(self, snapshot, moved=False))

    def import_request(self, snapshot: bytes) -> str:
        held, kv = held_from_snapshot(self, snapshot, moved=True)
        self._submit(held, kv)
        self.counters["imported"] += 1
        return held.request.request_id

    # ------------------------------------------------------------------ status

    def tokens_per_s(self) -> float:
        """Sampled tokens per second over the last 10 s of steps."""
        return self._rate.per_s()

    def status(self) -> EngineStatus:
        stats = self._stats.get("scheduler")
        used = round(stats.kv_cache_usage * self.num_blocks) if stats is not None else 0
        live = [h for h in self._held.values() if h.snapshot is None]
        running = stats.num_running_reqs if stats is not None else len(live)
        waiting = stats.num_waiting_reqs if stats is not None else 0
        return EngineStatus(
            engine_id=self.engine_id,
            version=self._version,
            state="serving" if self.has_work() else "idle",
            running=min(running, len(live)),
            waiting=min(waiting, len(live)),
            kv_blocks_used=min(used, self.num_blocks),
            kv_blocks_total=self.num_blocks,
            block_size=self.block_size,
            tokens_per_s=self.tokens_per_s(),
            max_running=self.config.max_num_seqs,
            engine_kind=KIND,
            requests=tuple(
                RunningRequest(
                    request_id=h.request.request_id,
                    version=h.request.version,
                    generated=len(h.tokens),
                    max_tokens=max(0, h.request.sampling.max_tokens),
                    kv_blocks=-(-h.context // self.block_size),
                    dispatched_at=h.request.dispatched_at,
                )
                for h in self._held.values()
            ),
        )

    def close(self) -> None:
        """Stop vLLM's engine core and remove the exchange directory."""
        import shutil

        try:
            self.llm.engine_core.shutdown()
        finally:
            shutil.rmtree(self.exchange.root, ignore_errors=True)


def _load_tokenizer(directory: Path) -> Any:
    from dora.models import load_tokenizer

    try:
        return load_tokenizer(directory)
    except Exception:  # a checkpoint without dora tokenizer files is still usable
        return None
