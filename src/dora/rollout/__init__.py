"""Rollout: dispatcher (version tags, GRPO groups, staleness budget), orchestrator policy,
generator stage and KV migrator.

Import the submodules directly (``dora.rollout.orchestrator``, ``dora.rollout.dispatcher``);
this package file stays import-light so the pure policy loads without the bus or torch.
"""
