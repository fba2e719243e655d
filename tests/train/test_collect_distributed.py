"""Data-parallel collection: two gloo processes on the CPU, started as torchrun starts them or inside their
caller's process group, write the traces one process writes, and any number of processes resume them."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open

from specops.core.target import Target, target_from_model
from specops.data import collect as collect_module
from specops.data.collect import (
    CollectConfig,
    check_same_plan,
    collect,
    is_rank_zero,
    load_prompts,
    make_plan,
    merge_ranks,
)
from specops.data.traces import FORMAT, MANIFEST, VERSION, TraceShards, read_manifest, shard_name
from tests.train.conftest import LAYERS, char_tokenizer, collect_config, tiny_llama
from tests.train.test_collect import (
    Killed,
    assert_same_shards,
    counting_backend,
    killing_backend,
    prompts_by_id,
)

WORLD = 2
SHARD_SIZE = 3  # collect_config's, as in the one-process traces_dir
# collect.coordination_timeout_s here: a rank left waiting fails after this long rather than hang the suite.
TIMEOUT_S = 30


def rank_target() -> Target:
    """conftest's tiny_target, built again in a rank (the same seed gives the same weights): a model that has
    run holds forward hooks that do not pickle, so it cannot be sent."""
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return target_from_model(model, tokenizer, name="tiny-char-llama")


def rank_main(rank: int, store_port: int, out_dir: Path, prompts_dir: Path, launch: str,
              kill_rank_1_after: int | None) -> None:
    """One rank collecting the train split, started as torchrun starts it ("torchrun": RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT in its environment) or inside its caller's gloo group ("group", as under
    Lightning DDP). Writes what its backend saw, the report it got or the error it raised, and whether it
    writes the reports, to out_dir/rank-R.json. It never raises: torch.multiprocessing would then stop the
    other rank, whose own way of ending is what the tests look at."""
    if launch == "torchrun":
        # torchrun's agent hosts the rendezvous store (run_ranks' here), and every rank connects to it.
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(store_port), TORCHELASTIC_USE_AGENT_STORE="True")
    else:
        dist.init_process_group("gloo", init_method=(out_dir / "caller-store").as_uri(), rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=2 * TIMEOUT_S))
    torch.set_num_threads(1)  # as in the one-process run the results are compared with
    seen: list[str] = []
    killed = rank == 1 and kill_rank_1_after is not None
    collect_module.BACKENDS["transformers"] = killing_backend(kill_rank_1_after) if killed else counting_backend(seen)
    outcome: dict[str, Any] = {"seen": seen}
    try:
        outcome["report"] = collect(collect_config(out_dir, splits=["train"], coordination_timeout_s=TIMEOUT_S),
                                    rank_target(), prompts_dir)
    except Exception as error:
        outcome["error"] = f"{type(error).__name__}: {error}"
    outcome["writes_reports"] = is_rank_zero()  # what the collect stage asks before it writes metrics/collect.json
    if launch == "group":
        assert dist.is_initialized()  # the caller's group is left to the caller,
        dist.barrier()  # which goes on with it, a failed rank included, as Lightning's would
        dist.destroy_process_group()
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(outcome))


def run_ranks(out_dir: Path, prompts_dir: Path, target: Target, launch: str = "torchrun",
              kill_rank_1_after: int | None = None) -> list[dict[str, Any]]:
    """Run the ranks to their end; returns each one's outcome (rank_main).

    They are forked from a forkserver, a fresh process that has imported this module (and torch) but never
    run torch, so no thread pool is cut in two by the fork, while each rank still starts at once: the
    server's imports (~4 s here) are paid once per session, where spawning pays them per rank and run. The
    torchrun launch's store listens on a port the OS picks as it binds, so no other process can take it
    first; the caller's group meets in a file."""
    assert rank_target().fingerprint == target.fingerprint  # the ranks collect with the test's target
    multiprocessing.set_forkserver_preload([__name__])  # before the session's first forkserver start; else unused
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    mp.start_processes(rank_main, (store.port, out_dir, prompts_dir, launch, kill_rank_1_after), nprocs=WORLD,
                       start_method="forkserver")
    return [json.loads((out_dir / f"rank-{rank}.json").read_text()) for rank in range(WORLD)]


