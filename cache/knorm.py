"""Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"):
keep the keys with the lowest L2 norm.

A key's norm predicts the attention it will get (low norm, high attention), so a token's keep score is
-||k||_2 of its key (rotated, as stored), per KV head, computed from the key alone: no attention
probabilities, so it composes with any attention kernel and with the sparse readers (knorm+quest).
At prefill each layer and KV head keeps the `budget` prompt tokens of lowest key norm; at every decode
step the new token is stored and the kept token of highest key norm leaves, so memory stays flat
(`decode_evict=false`: kvpress's rule, prefill compression only, decode tokens appended).
Defaults as kvpress's KnormPress and the authors' code: no sinks and no recent window (n_sink=0,
n_recent=0; both available through the one-method tier, cache/scored.py) and every layer compressed.  `ratio=` keeps
kvpress's share of the prompt (its compression_ratio); `budget=` a fixed count per layer and head.
Deviation (docs/policies.md): a slot cache always stores the new token, even when its key norm is the highest.
"""
from dataclasses import dataclass

from torch import Tensor

from cache.params import recent_param, sink_param
from cache.scored import ScoredEviction


@dataclass(eq=False)
class KnormPolicy(ScoredEviction):
    name = "knorm"
    n_sink: int = sink_param(0)
    n_recent: int = recent_param(0)

    def token_scores(self, layer: int, k: Tensor, v: Tensor, pos: Tensor) -> Tensor:
        """-||k||_2 [B, H_kv, T] of each key k [B, H_kv, T, D]: the lowest norms are kept."""
        return -k.float().norm(dim=-1)
