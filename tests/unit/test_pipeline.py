"""Pipelines on MemoryBus: composition, completion, failure, and YAML loading errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dora.bus import MemoryBus
from dora.events import Prompt, ScoredTrajectory, Trajectory
from dora.pipeline import Pipeline, PipelineConfigError, PipelineError, load_pipeline
from dora.registry import stage_types
from dora.stage import Context, Reject, Stage, StageError, derived_id, stage
from dora.stages import CountingSink, PromptSource, RuleGenerator, VerifierStage
from dora.subjects import Subjects


@pytest.fixture
async def bus() -> MemoryBus:
    client = MemoryBus(Subjects("unitpipe"))
    await client.connect()
    return client


@stage(emits={Prompt: "prompts"})
async def three(ctx: Context) -> AsyncIterator[Prompt]:
    for i in range(3):
        yield Prompt(event_id=f"p{i}", prompt_id=f"id{i}", text=f"{i}+{i}", answer=str(2 * i))


class Collect(Stage):
    consumes = "prompts"
    finite = True

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.got: list[str] = []

    async def handle(self, p: Prompt, ctx: Context) -> None:
        self.got.append(p.event_id)
        if len(self.got) == 3:
            ctx.complete()


async def test_python_pipeline_runs_to_completion(bus: MemoryBus) -> None:
    sink = Collect()
    summary = await Pipeline(bus=bus).add(three).add(sink).run()
    assert sorted(sink.got) == ["p0", "p1", "p2"]
    assert summary["completed"] is True
    assert summary["stages"]["three"]["stats"]["published"] == 3
    assert summary["stages"]["collect"]["stats"]["processed"] == 3


async def test_failing_source_fails_the_pipeline(bus: MemoryBus) -> None:
    @stage(emits={Prompt: "prompts"})
    async def broken(ctx: Context) -> AsyncIterator[Prompt]:
        raise RuntimeError("source exploded")
        yield  # pragma: no cover

    with pytest.raises(PipelineError, match="source exploded"):
        await Pipeline(bus=bus).add(broken).add(Collect()).run()


def test_duplicate_names_and_source_replicas_are_refused() -> None:
    p = Pipeline(run_id="x").add(Collect())
    with pytest.raises(StageError, match="two stages named 'collect'"):
        p.add(Collect())
    with pytest.raises(StageError, match="exactly 1 for a source"):
        p.add(three, replicas=2)


async def test_quickstart_yaml_runs_on_memory_bus(bus: MemoryBus, repo_root: Path) -> None:
    pipe = load_pipeline(repo_root / "pipelines" / "echo.yaml", bus=bus)
    summary = await pipe.run()
    assert summary["completed"]
    sink = summary["stages"]["sink"]
    assert sink["count"] == summary["stages"]["prompts"]["stats"]["published"] == 64
    assert 0 < sink["correct"] < 64  # the generator corrupts ~1 in 5 answers on purpose


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipe.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (
            "stages:\n  - type: no_such_stage\n",
            ["pipe.yaml", "stages[0].type", "unknown stage type 'no_such_stage'", *stage_types()],
        ),
        (
            "stages:\n  - type: prompt_source\n    config: {count: many}\n",
            ["pipe.yaml", "stages[0].config.count", "valid integer"],
        ),
        (
            "stages:\n  - type: prompt_source\n    config: {colour: red}\n",
            ["stages[0].config.colour", "Extra inputs are not permitted"],
        ),
        (
            "stages:\n  - type: prompt_source\n    config: {task: nope}\n",
            ["stages[0].config", "unknown task 'nope'", "arithmetic"],
        ),
        (
            "stages:\n  - type: prompt_source\n    replicas: 0\n",
            ["stages[0].replicas", "greater than or equal to 1"],
        ),
        ("stages: []\n", ["pipe.yaml", "stages", "at least 1"]),
        ("stagez: []\n", ["stagez", "Extra inputs"]),
        ("stages: [\n", ["pipe.yaml", "invalid YAML"]),
        (
            "stages:\n  - type: 'os.path:join'\n",
            ["stages[0].type", "not a Stage"],
        ),
        (
            "stages:\n  - type: 'dora.nothing_here:X'\n",
            ["stages[0].type", "cannot import module 'dora.nothing_here'"],
        ),
        (  # nested service configs are checked at load, before any server or warm start
            "stages:\n  - type: learner\n    config:\n      model: {warmstart: {}}\n"
            "      learner: {max_step: 2}\n",
            ["stages[0].config.learner", "'max_step' (did you mean 'max_steps'?)"],
        ),
        (
            "stages:\n  - type: rollout\n    config:\n      model: {warmstart: {}}\n"
            "      engine: {num_blocs: 64}\n",
            ["stages[0].config.engine", "'num_blocs' (did you mean 'num_blocks'?)"],
        ),
        (
            "stages:\n  - type: verifier\n    consumes: trajectory\n",
            ["stages[0].consumes", "unknown family 'trajectory'"],
        ),
        (  # the Ray deployment's keys are checked whatever the deployment
            "stages:\n  - type: verifier\n    resources: {num_gpu: 1}\n",
            ["stages[0].resources.num_gpu", "Extra inputs are not permitted"],
        ),
        (
            "stages:\n  - type: verifier\n    placement: scatter\n",
            ["stages[0].placement", "'pack', 'spread', 'strict_pack' or 'strict_spread'"],
        ),
    ],
)
def test_bad_pipeline_files_name_file_and_field(
    tmp_path: Path, text: str, needles: list[str]
) -> None:
    with pytest.raises(PipelineConfigError) as info:
        load_pipeline(write(tmp_path, text))
    for needle in needles:
        assert needle in str(info.value)


@stage(consumes="prompts", emits={ScoredTrajectory: "scored"})
async def dotted_stage(p: Prompt, ctx: Context) -> None:
    """Referenced from YAML by its import path."""
    ctx.log.info("seen", id=derived_id(p.event_id))


def test_dotted_path_and_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "name: custom\nstages:\n"
        "  - type: 'tests.unit.test_pipeline:dotted_stage'\n    name: renamed\n"
        "    concurrency: 3\n    retry: {max_deliver: 7}\n    consumes: requests.v3\n",
    )
    pipe = load_pipeline(path, run_id="r1")
    (only,) = pipe.stages
    assert (only.name, only.concurrency, only.retry.max_deliver) == ("renamed", 3, 7)
    assert only.consumes == "requests.v3" and dotted_stage.consumes == "prompts"
    assert pipe.run_id == "r1" and pipe.name == "custom"


class PickyGenerator(RuleGenerator):
    name = "generator"

    async def handle(self, prompt: Prompt, ctx: Context) -> Trajectory:
        if prompt.prompt_id.endswith(("0", "2", "4", "6", "8")):
            raise Reject("even prompts are refused")
        return await super().handle(prompt, ctx)


async def test_sink_counting_dead_letters_completes_despite_rejections(bus: MemoryBus) -> None:
    sink = CountingSink(expect=10, count_dead_letters=True)
    pipe = Pipeline(bus=bus).add(PromptSource(count=10)).add(PickyGenerator()).add(VerifierStage())
    summary = await pipe.add(sink).run()
    assert summary["completed"]
    assert summary["stages"]["sink"]["count"] == 5
    assert summary["stages"]["sink"]["dead_letters"] == 5
    assert summary["stages"]["generator"]["stats"]["dead_lettered"] == 5


def test_stage_module_next_to_the_yaml_is_importable_without_pythonpath(tmp_path: Path) -> None:
    (tmp_path / "my_local_stages.py").write_text(
        "from dora.events import Prompt\n"
        "from dora.stage import stage\n\n"
        "@stage(consumes='prompts')\n"
        "async def shout(p: Prompt, ctx) -> None:\n"
        "    ctx.log.info('seen')\n"
    )
    pipe = load_pipeline(write(tmp_path, "stages:\n  - type: 'my_local_stages:shout'\n"))
    assert [s.name for s in pipe.stages] == ["shout"]


async def test_a_run_that_stops_making_progress_fails_with_each_stages_state(
    bus: MemoryBus,
) -> None:
    """The sink waits for a fourth prompt that never comes: instead of waiting forever, the
    run fails once nothing moved for ``stall_timeout`` seconds, naming where each stage is."""

    class NeedsFour(Collect):
        async def handle(self, p: Prompt, ctx: Context) -> None:
            self.got.append(p.event_id)  # completes only at 4, which never comes

        def progress_total(self) -> int | None:
            return 4

    pipeline = Pipeline(bus=bus, stall_timeout=0.5).add(three).add(NeedsFour(name="sink"))
    with pytest.raises(PipelineError, match=r"no stage made progress for 0 s: .*sink 3/4"):
        await pipeline.run()


async def test_the_summary_names_work_no_consumer_took(bus: MemoryBus) -> None:
    """A request queued for a version no engine serves, and prompts past what the run needed,
    are still stored when the run ends: the summary lists them instead of staying silent."""
    s = bus.subjects
    await bus.publish(s.requests(7), b"{}", msg_id="orphan")

    class TakeTwo(Collect):
        async def handle(self, p: Prompt, ctx: Context) -> None:
            self.got.append(p.event_id)
            if len(self.got) == 2:
                ctx.complete()

    sink = TakeTwo(concurrency=1)
    summary = await Pipeline(bus=bus).add(three).add(sink).run()
    assert summary["completed"]
    left = summary["left_in_streams"]
    assert left["requests.v7"] == 1
    assert left.get("prompts", 0) == 3 - len(sink.got)
