"""vLLM as a dora engine (extra ``vllm``): the Engine protocol on vLLM's ``LLMEngine``.

One concept per module: ``config`` (VllmEngineConfig), ``engine`` (``VllmEngine``, the front
end), ``held`` (a request as the front end knows it), ``migration`` (export and import),
``connector`` (``DoraKVConnector``: KV blocks out of and into vLLM), ``exchange`` (the files
the two share), ``sampling`` (dora's deterministic sampling as a logits processor), ``worker``
(weights loaded in place through ``collective_rpc``).

Importing this package does not import vLLM; ``VllmEngine`` does, when constructed.
"""

from dora.engines.vllm.config import VllmEngineConfig


def vllm_missing() -> str | None:
    """None when vLLM imports, else the reason (and which extra to install)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        return f"vLLM is not importable ({type(exc).__name__}: {exc}); pip install 'dora-rl[vllm]'"
    return None


__all__ = ["VllmEngineConfig", "vllm_missing"]
