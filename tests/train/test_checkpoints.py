"""Checkpoints, best-validation export, resume, the learning-rate schedule and gradient accumulation of
the Lightning stages (specops.train.trainer), on train_draft with the tiny fixtures."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specops.train.strategies import make_strategy
from specops.train.train_draft import DraftDistillation, train_draft
from specops.train.trainer import ResumableLoader, ResumableSampler, lr_factor, run_key
from tests.train.test_draft_lm import fit_config

# 17 train sequences in batches of 3: 6 batches an epoch, 3 optimizer steps of 2 batches, 6 steps in 2 epochs.
RUN = dict(max_steps=-1, epochs=2, batch_size=3, accumulate_grad_batches=2, val_every_n_steps=2, lr_schedule="cosine",
           warmup_ratio=0.2)
TOTAL = 6


class Interrupted(Exception):
    """Stands for a kill: raised from inside the fit loop."""


@pytest.fixture
def interrupt(monkeypatch):
    """interrupt(step) makes the next fits raise Interrupted at the first batch that starts after `step`
    optimizer steps, and returns the global step each batch of theirs started from."""

    def arm(step: int) -> list[int]:
        seen: list[int] = []

        def hook(self, batch, batch_idx):
            seen.append(self.global_step)
            if self.global_step == step:
                raise Interrupted

        monkeypatch.setattr(DraftDistillation, "on_train_batch_start", hook, raising=False)
        return seen

    return arm


def run_config(root: Path, **overrides):
    return fit_config(root / "draft", **{**RUN, "curves_dir": str(root / "curves"), **overrides})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_target, traces_dir):
    """An uninterrupted run of RUN: (config, report)."""
    cfg = run_config(tmp_path_factory.mktemp("reference"))
    return cfg, train_draft(cfg, tiny_target, traces_dir)


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def weights(cfg) -> dict[str, torch.Tensor]:
    return load_file(Path(cfg.out_dir) / "model.safetensors")


def assert_same_run(a, b, report_a: dict, report_b: dict) -> None:
    """Bitwise: the same seed, data order, optimizer and schedule state on the CPU give the same floats."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[name], wb[name]) for name in wa)
    keys = ("steps", "final_loss", "val_loss", "best_step", "final_val_loss")
    assert {k: report_a[k] for k in keys} == {k: report_b[k] for k in keys}
    for name in ("train.csv", "val.csv"):
        assert read_csv(Path(a.curves_dir) / name) == read_csv(Path(b.curves_dir) / name)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_lr_factor_matches_torchs_schedulers(schedule, warmup):
    """The pure schedule against torch's own warm-up (LinearLR) and decay (LinearLR / CosineAnnealingLR)."""
    total, floor = 20, 0.1
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    decay = {"constant": torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0),
             "linear": torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, floor, total_iters=total - warmup),
             "cosine": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total - warmup, eta_min=floor)}[schedule]
    if warmup:
        ramp = torch.optim.lr_scheduler.LinearLR(optimizer, 1 / warmup, 1.0, total_iters=warmup - 1)
        decay = torch.optim.lr_scheduler.SequentialLR(optimizer, [ramp, decay], milestones=[warmup])
    reference = []
    for _ in range(total):
        reference.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        decay.step()
    ours = [lr_factor(step, total, warmup, schedule, floor) for step in range(total)]
    # torch's schedulers update the rate recursively, one rounding per step.
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64),
                               rtol=1e-9, atol=1e-12)
    assert lr_factor(total + 5, total, warmup, schedule, floor) == (1.0 if schedule == "constant" else floor)


def test_resume_equals_an_uninterrupted_run_and_a_changed_config_starts_afresh(reference, tmp_path, tiny_target,
                                                                             traces_dir, interrupt):
    reference_cfg, expected = reference
    assert expected["steps"] == TOTAL and expected["resumed_from_step"] is None
    assert not (Path(reference_cfg.checkpoint_dir) / "train_draft").exists()  # removed after success
    train = read_csv(Path(reference_cfg.curves_dir) / "train.csv")
    assert [int(row["step"]) for row in train] == list(range(1, TOTAL + 1))
    lrs = [reference_cfg.lr * lr_factor(step, TOTAL, 1, "cosine", reference_cfg.min_lr_ratio) for step in range(TOTAL)]
    assert [float(row["lr"]) for row in train] == pytest.approx(lrs, rel=1e-12)
    assert [int(row["step"]) for row in read_csv(Path(reference_cfg.curves_dir) / "val.csv")] == [2, 4, TOTAL]

    cfg = run_config(tmp_path)
    interrupt(3)  # the last checkpoint is step 2's, 4 batches into the first epoch's 6
    with pytest.raises(Interrupted):
        train_draft(cfg, tiny_target, traces_dir)
    changed = run_config(tmp_path, lr=2e-2)
    started = interrupt(3)
    with pytest.raises(Interrupted):
        train_draft(changed, tiny_target, traces_dir)
    assert started[0] == 0  # trained from scratch, not from the other config's step 2
    stage_dir = tmp_path / "checkpoints" / "train_draft"
    manifests = [traces_dir / split / "manifest.json" for split in ("train", "val")]
    assert {p.name for p in stage_dir.iterdir()} == {run_key("train_draft", c, manifests) for c in (cfg, changed)}

    started = interrupt(-1)  # record only
    report = train_draft(cfg, tiny_target, traces_dir)
    assert report["resumed_from_step"] == 2 and started[0] == 2
    assert_same_run(reference_cfg, cfg, expected, report)
    assert not stage_dir.exists()


