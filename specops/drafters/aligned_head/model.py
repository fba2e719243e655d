"""A GRIFFIN-style aligned draft head: one decoder layer that drafts from the target's own features.

EAGLE family (EAGLE arXiv 2401.15077, EAGLE-2 2406.16858, EAGLE-3 2503.01840, GRIFFIN 2502.11018).
At position t the head sees what the target computed there and the token that followed:

    target features f_t [L*H] --fc--> x_t [H]                  (EAGLE-3: several layers fused)
    next token x_{t+1} --target's embedding--> e [H]
    x = x + TGF(x, e)                                          (GRIFFIN token-guided fusion, optional)
    h = x + attn(cat(norm(e), norm(x)))                        (EAGLE-3 layer: q/k/v read 2H)
    a = act(gate(norm(h))) * up(norm(h))
    token branch   h + down(a)  --norm--> lm_head --> logits for x_{t+2} over the draft vocabulary
    feature branch h + down_f(a) --> g_{t+1}, stands in for x_{t+1} at the next drafting step
                                  (GRIFFIN token-enhanced head; without it both branches are one)

Drafting k tokens runs the layer once on the verified positions (true features) and then k-1 more
times on its own feature outputs, with its own small KV cache. Training unrolls the same steps in
parallel (`unroll`, the "training-time test" of EAGLE-3/GRIFFIN).

The draft vocabulary is the target's N most frequent tokens (EAGLE-3, FR-Spec arXiv 2502.14856):
`d2t[i]` is the offset from draft id i to its target id and `t2d` marks target ids in the draft
vocabulary, the layout vLLM and SGLang load. Without it (draft_vocab_size None) the logits go
through the target's frozen LM head. The head has the target's width and reads the target's token
embeddings, so neither embeddings nor a full-vocabulary head are stored with it.

Weights are safetensors with EAGLE-3's names (fc, midlayer.*, norm, lm_head, d2t, t2d); the GRIFFIN
additions are `tgf.*` and `midlayer.feature_down_proj`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specops.core.sampling import expand_draft_vocab

KIND = "aligned_head"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1


@dataclass
class AlignedHeadConfig:
    """Shapes of an aligned head; written to config.json next to the weights."""

    hidden_size: int  # the target's hidden size (the head reads its embeddings, so it has its width)
    target_vocab_size: int
    hidden_layers: list[int]  # target decoder layers whose outputs are fused, specops.data.traces convention
    num_target_layers: int  # the target's decoder layers (the export converts layer indices with it)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    draft_vocab_size: int | None = None  # None: logits through the target's LM head
    token_guided_fusion: bool = True
    token_enhanced_head: bool = True

    def __post_init__(self) -> None:
        if not self.hidden_layers:
            raise ValueError("An aligned head needs at least one target hidden layer to read.")
        bad = [layer for layer in self.hidden_layers if not 0 <= layer < self.num_target_layers]
        if bad:
            raise ValueError(f"hidden_layers {bad} are outside the target's {self.num_target_layers} decoder layers.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}.")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.target_vocab_size}, got {self.draft_vocab_size}.")

    @property
    def feature_size(self) -> int:
        return len(self.hidden_layers) * self.hidden_size


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Llama's default RoPE: (cos, sin) [T, head_dim] for integer positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, hd/2]
        angles = torch.cat([angles, angles], dim=-1)  # [T, hd]
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd] rotated by position (rotate-half form, as Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention whose q/k/v read 2H (token embedding and feature side by side)."""

    def __init__(self, cfg: AlignedHeadConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape  # x [B, T, 2H]
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, T, hd]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [B, nh, T, hd], k/v [B, nkv, S, hd], visible [T, S] bool -> [B, T, H]."""
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, nh, S, hd]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)  # [B, nh, T, hd]
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, h: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, inner, bias=False)
        self.up_proj = nn.Linear(h, inner, bias=False)
        self.down_proj = nn.Linear(inner, h, bias=False)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.gate_proj(x)) * self.up_proj(x)


class TokenGuidedFusion(nn.Module):
    """GRIFFIN's token-guided fusion: the next token's embedding corrects the (possibly self-generated)
    feature before the layer reads it, x + down(silu(up(cat(norm(x), norm(e))))).

    down_proj starts at zero, so a fresh TGF is the identity and the head starts as plain EAGLE-3."""

    def __init__(self, cfg: AlignedHeadConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.feature_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.token_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.up_proj = nn.Linear(2 * h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        nn.init.zeros_(self.down_proj.weight)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(F.silu(self.up_proj(torch.cat([self.feature_norm(x), self.token_norm(e)], -1))))


class DecoderLayer(nn.Module):
    """EAGLE-3's draft layer (vLLM/SGLang `midlayer`, norm_before_residual = False), plus GRIFFIN's
    token-enhanced head: a second down projection whose output is the feature for the next step."""

    def __init__(self, cfg: AlignedHeadConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)  # on the feature
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.feature_down_proj = nn.Linear(cfg.intermediate_size, h, bias=False) if cfg.token_enhanced_head else None

    def qkv(self, x: torch.Tensor, e: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.project(torch.cat([self.input_layernorm(e), self.hidden_norm(x)], dim=-1), cos, sin)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual + MLP: (token branch, feature branch), each [B, T, H] before the final norm."""
        h = x + attn
        inner = self.mlp.inner(self.post_attention_layernorm(h))
        token = h + self.mlp.down_proj(inner)
        feature = h + self.feature_down_proj(inner) if self.feature_down_proj is not None else token
        return token, feature


