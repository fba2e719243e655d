from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specops.core.target import encode_prompt, target_from_model
from specops.data import collect as collect_module
from specops.data.collect import CollectConfig, collect
from specops.data.traces import (
    MANIFEST,
    SequenceTrace,
    TraceError,
    TraceShards,
    hf_hidden_index,
    next_token_mask,
    resolve_layers,
    shard_name,
    write_manifest,
    write_shard,
)
from tests.train.conftest import LAYERS, collect_config, write_jsonl


def prompts_by_id(prompts_dir: Path, split: str) -> dict[str, dict]:
    rows = [json.loads(line) for line in (prompts_dir / f"{split}.jsonl").read_text().splitlines()]
    return {row["id"]: row for row in rows}


def shard_files(split_dir: Path) -> list[Path]:
    return sorted(split_dir.glob("shard-*.safetensors"))


def test_shards_hold_what_a_direct_forward_pass_gives(traces_dir, prompts_dir, tiny_target):
    model, tokenizer = tiny_target.model, tiny_target.tokenizer
    prompts = prompts_by_id(prompts_dir, "train")
    traces = TraceShards(traces_dir / "train")
    assert len(traces) == len(prompts) and traces.target == tiny_target.fingerprint.to_dict()
    with safe_open(str(shard_files(traces_dir / "train")[0]), framework="pt") as shard:
        meta = shard.metadata()
        assert shard.get_tensor("input_ids").dtype == torch.int32 and shard.get_tensor("loss_mask").dtype == torch.uint8
        assert shard.get_tensor("hidden_states").dtype == torch.float16
    assert json.loads(meta["hidden_layers"]) == [0, LAYERS - 1] and json.loads(meta["top_k"]) == 8
    prompt_ids = [pid for f in shard_files(traces_dir / "train") for pid in json.loads(safe_open(str(f), "pt").metadata()["prompt_ids"])]
    for index, pid in enumerate(prompt_ids):
        item = traces[index]
        ids = item["input_ids"]
        prompt = encode_prompt(tokenizer, prompts[pid]["messages"])
        n = len(prompt)
        assert ids[:n].tolist() == prompt
        # The response is the target's own greedy continuation, as HF generate produces it.
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, n:]
        assert ids[n:].tolist() == expected.tolist()
        assert item["loss_mask"].tolist() == [False] * n + [True] * (len(ids) - n)
        with torch.no_grad():
            out = model(input_ids=ids[None], output_hidden_states=True)
        top = out.logits[0].float().log_softmax(-1).topk(8, dim=-1)
        assert torch.equal(item["topk_ids"], top.indices)
        torch.testing.assert_close(item["topk_logprobs"], top.values, rtol=0, atol=1e-5)  # fp32 storage, same math
        for slot, layer in enumerate([0, LAYERS - 1]):
            reference = out.hidden_states[layer + 1][0].to(torch.float16)
            torch.testing.assert_close(item["hidden_states"][:, slot], reference, rtol=1e-3, atol=1e-3)  # fp16 storage


def test_hidden_layer_index_is_the_decoder_layer_output(tiny_target):
    """Layer i means what decoder layer i returns: checked with a hook, independently of HF's tuple."""
    model = tiny_target.model
    captured = {}
    handle = model.model.layers[0].register_forward_hook(lambda mod, args, out: captured.update(h=out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[5, 6, 7, 8]]), output_hidden_states=True)
    handle.remove()
    assert hf_hidden_index(0) == 1 and torch.equal(out.hidden_states[hf_hidden_index(0)], captured["h"])
    assert resolve_layers([-1, 0, 1], LAYERS) == [LAYERS - 1, 0, 1]
    with pytest.raises(ValueError, match="out of range"):
        resolve_layers([LAYERS], LAYERS)


def test_next_token_mask_marks_predictions_of_response_tokens():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)
    expected = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(next_token_mask(loss_mask), expected)


class Killed(Exception):
    pass


def killing_backend(after: int):
    """The transformers backend, interrupted after `after` sequences, like a killed process."""
    real = collect_module.transformers_backend
    done = {"n": 0}

    def backend(target, prompts, cfg):
        for trace in real(target, prompts, cfg):
            if done["n"] == after:
                raise Killed
            done["n"] += 1
            yield trace

    return backend


