"""A lean Llama forward over a static KV cache: the target's passes without transformers' per-call machinery.

transformers' forward is general (any cache, a mask builder, an output recorder, a kernel hub) and pays
for it on every pass: on this repo's 2-core CPU, SmolLM2-135M's 4-row bf16 pass took 42 ms through it,
of which the matrix products streaming the weights were about 25. Here one pass is the products plus a
few elementwise ops per layer, in the spirit of gpt-fast: q, k and v come from one fused product, gate
and up from another, the rotary tables are built once per cache, keys and values are written in place.

Eager, the products run on weights packed once (specops.core.packed_linear): for our kernel
(native_linear.cpp) where this CPU runs it, which streams the weights faster for a few rows and sums each
output in a fixed order, else in oneDNN's layout (F.linear's sums, without its reorder of every weight on
every call: SmolLM2's 5-row bf16 pass took 15.7 ms against 19.4 through F.linear). Compiled
(`compiled=True`), inductor freezes the weights, autotunes each product (its C++ GEMM template against ATen's mm; here ATen's mostly wins) and fuses the elementwise ops: the same
pass took 14-19 ms (docs/results.md). The ops mirror transformers' Llama (RMSNorm statistics in float32, rotate_half,
its eager attention for decoding passes and SDPA for a prompt's prefill), so the Python loop's eager logits
on oneDNN's products match its forward (our product and attention kernels round otherwise, within bf16's
precision);
compiled ones differ by kernel rounding, the same for every pass of the same shape, which is what batch
invariance needs (specops.core.kv).

Eager passes run their layers in C++ where the native decoder is built (specops.core.native: the products
through the same kernels, an attention kernel of its own that reads each cache in place up to each row's
visible end, and for bf16 one row kernel each for the norms, rotary, SiLU and the residual adds, without ~45
Python dispatches a layer and without the GIL; attention, the norms' sums and SiLU's exp round otherwise than
ATen's here); the Python loop (`_layers_python`) is what torch.compile traces and what runs without a
compiler. A process runs one or the other for every pass.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from specops.core import native
from specops.core.packed_linear import linear, pack
from specops.core.types import MIN_ROWS

# Eager F.linear streams cold bf16 weights at ~10 GB/s on this CPU (oneDNN reorders them every call); the
# products inductor picks under max-autotune on frozen weights, and the eager ones on weights packed once
# (specops.core.packed_linear), read each weight once.
# Rope types whose rotation is a fixed function of the position (not of the sequence length), so the rotary
# tables are built once per cache and cached keys can be moved to other positions (specops.core.kv).
ROPE_TYPES = ("default", "linear", "llama3")
# In the Python loop, a sequence's rows in a pass up to this many attend through LlamaForward.attention (decoding
# and verification passes); more (a prompt's prefill) through SDPA (the native decoder's kernel takes every row). Plain and speculative decoding share the prefill; a static
# width above this would put verification passes on SDPA too (static_width is far below it in practice).
MATH_ROWS = 64
# Caches pad to the longest of a batched pass only on one side of this many slots: in bf16 on this CPU an
# attention row changed when its cache was padded from 1024 slots or fewer to 1088 or more (oneDNN blocks
# the weights x values sum at 1024) and on neither side alone (672 random cases, docs/results.md).
PAD_LIMIT = 1024
# (cache length, padded length, rows, caches) of LlamaForward.pads_exactly's check, on each side of PAD_LIMIT
# and up to it: decoding and verification rows at the cache's last slots, which see the most keys.
PAD_CHECKS = ((128, 192, 1, 1), (192, 448, 5, 3), (320, 1024, 3, 8), (1088, 2048, 5, 2), (2112, 8192, 1, 1))
# What the native decoder's attention kernel takes (native_attention.cpp); other models run the Python loop.
NATIVE_DTYPES = (torch.bfloat16, torch.float32)
NATIVE_MAX_HEAD_DIM = 128
INDUCTOR_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


@dataclass(frozen=True)
class Branches:
    """A tree draft's rows, each root-to-leaf branch in a cache of its own (specops.core.kv.StaticLM.forward_tree).

    A tree row must reduce exactly as plain decoding reduces its token, over keys in the same slots: its
    ancestors at the slots right before its own, where a chain puts them. Siblings cannot share those
    slots in one cache, so each branch has its own copy ([branches, kv_heads, length, D] per layer) in which
    its tokens sit at the last committed position plus their depths. A row is computed once in the
    products, written to every branch through it (`write_branch`, `write_row`) and attends in one of them
    (`owner`)."""

    owner: torch.Tensor  # [n] the branch each row attends in (one whose path holds it)
    write_branch: torch.Tensor  # [w] with write_row: row write_row[i]'s keys and values go to branch write_branch[i]
    write_row: torch.Tensor  # [w]


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a pass: tokens [n] at positions [n] (their cache slots), its per-layer cache
    and its rotary tables. With `branches` (a tree), the cache holds one copy per branch."""

    ids: torch.Tensor
    pos: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    branches: Branches | None = None

    def args(self) -> tuple:
        """The arguments of LlamaForward.forward, in order."""
        return self.ids, self.pos, self.keys, self.values, self.cos, self.sin