class HeadCache:
    """The head's keys and values, one entry per drafted-from position: [1, nkv, S, hd]."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        if self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def unroll_attention_mask(length: int, step: int) -> torch.Tensor:
    """Which keys a query sees at unrolled step `step`: [T, (step+1)*T] bool over the keys of steps 0..step.

    Step j at position t continues a draft that began from the true features up to t-j: it sees
    step 0's keys at positions <= t-j and, for 1 <= i <= j, step i's key at position t-j+i, exactly
    the cache a drafter holds after j drafting steps from position t-j.
    """
    t = torch.arange(length)
    blocks = [t[None, :] <= t[:, None] - step]
    blocks += [t[None, :] == t[:, None] - step + i for i in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


class AlignedHead(nn.Module):
    def __init__(self, cfg: AlignedHeadConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.feature_size, cfg.hidden_size, bias=False)
        self.tgf = TokenGuidedFusion(cfg) if cfg.token_guided_fusion else None
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        n = cfg.draft_vocab_size
        self.lm_head = nn.Linear(cfg.hidden_size, n, bias=False) if n is not None else None
        if n is not None:
            self.register_buffer("d2t", torch.zeros(n, dtype=torch.long))  # target id = draft id + d2t
            self.register_buffer("t2d", torch.zeros(cfg.target_vocab_size, dtype=torch.bool))

    def set_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Install the draft vocabulary: draft id i is target id draft_to_target[i] (ascending, unique)."""
        ids = draft_to_target.long()
        if self.lm_head is None or ids.shape != self.d2t.shape:
            raise ValueError(f"This head's draft vocabulary has {self.config.draft_vocab_size} tokens; got {ids.numel()}.")
        if not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= self.config.target_vocab_size:
            raise ValueError("Draft vocabulary ids must be ascending, unique target ids.")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """[N] target id of each draft id, or None when the head uses the target's vocabulary."""
        return None if self.lm_head is None else torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., L, H] -> x [..., H]."""
        return self.fc(features.flatten(-2).to(self.fc.weight.dtype))

    def _guide(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.tgf(x, e) if self.tgf is not None else x

    def step(self, x: torch.Tensor, e: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
             cache: HeadCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Inference: x, e [1, T, H] at `positions` [T]; appends T cache entries; `visible` [T, S] over the
        cache after appending. Returns (token branch, feature branch), each [1, T, H]."""
        x = self._guide(x, e)
        cos, sin = self.rotary(positions)
        q, k, v = self.midlayer.qkv(x, e, cos, sin)
        keys, values = cache.append(k, v)
        return self.midlayer.finish(x, self.midlayer.self_attn.attend(q, keys, values, visible))

    def unroll(self, x0: torch.Tensor, e: torch.Tensor, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Training-time test: `steps` drafting steps at every position in parallel.

        x0 [B, T, H] are the fused true features, e [B, T, H] the next tokens' embeddings. Step j at
        position t reads the feature that step j-1 produced at t-1 (so for t < j there is no such
        draft; those outputs are meaningless and must be masked by the caller). Returns per step the
        (token branch, feature branch) [B, T, H].
        """
        B, T, _ = x0.shape
        cos, sin = self.rotary(torch.arange(T, device=x0.device))
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        x = x0
        for j in range(steps):
            guided = self._guide(x, e)
            q, k, v = self.midlayer.qkv(guided, e, cos, sin)
            keys.append(k)
            values.append(v)
            visible = unroll_attention_mask(T, j).to(x0.device)
            attn = self.midlayer.self_attn.attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), visible)
            token, feature = self.midlayer.finish(guided, attn)
            outputs.append((token, feature))
            # The next step continues each chain one position on. Detached, as GRIFFIN feeds its
            # q_hidden_states: a step learns from its inputs without back-propagating down the chain.
            x = torch.cat([x0[:, :1], feature[:, :-1].detach()], dim=1)
        return outputs

    def logits(self, token_branch: torch.Tensor, target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """[..., H] -> logits over the draft vocabulary [..., N] (or the target's, [..., V])."""
        hidden = self.norm(token_branch)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if target_lm_head is None:
            raise ValueError("This head has no draft vocabulary: pass the target's LM head weight to logits().")
        return F.linear(hidden, target_lm_head.to(hidden.dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.lm_head is None else draft_ids + self.d2t[draft_ids]

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., N] -> target-vocabulary logits [..., V], -inf outside the draft vocabulary."""
        if self.lm_head is None:
            return logits
        return expand_draft_vocab(logits, self.draft_to_target, self.config.target_vocab_size)


def save_head(head: AlignedHead, out_dir: Path | str) -> Path:
    """config.json + model.safetensors (contiguous float tensors; nothing pickled)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in head.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"kind": KIND})
    config = {"kind": KIND, "format_version": FORMAT_VERSION, **asdict(head.config)}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_head_config(path: Path | str) -> AlignedHeadConfig:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE}: it is not an aligned head folder.")
    data: dict[str, Any] = json.loads(file.read_text())
    if data.pop("kind", None) != KIND or data.pop("format_version", None) != FORMAT_VERSION:
        raise ValueError(f"{file} is not an aligned head config (kind '{KIND}', format_version {FORMAT_VERSION}).")
    known = {f.name for f in fields(AlignedHeadConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{file} has unknown key(s) {', '.join(unknown)}: written by a newer specops?")
    return AlignedHeadConfig(**data)


def load_head(path: Path | str) -> AlignedHead:
    """The head saved in `path`, in float32 and eval mode; refuses missing or unexpected tensors."""
    head = AlignedHead(read_head_config(path))
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{path} has no {WEIGHTS_FILE}.")
    missing, unexpected = head.load_state_dict(load_file(str(weights)), strict=False)
    if missing or unexpected:
        raise ValueError(f"{weights} does not fit its config.json: missing {missing}, unexpected {unexpected}.")
    return head.eval()