def shard_ids(split: Path, indices: set[int]) -> set[str]:
    """The prompt ids in shards `indices` of a split."""
    return {pid for index in indices for pid in json.loads(shard_metadata(split / shard_name(index))["prompt_ids"])}


def shard_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as shard:
        return shard.metadata()


def without_checksums(split: Path) -> dict:
    manifest = json.loads((split / MANIFEST).read_text())
    return {**manifest, "shards": [{k: v for k, v in entry.items() if k != "sha256"} for entry in manifest["shards"]]}


def assert_same_traces(split: Path, reference: Path) -> None:
    """Every tensor of every shard bitwise, the shards' metadata and the merged manifest. Not the files' bytes:
    safetensors writes its metadata in an order of its own in each process, so not even two one-process runs
    give equal sha256s; TraceShards checks each file against the sha256 its own manifest records."""
    assert_same_shards(split, reference)
    for ours, theirs in zip(sorted(split.glob("shard-*")), sorted(reference.glob("shard-*")), strict=True):
        assert shard_metadata(ours) == shard_metadata(theirs)
    assert without_checksums(split) == without_checksums(reference)
    assert len(TraceShards(split)) == len(TraceShards(reference))


@pytest.mark.parametrize("launch", ["torchrun", "group"])
def test_two_ranks_split_the_shards_and_write_what_one_process_writes(tmp_path, traces_dir, prompts_dir, tiny_target,
                                                                      launch):
    ranks = run_ranks(tmp_path, prompts_dir, tiny_target, launch)
    split, reference = tmp_path / "train", traces_dir / "train"
    assert_same_traces(split, reference)
    assert len(TraceShards(split)) == len(prompts_by_id(prompts_dir, "train"))
    assert sorted(p.name for p in split.iterdir() if not p.name.startswith("shard-")) == [MANIFEST]  # records merged
    n_shards = ranks[0]["report"]["train"]["shards"]
    # Round-robin: rank r collected shards r, r + 2, ..., each once.
    for rank, got in enumerate(ranks):
        assert set(got["seen"]) == shard_ids(reference, set(range(rank, n_shards, WORLD))), rank
    assert not set(ranks[0]["seen"]) & set(ranks[1]["seen"])
    assert ranks[0]["report"] == ranks[1]["report"] and ranks[0]["report"]["train"]["ranks"] == WORLD
    # One writer of the reports, also in a caller's group, where no RANK is in the environment.
    assert [got["writes_reports"] for got in ranks] == [True, False]


def test_a_rank_that_fails_in_a_callers_group_makes_the_other_fail_too(tmp_path, prompts_dir, tiny_target):
    """Rank 1 raises in its second shard; rank 0 raises too once its own shards are done, naming rank 1, instead
    of waiting for it until coordination_timeout_s (24 h by default): inside a caller's group no launcher
    stops it, and the failed rank's process lives on (rank_main waits in the caller's group)."""
    ranks = run_ranks(tmp_path, prompts_dir, tiny_target, "group", kill_rank_1_after=SHARD_SIZE + 1)
    assert ranks[1]["error"] == "Killed: "
    assert ranks[0]["error"] == "RuntimeError: collect: rank 1 failed (Killed), so rank 0 stops too; a rerun " \
                                "resumes every shard any rank recorded."


def test_a_killed_rank_is_resumed_by_any_number_of_processes(tmp_path, traces_dir, prompts_dir, tiny_target,
                                                             monkeypatch):
    # Rank 1 takes shards 1, 3, 5...: it records shard 1 and dies in shard 3; rank 0 records its own shards, then
    # fails too, as in a caller's group (above).
    ranks = run_ranks(tmp_path, prompts_dir, tiny_target, kill_rank_1_after=SHARD_SIZE + 1)
    assert ranks[1]["error"] == "Killed: " and ranks[0]["error"].startswith("RuntimeError: collect: rank 1 failed")
    split = tmp_path / "train"
    record = read_manifest(split / "rank-1")
    assert [entry["index"] for entry in record["shards"]] == [1]
    manifest = read_manifest(split)
    assert not manifest["complete"] and 1 not in {entry["index"] for entry in manifest["shards"]}
    recorded = {entry["index"] for entry in manifest["shards"]} | {1}

    seen: list[str] = []  # one process resumes: it merges rank 1's record and collects only what nobody recorded
    monkeypatch.setitem(collect_module.BACKENDS, "transformers", counting_backend(seen))
    report = collect(collect_config(tmp_path, splits=["train"]), tiny_target, prompts_dir)["train"]
    reference = traces_dir / "train"
    assert report["shards_resumed"] == len(recorded) and report["ranks"] == 1
    assert set(seen) == shard_ids(reference, set(range(report["shards"])) - recorded) and len(seen) == len(set(seen))
    assert_same_traces(split, reference)
    assert not (split / "rank-1").exists()


