"""The built-in paged-KV torch engine (continuous batching, prefix caching, KV migration).

One concept per module: ``config`` (EngineConfig), ``sequence`` (a request's state),
``block_manager`` (KV blocks, refcounts, prefix cache), ``scheduler`` (continuous batching,
chunked prefill, priority, preemption), ``attention`` + ``model_runner`` (the forward over one
KV tensor), ``fast_forward`` (inference forward on fused, oneDNN-prepacked weights) +
``cpu_ops`` (its compiled row-wise ops), ``paged_kernel`` (compiled CPU decode attention
reading K/V from the blocks),
``sampler`` (deterministic sampling), ``stopping``, ``admission`` (request
validation), ``migration`` (export/import), ``engine`` (``TorchEngine``, the step loop).
"""

from dora.engines.torch.config import EngineConfig
from dora.engines.torch.engine import EngineCounters, TorchEngine
from dora.engines.torch.sampler import sample, uniform

__all__ = ["EngineConfig", "EngineCounters", "TorchEngine", "sample", "uniform"]
