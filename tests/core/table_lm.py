"""A causal LM whose next-token distribution is an exact fp64 table of its context.

It honours the interface the decoding runtime uses on a Hugging Face model (a `DynamicCache`, a 4D
additive attention mask, `logits_to_keep`, `output_hidden_states`, `base_model`, input and output
embeddings), so the real loop, the real cache rollback and the real drafters run on it unchanged; only
the transformer is replaced by a lookup. Each row's context is read back from the cache the way
attention would see it: the token ids are stored as the cache's keys, and a row's context is the keys
its mask row makes visible, in position order. A wrong mask, a stale cache entry or a missed crop
therefore changes the distribution, as it would in a real model.

Hidden states are the log-probabilities themselves (hidden size = vocabulary size, identity LM head),
so drafters that read hidden states (the draft LM's head, the acceptance head, aligned heads) see
features that carry the context.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import torch
from torch import nn
from transformers import DynamicCache, GenerationConfig, LlamaConfig

from specops.core.target import Target, TargetFingerprint


class TableLM(nn.Module):
    def __init__(self, vocab: int, salt: int, sharpness: float, max_positions: int = 64) -> None:
        super().__init__()
        self.vocab, self.salt, self.sharpness = vocab, salt, sharpness
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=vocab, intermediate_size=vocab, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=max_positions)
        self.generation_config = GenerationConfig(eos_token_id=None)  # never stops: every run has L tokens
        self.embed_tokens = nn.Embedding(vocab, vocab).to(torch.float64)
        self.lm_head = nn.Linear(vocab, vocab, bias=False).to(torch.float64)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.eye(vocab))
            self.lm_head.weight.copy_(torch.eye(vocab))
        self._table: dict[tuple[int, ...], torch.Tensor] = {}
        self.base_model = _Decoder(self)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def log_probs(self, context: tuple[int, ...]) -> torch.Tensor:
        """log p(. | context) [V], fp64: a fixed pseudo-random function of the context and the salt."""
        if context not in self._table:
            g = torch.Generator().manual_seed(zlib.crc32(repr((context, self.salt)).encode()))
            scores = self.sharpness * torch.randn(self.vocab, generator=g, dtype=torch.float64)
            self._table[context] = scores.log_softmax(-1)
        return self._table[context]

    def hidden(self, input_ids: torch.Tensor, past_key_values: DynamicCache,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Append input_ids [1, n] to the cache; each row's log-probs [1, n, V] from the keys it may see."""
        past = past_key_values.get_seq_length()
        new = input_ids[0].to(torch.float64)[None, None, :, None]  # [1, 1, n, 1]: token ids as keys
        keys, _ = past_key_values.update(new, new.clone(), 0)
        ids = keys[0, 0, :, 0].long().tolist()
        n = input_ids.shape[1]
        if attention_mask is None:
            visible = torch.ones(n, past + n, dtype=torch.bool).tril(past)
        else:
            visible = attention_mask[0, 0] == 0
        rows = [self.log_probs(tuple(ids[j] for j in range(past + n) if visible[r, j])) for r in range(n)]
        return torch.stack(rows)[None]

    def forward(self, input_ids: torch.Tensor, past_key_values: DynamicCache, use_cache: bool = True,
                output_hidden_states: bool = False, logits_to_keep: int = 0,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
                ) -> SimpleNamespace:
        hidden = self.hidden(input_ids, past_key_values, attention_mask)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return SimpleNamespace(logits=self.lm_head(kept), hidden_states=(hidden, hidden) if output_hidden_states else None)


class _Decoder:
    """`model.base_model`: the decoder without the LM head, as drafters call it."""

    def __init__(self, lm: TableLM) -> None:
        self.lm = lm

    def __call__(self, input_ids: torch.Tensor, past_key_values: DynamicCache, use_cache: bool = True,
                 attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
                 ) -> SimpleNamespace:
        return SimpleNamespace(last_hidden_state=self.lm.hidden(input_ids, past_key_values, attention_mask))


def table_target(lm: TableLM) -> Target:
    """A Target around a TableLM: no tokenizer (ids in, ids out) and no EOS."""
    return Target(model=lm, tokenizer=None, fingerprint=TargetFingerprint(f"table-{lm.salt}", "-", "-"))  # type: ignore[arg-type]