def test_loader_resumes_mid_epoch_and_at_the_next_epoch():
    data = list(range(10))
    sampler = ResumableSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = ResumableLoader(data, batch_size=3, sampler=sampler)
    whole = [batch.tolist() for batch in loader]
    passed = iter(loader)
    next(passed), next(passed)
    state = loader.state_dict()
    assert state == {"served": 2}
    loader.load_state_dict(state)
    assert [batch.tolist() for batch in loader] == whole[2:]
    assert loader.state_dict() == {"served": len(whole)}
    loader.load_state_dict(loader.state_dict())  # saved on an epoch's last batch: the next pass is whole
    assert [batch.tolist() for batch in loader] == whole


def test_exported_weights_are_the_best_validations(tmp_path, tiny_target, traces_dir, monkeypatch):
    """Scripted validation losses put the best at step 4 of 5: the export must be the weights a run
    stopped at step 4 ends with (a constant schedule makes its first 4 steps the same)."""
    scripted = {2: 3.0, 4: 1.0, 5: 2.0}

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", scripted[self.global_step], batch_size=len(batch["input_ids"]))

    monkeypatch.setattr(DraftDistillation, "validation_step", validation_step)
    settings = dict(epochs=1, batch_size=4, accumulate_grad_batches=1, lr_schedule="constant", warmup_ratio=0.0)
    cfg = run_config(tmp_path / "best", **settings)
    report = train_draft(cfg, tiny_target, traces_dir)
    assert (report["steps"], report["best_step"], report["val_loss"], report["final_val_loss"]) == (5, 4, 1.0, 2.0)
    info = json.loads((Path(cfg.out_dir) / "specops_training.json").read_text())
    assert info["report"]["best_step"] == 4
    stopped = run_config(tmp_path / "stopped", max_steps=4, **settings)
    assert train_draft(stopped, tiny_target, traces_dir)["best_step"] == 4
    best, at_step_4 = weights(cfg), weights(stopped)
    assert all(torch.equal(best[name], at_step_4[name]) for name in best)


def test_without_checkpoints_the_last_weights_are_exported(reference, tmp_path, tiny_target, traces_dir):
    reference_cfg, expected = reference
    cfg = run_config(tmp_path, checkpoint_dir=None)
    report = train_draft(cfg, tiny_target, traces_dir)
    assert report["best_step"] is None and report["val_loss"] == report["final_val_loss"] == expected["final_val_loss"]
    assert not (tmp_path / "checkpoints").exists()
    assert read_csv(Path(cfg.curves_dir) / "train.csv") == read_csv(Path(reference_cfg.curves_dir) / "train.csv")


def test_deepspeed_accumulates_resumes_and_exports_like_auto(reference, tmp_path, tiny_target, traces_dir, interrupt):
    """ZeRO-2 with 2 accumulated batches per step, interrupted and resumed from its checkpoint folder,
    exports what the plain run does, up to float32 summation order (as test_deepspeed_zero_on_cpu_trains_like_auto;
    that test's ZeRO-3 run exports from a ZeRO-3 checkpoint folder)."""
    reference_cfg, expected = reference
    cfg = run_config(tmp_path, strategy="deepspeed_stage_2")
    interrupt(5)  # the last checkpoint is step 4's, in the second epoch
    with pytest.raises(Interrupted):
        train_draft(cfg, tiny_target, traces_dir)
    assert (tmp_path / "checkpoints" / "train_draft").is_dir()
    started = interrupt(-1)
    report = train_draft(cfg, tiny_target, traces_dir)
    assert report["resumed_from_step"] == 4 and started[0] == 4
    assert (report["steps"], report["best_step"]) == (expected["steps"], expected["best_step"])
    assert report["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-4)
    ours, theirs = weights(cfg), weights(reference_cfg)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-4, atol=1e-5)


def test_deepspeed_refuses_accumulation_that_does_not_divide_an_epoch(tmp_path, tiny_target, traces_dir):
    cfg = run_config(tmp_path, strategy="deepspeed_stage_2", accumulate_grad_batches=4)
    with pytest.raises(ValueError, match="train_draft.accumulate_grad_batches 4 does not divide the 6 batches"):
        train_draft(cfg, tiny_target, traces_dir)


def test_deepspeed_json_may_not_set_what_params_set(tmp_path):
    config = tmp_path / "zero.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}))
    with pytest.raises(ValueError, match="gradient_accumulation_steps; set the stage's accumulate_grad_batches"):
        make_strategy("deepspeed_stage_2", str(config))


@pytest.mark.parametrize(("overrides", "match"), [
    ({"lr_schedule": "step"}, "train_draft.lr_schedule 'step' is unknown"),
    ({"warmup_ratio": 1.0}, "warmup_ratio must be in"),
    ({"accumulate_grad_batches": 0}, "accumulate_grad_batches"),
    ({"val_every_n_steps": 0}, "val_every_n_steps"),
])
def test_schedule_and_validation_settings_are_checked(overrides, match):
    with pytest.raises(ValueError, match=match):
        fit_config(Path("unused"), **overrides)
