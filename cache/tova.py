"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): keep what the current query attends to.

Per layer the cache holds `budget` tokens, the same ones for every KV head.  At prefill the prompt's
last query ranks the tokens by its attention averaged over all query heads of the layer; at every
decode step the query attends over the cache plus the new token (one joint softmax), and the kept
token with the lowest attention averaged over the layer's heads makes room for the new one.  Only the
current step's attention counts (H2O accumulates it).  Deviation: TOVA may drop the new token itself
when its own attention is the lowest; a slot cache always stores it (docs/policies.md).
"""
from dataclasses import dataclass

from torch import Tensor

from cache.base import EvictionPolicy
from cache.params import Budget, DecodeEviction
from cache.scoring import column_scores
from cache.shard import shard_of


@dataclass(eq=False)
class TOVAPolicy(DecodeEviction, Budget, EvictionPolicy):
    name = "tova"
    decode_attention = True

    def prefill_stats(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> dict:
        last = column_scores(q, k, q_pos, 1, self.sliding_window, k_pos=k_pos)      # [B, H_kv, T], group mean
        layer_mean = shard_of(self.args).mean(last.mean(1, keepdim=True))  # every head's (--tp: all-reduce)
        return {"acc": layer_mean.expand_as(last)}

    def prefill_queries(self) -> int:
        return 1

    def keep_scores(self, layer: int, stats: dict, q_pos: Tensor, n_heads: int) -> Tensor:
        return stats["acc"]

    def observe(self, layer: int, p_old: Tensor, p_new: Tensor) -> None:
        """p_old [B, H_kv, G, C]: this step's attention, averaged over every head of the layer (under --tp
        over every process's heads: one all-reduce of B x C per layer and step)."""
        layer_mean = shard_of(self.args).mean(p_old.mean((1, 2), keepdim=True)[:, :, 0])
        self.score[layer].copy_(layer_mean.expand_as(self.score[layer]))
