"""OSD under a distribution shift: a draft LM trained on ShareGPT chat meets a stream of HumanEval code.

1. Setup, cached in --workdir: a mini project whose params.yaml takes ShareGPT prompts only;
   `specops stage prepare`, `collect` and `train_draft` make a draft LM from them, and it is
   registered as the champion of the workdir's own MLflow registry (the project's is untouched).
   Every run starts from that champion, with an empty feedback log.
2. Two `specops serve` processes on 127.0.0.1: the registry's champion (polling its alias, so it
   hot-reloads), and `--drafter none`, plain decoding of the same target, the speed baseline.
3. Before: --requests-before HumanEval prompts, each sent to the baseline, then to the champion,
   which logs them to its feedback database.
4. `specops retrain`, run as a scheduler would, on the workdir's params.yaml.
5. The champion server hot-reloads the promoted challenger.
6. After: --requests-after fresh HumanEval prompts, disjoint from the first ones, the same way.
7. --out (JSON) with acceptance rates and speedups before and after, and --plot: acceptance per
   request over time.

Speedup is tokens/s of the champion server over the baseline server's on the same prompts, measured
by the client; requests alternate between them prompt by prompt, so machine load hits both alike.
Sizes for about 15 minutes on a 2-core CPU with SmolLM2 (first run; the setup is reused after):

    .venv/bin/python benchmarks/osd_shift.py --requests-before 24 --requests-after 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from specops.data.datasets import read_humaneval

REPO = Path(__file__).resolve().parents[1]
MODEL = "osd-shift-drafter"
READY_TIMEOUT_S = 600.0  # two SmolLM2 servers loading at once on 2 cores
RELOAD_TIMEOUT_S = 300.0
SETUP_STAGES = ("prepare", "collect", "train_draft")


@dataclass
class Served:
    """One prompt served by both servers."""

    phase: str  # "before" or "after"
    index: int  # position in the whole stream
    completion_tokens: int
    drafted: int
    accepted: int
    seconds: float  # champion server, client-side
    baseline_seconds: float  # --drafter none server, same prompt
    identical: bool  # same text from both: speculative decoding stayed lossless
    model_version: str


def specops(args: list[str], cwd: Path, log: Path) -> subprocess.CompletedProcess:
    """Run the specops CLI in a subprocess; its output goes to `log`, and a failure shows its tail."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log, "ab") as handle:
        result = subprocess.run([sys.executable, "-m", "specops.cli", *args], cwd=cwd, env=env, stdout=handle,
                                stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise RuntimeError(f"`specops {' '.join(args)}` failed ({result.returncode}); see {log}:\n"
                           f"{log.read_text()[-3000:]}")
    return result


def project_params(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The mini project: ShareGPT only for the first draft, the OSD round sized for a CPU."""
    return {
        "target": {"source": args.target, "dtype": args.dtype},
        "metrics": {"dir": "metrics"},
        "mlflow": {"tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}", "model_name": MODEL},
        "prepare": {"sharegpt_max": 4 * args.setup_prompts, "humaneval": False, "test_fraction": 0.1,
                    "max_prompt_tokens": 256, "out_dir": "data/prompts"},
        # ShareGPT's own replies teacher-forced (the cheapest start; the README's OSD numbers are from it),
        # an 8k-token draft vocabulary as in the quickstart.
        "collect": {"responses": "dataset", "max_new_tokens": 128, "top_k_logits": 32, "hidden_layers": [],
                    "shard_size": 16, "splits": ["train"], "max_prompts_per_split": args.setup_prompts,
                    "out_dir": "data/traces"},
        "train_draft": {"init_layers_from_target": True, "num_layers": 2, "train_embeddings": False,
                        "draft_vocab_size": 8192, "lr": 1e-3, "epochs": args.setup_epochs, "batch_size": 8,
                        "max_seq_len": 384, "accelerator": "cpu", "out_dir": "models/draft_lm"},
        "evaluate": {"split": "test"},
        "register": {"experiment": "osd-shift", "artifact_root": str(workdir / "mlartifacts")},
        # Gate on the deterministic acceptance length by default: wall-clock speed on a shared 2-core
        # machine jitters by more than the gate's tolerance.
        "promote": {"gate": {"metric": args.gate_metric}},
        "osd": {"min_rows": 8, "accelerator": "cpu", "eval_prompts": args.eval_prompts,
                "eval_max_new_tokens": args.max_tokens, "epochs": args.osd_epochs, "lr": args.osd_lr},
    }


def setup(args: argparse.Namespace, workdir: Path) -> str:
    """Train and register the ShareGPT-only champion once per setup configuration; returns its version."""
    params = project_params(args, workdir)
    key = hashlib.sha256(json.dumps({k: params[k] for k in ("target", "prepare", "collect", "train_draft")},
                                    sort_keys=True).encode()).hexdigest()[:16]
    marker = workdir / "setup.json"
    if marker.is_file() and json.loads(marker.read_text())["key"] == key:
        print(f"setup: reusing the ShareGPT-only draft in {workdir}", flush=True)
    else:
        if workdir.exists() and any(workdir.iterdir()):
            if not (workdir / "params.yaml").is_file() or not (workdir / "setup.log").is_file():
                raise FileExistsError(f"{workdir} is not empty and not an osd_shift workdir; pass another --workdir.")
            shutil.rmtree(workdir)  # a setup for other sizes: start it over
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        for stage in SETUP_STAGES:
            print(f"setup: specops stage {stage}", flush=True)
            specops(["stage", stage], workdir, workdir / "setup.log")
        version = register_champion(args, workdir)
        marker.write_text(json.dumps({"key": key, "version": version}) + "\n")
    (workdir / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))  # OSD knobs may differ per run
    return json.loads(marker.read_text())["version"]


def register_champion(args: argparse.Namespace, workdir: Path) -> str:
    from specops.core.target import load_tokenizer
    from specops.pipeline.registry import register_bundle, tracking_setup
    from specops.server.bundle import write_bundle

    _, fingerprint = load_tokenizer(args.target)
    training = json.loads((workdir / "metrics" / "train_draft.json").read_text())
    # Not benchmarked here: the OSD round measures champion and challenger side by side itself.
    metrics = {"method": f"draft-lm@{args.draft_tokens}", "trained_on": "sharegpt",
               "final_loss": training["final_loss"], "val_loss": training["val_loss"]}
    bundle = write_bundle(workdir / "bundle", drafter_dir=workdir / "models" / "draft_lm", drafter_kind="draft-lm",
                          serving={"verifier": "auto", "draft_tokens": args.draft_tokens,
                                   "static_width": args.static_width}, target_source=args.target,
                          target_dtype=args.dtype, fingerprint=fingerprint, metrics=metrics, overwrite=True)
    tracking_setup(f"sqlite:///{workdir / 'mlflow.db'}")
    _, version = register_bundle(bundle, model_name=MODEL, experiment="osd-shift",
                                 artifact_root=str(workdir / "mlartifacts"), params={"osd_shift_setup": vars(args)})
    return version


def reset_round(workdir: Path, version: str) -> None:
    """Start from the ShareGPT-only champion with an empty feedback log and no OSD state."""
    from mlflow import MlflowClient

    from specops.pipeline.registry import tracking_setup

    tracking_setup(f"sqlite:///{workdir / 'mlflow.db'}")
    MlflowClient().set_registered_model_alias(MODEL, "champion", version)
    for path in ("feedback", "data/osd", "models/osd_draft", "models/osd_bundle", "metrics/osd"):
        shutil.rmtree(workdir / path, ignore_errors=True)


def start_server(extra: list[str], port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "specops.cli", "serve", "--port", str(port), "--timeout-s", "3600", *extra]
    with open(log, "wb") as handle:
        return subprocess.Popen(command, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=handle,
                                stderr=subprocess.STDOUT)


def wait_until(check: Any, timeout: float, what: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"The server exited; see {log}:\n{log.read_text()[-2000:]}")
        try:
            if check():
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{what} within {timeout:.0f} s; see {log}.")


def model_version(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["model_version"]


def complete(url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[dict[str, Any], float]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=3600)
    seconds = time.perf_counter() - start
    response.raise_for_status()
    return response.json(), seconds


def serve_phase(phase: str, prompts: list[list[dict[str, str]]], first: int, urls: dict[str, str],
                max_tokens: int) -> list[Served]:
    served = []
    for offset, messages in enumerate(prompts):
        baseline, baseline_s = complete(urls["baseline"], messages, max_tokens)
        reply, seconds = complete(urls["champion"], messages, max_tokens)
        usage = reply["usage"]
        served.append(Served(phase, first + offset, usage["completion_tokens"], usage["drafted"], usage["accepted"],
                             seconds, baseline_s, reply["choices"][0]["message"]["content"] ==
                             baseline["choices"][0]["message"]["content"], model_version(urls["champion"])))
        row = served[-1]
        rate = row.accepted / row.drafted if row.drafted else 0.0
        print(f"{phase} {offset + 1}/{len(prompts)}: acceptance {rate:.2f}, "
              f"{row.baseline_seconds / row.seconds:.2f}x, v{row.model_version}", flush=True)
    return served


def summarize(rows: list[Served]) -> dict[str, Any]:
    drafted = sum(r.drafted for r in rows)
    tokens = sum(r.completion_tokens for r in rows)
    return {
        "requests": len(rows), "completion_tokens": tokens,
        "acceptance_rate": round(sum(r.accepted for r in rows) / drafted, 4) if drafted else None,
        # Both servers produce the same tokens (lossless), so the time ratio is the tokens/s ratio.
        "speedup": round(sum(r.baseline_seconds for r in rows) / sum(r.seconds for r in rows), 4),
        "tokens_per_s": round(tokens / sum(r.seconds for r in rows), 3),
        "baseline_tokens_per_s": round(tokens / sum(r.baseline_seconds for r in rows), 3),
        "identical_to_baseline": all(r.identical for r in rows),
        "model_versions": sorted({r.model_version for r in rows}),
    }


def plot(rows: list[Served], retrain_at: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 4
    fig, ax = plt.subplots(figsize=(8, 4))
    for phase, color in (("before", "tab:blue"), ("after", "tab:green")):
        part = [r for r in rows if r.phase == phase]
        rates = [r.accepted / r.drafted if r.drafted else 0.0 for r in part]
        # The rolling mean restarts at the retrain, so it never mixes the two drafters.
        rolling = [sum(rates[max(0, i - window + 1):i + 1]) / len(rates[max(0, i - window + 1):i + 1])
                   for i in range(len(rates))]
        xs = [r.index for r in part]
        ax.scatter(xs, rates, s=14, alpha=0.5, color=color, label=f"per request, {phase}")
        ax.plot(xs, rolling, color=color, label=f"rolling mean ({window}), {phase}")
    ax.axvline(retrain_at - 0.5, color="black", linestyle="--", linewidth=1, label="specops retrain + hot reload")
    ax.set(xlabel="request (HumanEval stream)", ylabel="acceptance rate (accepted / drafted)", ylim=(0, 1.02),
           title="OSD: a ShareGPT-trained draft LM adapting to code")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def code_prompts(n_before: int, n_after: int, seed: int) -> tuple[list[Any], list[Any]]:
    """Two disjoint sets of HumanEval prompts, shuffled by seed."""
    tasks = [row["messages"] for row in read_humaneval() if isinstance(row, dict)]
    if n_before + n_after > len(tasks):
        raise ValueError(f"HumanEval has {len(tasks)} prompts; asked for {n_before} + {n_after}.")
    random.Random(seed).shuffle(tasks)
    return tasks[:n_before], tasks[n_before:n_before + n_after]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests-before", type=int, default=24, help="code prompts served before the retrain")
    parser.add_argument("--requests-after", type=int, default=16, help="fresh code prompts served after it")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (and per traced response)")
    parser.add_argument("--setup-prompts", type=int, default=400, help="ShareGPT prompts the first draft learns from")
    parser.add_argument("--setup-epochs", type=int, default=2, help="train_draft epochs of the first draft")
    parser.add_argument("--osd-epochs", type=int, default=3, help="epochs of the OSD round (osd.epochs)")
    parser.add_argument("--osd-lr", type=float, default=1e-3, help="learning rate of the OSD round (osd.lr)")
    parser.add_argument("--eval-prompts", type=int, default=6, help="prompts per slice in the retrain's evaluation")
    parser.add_argument("--draft-tokens", type=int, default=4, help="tokens the draft LM proposes per step")
    parser.add_argument("--gate-metric", default="mean_accepted_length",
                        help="promote.gate.metric: mean_accepted_length (deterministic) or speedup_vs_ar")
    parser.add_argument("--target", default="smollm2", help="target source, as params.yaml target.source")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--static-width", type=int, default=0,
                        help="both servers on the static runtime with passes this wide (0: the dynamic cache); "
                             "must exceed --draft-tokens. bf16 is lossless only there")
    parser.add_argument("--seed", type=int, default=0, help="shuffles HumanEval before splitting it")
    parser.add_argument("--workdir", default=str(REPO / ".cache" / "osd_shift"), help="the mini project (cached)")
    parser.add_argument("--base-port", type=int, default=18500, help="the servers listen on this port and the next")
    parser.add_argument("--out", default="metrics/osd_shift.json")
    parser.add_argument("--plot", default="metrics/osd_shift_acceptance.png")
    args = parser.parse_args(argv)
    if min(args.requests_before, args.requests_after, args.max_tokens, args.setup_prompts, args.eval_prompts) < 1:
        parser.error("request counts, --max-tokens, --setup-prompts and --eval-prompts must be >= 1")
    if args.requests_before < 8:
        parser.error("--requests-before must be >= 8 (osd.min_rows of the round)")
    if args.static_width and args.static_width <= args.draft_tokens:
        parser.error("--static-width must exceed --draft-tokens (a pass verifies at most width - 1 drafts)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    before_prompts, after_prompts = code_prompts(args.requests_before, args.requests_after, args.seed)
    workdir = Path(args.workdir).resolve()
    version = setup(args, workdir)
    reset_round(workdir, version)
    setup_s = time.perf_counter() - start
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    urls = {"champion": f"http://127.0.0.1:{args.base_port}", "baseline": f"http://127.0.0.1:{args.base_port + 1}"}
    servers = {
        "champion": start_server(["--model-uri", f"models:/{MODEL}@champion", "--tracking-uri",
                                  f"sqlite:///{workdir / 'mlflow.db'}", "--poll-s", "2", "--feedback-db",
                                  str(workdir / "feedback" / "feedback.db")], args.base_port, logs / "champion.log"),
        "baseline": start_server(["--drafter", "none", "--target", args.target, "--dtype", args.dtype,
                                  "--static-width", str(args.static_width),
                                  "--no-feedback"], args.base_port + 1, logs / "baseline.log"),
    }
    try:
        for name, process in servers.items():
            wait_until(lambda name=name: httpx.get(f"{urls[name]}/ready", timeout=2).status_code == 200,
                       READY_TIMEOUT_S, f"The {name} server was not ready", process, logs / f"{name}.log")
        before = serve_phase("before", before_prompts, 0, urls, args.max_tokens)
        print("specops retrain ...", flush=True)
        retrain_start = time.perf_counter()
        specops(["retrain"], workdir, logs / "retrain.log")
        retrain_s = time.perf_counter() - retrain_start
        decision = json.loads((workdir / "metrics" / "osd_retrain.json").read_text())
        print(f"retrain: {'promoted' if decision['promoted'] else 'refused'} v{decision['challenger_version']} "
              f"({decision['reason']})", flush=True)
        wait_until(lambda: model_version(urls["champion"]) == decision["champion_version"], RELOAD_TIMEOUT_S,
                   f"The champion server did not serve v{decision['champion_version']}", servers["champion"],
                   logs / "champion.log")
        after = serve_phase("after", after_prompts, len(before), urls, args.max_tokens)
    finally:
        for process in servers.values():
            process.terminate()
        for process in servers.values():
            process.wait(timeout=60)
    first, second = summarize(before), summarize(after)
    report = {
        "acceptance_rate_before": first["acceptance_rate"], "acceptance_rate_after": second["acceptance_rate"],
        "speedup_before": first["speedup"], "speedup_after": second["speedup"],
        "before": first, "after": second,
        "retrain": {key: decision[key] for key in ("parent_version", "challenger_version", "promoted", "reason",
                                                   "champion_version", "train", "evaluation", "seconds")},
        "seconds": {"setup": round(setup_s, 1), "retrain": round(retrain_s, 1),
                    "total": round(time.perf_counter() - start, 1)},
        "config": {key: value for key, value in vars(args).items() if key not in ("out", "plot")},
        "requests": [asdict(row) for row in before + after],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(before + after, len(before), Path(args.plot))
    print(json.dumps({key: report[key] for key in ("acceptance_rate_before", "acceptance_rate_after",
                                                   "speedup_before", "speedup_after")}, indent=2))
    print(f"wrote {out} and {args.plot}")


if __name__ == "__main__":
    main()
