"""``DoraWorkerExtension``: what ``collective_rpc`` can ask of each vLLM worker.

vLLM mixes this class into its worker (``worker_extension_cls``), so a new policy version is
loaded into the running model in place (no restart; the KV cache stays allocated): the front
end calls ``collective_rpc("dora_load_weights", args=(path,))`` with a safetensors file of
HF-named tensors, and vLLM's own in-place reload (``Worker.reload_weights``) maps them onto
its fused layers.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


class DoraWorkerExtension:
    """Methods vLLM adds to its worker; ``self`` is the worker."""

    model_runner: Any
    reload_weights: Any

    def dora_load_weights(self, path: str) -> int:
        """Load HF-named tensors from a safetensors file; the number of tensors loaded."""
        from safetensors.torch import load_file

        state = load_file(path)
        # vLLM's in-place reload: restores the layers' checkpoint-format parameters, loads,
        # then re-runs the backend's post-load processing (e.g. the CPU backend's repacking)
        self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        return len(state)

    def dora_ping(self) -> bool:
        """A no-op: its return tells the front end the engine core handled earlier inputs."""
        return True

    def dora_kv_layout(self) -> dict[str, Any]:
        """The KV tensors as the connector sees them: backend, one layer's shape, which of its
        dimensions indexes blocks, the number of layers and of blocks."""
        caches = [t for t in self.model_runner.kv_caches if t is not None]
        num_blocks = self.model_runner.kv_cache_config.num_blocks
        shape = list(caches[0].shape)
        block_dim = next(d for d, n in enumerate(shape) if n == num_blocks)
        backend = self.model_runner.attn_groups[0][0].backend.get_name()
        return {
            "backend": backend,
            "shape": shape,
            "block_dim": block_dim,
            "layers": len(caches),
            "num_blocks": num_blocks,
        }

    def dora_weights_digest(self) -> str:
        """sha256 over the model's parameters as loaded (tests: a load took effect)."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self.model_runner.model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
