"""An independent draft LM with its own KV cache, sharing the target's vocabulary.

With an acceptance head (SpecDec++, arXiv 2405.19715) it can end a draft early: `propose` then
scores each drafted token and asks a `stop` rule whether to go on.

As `draft-lm-tree` it grows EAGLE-2's dynamic tree (specops.drafters.dynamic_tree) instead of a chain:
a level's best nodes run through the draft in one masked forward pass, and the target verifies the tree
in one pass too. The first draft token is the target's top-1 far more often among the draft's top-4
than as its top-1 alone (SpecInfer's and Sequoia's case for token trees from small LMs).

With a draft vocabulary (FR-Spec, arXiv 2502.14856; train_draft.draft_vocab_size) the draft proposes
only the N most frequent tokens of its training data: its LM head runs on those N rows. On a CPU the
full 49k-row head of a SmolLM2-sized draft is most of a draft step. The other tokens get logit -inf, so
q is still a distribution over the target's vocabulary and every verifier stays lossless. The model
folder keeps the full head, so Hugging Face code (assisted generation) loads it unchanged.

With a window (LongSpec, arXiv 2502.17421; StreamingLLM's attention sinks, arXiv 2309.17453) drafting
stays cheap and in distribution as the context grows: the draft's cache holds at most `window` tokens,
the context's first `sinks` tokens and its most recent ones, at positions 0..window-1. The draft was
trained on sequences of a few hundred tokens (train_draft's max_seq_len), so a window no longer than
that keeps it at positions it has seen, where a full cache would run it at thousands. A long prompt is
prefilled into the draft as its sinks and its last tokens only; when the window fills, its oldest
tokens after the sinks are dropped and the rest move to earlier positions (their keys re-rotated,
specops.core.kv.shift_positions), a quarter window at a time so eviction is rare. The draft's memory
and its cost per token are then bounded by the window, whatever the prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from specops.core.batching import PassBatcher, batch_invariant
from specops.core.drafter import Draft, DrafterBase, TokenStop
from specops.core.kv import CachedLM, StaticLM, rotary_frequencies, storage_bytes
from specops.core.llama import UnsupportedModelError, llama_forward, rms_norm
from specops.core.packed_linear import linear, pack
from specops.core.sampling import Randomness, argmax, draw, expand_draft_vocab, logits_to_probs
from specops.core.small_batch_linear import use_small_batch_linear
from specops.core.types import DEFAULT_PREFILL_CHUNK, SamplingParams, static_cache_length
from specops.drafters.acceptance_head import AcceptanceHead
from specops.drafters.dynamic_tree import Children, TreeNode, grow_nodes, select_best, top_children

VOCAB_FILE = "draft_vocab.safetensors"
# A full draft window drops this fraction of its non-sink tokens beyond what the step needs: eviction (a
# re-rotation and copy of the window's keys) then happens once every window/4 tokens or so, not every step.
EVICT_FRACTION = 4
# Most tokens a batched draft pass takes for one sequence (the last accepted tokens and the bonus token);
# a longer feed runs alone (StaticDraftLM).
DRAFT_PASS_ROWS = 8


class VocabularyMismatchError(ValueError):
    pass


def save_draft_vocab(out_dir: Path, vocab: torch.Tensor) -> None:
    save_file({"draft_to_target": vocab.to(torch.int64).contiguous()}, str(out_dir / VOCAB_FILE))


def load_draft_vocab(model_dir: Path | str) -> torch.Tensor | None:
    """The target ids a draft may propose (ascending [N]), or None when it drafts over the whole vocabulary."""
    path = Path(model_dir) / VOCAB_FILE
    return load_file(str(path))["draft_to_target"] if path.is_file() else None


def load_draft_model(model_dir: Path | str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A draft LM folder's model in eval mode (the full head kept, so Hugging Face code can use it).

    In float32 its linear layers are specops.core.small_batch_linear's, as the target's are: a tree level
    runs a few rows through the draft, and HF assisted generation loads the draft here too, so every
    method in a benchmark drafts on the same kernels."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"Draft model folder {model_dir} has no config.json; pass a Hugging Face model folder.")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if dtype == torch.float32:
        use_small_batch_linear(model)
    return model


def load_draft(model_dir: Path | str, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, torch.Tensor | None]:
    """A draft LM and its draft vocabulary; pass the target's dtype, since a bf16 target wants a bf16 draft."""
    return load_draft_model(model_dir, dtype), load_draft_vocab(model_dir)


