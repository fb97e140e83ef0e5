"""Deployments beyond one process: ``dora run --ray`` (``dora.deploy.ray``)."""