def counting_backend(seen: list[str]):
    real = collect_module.transformers_backend

    def backend(target, prompts, cfg):
        prompts = list(prompts)
        seen.extend(prompt.id for prompt in prompts)
        yield from real(target, prompts, cfg)

    return backend


def test_resume_after_a_kill_skips_finished_shards_and_matches_a_clean_run(tmp_path, traces_dir, prompts_dir,
                                                                         tiny_target, monkeypatch):
    cfg = collect_config(tmp_path, splits=["train"])
    monkeypatch.setitem(collect_module.BACKENDS, "transformers", killing_backend(after=4))  # shard 0 done, 1 half
    with pytest.raises(Killed):
        collect(cfg, tiny_target, prompts_dir)
    split = tmp_path / "train"
    manifest = json.loads((split / MANIFEST).read_text())
    assert [e["index"] for e in manifest["shards"]] == [0] and not manifest["complete"]
    assert [f.name for f in shard_files(split)] == ["shard-00000.safetensors"]
    with pytest.raises(RuntimeError, match="incomplete"):
        TraceShards(split)
    first_shard = (split / "shard-00000.safetensors").stat().st_mtime_ns
    (split / "shard-00001.safetensors.tmp").write_bytes(b"half a shard")  # a kill in the middle of a write

    seen: list[str] = []
    monkeypatch.setitem(collect_module.BACKENDS, "transformers", counting_backend(seen))
    report = collect(cfg, tiny_target, prompts_dir)["train"]
    n_prompts = len(prompts_by_id(prompts_dir, "train"))
    assert report["shards_resumed"] == 1 and len(seen) == n_prompts - 3
    assert (split / "shard-00000.safetensors").stat().st_mtime_ns == first_shard
    clean = shard_files(traces_dir / "train")
    assert [f.name for f in shard_files(split)] == [f.name for f in clean]
    for resumed, reference in zip(shard_files(split), clean, strict=True):
        a, b = load_file(str(resumed)), load_file(str(reference))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert safe_open(str(resumed), "pt").metadata() == safe_open(str(reference), "pt").metadata()

    seen.clear()  # a finished split is not recomputed at all
    assert collect(cfg, tiny_target, prompts_dir)["train"]["shards_resumed"] == manifest["n_shards"] and not seen


def test_changed_settings_start_the_split_over(tmp_path, prompts_dir, tiny_target):
    collect(collect_config(tmp_path, splits=["val"]), tiny_target, prompts_dir)
    report = collect(collect_config(tmp_path, splits=["val"], top_k_logits=4, hidden_layers=[]), tiny_target, prompts_dir)
    assert report["val"]["shards_resumed"] == 0
    traces = TraceShards(tmp_path / "val", fields=("topk_ids",))
    assert traces[0]["topk_ids"].shape[-1] == 4
    with pytest.raises(KeyError, match="hidden_states"):
        TraceShards(tmp_path / "val")


def test_sampling_is_reproducible_per_prompt(tmp_path, prompts_dir, tiny_target):
    cfg = dict(splits=["val"], temperature=1.0, max_new_tokens=12, hidden_layers=[])
    collect(collect_config(tmp_path / "a", **cfg), tiny_target, prompts_dir)
    collect(collect_config(tmp_path / "b", **cfg, shard_size=1), tiny_target, prompts_dir)  # other shards, same samples
    collect(collect_config(tmp_path / "c", **{**cfg, "seed": 1}), tiny_target, prompts_dir)
    a, b, c = (TraceShards(tmp_path / d / "val", fields=("input_ids",)) for d in "abc")
    a_ids, b_ids, c_ids = ([x[i]["input_ids"].tolist() for i in range(len(x))] for x in (a, b, c))
    assert a_ids == b_ids and a_ids != c_ids


def test_unknown_backend_and_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="backend 'sglang' is unknown. Available: transformers, vllm"):
        CollectConfig(backend="sglang")
    with pytest.raises(ValueError, match="unknown split"):
        CollectConfig(splits=["dev"])
    with pytest.raises(ValueError, match="logprobs_dtype"):
        CollectConfig(logprobs_dtype="bfloat16")


