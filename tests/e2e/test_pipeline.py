"""The whole `dvc repro` on a tiny random target: registry aliases, a loadable champion, a no-op rerun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specops.drafters.kinds import MethodSpec
from tests.conftest import tiny_llama, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TINY_PARAMS = {
    "prepare": {"sharegpt_max": 0, "humaneval": False, "user_files": ["prompts.jsonl"], "val_fraction": 0.15,
                "test_fraction": 0.15, "max_prompt_tokens": 64},
    "collect": {"max_new_tokens": 8, "top_k_logits": 8, "hidden_layers": [0, 1], "shard_size": 4,
                "max_prompts_per_split": 12},
    "train_draft": {"init_layers_from_target": True, "num_layers": 1, "batch_size": 4, "epochs": 1,
                    "max_seq_len": 64, "accelerator": "cpu"},
    "train_specialists": {"slices": {"a": ["user:prompts.jsonl"], "b": ["user:prompts.jsonl"]}, "batch_size": 4, "max_steps": 2, "max_seq_len": 64},
    "train_aligned": {"draft_vocab_size": 32, "batch_size": 4, "epochs": 1, "max_seq_len": 64},
    "train_acceptance": {"epochs": 2},
    "train_exit": {"exit_layers": [1], "draft_vocab_size": 32, "max_sequences": 8, "epochs": 1},
    # params.yaml's serving runtime (bf16, static); trees would need a wider tiny target (batch_invariant).
    "evaluate": {"n_prompts": 3, "max_new_tokens": 8,
                 "methods": ["prompt-lookup@2", "draft-lm@2", "draft-lm+specdecpp@3", "draft-lm-suffix+specdecpp@3",
                             "aligned_head@2", "del", "cosine@2"]},
}


def params_of(project: Path) -> dict:
    return yaml.safe_load((project / "params.yaml").read_text())


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A fresh project: our dvc.yaml and params.yaml with tiny sizes, a tiny target, temp MLflow and DVC remote."""
    root = tmp_path_factory.mktemp("project")
    shutil.copytree(ROOT / "specops", root / "specops", ignore=shutil.ignore_patterns("__pycache__"))  # dvc.yaml's code deps
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    tiny_llama(seed=0, max_positions=128).save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    with open(root / "prompts.jsonl", "w") as handle:
        for i in range(40):
            words = " ".join(f"w{(i * 7 + j * 3) % 80}" for j in range(4 + i % 5))
            handle.write(json.dumps({"prompt": words}) + "\n")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for name, overrides in TINY_PARAMS.items():
        params[name].update(overrides)
    params["target"]["source"] = str(root / "target")
    params["mlflow"]["tracking_uri"] = f"sqlite:///{root / 'mlflow.db'}"
    params["register"]["artifact_root"] = str(root / "mlartifacts")
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(["git", "init", "-q"], root)
    run(["dvc", "init", "-q"], root)
    run(["dvc", "remote", "add", "-d", "local", str(root / "remote")], root)
    return root


@pytest.fixture(scope="module")
def first_repro(project):
    return run(["dvc", "repro"], project)


def test_repro_registers_promotes_and_publishes(project, first_repro):
    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{project / 'mlflow.db'}"
    # Both: an earlier test in this process may have pointed the registry URI elsewhere.
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    model = MlflowClient().get_registered_model("specops-drafter")
    assert set(model.aliases) == {"challenger", "champion"}
    decision = json.loads((project / "metrics" / "promotion.json").read_text())
    assert decision["passed"], decision
    evaluation = json.loads((project / "metrics" / "eval_report.json").read_text())
    assert MethodSpec.parse(evaluation["default"]["method"]).kind in params_of(project)["evaluate"][
        "bundle_drafters"]
    # Lossless on the serving runtime: every method of ours is bitwise our plain decoding in the same dtype. HF's
    # baselines (hf_*) are another runtime: in bf16 their attention rounds otherwise than our native kernel's.
    ours = {name: row for name, row in evaluation["methods"].items() if not name.startswith("hf_")}
    assert set(ours) >= {"plain", *params_of(project)["evaluate"]["methods"]}
    assert all(row["identical_to_plain"] for row in ours.values()), ours
    evaluate = params_of(project)["evaluate"]
    assert evaluation["dtype"] == evaluate["dtype"]
    serving = yaml.safe_load((project / "bundles" / "champion" / "serving.yaml").read_text())
    manifest = json.loads((project / "bundles" / "champion" / "manifest.json").read_text())
    assert serving["static_width"] == evaluate["static_width"] and serving["compiled"] == evaluate["compiled"]
    assert manifest["target"]["dtype"] == evaluate["dtype"]
    assert (project / "metrics" / "plots" / "speedup.png").stat().st_size > 0
    assert (project / "bundles" / "champion" / "manifest.json").is_file()

    champion = mlflow.pyfunc.load_model("models:/specops-drafter@champion")
    out = champion.predict(["w1 w2 w3"])
    assert isinstance(out, list) and out and isinstance(out[0]["text"], str)
    assert out[0]["stats"]["new_tokens"] >= 1


def test_second_repro_does_nothing_and_push_pull_work(project, first_repro):
    again = run(["dvc", "repro"], project)
    assert "Running stage" not in again.stdout, again.stdout
    # A server-only edit reruns no stage: no stage's deps list the server's modules.
    with open(project / "specops" / "server" / "app.py", "a") as handle:
        handle.write("\n# an edit that only the server sees\n")
    again = run(["dvc", "repro"], project)
    assert "Running stage" not in again.stdout, again.stdout
    run(["dvc", "push"], project)
    assert any((project / "remote").rglob("*")), "dvc push wrote nothing to the local remote"
    shutil.rmtree(project / "models" / "draft_lm")
    run(["dvc", "pull"], project)
    assert (project / "models" / "draft_lm" / "model.safetensors").is_file()


def test_retrain_is_gated_against_the_champion_in_the_same_eval(project, first_repro):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train_draft"]["seed"] = 1
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = run(["dvc", "repro"], project)
    assert "Running stage 'train_draft'" in result.stdout and "Running stage 'prepare'" not in result.stdout
    evaluation = json.loads((project / "metrics" / "eval_report.json").read_text())
    assert evaluation["champion"]["method"] == "champion"  # the old champion ran in the same benchmark
    decision = json.loads((project / "metrics" / "promotion.json").read_text())
    assert decision["challenger_version"] == "2" and decision["previous_champion_version"] == "1"
    assert decision["champion"] == evaluation["champion"]
    assert decision["champion_version"] == ("2" if decision["passed"] else "1")
