"""DEL: the target drafts for itself with its first layers and a light exit head (arXiv 2504.05598).

No second model. A draft token runs the target's first e decoder layers (e, the exit layer, is one
of a few candidates) on the newest token and maps the output of layer e through that layer's exit
head to logits over a reduced draft vocabulary (FR-Spec, as the draft LM's: the full 49k-row head
would cost more than the layers). SmolLM2 was not trained for early exit, so the heads are trained
(specops.train.train_exit): each is an identity-initialized linear adapter, an RMSNorm and the
target's LM-head rows of the draft vocabulary, distilled from the target's top-k.

Cache. On the static runtime (specops.core.kv.StaticLM) the drafter reads and writes the target's
own per-layer K/V: the committed prefix's early-layer keys are the ones verification wrote, so a draft
pass costs e layers over one token and nothing is recomputed. Draft passes write only at slots >= the
committed length (the last committed token, then the drafts), and the next verification pass writes
every one of those slots before any row can see them, so the output stays bitwise plain decoding's.
On the dynamic runtime (or unshared, e.g. in PEARL's thread) it keeps its own early-layer cache,
filled from the committed tokens.

Adaptive exit (DEL's rule). After each verification the drafter sees the target's features at the
committed tokens for every candidate layer (the verify pass computes them anyway) and the target's
next token there; each layer's exit head is scored on them (one candidate per step, in turn, so the
scoring costs one head per step), which tracks each layer's acceptance rate alpha_e, starting from
the agreement measured on the validation traces. Each step then drafts from the (e, k) maximizing
expected tokens per unit of time,

    (1 + alpha_e + ... + alpha_e^k) / (verify + k * token_e),

k = 0 (plain decoding) included, where verify is a verification pass's time and token_e a drafted
token's from layer e (its e layers over one token and its head), both measured once on this machine
when the factory builds the drafter (`measure_exit_costs`), since their ratio depends on the runtime: a
drafted token runs eagerly, one small op at a time, so against a compiled verification it costs more
(SmolLM2 bf16, 2 threads: a token from layer 2 at 0.09 of an eager verification pass, 0.11 of a
compiled one). A fixed exit layer keeps the same length rule on its one layer.
"""

from __future__ import annotations

import copy
import json
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from specops.core.cost_model import median_seconds, timing_ids
from specops.core.drafter import Draft, DrafterBase, TokenStop, refuse_stop
from specops.core.kv import CachedLM, StaticLM, storage_bytes
from specops.core.llama import LlamaForward, llama_forward, rms_norm
from specops.core.packed_linear import linear, pack
from specops.core.policies import expected_tokens
from specops.core.sampling import Randomness, argmax, draw, expand_draft_vocab, logits_to_probs
from specops.core.types import SamplingParams, static_cache_length

CHOICES_KEPT = 4096  # DEL's recent (exit layer, k) choices kept for reports and tests: a server slot runs for days
PackedHead = tuple[torch.Tensor | None, torch.Tensor | None]  # an exit head's adapter and rows, packed

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class ExitHeadsConfig:
    """config.json of an exit-heads folder."""

    hidden_size: int
    exit_layers: list[int]  # decoder layers run before each head (e: the output of layer e - 1 feeds it)
    num_target_layers: int
    rms_norm_eps: float = 1e-5
    # Each head's top-1 agreement with the target on the validation traces: the tracker's starting point.
    prior_acceptance: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.exit_layers or sorted(set(self.exit_layers)) != list(self.exit_layers):
            raise ValueError(f"exit_layers must be ascending and distinct, got {self.exit_layers}.")
        if not (self.exit_layers[0] > 0 and self.exit_layers[-1] < self.num_target_layers):
            raise ValueError(f"exit_layers must lie in 1..{self.num_target_layers - 1}, got {self.exit_layers}.")
        if not self.prior_acceptance:
            self.prior_acceptance = [0.0] * len(self.exit_layers)
        if len(self.prior_acceptance) != len(self.exit_layers):
            raise ValueError("prior_acceptance needs one rate per exit layer.")