def test_dataset_responses_teacher_force_the_reply_and_regenerate_the_rest(tmp_path, tiny_target, chat_tokenizer):
    rows = [{"messages": [{"role": "user", "content": "say hi"}], "reply": "hello there, friend"},
            {"messages": [{"role": "user", "content": "no answer"}]}]
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    write_jsonl(prompts / "train.jsonl", [{"id": f"{i:064x}", **row} for i, row in enumerate(rows, 1)])
    collect(collect_config(tmp_path / "traces", splits=["train"], responses="dataset", max_new_tokens=8), tiny_target, prompts)
    traces = TraceShards(tmp_path / "traces" / "train")
    answered, regenerated = traces[0], traces[1]
    n = len(encode_prompt(chat_tokenizer, rows[0]["messages"]))
    # The reply's first 8 tokens, teacher-forced; the mask marks them as the response.
    assert answered["input_ids"][n:].tolist() == chat_tokenizer("hello there, friend").input_ids[:8]
    assert answered["loss_mask"].sum() == 8
    prompt = encode_prompt(chat_tokenizer, rows[1]["messages"])
    expected = tiny_target.model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
    assert regenerated["input_ids"][len(prompt):].tolist() == expected.tolist()
    with pytest.raises(ValueError, match="responses"):
        collect_config(tmp_path, responses="human")


def test_a_short_reply_ends_with_the_end_of_turn_token(tiny_target, chat_tokenizer):
    ids = collect_module.reply_ids(tiny_target, "ok")
    assert ids == chat_tokenizer("ok").input_ids + [chat_tokenizer.eos_token_id]
    assert collect_module.reply_ids(tiny_target, None) is None


@pytest.fixture(scope="module")
def early_eos_target(tiny_target, prompts_dir):
    """The tiny target with, as its EOS, the token that first appears at the most different steps of its
    greedy replies, so that replies sharing a batch end at different steps."""
    model = copy.deepcopy(tiny_target.model)
    prompts = [encode_prompt(tiny_target.tokenizer, row["messages"]) for row in prompts_by_id(prompts_dir, "train").values()]
    replies = [model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist() for p in prompts]
    first_steps = {token: {reply.index(token) for reply in replies if token in reply} for reply in replies for token in reply}
    model.generation_config.eos_token_id = max(first_steps, key=lambda token: len(first_steps[token]))
    return target_from_model(model, tiny_target.tokenizer, name="tiny-early-eos")


@pytest.mark.parametrize("eos", ["never", "early"])
def test_batched_regeneration_matches_one_prompt_at_a_time(tmp_path, prompts_dir, tiny_target, early_eos_target, eos):
    """Left padding, length-sorted batches and EOS cuts give each prompt the target's own greedy reply, in
    the original prompt order, and generate's own hidden states give what a separate scoring pass gives."""
    target = early_eos_target if eos == "early" else tiny_target
    one = collect(collect_config(tmp_path / "one", splits=["train"], max_new_tokens=24), target, prompts_dir)
    many = collect(collect_config(tmp_path / "many", splits=["train"], max_new_tokens=24, generate_batch_size=4),
                   target, prompts_dir)
    assert one["train"]["sequences"] == many["train"]["sequences"] > 4
    a, b = (TraceShards(tmp_path / d / "train") for d in ("one", "many"))
    for i in range(len(a)):
        for name in ("input_ids", "loss_mask", "topk_ids"):
            assert torch.equal(a[i][name], b[i][name]), (i, name)
        # Padded, cached attention sums in another order than one unpadded pass: float rounding only.
        torch.testing.assert_close(a[i]["topk_logprobs"], b[i]["topk_logprobs"], rtol=0, atol=1e-4)
        torch.testing.assert_close(a[i]["hidden_states"], b[i]["hidden_states"], rtol=1e-3, atol=1e-3)  # fp16 storage
    prompt_lengths = {len(b[i]["input_ids"]) - int(b[i]["loss_mask"].sum()) for i in range(len(b))}
    assert len(prompt_lengths) > 1  # prompts of several lengths shared batches, so padding was exercised
    ended = [i for i in range(len(b)) if int(b[i]["input_ids"][-1]) in target.eos_token_ids]
    reply_lengths = {int(b[i]["loss_mask"].sum()) for i in range(len(b))}
    assert (ended and len(reply_lengths) > 1) if eos == "early" else not ended  # early: replies ended at several steps


