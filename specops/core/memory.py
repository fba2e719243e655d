"""A memory model of speculative decoding (SpecMemo, arXiv 2506.01986): bytes from the configs alone.

Nothing here allocates or imports torch: every term is computed from the model shapes (a Hugging Face
config's attributes) and the decoding settings, after reading what the runtime actually keeps:

  * the target's weights, once per parameter (tied embeddings once); the static runtime's lean forward
    (specops.core.llama) stores q|k|v and gate|up concatenated, a second copy of those products; the
    float32 dynamic runtime's SmallBatchLinear keeps a transposed copy of every linear weight it runs
    on one row (specops.core.small_batch_linear), the tied LM head included;
  * the target's KV cache per request: the static runtime allocates layers x 2 x kv_heads x slots x
    head_dim at the start of a generation, slots = specops.core.types.static_cache_length (rounded to STATIC_BUCKET), plus
    its rotary tables; the dynamic cache grows to the tokens held;
  * the draft LM's weights (shared by every generation slot) and its dynamic KV cache per request (beside a
    static target, a chain draft LM runs on the static runtime instead: a cache up to ~256 slots longer,
    briefly held three times while it is rebuilt, and fused weight copies; not modelled here, and small
    for the quickstart's 2-layer draft);
  * the buffers of one pass: the lean forward keeps every layer's output (`captured`, then stacked: two
    copies) and returns logits for every row of a decoding pass (a prefill runs without the head), so
    2 x n x L x H activations; a verification pass of `width` rows the same at its width; sampled
    verification makes float32 probabilities of every row and sorts them for top-p (specops.core.sampling);
    concurrent generations prefill one at a time (on the batcher's pass thread), so at the serving peak
    one request holds its peak and the others what they hold while decoding (`RequestMemory.held`);
  * tree buffers on the dynamic runtime: the tree's rows of logits and its additive mask;
  * a fixed process overhead (Python, torch, transformers, the server's imports) and the transient of
    dequantizing the GGUF at load time, both measured on this machine, and a residue calibrated on one
    configuration of benchmarks/memory_model.py (constants below).

`MemoryReport.peak_bytes` is the larger of the load peak and the serving peak; specops.core.planner
picks the draft length, tree size, concurrency and context that fit a budget.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from specops.core.types import MIN_ROWS, ONEDNN_MIN_WORK, static_cache_length

TILE_INPUTS = 32  # native_linear.cpp's kChunk: on AMX tiles a packed weight's inputs are padded to whole tiles


def packed_elements(out_features: int, in_features: int) -> int:
    """Elements of packed_linear.pack's copy of an [out, in] weight in this process: as many as the weight's,
    but on AMX tiles (where the weight's shape fits our kernel) its inputs padded to whole 32-input tiles."""
    from specops.core.packed_linear import tiles  # here: the model itself needs no torch

    if tiles() and out_features % 16 == 0 and in_features % 2 == 0:
        return out_features * -(-in_features // TILE_INPUTS) * TILE_INPUTS
    return out_features * in_features


# Process overhead: VmRSS of `python -c "import specops.server.app"` after the import (torch 2.13,
# transformers 5.23, fastapi, uvicorn; no model), median of 3 runs on this repo's 2-core machine
# (benchmarks/memory_model.py --overhead, 2026-11-27 late night: 424 MiB; 488 earlier that day).
RUNTIME_OVERHEAD_BYTES = 424 * 2**20
# Loading the SmolLM2 GGUF: VmHWM minus VmRSS right after `load_target` (the dequantized float tensors
# and the mapped file, freed once the model is built), measured in bf16 (227 MiB) and fp32 (230 MiB) by
# a probe that loaded the target alone; benchmarks/memory_model.py's 14 loads then measured 222-226 MiB
# (load_hwm_mib - loaded_rss_mib). Independent of the dtype: transformers dequantizes to float32 either way.
GGUF_LOAD_TRANSIENT_BYTES = 230 * 2**20
# What a GGUF target's process holds beyond the terms above once it has served (the tokenizer, 36 MiB by
# itself; heap the dequantization freed but the allocator kept; kernel workspaces of the first passes).
# Calibrated on ONE configuration of benchmarks/memory_model.py (bf16, static width 1, no draft, one
# request of 64 + 64 tokens: measured serving peak 1172 MiB minus the model's 1084 without it, 2026-11-27
# late night, with packed bf16 products) and validated on the others; it counts in the load peak too (the
# tokenizer loads first).
RUNTIME_RESIDUE_BYTES = 88 * 2**20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_bytes(text: str) -> int:
    """'1.5GiB' -> 1610612736; units B, kB/MB/GB (powers of 10) and KiB/MiB/GiB (powers of 2), any case."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"Cannot read '{text}' as a size: write a number and a unit, e.g. 1.5GiB, 800MiB or 2GB.")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Llama-architecture model that its memory depends on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    max_context: int = 8192

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """From a transformers config (attributes only, so any object with them will do)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                   config.num_attention_heads, config.num_key_value_heads, head_dim, config.vocab_size,
                   bool(getattr(config, "tie_word_embeddings", False)),
                   int(getattr(config, "max_position_embeddings", 8192)))

    @property
    def qkv_params(self) -> int:
        return self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def layer_params(self) -> int:
        """q, k, v, o, gate, up, down and two norms."""
        return self.qkv_params + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate \
            + 2 * self.hidden

    @property
    def params(self) -> int:
        """Every parameter once: tied embeddings count once."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * self.layer_params + self.hidden

    @property
    def packed_decoder_params(self) -> int:
        """What specops.core.packed_linear packs of the lean forward's decoder in bf16: every product weight
        over ONEDNN_MIN_WORK elements (q|k|v, o, gate|up, down per layer)."""
        q = self.heads * self.head_dim
        weights = ((self.qkv_params // self.hidden, self.hidden), (self.hidden, q), (2 * self.intermediate, self.hidden),
                   (self.hidden, self.intermediate))  # [out, in]
        return self.layers * sum(packed_elements(*w) for w in weights if w[0] * w[1] > ONEDNN_MIN_WORK)

    @property
    def packed_params(self) -> int:
        """The decoder's packed products and the LM head's (packed at its first use)."""
        head = self.vocab * self.hidden
        return self.packed_decoder_params + (packed_elements(self.vocab, self.hidden) if head > ONEDNN_MIN_WORK else 0)

    @property
    def linear_params(self) -> int:
        """Parameters of the nn.Linear layers (the LM head included, tied or not)."""
        return self.layers * (self.layer_params - 2 * self.hidden) + self.vocab * self.hidden

    def kv_bytes(self, tokens: int, dtype_bytes: int) -> int:
        """Keys and values of `tokens` positions in every layer."""
        return self.layers * 2 * self.kv_heads * tokens * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class DecodingShape:
    """The serving settings the memory depends on (a DecodingConfig plus the load's)."""

    dtype: str = "bfloat16"
    static_width: int = 0  # 0: the dynamic runtime
    draft_tokens: int = 0  # chain drafts; a tree's depth
    tree_nodes: int = 0  # > 0: the drafter grows trees (on the static runtime, a cache per leaf)
    concurrency: int = 1  # generations decoding at once (1 unless the runtime batches exactly)
    context: int = 2048  # prompt + max_tokens every slot must hold
    prefill_chunk: int = 512  # DEFAULT_PREFILL_CHUNK
    sampled: bool = False  # sampled verification (float32 probabilities) rather than greedy only
    gguf: bool = True  # the target is dequantized from a GGUF at load
    draft_window: int = 0  # > 0: the draft LM's cache holds at most this many tokens (DecodingConfig.draft_window)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"Unknown dtype '{self.dtype}'. Choose one of: {', '.join(DTYPE_BYTES)}.")
        if self.concurrency < 1 or self.context < 2 or self.static_width < 0 or self.draft_tokens < 0:
            raise ValueError("concurrency >= 1, context >= 2, static_width >= 0 and draft_tokens >= 0 are needed.")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def pass_rows(self) -> int:
        """Rows of one verification pass: the last token plus a tree, else the static width, else the last
        token plus the chain."""
        if self.tree_nodes:
            return 1 + self.tree_nodes
        return self.static_width or 1 + self.draft_tokens

    @property
    def branch_caches(self) -> int:
        """Target caches per generation: on the static runtime a tree's branches have one each (at most
        one per node: StaticLM.forward_tree), the first being the main cache."""
        return max(1, self.tree_nodes) if self.static_width else 1


@dataclass(frozen=True)
class TargetWeights:
    params: int  # the HF model's parameters, once
    lean_copy: int  # the static runtime's fused q|k|v and gate|up copies (0 on the dynamic runtime)
    transposed: int  # float32 dynamic runtime: SmallBatchLinear's transposed copies
    dtype_bytes: int
    packed: int = 0  # bf16 static runtime: the lean forward's products packed for oneDNN

    @property
    def bytes(self) -> int:
        return (self.params + self.lean_copy + self.transposed + self.packed) * self.dtype_bytes


@dataclass(frozen=True)
class DraftWeights:
    params: int
    vocab_rows: int  # a draft vocabulary's LM-head rows, copied out of the full head (draft_lm.draft_head)
    transposed: int  # float32: SmallBatchLinear's transposed copies of its decoder's linears
    dtype_bytes: int
    packed: int = 0  # bf16: those rows packed for oneDNN, and a static chain draft's decoder products

    @property
    def bytes(self) -> int:
        return (self.params + self.vocab_rows + self.transposed + self.packed) * self.dtype_bytes


@dataclass(frozen=True)
class RequestMemory:
    """What one concurrent generation holds at its peak, in bytes."""

    target_kv: int
    rotary: int  # the static runtime's cos and sin tables
    draft_kv: int
    prefill: int  # one prefill chunk's buffers (logits, layer outputs, attention scores, MLP)
    verification: int  # one verification pass's logits and activations, float32 copies when sampled
    tree: int  # a tree's mask and rows beyond a chain's
    prefills_alone: bool = True  # its prefill runs on the batcher's pass thread, one request's at a time

    @property
    def bytes(self) -> int:
        """At its peak: a request prefills, then decodes; its pass buffers are one or the other, never both."""
        return self.target_kv + self.rotary + self.draft_kv + max(self.prefill, self.verification + self.tree)

    @property
    def held(self) -> int:
        """Beside one request at its peak, what each other concurrent one holds. Their target prefills are
        passes of their own on the batcher's one pass thread (specops.core.batching), one at a time: the
        others then hold their caches and one verification pass's buffers. A draft LM on its own dynamic
        cache (a tree, a window) catches up on each generation's thread, any number at once: then every
        request counts at its peak."""
        if not self.prefills_alone:
            return self.bytes
        return self.target_kv + self.rotary + self.draft_kv + self.verification + self.tree


@dataclass(frozen=True)
class MemoryReport:
    target: TargetWeights
    draft: DraftWeights | None
    request: RequestMemory
    concurrency: int
    overhead: int = RUNTIME_OVERHEAD_BYTES
    load_transient: int = GGUF_LOAD_TRANSIENT_BYTES
    residue: int = RUNTIME_RESIDUE_BYTES

    @property
    def load_peak_bytes(self) -> int:
        """While loading: the HF weights plus the dequantization transient (the lean copies come later)."""
        return self.overhead + self.residue + self.target.params * self.target.dtype_bytes + self.load_transient

    @property
    def serving_peak_bytes(self) -> int:
        draft = self.draft.bytes if self.draft is not None else 0
        return (self.overhead + self.residue + self.target.bytes + draft + self.request.bytes
                + (self.concurrency - 1) * self.request.held)

    @property
    def peak_bytes(self) -> int:
        return max(self.load_peak_bytes, self.serving_peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(target_bytes=self.target.bytes, draft_bytes=self.draft.bytes if self.draft else 0,
                   request_bytes=self.request.bytes, load_peak_bytes=self.load_peak_bytes,
                   serving_peak_bytes=self.serving_peak_bytes, peak_bytes=self.peak_bytes)
        return out


def _pass_bytes(shape: ModelShape, rows: int, keys: int, dtype_bytes: int, lean: bool, head: bool = True) -> int:
    """Live buffers at the peak of one forward over `rows` tokens attending to `keys` positions.

    The lean forward keeps every layer's output and then stacks it [rows, L, H] (twice) and, with its
    `head` (not in a prefill), ends with logits [rows, V] and the final norm's float32 statistics [rows, H].
    The HF forward (prefill with logits_to_keep=1) peaks inside a layer instead: the MLP's gate, up and
    their product [rows, I] and SDPA's float32 scores [heads, rows, keys]."""
    rows = max(rows, MIN_ROWS)
    scores = shape.heads * rows * keys * 4
    mlp = 3 * rows * shape.intermediate * dtype_bytes
    if lean:
        logits = rows * shape.vocab * dtype_bytes + rows * shape.hidden * 4 if head else 0
        return logits + 2 * rows * shape.layers * shape.hidden * dtype_bytes + max(scores, mlp)
    return shape.vocab * dtype_bytes + scores + mlp


def _sampled_bytes(rows: int, vocab: int) -> int:
    """Sampled verification: float32 scores and probabilities, top-p's sorted copy (float32) and its
    int64 order, the cumulative sum; per row of the pass."""
    return rows * vocab * (4 + 4 + 4 + 8 + 4)


def memory_report(target: ModelShape, decoding: DecodingShape, draft: ModelShape | None = None,
                  draft_vocab: int = 0) -> MemoryReport:
    """The memory of serving `target` (and `draft`, a draft LM with a `draft_vocab`-token vocabulary, 0 for
    the full one) as `decoding` says."""
    b = decoding.dtype_bytes
    static = decoding.static_width > 0
    fp32_small_batch = decoding.dtype == "float32"  # load_target / load_draft swap their linears then
    lean = target.layers * (target.qkv_params + 2 * target.hidden * target.intermediate) if static else 0
    packed = target.packed_params if static and decoding.dtype == "bfloat16" else 0
    weights = TargetWeights(target.params, lean, target.linear_params if fp32_small_batch and not static else 0, b,
                            packed)
    draft_weights = None
    # A chain draft LM without a window runs on the static runtime beside a static target (StaticDraftLM);
    # otherwise on its own dynamic cache, prefilling on each generation's thread.
    static_draft = draft is not None and static and not decoding.tree_nodes and not decoding.draft_window
    if draft is not None:
        # The draft runs its decoder through SmallBatchLinear; its head too unless it drafts a reduced vocabulary.
        transposed = draft.linear_params - (draft.vocab * draft.hidden if draft_vocab else 0)
        packed_draft = 0
        if decoding.dtype == "bfloat16":  # its vocabulary rows, and its lean forward's products when static
            packed_draft = (packed_elements(draft_vocab, draft.hidden)
                            + (draft.packed_decoder_params if static_draft else 0))
        draft_weights = DraftWeights(draft.params, draft_vocab * draft.hidden, transposed if fp32_small_batch else 0, b,
                                     packed_draft)
    tokens = decoding.context + decoding.pass_rows
    slots = static_cache_length(decoding.context, 0, decoding.static_width) if static else tokens
    chunk = min(decoding.prefill_chunk or decoding.context, decoding.context)
    rows = decoding.pass_rows
    verification = _pass_bytes(target, rows, slots, b, lean=static) if static else \
        rows * target.vocab * b + _pass_bytes(target, rows, slots, b, lean=False)
    if decoding.sampled:
        verification += _sampled_bytes(rows, target.vocab) + decoding.draft_tokens * target.vocab * 4
    tree = 0
    if decoding.tree_nodes:  # the additive mask in the model dtype, [rows, keys]; the static runtime's boolean one
        tree = rows * slots * b
    request = RequestMemory(
        target_kv=target.kv_bytes(slots, b) * decoding.branch_caches,
        rotary=2 * slots * target.head_dim * b if static else 0,
        draft_kv=draft.kv_bytes(min(tokens, decoding.draft_window or tokens), b) if draft is not None else 0,
        prefill=_pass_bytes(target, chunk, slots, b, lean=static, head=False),
        verification=verification,
        tree=tree,
        prefills_alone=draft is None or static_draft)
    return MemoryReport(weights, draft_weights, request, decoding.concurrency,
                        load_transient=GGUF_LOAD_TRANSIENT_BYTES if decoding.gguf else 0,
                        residue=RUNTIME_RESIDUE_BYTES if decoding.gguf else 0)