def test_ranks_that_would_make_other_shards_are_refused():
    plan = {"top_k": 8, "prompts_sha256": "a"}
    check_same_plan([plan, dict(plan)], "train")
    with pytest.raises(ValueError, match="collect train: rank 1 differs from rank 0 in prompts_sha256, top_k; every rank"):
        check_same_plan([plan, {"top_k": 4, "prompts_sha256": "b"}], "train")


def test_a_default_run_plans_as_before_and_a_gpu_run_plans_apart(tmp_path, prompts_dir, tiny_target):
    """A one-process CPU run of the transformers backend plans exactly as before `device` (and the vllm backend's
    max_model_len) could join the plan, so the manifests made then still resume. On a GPU the plan names
    the device: a split collected on the CPU is started over there, and ranks on both are refused."""
    prompts, _ = load_prompts(prompts_dir / "train.jsonl", tiny_target, None)
    plan = make_plan(collect_config(tmp_path), tiny_target, prompts)
    assert plan == {
        "format": FORMAT, "version": VERSION, "backend": "transformers", "responses": "regenerate", "max_new_tokens": 6,
        "generate_batch_size": 1, "temperature": 0.0, "seed": 0, "top_k": 8, "logprobs_dtype": "float32",
        "hidden_layers": [0, LAYERS - 1], "shard_size": SHARD_SIZE, "n_prompts": len(prompts),
        "prompts_sha256": plan["prompts_sha256"], "target": tiny_target.fingerprint.to_dict()}
    cpu, gpu = (make_plan(collect_config(tmp_path, generate_batch_size=2, device=device), tiny_target, prompts)
                for device in ("cpu", "cuda"))
    with pytest.raises(ValueError, match="rank 1 differs from rank 0 in device; every rank"):
        check_same_plan([cpu, gpu], "train")


def test_shards_rank_0_cannot_see_are_an_error_naming_the_shared_filesystem(tmp_path):
    manifest = {"plan": {}, "n_shards": 2, "shards": [], "complete": False}
    with pytest.raises(RuntimeError, match=r"2 shard\(s\) .* shard-00000.safetensors.*filesystem every rank shares"):
        merge_ranks(tmp_path, manifest)


def test_cuda_collection_needs_batched_generate_and_a_known_device():
    with pytest.raises(ValueError, match="collect.device: cuda .* set collect.generate_batch_size > 1"):
        CollectConfig(device="cuda")
    with pytest.raises(ValueError, match="collect.device must be one of cpu, cuda"):
        CollectConfig(device="tpu")
    assert CollectConfig(device="cuda", generate_batch_size=8).device == "cuda"
    with pytest.raises(ValueError, match="collect.coordination_timeout_s must be > 0, got 0"):
        CollectConfig(coordination_timeout_s=0)


def test_a_resumed_split_is_incomplete_on_disk_until_its_missing_shards_are_back(tmp_path, traces_dir, prompts_dir,
                                                                                  tiny_target, monkeypatch):
    """Rank 0 rewrites the manifest before any shard is collected: a finished split with a shard gone must not
    still say complete if the run is killed then."""
    split = tmp_path / "val"
    shutil.copytree(traces_dir / "val", split)
    (split / shard_name(0)).unlink()
    monkeypatch.setitem(collect_module.BACKENDS, "transformers", killing_backend(after=0))
    with pytest.raises(Killed):
        collect(collect_config(tmp_path, splits=["val"]), tiny_target, prompts_dir)
    with pytest.raises(RuntimeError, match="incomplete"):
        TraceShards(split)
