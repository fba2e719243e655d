"""dvc.yaml lists exactly the code each stage runs, so a server-only or docs-only edit reruns nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from specops.pipeline.stage_deps import REPO, STAGE_FILES, STAGE_FUNCTIONS, stage_deps, stage_modules

SERVER_ONLY = {"specops.server.app", "specops.server.worker", "specops.server.reload", "specops.server.guards",
               "specops.server.protocol", "specops.server.metrics", "specops.server.textstream",
               "specops.server.commands", "specops.cli"}
STAGES = [(f, name) for f in STAGE_FILES for name in yaml.safe_load((REPO / f).read_text())["stages"]]


def code_deps(dvc_file: str, stage: str) -> list[str]:
    deps = yaml.safe_load((REPO / dvc_file).read_text())["stages"][stage]["deps"]
    return sorted(d for d in deps if not d.startswith("${"))


@pytest.mark.parametrize(("dvc_file", "stage"), STAGES, ids=[f"{f}:{s}" for f, s in STAGES])
def test_dvc_yaml_lists_the_stage_code(dvc_file, stage):
    expected = stage_deps(STAGE_FILES[dvc_file], STAGE_FUNCTIONS[dvc_file](stage))
    assert code_deps(dvc_file, stage) == expected, "run `python -m specops.pipeline.stage_deps` and update " + dvc_file


@pytest.mark.parametrize(("dvc_file", "stage"), STAGES, ids=[f"{f}:{s}" for f, s in STAGES])
def test_no_stage_runs_server_only_code(dvc_file, stage):
    assert not stage_modules(STAGE_FILES[dvc_file], STAGE_FUNCTIONS[dvc_file](stage)) & SERVER_ONLY


def test_the_closure_follows_lazy_imports():
    """prepare imports its library inside the function; the closure must see it and leave other stages out."""
    modules = stage_modules("specops.pipeline.stages", "prepare")
    assert {"specops.data.prompts", "specops.pipeline.stages"} <= modules
    assert "specops.train.train_draft" not in modules
    assert "specops.train.train_draft" in stage_modules("specops.pipeline.stages", "train_draft")


MAIN_STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("stage", list(MAIN_STAGES))
def test_cmd_passes_exactly_the_stage_inputs(stage):
    """The cmd names every input the stage reads (--in NAME=PATH), and each is a dep DVC tracks."""
    from specops.pipeline.stages import STAGE_INPUTS

    spec = MAIN_STAGES[stage]
    assert spec["cmd"].split()[:3] == ["specops", "stage", stage]
    given = dict(arg.partition("=")[::2] for arg in spec["cmd"].split()[3:][1::2])
    assert spec["cmd"].split()[3:][::2] == ["--in"] * len(given)
    assert given == STAGE_INPUTS[stage]
    assert set(given.values()) <= set(spec["deps"])


def test_stage_inputs_come_from_the_command_line_or_params():
    from specops.pipeline.stages import stage_inputs

    params = {"prepare": {"out_dir": "data/prompts"}}
    assert stage_inputs("collect", params) == {"prompts": Path("data/prompts")}
    assert stage_inputs("collect", params, {"prompts": "elsewhere"}) == {"prompts": Path("elsewhere")}
    with pytest.raises(ValueError, match="takes no input traces"):
        stage_inputs("collect", params, {"traces": "x"})
    with pytest.raises(ValueError, match="params has no 'prepare.out_dir'"):
        stage_inputs("collect", {})
