"""The generator stage's engine choice fails at load, naming the field, when it cannot work;
and a run asking for vLLM where it is not installed says which extra to install."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora.models import build_model, save_pretrained
from dora.pipeline import PipelineConfigError, load_pipeline
from dora.stages.generator import GeneratorStage


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tok = build_model("tiny", seed=0, num_hidden_layers=1)
    return save_pretrained(model, tmp_path_factory.mktemp("m") / "tiny", tok)


def write(tmp_path: Path, model_dir: Path, config: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(
        "stages:\n  - type: generator\n    replicas: 2\n    config:\n"
        f"      model: {{path: {model_dir}}}\n{config}"
    )
    return path


@pytest.mark.parametrize(
    ("config", "needles"),
    [
        ("      engine_kind: sglang\n", ["engine_kind", "'dora' or 'vllm'"]),
        ("      engine_kind: vllm\n      vllm: {blok_size: 32}\n", ["vllm", "blok_size"]),
        (
            "      engine_kind: vllm\n      episodes: {environment: calculator}\n",
            ["episodes", "engine_kind: dora"],
        ),
    ],
)
def test_a_bad_engine_choice_fails_at_load(
    tmp_path: Path, model_dir: Path, config: str, needles: list[str]
) -> None:
    with pytest.raises(PipelineConfigError) as info:
        load_pipeline(write(tmp_path, model_dir, config))
    for needle in needles:
        assert needle in str(info.value)


def test_one_kind_per_replica(model_dir: Path) -> None:
    stage = GeneratorStage(model={"path": str(model_dir)}, engine_kind=["dora", "vllm"])
    stage.replica_ids = (0, 1)
    assert stage._kinds() == {0: "dora", 1: "vllm"}
    stage.replica_ids = (1,)  # its own process: replica 1 only
    assert stage._kinds() == {1: "vllm"}
    stage.replica_ids = (0, 1, 2)
    with pytest.raises(ValueError, match="engine_kind lists 2 kinds but replica 2 runs"):
        stage._kinds()


def test_vllm_without_the_extra_names_it(model_dir: Path) -> None:
    from dora.engines.vllm import vllm_missing

    if vllm_missing() is None:
        pytest.skip("vLLM is installed here")
    stage = GeneratorStage(model={"path": str(model_dir)}, engine_kind="vllm")
    with pytest.raises(RuntimeError, match=r"engine_kind vllm: .*pip install 'dora-rl\[vllm\]'"):
        stage._vllm_engine(model_dir, "engine-0")