def vocab_logits(hidden: torch.Tensor, head_rows: torch.Tensor, vocab: torch.Tensor, vocab_size: int,
                 packed: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [..., H], the LM head's rows for the draft vocabulary [N, H] (and `pack(head_rows)`, the same
    product faster in bf16) -> logits [..., vocab_size], -inf outside the draft vocabulary."""
    return expand_draft_vocab(linear(hidden, head_rows, packed), vocab, vocab_size)


def draft_head(model: PreTrainedModel, vocab: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The draft's LM head as drafting uses it: last hidden states [..., H] -> logits [..., V] over the
    target's vocabulary, -inf outside the draft vocabulary when it has one (whose rows alone were trained)."""
    head = model.get_output_embeddings()
    if vocab is None:
        return head
    rows = head.weight[vocab].detach()
    packed = pack(rows)
    return lambda hidden: vocab_logits(hidden, rows, vocab, head.weight.shape[0], packed)


class StaticDraftLM:
    """The draft model on the static runtime, for a target on it. With the target's batcher its passes are
    batched on the pass thread with every other sequence's (specops.core.batching): one weight read and one
    pass's Python for all the sequences' draft tokens, and no drafting on the generation threads, where it
    competed for the cores with the batched target passes. Without one it runs the same lean forward on
    this thread, so a sampled request drafts the same distributions in a one-at-a-time server, the CLI and a
    batched server (its rows do not depend on the batch: batch_invariant). The cache grows by reallocation
    as the sequence grows, which depends only on the sequence itself. Chains only, no window."""

    ROOM = 256  # slots added beyond the need at each (re)allocation: the cache is rebuilt every ROOM tokens or so

    def __init__(self, model: PreTrainedModel, batcher: PassBatcher | None, width: int, chunk: int) -> None:
        """`width`: the most tokens of one (batched) pass; a longer feed runs alone, in passes of at most
        `chunk` tokens (a batched sequence waits for each, so a long prompt does not block it in one go)."""
        self.model, self.batcher, self.width, self.chunk = model, batcher, width, chunk
        self.static: StaticLM | None = None

    @property
    def length(self) -> int:
        return self.static.length if self.static is not None else 0

    def crop(self, length: int) -> None:
        if self.static is not None:
            self.static.crop(length)

    def kv_bytes(self) -> int:
        return storage_bytes([*self.static.keys, *self.static.values]) if self.static is not None else 0

    def forward_final_hidden(self, token_ids: list[int]) -> torch.Tensor:
        """Append tokens; the final norm's output [n, H] at each. Up to `width` tokens run as one pass
        (batched when the target's are); a longer feed (the prompt, or the tokens a suffix front drafted)
        runs alone, chunk by chunk."""
        need = self.length + len(token_ids) + self.width
        if self.static is None or need > self.static.max_length:
            grown = StaticLM(self.model, self.width, static_cache_length(need, self.ROOM, 0), batcher=self.batcher,
                             head=False)
            if self.static is not None:
                grown.restore(self.static.snapshot())
            self.static = grown
        if len(token_ids) <= self.width:
            return self.static.forward(token_ids)
        static, hidden = self.static, []
        for begin in range(0, len(token_ids), self.chunk):
            layers = static.prefill(token_ids[begin: begin + self.chunk])
            assert layers is not None
            hidden.append(rms_norm(layers[:, -1], static.eager.norm, static.eager.eps))
        return torch.cat(hidden)