def test_until_eos_keeps_the_first_eos_and_drops_what_the_batch_generated_after_it():
    assert collect_module.until_eos([5, 6, 2, 0, 0], {2}) == [5, 6, 2]
    assert collect_module.until_eos([5, 6, 7], {2}) == [5, 6, 7]
    assert collect_module.until_eos([2, 2], {2, 9}) == [2]


def test_batched_regeneration_is_greedy_only():
    with pytest.raises(ValueError, match="generate_batch_size: 1"):
        CollectConfig(generate_batch_size=8, temperature=0.7)
    with pytest.raises(ValueError, match="generate_batch_size >= 1"):
        CollectConfig(generate_batch_size=0)


def flip_loss_mask_byte(shard: Path) -> None:
    """Flip one loss_mask entry in place: still a valid safetensors file, with other training data in it."""
    raw = bytearray(shard.read_bytes())
    header_size = int.from_bytes(raw[:8], "little")
    start, _ = json.loads(raw[8:8 + header_size])["loss_mask"]["data_offsets"]
    raw[8 + header_size + start] ^= 1
    shard.write_bytes(bytes(raw))


def assert_same_shards(split: Path, reference: Path) -> None:
    assert [f.name for f in shard_files(split)] == [f.name for f in shard_files(reference)]
    for ours, theirs in zip(shard_files(split), shard_files(reference), strict=True):
        a, b = load_file(str(ours)), load_file(str(theirs))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_corrupted_shard_is_refused_on_read_and_regenerated(tmp_path, traces_dir, prompts_dir, tiny_target):
    split = tmp_path / "val"
    shutil.copytree(traces_dir / "val", split)
    flip_loss_mask_byte(shard_files(split)[0])
    with pytest.raises(TraceError, match=r"shard-00000\.safetensors does not match the sha256 in manifest\.json"):
        TraceShards(split)
    report = collect(collect_config(tmp_path, splits=["val"]), tiny_target, prompts_dir)["val"]
    assert report["shards_resumed"] == report["shards"] - 1
    assert len(TraceShards(split)) == len(TraceShards(traces_dir / "val"))
    assert_same_shards(split, traces_dir / "val")


@pytest.mark.parametrize("content", ["", "{\"plan\": {}}", "[1, 2]"])
def test_an_unreadable_manifest_is_a_clear_error_and_collect_starts_over(tmp_path, traces_dir, prompts_dir,
                                                                       tiny_target, content):
    split = tmp_path / "val"
    shutil.copytree(traces_dir / "val", split)
    (split / MANIFEST).write_text(content)  # e.g. a rename that reached the disk before the file's bytes
    with pytest.raises(TraceError, match="manifest.json is (unreadable|not a trace manifest).*Rerun the collect stage"):
        TraceShards(split)
    report = collect(collect_config(tmp_path, splits=["val"]), tiny_target, prompts_dir)["val"]
    assert report["shards_resumed"] == 0
    assert_same_shards(split, traces_dir / "val")


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names open files through /proc")
def test_shards_and_manifest_are_synced_before_and_after_their_rename(tmp_path, monkeypatch):
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src: Path, dst: Path) -> None:
        events.append(("replace", Path(src), Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    trace = SequenceTrace("p0", torch.tensor([5, 6, 7]), 1, torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2), None)
    write_shard(tmp_path / shard_name(0), [trace], {}, "float32")
    write_manifest(tmp_path, {"plan": {}, "n_shards": 1, "shards": [], "complete": False})

    renames = [event for event in events if event[0] == "replace"]
    assert [dst.name for _, _, dst in renames] == [shard_name(0), MANIFEST]
    for rename in renames:
        _, src, dst = rename
        at = events.index(rename)
        assert ("fsync", src.resolve()) in events[:at]  # the bytes reach the disk before the name does
        assert ("fsync", dst.parent.resolve()) in events[at + 1:]  # and the rename itself after it