class UnsupportedModelError(ValueError):
    """The lean runtime covers Llama-architecture models (SmolLM2, Llama 2/3, TinyLlama)."""


def _frozen(t: torch.Tensor) -> nn.Parameter:
    """The model's own storage where it is used as is: a second copy of the target would double its memory."""
    return nn.Parameter(t.detach(), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op: the statistics in float32, the scale in the model dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's silu(gate) * up, gate the first half of each row of the gate_up product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# The Python loop's per-layer norm and gated MLP: ATen's ops. The native decoder runs row kernels of its own for
# bf16 passes (native_elementwise.cpp: the norm's sum and SiLU's exp round otherwise), which the tests put here
# where the two loops must match bit for bit, as they put its attention kernel in _AttentionPlan.attend.
LAYER_OPS = (rms_norm, silu_mul)


def hidden_slots(visible: torch.Tensor) -> torch.Tensor:
    """Visibility [B, 1, W, L] -> the slots each row does not see, [B, 1, 1, W, L]: attention's mask, broadcast
    over the query heads that share a key head."""
    return ~visible[:, :, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Packed(NamedTuple):
    """LlamaForward's decoder weights packed (packed_linear.pack), per layer (None where F.linear stays)."""

    qkv: list[torch.Tensor | None]
    o: list[torch.Tensor | None]
    gate_up: list[torch.Tensor | None]
    down: list[torch.Tensor | None]

    @classmethod
    def none(cls, layers: int) -> _Packed:
        return cls([None] * layers, [None] * layers, [None] * layers, [None] * layers)


class LlamaForward(nn.Module):
    """A Llama model's decoder as one function of (tokens, positions, cache): the weights are copied in
    fused, the cache is passed in as per-layer tensors (one tensor per layer keeps inductor's in-place
    writes local: a view of one big cache made it copy the whole cache per layer). Every layer's output
    comes back, so plain decoding and drafters that read some layers (aligned heads) run one graph."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        cfg = model.config
        if cfg.model_type != "llama":
            raise UnsupportedModelError(f"The static runtime runs Llama-architecture targets; this one is "
                                        f"'{cfg.model_type}'. Use static_width 0 (the dynamic runtime).")
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False) or cfg.hidden_act != "silu":
            raise UnsupportedModelError("The static runtime's Llama forward has no attention or MLP biases and "
                                        "uses SiLU; use static_width 0 for this model.")
        rotary = model.model.rotary_emb
        if rotary.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"Rope type '{rotary.rope_type}' changes with the sequence length; the "
                                        "static runtime supports default, linear and llama3. Use static_width 0.")
        attn = model.model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
        self.eps = float(cfg.rms_norm_eps)
        self.inv_freq = rotary.inv_freq.detach().float().clone()
        self.rope_scaling = float(rotary.attention_scaling)
        layers = model.model.layers
        self.qkv = nn.ParameterList(_frozen(torch.cat([a.self_attn.q_proj.weight, a.self_attn.k_proj.weight,
                                                       a.self_attn.v_proj.weight])) for a in layers)
        self.o = nn.ParameterList(_frozen(a.self_attn.o_proj.weight) for a in layers)
        self.gate_up = nn.ParameterList(_frozen(torch.cat([a.mlp.gate_proj.weight, a.mlp.up_proj.weight]))
                                        for a in layers)
        self.down = nn.ParameterList(_frozen(a.mlp.down_proj.weight) for a in layers)
        self.attn_norm = nn.ParameterList(_frozen(a.input_layernorm.weight) for a in layers)
        self.mlp_norm = nn.ParameterList(_frozen(a.post_attention_layernorm.weight) for a in layers)
        self.embed = _frozen(model.model.embed_tokens.weight)
        self.norm = _frozen(model.model.norm.weight)
        tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        self.head = self.embed if tied else _frozen(model.lm_head.weight)
        self.dtype = model.dtype
        # The eager passes' products on weights packed once (bf16 on a CPU: our kernel's or oneDNN's, the
        # products two to three times as fast as F.linear's); a plain attribute, not parameters, so
        # torch.compile sees only the plain weights and packs its own. A copy: a LlamaForward is rebuilt when the weights change (llama_forward).
        self.packed = self.packed_weights()
        self.packing = True  # False: F.linear on the plain weights (A/B timing: benchmarks/packed_linear.py)
        self.use_native = True  # False: the Python loop (ATen's attention, which rounds otherwise: tests, A/B timing)
        self._native_decoder: tuple[_Packed, Any] | None = None  # built at the first pass that runs it (_native)

    @property
    def num_layers(self) -> int:
        return len(self.qkv)

    def packed_weights(self, ours: bool = True, on_tiles: bool | None = None) -> _Packed:
        """The decoder's weights packed for the eager passes (packed_linear.pack; `ours` False: oneDNN's packing
        even where our kernel runs, `on_tiles` False: our dot products even where AMX tiles run; A/Bs of the
        kernels)."""
        return _Packed(*([pack(w, ours, on_tiles) for w in weights]
                         for weights in (self.qkv, self.o, self.gate_up, self.down)))

    def new_cache(self, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (self.kv_heads, length, self.head_dim)
        return ([torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)],
                [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)])

    def tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [length, head_dim] for positions 0..length-1, as transformers computes them per pass."""
        freqs = torch.arange(length, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scaling).to(self.dtype), (emb.sin() * self.rope_scaling).to(self.dtype)

    def visible_ends(self, pos: torch.Tensor, length: int) -> torch.Tensor:
        """How many of a cache's `length` slots each row at `pos` [n] sees, from slot 0: up to its own position."""
        return pos + 1

    def visibility(self, pos: torch.Tensor, length: int) -> torch.Tensor:
        """Causal visibility [n, length] (visible_ends as a mask): a row sees the slots up to its own position."""
        return torch.arange(length)[None, :] < self.visible_ends(pos, length)[:, None]

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `ids` [n] at positions `pos` [n] (also their cache slots), each seeing the slots up to
        its own. Writes their keys and values; returns logits [n, V] and every layer's output [n, L, H]."""
        return self.forward_many([Segment(ids, pos, keys, values, cos, sin)])[0]

    def prefill(self, ids: torch.Tensor, pos: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`forward` without the LM head: every layer's output [n, L, H]. A prompt's logits are not needed
        (decoding starts from its last token), and over its rows the head was a fifth of the work (SmolLM2:
        49k x 576 of ~135M weights per row)."""
        layers = self.decoder([Segment(ids, pos, keys, values, cos, sin)], self.num_layers, MIN_ROWS)
        return torch.stack(layers, 1)[: ids.shape[0]]

    def early(self, ids: torch.Tensor, pos: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
              cos: torch.Tensor, sin: torch.Tensor, layers: int) -> torch.Tensor:
        """The first `layers` decoder layers only (DEL's self-drafting, specops.drafters.del_exit): tokens
        `ids` [n] at positions `pos` [n] write their keys and values in those layers' caches (`keys[i]`
        for i < layers) and every one of those layers' outputs comes back [n, layers, H]. The rows are not
        padded to MIN_ROWS, since a draft's rounding need not match anything (verification recomputes
        every row it keeps), and no head runs."""
        return torch.stack(self.decoder([Segment(ids, pos, keys, values, cos, sin)], layers, min_rows=1), 1)

    def forward_many(self, segments: list[Segment], head: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One pass over several sequences, each with its own cache: the products run over all their rows
        at once (the weights are read once), attention per sequence over its own cache (the native kernel), or
        in the Python loop in one call over their caches padded to the longest on each side of PAD_LIMIT
        (LlamaForward.pads_exactly; else one call per cache length). A row's result
        does not depend on the other segments as long as the products are batch-invariant over the row
        count, which bf16 F.linear is on this CPU and fp32 is not (specops.core.batching).
        Per segment: its logits, or without `head` the final norm's output (a draft applies its own head),
        and every layer's output."""
        sizes = [segment.ids.shape[0] for segment in segments]
        real = sum(sizes)
        captured = self.decoder(segments, self.num_layers, MIN_ROWS)
        out = rms_norm(captured[-1], self.norm, self.eps)
        if head:
            out = self._head(out)
        layers = torch.stack(captured, 1)
        return list(zip(out[:real].split(sizes), layers[:real].split(sizes), strict=True))

    def decoder(self, segments: list[Segment], layers: int, min_rows: int) -> list[torch.Tensor]:
        """The first `layers` decoder layers over the segments' rows, padded to at least `min_rows` rows
        (copies of the first, which take part in the products only): each layer's output [n, H]."""
        sizes = [segment.ids.shape[0] for segment in segments]
        real = sum(sizes)
        n = max(real, min_rows)
        # Elementwise work (rotary, views) runs on all rows at once; only the cache writes, which go to each
        # sequence's own cache, run per sequence, and attention per group of sequences (_AttentionPlan).
        pad = [0] * (n - real)
        cos = torch.cat([segment.cos[segment.pos] for segment in segments] + [segments[0].cos[pad]])
        sin = torch.cat([segment.sin[segment.pos] for segment in segments] + [segments[0].sin[pad]])
        native_loop = self._native()
        plan = _AttentionPlan(self, segments, sizes, n, kernel=native_loop is not None)
        ids = torch.cat([segment.ids for segment in segments])
        x = F.embedding(torch.cat([ids, ids[pad]]), self.embed)
        if native_loop is not None:
            return native_loop.run(x, cos, sin, plan.for_native(), layers, self._packs())
        return self._layers_python(x, cos, sin, plan, layers)

    def _layers_python(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: _AttentionPlan,
                       layers: int) -> list[torch.Tensor]:
        """The decoder layers as Python dispatches them: what torch.compile traces, where the native decoder
        (native_decoder.cpp, which mirrors this loop op for op but for attention, where its kernel takes every row)
        is not built, and its reference in the tests (with the kernel's attention patched in)."""
        n = x.shape[0]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        packed = self._packed_or_none()
        norm, gated = LAYER_OPS
        captured = []
        for i in range(layers):
            h = norm(x, self.attn_norm[i], self.eps)
            qkv = linear(h, self.qkv[i], packed.qkv[i])
            # q and k rotate in one call (their heads side by side): elementwise, the same values as apart.
            qk = qkv[:, : q_size + kv_size].view(n, self.heads + self.kv_heads, self.head_dim)
            qk = rotate(qk.transpose(0, 1), cos, sin)
            q, k = qk[: self.heads], qk[self.heads:]
            v = qkv[:, q_size + kv_size:].view(n, self.kv_heads, self.head_dim).transpose(0, 1)
            for j, (segment, rows) in enumerate(zip(plan.segments, plan.rows, strict=True)):
                if segment.branches is None:
                    segment.keys[i].index_copy_(1, segment.pos, k[:, rows])
                    segment.values[i].index_copy_(1, segment.pos, v[:, rows])
                else:  # one write per layer into every branch through each row
                    branch, slot, row = plan.writes[j]
                    segment.keys[i][branch, :, slot] = k[:, row].transpose(0, 1)
                    segment.values[i][branch, :, slot] = v[:, row].transpose(0, 1)
            att = plan.attend(q, i)
            x = x + linear(att.transpose(0, 1).reshape(n, q_size), self.o[i], packed.o[i])
            h = norm(x, self.mlp_norm[i], self.eps)
            x = x + linear(gated(linear(h, self.gate_up[i], packed.gate_up[i])), self.down[i], packed.down[i])
            captured.append(x)
        return captured

    def _native(self) -> Any:
        """The native decoder over this model's weights (specops.core.native), or None where the Python loop
        runs: the extension not built (or SPECOPS_NATIVE=0), `use_native` off, torch.compile tracing, or a
        model the attention kernel does not take (bf16 and fp32 only, head_dim up to 128: fp64 test models).
        Grad mode does not matter (the weights are frozen copies, nothing in a pass requires grad, and the C++
        loop runs without grad): the two runtimes attend with different rounding, and a pass run outside inference mode (a
        test's prefill, a script's) must not switch a sequence from one to the other."""
        if (not self.use_native or torch.compiler.is_compiling() or self.dtype not in NATIVE_DTYPES
                or self.head_dim > NATIVE_MAX_HEAD_DIM):
            return None
        extension = native.extension()
        if extension is None:
            return None
        # Built over the packed weights it is given: rebuilt if they are swapped (an A/B of packings).
        if self._native_decoder is None or self._native_decoder[0] is not self.packed:
            self._native_decoder = self.packed, extension.Decoder(
                list(self.attn_norm), list(self.mlp_norm), list(self.qkv), list(self.o), list(self.gate_up),
                list(self.down), *self.packed, self.eps, self.heads, self.kv_heads, self.head_dim)
        return self._native_decoder[1]

    def _packs(self) -> bool:
        """Whether this pass runs the packed weights: not while torch.compile traces (it must not see oneDNN's
        opaque tensors), nor with packing off."""
        return self.packing and not torch.compiler.is_compiling()

    def _packed_or_none(self) -> _Packed:
        return self.packed if self._packs() else _Packed.none(self.num_layers)

    @functools.cached_property
    def packed_head(self) -> torch.Tensor | None:
        """The LM head packed at its first use: a draft LM's lean forward applies its own head instead."""
        return pack(self.head)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.head, self.packed_head) if self._packs() else F.linear(x, self.head)

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """transformers' eager Llama attention over a batch of sequences with caches of one length (or padded
        to one: pads_exactly): q [B, heads, W, D], keys and values [B, kv_heads, L, D], visible [B, 1, W, L]
        -> [B, heads, W, D].

        The products in the model dtype, the softmax in float32, as transformers computes them (it repeats
        the key heads and adds a mask; here query heads are folded into rows and masked keys set to -inf,
        the same sums). Each query row is a dot product over D, a softmax and a product over the key axis,
        and in bf16 a row comes out bitwise the same whatever the query count W and the batch B (checked on
        this CPU for SmolLM2's head shapes; fp32 rows change with the shape, and so do some of SDPA's flash
        kernel's rows with W)."""
        return self.masked_attention(q, keys, values, hidden_slots(visible))

    def masked_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         hidden: torch.Tensor) -> torch.Tensor:
        """`attention` with the slots a row does not see given as `hidden` [B, 1, 1, W, L] (hidden_slots), as a
        pass's attention plan holds them: built once a pass, not once a layer (the Python loop's attention)."""
        b, _, w, d = q.shape
        groups = self.heads // self.kv_heads
        # GQA by folding each kv head's query heads into rows, not by repeating the keys (a copy per pass).
        # In place on the product's fresh output: the same values without a copy of the scores per step.
        scores = torch.matmul(q.reshape(b, self.kv_heads, groups * w, d), keys.transpose(-1, -2)).mul_(d ** -0.5)
        scores = scores.view(b, self.kv_heads, groups, w, -1).masked_fill_(hidden, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights.view(b, self.kv_heads, groups * w, -1), values).view(b, self.heads, w, d)

    @functools.cached_property
    def pads_exactly(self) -> bool:
        """Whether `attention` gives a cache's rows bitwise alike over the cache alone and over the cache padded
        with slots no row sees, so sequences whose caches differ in length can attend in one call (padded to
        the longest) without a row depending on the others' lengths. On this CPU the masked slots' weights
        are exact zeros that leave the float32 softmax sums and oneDNN's bf16 products unchanged (measured
        for SmolLM2's head shapes on either side of PAD_LIMIT, 1-8 rows, 1-8 caches, 1 and 2 threads). A
        measured property of these kernels, not a guarantee, so it is checked once per model on its head
        shapes (as packed_linear.pack checks each weight), and caches keep one call per length where it fails.
        Never across PAD_LIMIT, where it does fail."""
        generator = torch.Generator().manual_seed(0)
        return all(self.pads_alike(*case, generator) for case in PAD_CHECKS)

    def pads_alike(self, length: int, padded: int, rows: int, batch: int, generator: torch.Generator) -> bool:
        """One random draw of `pads_exactly`'s check: `batch` caches of `length` slots and `rows` query rows at
        their last slots; are the rows bitwise alike over the caches alone and padded to `padded` slots?"""
        def draw(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(self.dtype)

        q = draw(batch, self.heads, rows, self.head_dim)
        keys, values = (draw(batch, self.kv_heads, length, self.head_dim) for _ in range(2))
        pos = torch.arange(length - rows, length)
        alone = self.attention(q, keys, values, self.visibility(pos, length).expand(batch, 1, rows, length))
        tail = (batch, self.kv_heads, padded - length, self.head_dim)
        together = self.attention(q, torch.cat([keys, draw(*tail)], 2), torch.cat([values, draw(*tail)], 2),
                                  self.visibility(pos, padded).expand(batch, 1, rows, padded))
        return torch.equal(alone, together)


class _Group(NamedTuple):
    """Sequences attending in one call (their caches padded to the longest); or one tree's branches."""

    members: list[int]  # their indices among the pass's segments (a tree: its one segment)
    batch: int  # caches attended in (members, or a tree's branches)
    width: int  # query rows per cache: the widest's
    take: torch.Tensor  # [batch * width] the pass row of each query slot (a cache's first row pads it)
    hidden: torch.Tensor  # [batch, 1, 1, width, length]: the slots each query slot does not see (hidden_slots)
    keep: torch.Tensor  # the query slots holding real rows, in pass order
    out: torch.Tensor  # the pass rows they fill


class _AttentionPlan:
    """How one pass attends. With `kernel` (the native decoder), each sequence's rows through
    native_attention.cpp, which reads every cache in place up to each row's visible end and computes a row from
    its query and the slots it sees alone, a prompt's rows too: a prompt's keys and values then do not depend on
    how it is cut into passes, which a prefix cache needs (specops.core.prefix_cache), and for 192 rows the
    kernel took 0.6 ms a layer against SDPA's 0.75. In the Python loop, a long segment (a prefill) attends alone
    through SDPA, whose flash kernel does not materialise its [W, L] scores, and the other rows through
    ATen (`LlamaForward.attention`): the sequences in one batched call on each side of PAD_LIMIT, their queries
    padded to the widest and their caches to the longest (one call per cache length where padding would change
    a row, LlamaForward.pads_exactly), a tree's rows in its branch caches in one call of their own
    (Segment.branches). Per call, not per sequence, is what ATen's batching needs: SDPA's fixed cost (~60-90 us
    on this CPU) per sequence and layer was most of a batched pass's time beyond the products."""

    def __init__(self, forward: LlamaForward, segments: list[Segment], sizes: list[int], n: int,
                 kernel: bool = False) -> None:
        self.forward = forward
        self.segments = segments
        self.n = n
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        self.rows = [slice(start, start + size) for start, size in zip(starts, sizes, strict=True)]
        self.flash = {} if kernel else {j: self._flash(segments[j]) for j, size in enumerate(sizes) if size > MATH_ROWS}
        self.groups: list[_Group] = []
        self.writes: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # a tree's (branch, slot, pass row)
        groups: dict[int, list[int]] = {}
        for j, size in enumerate(sizes):
            tree = segments[j].branches
            if tree is not None:
                if size > MATH_ROWS:
                    raise ValueError(f"A tree pass takes at most {MATH_ROWS} rows, got {size}.")
                self.writes[j] = (tree.write_branch, segments[j].pos[tree.write_row], tree.write_row + starts[j])
                if not kernel:
                    self.groups.append(self._branches(j, starts[j]))
            elif size <= MATH_ROWS and not kernel:
                # One segment (every compiled pass) is one group without reading its cache length: a length
                # used as a key would specialise a compiled graph on it and recompile for every other length.
                # Several attend in one call padded to the longest cache, on each side of PAD_LIMIT, where that
                # changes no row (pads_exactly): a call per length cost 3-4 ms a pass per extra length
                # (benchmarks/batched_pass.py).
                groups.setdefault(self._key(segments[j].keys[0].shape[1]) if len(segments) > 1 else 0, []).append(j)
        for members in groups.values():
            length = max(segments[j].keys[0].shape[1] for j in members)
            rows = [list(range(starts[j], starts[j] + sizes[j])) for j in members]
            self.groups.append(self._group_of(members, len(members), rows, [segments[j].pos for j in members], length))
        # The common case needs no gather or scatter: one group, every member `width` rows, no padding rows.
        self.uniform = (not self.flash and not self.writes and len(self.groups) == 1 and sum(sizes) == n
                        and all(size == self.groups[0].width for size in sizes))

    def _key(self, length: int) -> int:
        """The attention call of a cache of `length` slots in a pass of several segments."""
        return int(length > PAD_LIMIT) if self.forward.pads_exactly else length

    def _flash(self, segment: Segment) -> tuple[int, torch.Tensor | None]:
        """A long segment's keys: the cache slots up to its last row's position, and its visibility over them,
        None for a prompt's first pass (rows at slots 0..n-1), which SDPA's causal kernel takes without a
        mask and skips the blocks a row cannot see: over the whole cache with a mask, the flash kernel
        spent 28% of a 192-token prefill on blocks of slots no row saw. A compiled pass (a static width
        above MATH_ROWS) keeps the whole cache: reading positions would specialise its graph on them."""
        pos, length = segment.pos, segment.keys[0].shape[1]
        if torch.compiler.is_compiling():
            return length, self.forward.visibility(pos, length)
        end = int(pos.max()) + 1
        causal = end == len(pos) and torch.equal(pos, torch.arange(end))
        return end, None if causal else self.forward.visibility(pos, end)

    def _group_of(self, members: list[int], batch: int, rows: list[list[int]], positions: list[torch.Tensor],
                  length: int) -> _Group:
        """A group attending in `batch` caches of `length` slots: the pass rows [rows[b]] at `positions[b]` in
        cache b, each cache's queries padded to the widest with copies of its first row."""
        width = max(len(r) for r in rows)
        take, visible, keep, out = [], [], [], []
        for b, (real, pos) in enumerate(zip(rows, positions, strict=True)):
            take += real + real[:1] * (width - len(real))
            visible.append(self.forward.visibility(torch.cat([pos, pos[:1].expand(width - len(real))]), length))
            keep += range(b * width, b * width + len(real))
            out += real
        return _Group(members, batch, width, torch.tensor(take), hidden_slots(torch.stack(visible)[:, None]),
                      torch.tensor(keep), torch.tensor(out))

    def _branches(self, j: int, start: int) -> _Group:
        """Tree segment j's group: each branch's cache with the rows that attend in it."""
        segment = self.segments[j]
        owner = segment.branches.owner  # type: ignore[union-attr]
        batch = int(owner.max()) + 1
        rows = [torch.nonzero(owner == b).flatten() for b in range(batch)]
        return self._group_of([j], batch, [(r + start).tolist() for r in rows], [segment.pos[r] for r in rows],
                              segment.keys[0].shape[2])

    def for_native(self) -> Any:
        """This plan as the native decoder takes it (native_decoder.cpp's Plan): per sequence its cache, rows,
        writes and each row's visible end (LlamaForward.visible_ends); the kernel attends every row, prompts' too."""
        extension = native.extension()
        assert extension is not None
        sequences = []
        for j, (segment, rows) in enumerate(zip(self.segments, self.rows, strict=True)):
            branch, slot, row = self.writes.get(j, (None, None, None))
            ends = self.forward.visible_ends(segment.pos, segment.keys[0].shape[-2])
            owner = None if segment.branches is None else segment.branches.owner
            sequences.append(extension.Sequence(segment.keys, segment.values, segment.pos, rows.start,
                                                rows.stop - rows.start, branch, slot, row, ends, owner))
        return extension.Plan(sequences)

    def attend(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Attention outputs [heads, n, D] for the pass's queries q [heads, n, D] at `layer` (padding rows 0)."""
        fw = self.forward
        if self.uniform:
            group = self.groups[0]
            queries = q.view(fw.heads, group.batch, group.width, fw.head_dim).transpose(0, 1)
            return self._group(queries, group, layer).transpose(0, 1).reshape(fw.heads, self.n, fw.head_dim)
        att = q.new_zeros(fw.heads, self.n, fw.head_dim)
        for group in self.groups:
            queries = q[:, group.take].view(fw.heads, group.batch, group.width, fw.head_dim).transpose(0, 1)
            result = self._group(queries, group, layer)
            att[:, group.out] = result.transpose(0, 1).reshape(fw.heads, -1, fw.head_dim)[:, group.keep]
        self.attend_prefills(q, layer, att)
        return att

    def attend_prefills(self, q: torch.Tensor, layer: int, att: torch.Tensor) -> None:
        """The long segments' attention outputs at `layer`, through SDPA, written into att [heads, n, D] (the
        Python loop's; the native decoder's kernel attends them as it does every row)."""
        for j, (end, mask) in self.flash.items():
            segment, rows = self.segments[j], self.rows[j]
            att[:, rows] = F.scaled_dot_product_attention(
                q[None, :, rows], segment.keys[layer][None, :, :end], segment.values[layer][None, :, :end],
                attn_mask=mask, is_causal=mask is None, enable_gqa=True)[0]

    def _group(self, queries: torch.Tensor, group: _Group, layer: int) -> torch.Tensor:
        segments = [self.segments[j] for j in group.members]
        if segments[0].branches is not None:  # the tree's branch caches, a view: no copy
            keys, values = segments[0].keys[layer][: group.batch], segments[0].values[layer][: group.batch]
        elif len(segments) == 1:
            keys, values = segments[0].keys[layer][None], segments[0].values[layer][None]
        else:
            keys = _padded_stack([s.keys[layer] for s in segments], group.hidden.shape[-1])
            values = _padded_stack([s.values[layer] for s in segments], group.hidden.shape[-1])
        return self.forward.masked_attention(queries, keys, values, group.hidden)


def _padded_stack(caches: list[torch.Tensor], length: int) -> torch.Tensor:
    """Caches [kv_heads, L_i, D] stacked [n, kv_heads, length, D], each padded after its slots with zeros,
    which no row sees (its visibility ends at its own slots) and whose zero values keep the masked weights'
    products 0."""
    if all(cache.shape[1] == length for cache in caches):
        return torch.stack(caches)
    out = caches[0].new_zeros(len(caches), caches[0].shape[0], length, caches[0].shape[2])
    for i, cache in enumerate(caches):
        out[i, :, : cache.shape[1]] = cache
    return out


_FORWARDS: weakref.WeakKeyDictionary[PreTrainedModel, dict] = weakref.WeakKeyDictionary()
# Sequences starting together on their own threads (a batched server's) must share one forward per model:
# a batcher tells models apart by their forward, and a second one would also hold a second packed copy.
_FORWARDS_LOCK = threading.Lock()


def _weights_version(model: PreTrainedModel) -> tuple[int, ...]:
    """Changes whenever a parameter is modified in place (training, a reload), so stale copies are rebuilt."""
    return tuple(p._version for p in model.parameters())


def llama_forward(model: PreTrainedModel, compiled: bool = False) -> tuple[LlamaForward, nn.Module]:
    """The lean forward for `model` (eager) and the one its fixed-width passes run (compiled or the same
    eager module), built once per model: compiling takes a minute or two, once a process, and every
    caller (plain decoding, feature-reading drafters) shares the one graph, so they round alike."""
    version = _weights_version(model)
    with _FORWARDS_LOCK:
        entry = _FORWARDS.get(model)
        if entry is None or entry["version"] != version:
            entry = {"version": version, "eager": LlamaForward(model).eval()}
            _FORWARDS[model] = entry
        if not compiled:
            return entry["eager"], entry["eager"]
        if "compiled" not in entry:
            entry["compiled"] = torch.compile(entry["eager"], options=INDUCTOR_OPTIONS)
        return entry["eager"], entry["compiled"]