class DraftLMDrafter(DrafterBase):
    def __init__(self, model: PreTrainedModel, target_vocab_size: int, head: AcceptanceHead | None = None,
                 vocab: torch.Tensor | None = None, tree_nodes: int = 0, tree_top_k: int = 4,
                 window: int = 0, sinks: int = 0) -> None:
        """tree_nodes = 0 drafts chains; > 0 drafts a dynamic tree of at most that many nodes (EAGLE-2's,
        specops.drafters.dynamic_tree), whose depth is propose's k. window = 0 keeps every context token
        in the draft's cache; > 0 keeps at most that many, the first `sinks` and the most recent."""
        draft_vocab = model.get_output_embeddings().weight.shape[0]
        if draft_vocab != target_vocab_size:
            raise VocabularyMismatchError(
                f"The draft model's vocabulary has {draft_vocab} tokens but the target's has {target_vocab_size}: "
                "a draft LM must share the target's tokenizer.")
        if head is not None and head.config.hidden_size != model.config.hidden_size:
            raise ValueError(f"The acceptance head reads hidden states of size {head.config.hidden_size} but the "
                             f"draft model's are {model.config.hidden_size}: it was trained for another draft.")
        if vocab is not None and (vocab.numel() == 0 or int(vocab.max()) >= target_vocab_size):
            raise VocabularyMismatchError(f"The draft vocabulary must be non-empty target ids below {target_vocab_size}.")
        if tree_nodes < 0 or tree_top_k < 1:
            raise ValueError(f"tree_nodes must be >= 0 and tree_top_k >= 1, got {tree_nodes}, {tree_top_k}.")
        if window < 0 or sinks < 0 or (window and window <= sinks):
            raise ValueError(f"A draft window must be 0 (off) or larger than its {sinks} sink tokens, got {window}.")
        if tree_nodes and head is not None:
            raise ValueError("An acceptance head stops chains; the draft-lm-tree drafter grows trees without one.")
        self.tree_nodes, self.tree_top_k = tree_nodes, tree_top_k
        self.name = "draft-lm-tree" if tree_nodes else "draft-lm"
        self.model = model.eval()
        self.head = head.eval() if head is not None else None
        self.vocab = vocab
        self.lm_head = draft_head(model, vocab)
        self.window, self.sinks = window, sinks
        self.inv_freq = rotary_frequencies(self.model) if window else None
        self.reset()

    @property
    def predicts_acceptance(self) -> bool:
        """Whether `propose` can take a per-token `stop` rule (it needs an acceptance head)."""
        return self.head is not None

    def reset(self) -> None:
        self.lm: CachedLM | StaticDraftLM = CachedLM(self.model)
        self.cached: list[int] = []  # tokens whose keys/values are in self.lm's cache, in cache order
        # Context tokens between the sinks and the window that the cache does not hold: cache slot i holds
        # context[i] below the sinks and context[i + skipped] from them on (always 0 without a window).
        self.skipped = 0
        self.peak_kv_bytes = 0

    def share_runtime(self, lm: CachedLM | StaticLM) -> None:
        """On the static runtime too when the target is (StaticDraftLM: a chain draft without a window, on a
        model the lean forward runs and whose rows do not depend on the batch), batched with the target's
        passes when they are; otherwise the draft keeps its own dynamic cache."""
        if isinstance(lm, StaticLM) and not self.tree_nodes and not self.window and batch_invariant(self.model):
            try:
                llama_forward(self.model)
            except UnsupportedModelError:  # another architecture: transformers' forward serves it
                return
            self.lm = StaticDraftLM(self.model, lm.batcher, DRAFT_PASS_ROWS, DEFAULT_PREFILL_CHUNK)

    def _sync(self, context: list[int]) -> list[int]:
        """Roll the cache back to the longest prefix shared with `context`; return the tokens to feed."""
        skip, common = self.skipped, 0
        limit = min(len(self.cached), len(context) - skip - 1)  # always re-feed the last token to get logits
        while common < limit and self.cached[common] == context[common + (skip if common >= self.sinks else 0)]:
            common += 1
        if common < self.sinks:  # the window is cropped away with the sinks that differ: context order again
            self.skipped = skip = 0
        self.lm.crop(common)
        self.cached = self.cached[:common]
        return context[common + (skip if common >= self.sinks else 0):]

    def _fit(self, feed: list[int], room: int) -> list[int]:
        """With a window: make the cache plus `feed` plus `room` drafted positions fit in it, dropping the
        oldest tokens after the sinks (from the cache, then from the head of `feed`); the tokens to feed."""
        common = len(self.cached)
        over = common + len(feed) + room - self.window
        if not self.window or over <= 0:
            return feed
        drop = over + (self.window - self.sinks) // EVICT_FRACTION
        if self.window - self.sinks - room - (self.window - self.sinks) // EVICT_FRACTION < 1:
            raise ValueError(f"A draft window of {self.window} tokens with {self.sinks} sinks has no room for "
                             f"{room} drafted tokens: widen it (draft_window).")
        evicted = min(drop, max(common - self.sinks, 0))
        if evicted:
            self.lm.evict(self.sinks, evicted, self.inv_freq)
            del self.cached[self.sinks: self.sinks + evicted]
        head = max(self.sinks - common, 0)  # feed tokens that are still sinks
        self.skipped += drop
        return feed[:head] + feed[head + drop - evicted:]

    def _measure(self) -> None:
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.lm.kv_bytes())

    def _forward_last(self, feed: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [V] at the last fed token and its hidden state [H] (the acceptance head reads it)."""
        hidden = self.lm.forward_final_hidden(feed)[-1]
        return self.lm_head(hidden), hidden

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: Randomness, stop: TokenStop | None = None) -> Draft:
        """Up to k tokens; with `stop`, the draft also ends after the first token for which
        stop(acceptance probabilities so far) is True."""
        if stop is not None and self.head is None:
            raise ValueError("A per-token stop rule needs an acceptance head; load one into the draft-lm drafter.")
        feed = self._fit(self._sync(context), self.tree_nodes if self.tree_nodes else k)
        if self.tree_nodes and k > 0:
            return self._tree(feed, k)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        accept_probs: list[float] = []
        for _ in range(k):
            logits, hidden = self._forward_last(feed)
            self.cached += feed
            if sampling.greedy:
                token = int(argmax(logits))
            else:
                probs = logits_to_probs(logits, sampling)
                rows.append(probs)
                token = draw(probs, generator, len(tokens))  # coupled: the noise of this drafted position
            tokens.append(token)
            if stop is not None:
                accept_probs.append(self.head.accept_prob(hidden, logits, token))
                if stop(accept_probs):
                    break
            feed = [token]
        self._measure()
        # At temperature 0 q is exactly the one-hot of each token, which the verifiers assume for q=None.
        return Draft(tokens=tokens, q=torch.stack(rows) if rows else None, accept_probs=accept_probs if stop else None)

    def _children(self, hidden: torch.Tensor) -> list[Children]:
        """Top-K children (target ids, draft log-probabilities) of each position of hidden [n, H]; outside
        a draft vocabulary the logits are -inf, so children come from it alone."""
        return top_children(self.lm_head(hidden).float().log_softmax(-1), self.tree_top_k)

    def _tree(self, feed: list[int], max_depth: int) -> Draft:
        return select_best(self._grow(feed, max_depth), self.tree_nodes)

    def candidates(self, context: list[int], max_depth: int) -> list[TreeNode]:
        """Every node of the dynamic tree continuing `context` before the best are chosen (with their
        cumulative draft log-probabilities): what CoSine fuses (specops.drafters.cosine)."""
        return self._grow(self._sync(context), max_depth)

    def guesses(self, context: list[int], start: int) -> list[int]:
        """Teacher forcing: the draft's top-1 after each of context[start:-1], i.e. its guesses at
        context[start + 1:]. Its cache must hold context[:start]; it then holds context[:-1], so the next
        `propose` or `candidates` feeds only the last token."""
        if self.cached[:start] != context[:start]:
            raise ValueError("guesses: the draft's cache does not hold the context's first `start` tokens.")
        self.lm.crop(start)
        self.cached = context[:start]
        feed = context[start:-1]
        if not feed:
            return []
        hidden = self.lm.forward_final_hidden(feed)  # [n, H]
        self.cached += feed
        return argmax(self.lm_head(hidden)).tolist()

    def _grow(self, feed: list[int], max_depth: int) -> list[TreeNode]:
        """Feed the new context tokens, then grow the dynamic tree's nodes; drafted positions leave the cache."""
        root_hidden = self.lm.forward_final_hidden(feed)[-1]
        self.cached += feed
        verified = self.lm.length  # == len(context): a depth-d node sits at position verified + d - 1

        def expand(nodes: list[TreeNode], chosen: list[int], visible: torch.Tensor, depth: int) -> list[Children]:
            hidden = self.lm.forward_final_hidden([nodes[i].token for i in chosen], verified + depth - 1, visible)
            return self._children(hidden)

        try:
            return grow_nodes(self._children(root_hidden[None])[0], expand, max_depth, self.tree_top_k, verified)
        finally:
            self._measure()
            self.lm.crop(verified)
