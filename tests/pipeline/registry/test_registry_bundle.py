"""The bundle contract: what write_bundle writes, load_bundle reads back, and every way it refuses."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from specops.core.target import sha256_file
from specops.server.bundle import SHA256_TAG, VERSION_TAG, BundleError, load_bundle, write_bundle
from tests.pipeline.registry.conftest import rehash


def _rewrite_manifest(root: Path, **changes: object) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest.update(changes)
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_round_trip_lists_every_file_with_its_checksum(make_bundle, tiny_drafter_dir, fingerprint):
    root = make_bundle(extra_dirs={"acceptance_head": tiny_drafter_dir},
                       mlflow_info={"run_id": "r1", "model_name": "m"})
    bundle = load_bundle(root, expected_fingerprint=fingerprint)

    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} - {"manifest.json"}
    files = bundle.manifest["files"]
    assert set(files) == on_disk
    assert {"serving.yaml", "drafter/config.json", "drafter/model.safetensors", "drafter/tokenizer.json",
            "acceptance_head/model.safetensors"} <= on_disk
    for rel, entry in files.items():
        assert entry == {"sha256": sha256_file(root / rel), "size": (root / rel).stat().st_size}

    assert bundle.manifest["format_version"] == 1
    assert bundle.manifest["git_sha"] == "0" * 40
    assert bundle.manifest["mlflow"] == {"run_id": "r1", "model_name": "m", "model_version": None}
    assert bundle.manifest["metrics"]["speedup_vs_ar"] == 1.5
    assert bundle.manifest["target"] == {"source": "smollm2", "dtype": "float32", "fingerprint": fingerprint.to_dict()}
    assert bundle.fingerprint == fingerprint
    assert (bundle.target_source, bundle.target_dtype) == ("smollm2", "float32")
    assert bundle.serving == {"drafter": "draft-lm", "verifier": "greedy", "draft_tokens": 4}
    assert bundle.drafter_kind == "draft-lm"
    assert bundle.drafter_dir == root / "drafter"
    assert bundle.extra_dirs == {"acceptance_head": root / "acceptance_head"}
    assert len(bundle.version) == 12


def test_drafter_weights_survive_the_bundle(make_bundle, draft_model):
    bundle = load_bundle(make_bundle())
    loaded = LlamaForCausalLM.from_pretrained(bundle.drafter_dir)
    for name, tensor in load_file(bundle.drafter_dir / "model.safetensors").items():
        torch.testing.assert_close(tensor, draft_model.state_dict()[name], rtol=0, atol=0)
    assert loaded.config.num_hidden_layers == draft_model.config.num_hidden_layers


def test_weightless_drafter_has_no_drafter_dir(make_bundle):
    bundle = load_bundle(make_bundle(drafter_dir=None, drafter_kind="prompt-lookup"))
    assert bundle.drafter_dir is None
    assert bundle.drafter_kind == "prompt-lookup"
    assert set(bundle.manifest["files"]) == {"serving.yaml"}


@pytest.mark.parametrize("how", ["flip a byte", "append"])
def test_tampered_file_is_refused(make_bundle, how):
    root = make_bundle()
    weights = root / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if how == "flip a byte":  # same size: only the sha256 can catch it
        data[-1] ^= 0xFF
    else:
        data += b"\0"
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"'drafter/model\.safetensors' does not match its checksum.*tampered"):
        load_bundle(root)


def test_tampered_serving_yaml_is_refused(make_bundle):
    root = make_bundle()
    (root / "serving.yaml").write_text(yaml.safe_dump({"drafter": "draft-lm", "verifier": "rejection"}))
    with pytest.raises(BundleError, match=r"'serving\.yaml' does not match"):
        load_bundle(root)


def test_a_rehashed_bundle_verifies_but_is_not_the_registered_one(make_bundle):
    bundle = load_bundle(make_bundle())
    registered = {SHA256_TAG: bundle.manifest_sha256, VERSION_TAG: bundle.version}
    bundle.check_registered(registered)
    bundle.check_registered({VERSION_TAG: bundle.version})  # registered before the full hash was recorded
    (bundle.root / "serving.yaml").write_text(yaml.safe_dump({"drafter": "draft-lm", "verifier": "rejection"}))
    rehash(bundle.root, "serving.yaml")
    edited = load_bundle(bundle.root)  # consistent with its own manifest: the checksums alone accept it
    for tags in (registered, {VERSION_TAG: bundle.version}, {SHA256_TAG: "0" * 64, VERSION_TAG: edited.version}, {}):
        with pytest.raises(BundleError, match="is not the bundle the registry recorded"):
            edited.check_registered(tags)


def test_missing_file_is_refused(make_bundle):
    root = make_bundle()
    (root / "drafter" / "config.json").unlink()
    with pytest.raises(BundleError, match=r"'drafter/config\.json' is listed in manifest\.json but missing"):
        load_bundle(root)


def test_extra_file_is_refused(make_bundle):
    root = make_bundle()
    (root / "drafter" / "notes.txt").write_text("hello")
    with pytest.raises(BundleError, match=r"extra file 'drafter/notes\.txt' is not listed"):
        load_bundle(root)


def test_missing_manifest_is_not_a_bundle(make_bundle):
    root = make_bundle()
    (root / "manifest.json").unlink()
    with pytest.raises(BundleError, match="not a bundle: manifest.json is missing"):
        load_bundle(root)


def test_pickle_file_is_refused_when_writing(tmp_path, tiny_drafter_dir, make_bundle):
    source = tmp_path / "drafter_with_bin"
    source.mkdir()
    for path in tiny_drafter_dir.iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    (source / "pytorch_model.bin").write_bytes(b"pickled")
    with pytest.raises(BundleError, match=r"'pytorch_model\.bin' is a pickle-capable '\.bin' file"):
        make_bundle("refused", drafter_dir=source)
    assert not (tmp_path / "refused").exists()  # refused before anything was copied


def test_pickle_file_listed_in_manifest_is_refused_when_loading(make_bundle):
    # A hand-edited manifest that vouches for a pickle must not get it loaded either.
    root = make_bundle()
    bad = root / "drafter" / "optimizer.pt"
    bad.write_bytes(b"pickled")
    files = json.loads((root / "manifest.json").read_text())["files"]
    files["drafter/optimizer.pt"] = {"sha256": sha256_file(bad), "size": bad.stat().st_size}
    _rewrite_manifest(root, files=files)
    with pytest.raises(BundleError, match=r"'drafter/optimizer\.pt' is a pickle-capable"):
        load_bundle(root)


def test_manifest_path_outside_the_bundle_is_refused(make_bundle, tmp_path):
    root = make_bundle()
    outside = tmp_path / "secret.txt"
    outside.write_text("x")
    files = json.loads((root / "manifest.json").read_text())["files"]
    files["../secret.txt"] = {"sha256": sha256_file(outside), "size": 1}
    _rewrite_manifest(root, files=files)
    with pytest.raises(BundleError, match=r"'\.\./secret\.txt', which is outside the bundle"):
        load_bundle(root)


def test_other_target_is_refused(make_bundle, fingerprint):
    root = make_bundle()
    other = replace(fingerprint, name="other-target", weights_sha256="c" * 64)
    with pytest.raises(BundleError, match=r"built for another target \(tiny-target\), not other-target: weights differ"):
        load_bundle(root, expected_fingerprint=other)
    vocab = replace(fingerprint, vocab_sha256="d" * 64)
    with pytest.raises(BundleError, match="vocabularies differ"):
        load_bundle(root, expected_fingerprint=vocab)


def test_conflicting_drafter_kind_is_refused(make_bundle):
    with pytest.raises(BundleError, match="serving.yaml says drafter 'aligned_head' but drafter_kind is 'draft-lm'"):
        make_bundle(serving={"drafter": "aligned_head", "verifier": "greedy"})


def test_component_without_safetensors_is_refused(make_bundle, tmp_path):
    empty = tmp_path / "router_src"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(BundleError, match=r"Component 'router': .* has no \*\.safetensors weights"):
        make_bundle(extra_dirs={"router": empty})


def test_existing_bundle_is_kept_unless_overwrite(make_bundle, tmp_path, tiny_drafter_dir, fingerprint):
    first = load_bundle(make_bundle())
    with pytest.raises(BundleError, match="exists and is not empty"):
        make_bundle()
    assert load_bundle(first.root).version == first.version
    write_bundle(first.root, drafter_dir=None, drafter_kind="recycling", serving={}, target_source="smollm2",
                 target_dtype="bfloat16", fingerprint=fingerprint, metrics={}, overwrite=True)
    second = load_bundle(first.root)
    assert (second.drafter_kind, second.drafter_dir, second.target_dtype) == ("recycling", None, "bfloat16")
