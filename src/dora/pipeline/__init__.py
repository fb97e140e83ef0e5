"""Pipelines: stages composed in Python (``Pipeline``) or loaded from ``pipelines/*.yaml``.

::

    async with Pipeline(run_id="demo", bus=bus) as p:   # or Pipeline(nats_url=...) / embedded
        p.add(source).add(worker, replicas=2).add(sink)  # (add before entering)
        await p.wait()                                   # until every finite stage finished

    summary = await load_pipeline(Path("pipelines/quickstart.yaml")).run()

See ``dora.stage`` for declaring stages and ``dora.pipeline.spec`` for the YAML schema.
"""

from dora.pipeline.core import SUMMARY_FILE, Pipeline, PipelineError, new_run_id
from dora.pipeline.spec import (
    PipelineConfigError,
    PipelineFile,
    StageEntry,
    load_pipeline,
    read_pipeline_file,
)

__all__ = [
    "SUMMARY_FILE",
    "Pipeline",
    "PipelineConfigError",
    "PipelineError",
    "PipelineFile",
    "StageEntry",
    "load_pipeline",
    "new_run_id",
    "read_pipeline_file",
]