class ExitHeads(nn.Module):
    """One head per exit layer: hidden [..., H] -> logits [..., N] over the draft vocabulary `vocab` [N]
    (column j is target id vocab[j]). h' = h + A h (A zero at init), then RMSNorm, then the LM-head rows."""

    def __init__(self, config: ExitHeadsConfig, vocab: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        h, n, heads = config.hidden_size, len(vocab), len(config.exit_layers)
        self.register_buffer("vocab", vocab.to(torch.long).clone())
        self.adapters = nn.ParameterList(nn.Parameter(torch.zeros(h, h)) for _ in range(heads))
        self.norms = nn.ParameterList(nn.Parameter(torch.ones(h)) for _ in range(heads))
        self.rows = nn.ParameterList(nn.Parameter(torch.zeros(n, h)) for _ in range(heads))

    def forward(self, hidden: torch.Tensor, index: int, packed: PackedHead = (None, None)) -> torch.Tensor:
        """hidden [..., H] after exit layer `config.exit_layers[index]` -> draft-vocabulary logits [..., N];
        `packed`: `pack_head(index)`, the same products faster when drafting in bf16."""
        h = hidden + linear(hidden, self.adapters[index], packed[0])
        return linear(rms_norm(h, self.norms[index], self.config.rms_norm_eps), self.rows[index], packed[1])

    def predict(self, hidden: torch.Tensor, index: int, packed: PackedHead = (None, None)) -> torch.Tensor:
        """The target id [...] of head `index`'s most likely draft token at each row of `hidden` [..., H]."""
        return self.vocab[argmax(self(hidden, index, packed))]

    def pack_head(self, index: int) -> PackedHead:
        """Head `index`'s adapter and rows packed for drafting (specops.core.packed_linear); stale once they change."""
        return pack(self.adapters[index]), pack(self.rows[index])

    @classmethod
    def from_target(cls, model: PreTrainedModel, exit_layers: list[int], vocab: torch.Tensor) -> ExitHeads:
        """Heads that start as the target's own final norm and LM head (the adapter is zero): what the
        untrained early exit of the issue scores (4-8% agreement on SmolLM2)."""
        cfg = model.config
        config = ExitHeadsConfig(cfg.hidden_size, list(exit_layers), cfg.num_hidden_layers, float(cfg.rms_norm_eps))
        heads = cls(config, vocab)
        with torch.no_grad():
            for norm, rows in zip(heads.norms, heads.rows, strict=True):
                norm.copy_(model.model.norm.weight.float())
                rows.copy_(model.lm_head.weight[vocab].float())
        return heads

    def save(self, out_dir: Path | str) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({name: t.detach().float().contiguous() if t.is_floating_point() else t.contiguous()
                   for name, t in self.state_dict().items()}, str(out / WEIGHTS_FILE))
        (out / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        return out

    @classmethod
    def load(cls, folder: Path | str, dtype: torch.dtype = torch.float32) -> ExitHeads:
        folder = Path(folder)
        if not (folder / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"{folder} has no {CONFIG_FILE}: pass train_exit's output folder (models/exit_heads).")
        config = ExitHeadsConfig(**json.loads((folder / CONFIG_FILE).read_text()))
        state = load_file(str(folder / WEIGHTS_FILE))
        heads = cls(config, state["vocab"])
        heads.load_state_dict(state)
        return heads.to(dtype).eval()


# Before a measurement (a drafter built by hand, as in the tests): costs in the time of one decoder layer run
# for one drafted token, from this repo's documented timings of SmolLM2-135M (bf16, static runtime, width 5,
# 2-core CPU): a pass of up to 5 rows ~22 ms, of which the 49k-row LM head ~2.3 ms, so a layer ~0.65 ms,
# an 8192-row exit head ~0.4 ms (0.6 layers) and a verification ~34 layers: a token from layer 2 at 0.076
# of a verification, where `measure_exit_costs` found 0.09 eager and 0.11 compiled.
NOMINAL_LAYER, NOMINAL_HEAD, NOMINAL_VERIFY = 1.0, 0.6, 34.0


@dataclass(frozen=True)
class ExitCosts:
    """What DEL's choice weighs, in one unit (seconds when measured): a verification pass, and one drafted
    token from each exit layer of the heads (its first layers over one token, then its head)."""

    verify: float
    token: tuple[float, ...]  # per exit layer, in the heads' order

    @classmethod
    def nominal(cls, exit_layers: list[int]) -> ExitCosts:
        return cls(NOMINAL_VERIFY, tuple(e * NOMINAL_LAYER + NOMINAL_HEAD for e in exit_layers))


def choose_exit(alphas: list[float], token_costs: list[float], verify: float, max_k: int) -> tuple[int, int]:
    """DEL's choice: (candidate index, draft length) maximizing expected tokens per unit of time, a step
    drafting k tokens from candidate i costing `verify + k * token_costs[i]`. k = 0 is plain decoding (its
    index is then meaningless); ties go to the shorter draft and the earlier candidate."""
    best, choice = 1.0 / verify, (0, 0)
    for index, (alpha, per_token) in enumerate(zip(alphas, token_costs, strict=True)):
        for k in range(1, max_k + 1):
            rate = expected_tokens(alpha, k) / (verify + k * per_token)
            if rate > best:
                best, choice = rate, (index, k)
    return choice


class AcceptanceTracker:
    """Each candidate layer's acceptance rate: agreements seen (exponentially forgotten, so it follows the
    current request) plus `weight` pseudo-observations at the validation prior."""

    def __init__(self, prior: list[float], weight: float = 16.0, decay: float = 0.97) -> None:
        self.prior, self.weight, self.decay = list(prior), weight, decay
        self.reset()

    def reset(self) -> None:
        self.hits = [0.0] * len(self.prior)
        self.seen = [0.0] * len(self.prior)

    def update(self, index: int, agree: torch.Tensor) -> None:
        """agree [n] bool: did layer `index`'s head predict the target's next token at each committed row."""
        n = agree.numel()
        self.hits[index] = self.hits[index] * self.decay ** n + float(agree.sum())
        self.seen[index] = self.seen[index] * self.decay ** n + n

    def rates(self) -> list[float]:
        return [(h + self.weight * p) / (s + self.weight) for h, s, p in zip(self.hits, self.seen, self.prior, strict=True)]


class EarlyCache:
    """The early layers' K/V the drafter writes and reads: the target's own (a static runtime shared by
    `share`), or a private one grown on demand and filled from the committed tokens."""

    def __init__(self, forward: LlamaForward, layers: int) -> None:
        self.forward, self.layers = forward, layers
        self.shared: StaticLM | None = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.cos = self.sin = torch.empty(0)
        self.cached: list[int] = []  # private cache: tokens whose K/V it holds, slot t for token t

    def share(self, lm: StaticLM) -> None:
        self.shared = lm
        self.keys, self.values = lm.keys, lm.values
        self.cos, self.sin = lm.tables

    def ready(self, context: list[int], room: int) -> int:
        """Make the K/V of every committed token but the last available; return their count (the slot
        the last committed token is written at). `room`: slots the draft will write from there."""
        committed = len(context) - 1
        if self.shared is not None:
            if self.shared.length != committed:
                raise RuntimeError(f"The target's cache holds {self.shared.length} tokens, the context {committed} "
                                   "committed before its last: DEL drafts between verification passes only.")
            return committed
        self._grow(committed + room)
        common = 0
        while common < min(len(self.cached), committed) and self.cached[common] == context[common]:
            common += 1
        if common < committed:
            self.forward.early(torch.tensor(context[common:committed]), torch.arange(common, committed),
                               self.keys, self.values, self.cos, self.sin, self.layers)
        self.cached = context[:committed]
        return committed

    def _grow(self, need: int) -> None:
        length = self.keys[0].shape[1] if self.keys else 0
        if need <= length:
            return
        size = max(256, 2 * length, need)
        keys, values = self.forward.new_cache(size)
        for i in range(len(self.keys)):
            keys[i][:, :length] = self.keys[i]
            values[i][:, :length] = self.values[i]
        self.keys, self.values = keys[: self.layers], values[: self.layers]
        self.cos, self.sin = self.forward.tables(size)


class DELDrafter(DrafterBase):
    """The target's first layers plus an exit head; the exit layer fixed or chosen per step (DEL)."""

    name = "del"

    def __init__(self, target_model: PreTrainedModel, heads: ExitHeads, exit_layer: int = 0,
                 costs: ExitCosts | None = None, tracker_weight: float = 16.0) -> None:
        """`exit_layer` 0 adapts the layer per step; otherwise one of the heads' exit layers, fixed. `costs`:
        measured ones (`measure_exit_costs`, as the factory does), else the nominal ones."""
        cfg = heads.config
        if cfg.num_target_layers != target_model.config.num_hidden_layers or cfg.hidden_size != target_model.config.hidden_size:
            raise ValueError(f"The exit heads were trained for a {cfg.num_target_layers}-layer target of hidden size "
                             f"{cfg.hidden_size}; this one has {target_model.config.num_hidden_layers} and "
                             f"{target_model.config.hidden_size}.")
        if exit_layer and exit_layer not in cfg.exit_layers:
            raise ValueError(f"No exit head after layer {exit_layer}; trained exit layers: {cfg.exit_layers}.")
        self.heads = heads.to(target_model.dtype).eval().requires_grad_(False)  # drafting only: packed products
        self.packed = [self.heads.pack_head(i) for i in range(len(cfg.exit_layers))]
        self.vocab_size = target_model.config.vocab_size
        self.candidates = [cfg.exit_layers.index(exit_layer)] if exit_layer else list(range(len(cfg.exit_layers)))
        self.costs = costs or ExitCosts.nominal(cfg.exit_layers)
        self.hidden_layers = [cfg.exit_layers[i] - 1 for i in self.candidates]  # the verify pass captures them
        self.tracker = AcceptanceTracker([cfg.prior_acceptance[i] for i in self.candidates], tracker_weight)
        self.forward = llama_forward(target_model)[0]
        self.cache = EarlyCache(self.forward, max(cfg.exit_layers[i] for i in self.candidates))
        self._turn = 0  # the candidate scored at the next verification
        self._target_next: torch.Tensor | None = None
        self.choices: deque[tuple[int, int]] = deque(maxlen=CHOICES_KEPT)  # (exit layer, k) of recent drafted steps

    def __copy__(self) -> DELDrafter:
        """A fork (one per server generation slot) with its own tracker, cache and choices: a rejection-
        sampled request's draft lengths must not depend on the other requests. Heads and costs are shared."""
        twin = object.__new__(DELDrafter)
        twin.__dict__.update(self.__dict__)
        twin.tracker = copy.deepcopy(self.tracker)
        twin.cache = EarlyCache(self.forward, self.cache.layers)
        twin.choices = deque(maxlen=CHOICES_KEPT)
        return twin

    def reset(self) -> None:
        self.cache = EarlyCache(self.forward, self.cache.layers)
        self.tracker.reset()
        self._turn, self._target_next = 0, None

    @property
    def peak_kv_bytes(self) -> int:  # type: ignore[override]
        """Its private early-layer cache, which only grows (none while it drafts in the target's cache)."""
        if self.cache.shared is not None:
            return 0
        return storage_bytes((*self.cache.keys, *self.cache.values))

    def share_runtime(self, lm: CachedLM | StaticLM) -> None:
        """Draft into the target's own static cache. A dynamic cache, or a static one whose passes a batcher
        runs with other sequences', is not shared: the private early-layer cache stays."""
        if isinstance(lm, StaticLM) and lm.batcher is None:
            self.cache.share(lm)

    def choose(self, max_k: int) -> tuple[int, int]:
        """(candidate, draft length) for this step from the tracked rates."""
        tokens = [self.costs.token[i] for i in self.candidates]
        index, k = choose_exit(self.tracker.rates(), tokens, self.costs.verify, max_k)
        return self.candidates[index], k

    def propose(self, context: list[int], k: int, sampling: SamplingParams, generator: Randomness,
                stop: TokenStop | None = None) -> Draft:
        refuse_stop(self, stop)
        if self.cache.shared is not None:
            k = min(k, self.cache.shared.width - 1)
        head, k = self.choose(k)
        if k == 0:
            return Draft(tokens=[])
        self.choices.append((self.heads.config.exit_layers[head], k))
        start = self.cache.ready(context, k)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        token = context[-1]
        for j in range(k):  # slot start + j: the last committed token, then the drafts (verification rewrites them)
            logits = self.token_logits(self.cache, token, start + j, head)
            if sampling.greedy:
                token = int(argmax(logits))
            else:
                probs = logits_to_probs(logits, sampling)
                rows.append(probs)
                token = draw(probs, generator, j)
            tokens.append(token)
        return Draft(tokens=tokens, q=torch.stack(rows) if rows else None)

    def token_logits(self, cache: EarlyCache, token: int, slot: int, head: int) -> torch.Tensor:
        """One drafted token's logits [V]: `token` at `slot` through the first layers of exit head `head`
        (writing their K/V in `cache`), then the head."""
        layers = self.heads.config.exit_layers[head]
        hidden = self.forward.early(torch.tensor([token]), torch.tensor([slot]), cache.keys, cache.values,
                                    cache.cos, cache.sin, layers)[0, -1]  # [H]
        return expand_draft_vocab(self.heads(hidden, head, self.packed[head]), self.heads.vocab, self.vocab_size)

    def observe(self, tokens: list[int], logits: torch.Tensor) -> None:
        self._target_next = argmax(logits)  # [n]: the target's next token after each row of the pass

    def observe_features(self, features: torch.Tensor) -> None:
        """features [n, C, H] at the committed rows of the last pass: score one candidate's head on them."""
        if self._target_next is None:  # the prompt's features: no target prediction to score them against
            return
        target_next, self._target_next = self._target_next[: features.shape[0]], None
        slot = self._turn % len(self.candidates)
        self._turn += 1
        head = self.candidates[slot]
        self.tracker.update(slot, self.heads.predict(features[:, slot], head, self.packed[head]) == target_next)


def measure_exit_costs(drafter: DELDrafter, target_model: PreTrainedModel, width: int, compiled: bool = False,
                       context_tokens: int = 64, repeats: int = 5) -> ExitCosts:
    """Seconds, on this machine, of a verification pass as the runtime runs it (`width` rows on the static
    runtime, compiled or not, reading the drafter's feature layers; on the dynamic runtime, width 0, a pass
    over 2 tokens) and of one drafted token from each exit layer as `propose` runs it, after
    `context_tokens` tokens. Medians of `repeats` runs (specops.core.cost_model.median_seconds)."""
    context = timing_ids(context_tokens)
    with torch.inference_mode():
        lm: CachedLM | StaticLM
        if width:
            length = static_cache_length(context_tokens, 0, width)
            lm = StaticLM(target_model, width, length, drafter.hidden_layers, compiled)
        else:
            lm = CachedLM(target_model, drafter.hidden_layers)
        lm.prefill(context)
        rows = timing_ids(width or 2)
        verify = median_seconds(lambda: lm.forward(rows), lambda: lm.crop(context_tokens), repeats)
        cache = EarlyCache(drafter.forward, max(drafter.heads.config.exit_layers))
        start = cache.ready(context, 1)
        token = tuple(median_seconds(lambda i=i: argmax(drafter.token_logits(cache, context[-1], start, i)),
                                     lambda: None, repeats)
                      for i in range(len(drafter.heads.config.exit_layers)))
    return ExitCosts(verify, token)


def load_del_drafter(folder: Path | str, target_model: PreTrainedModel, exit_layer: int = 0) -> DELDrafter:
    return DELDrafter(target_model, ExitHeads.load(folder, target_model.dtype), exit_layer)
