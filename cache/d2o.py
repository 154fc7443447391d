"""D2O (Wan et al., 2024): dynamic discriminative operations on the KV cache.

Layer level: the variance of each layer's column-summed prompt attention (mean over heads and
batch) measures its density; dense layers get dense_factor * S (the paper's alpha), the others S.
Dense = at or below the paper's absolute gate g (`gate=100` in the paper) or, by default, the
`dense_share` of layers with the lowest variance: the variance grows with the prompt length (on
SmolLM2, 6 of 30 layers are below 100 at 3000 tokens, 10 at 1000), so a fixed g does not carry
across models or lengths.  With `conserve_total=true` (default) S is chosen so the budgets sum
exactly to n_layers * budget, the same KV bytes as the other policies at this budget;
`conserve_total=false` is the paper's literal S = budget (more memory).  Budgets need every layer,
so compression waits for `end_prefill`.  The dense layers are chosen for the batch; each row splits its own
token budget (`ratio=`: from its prompt length) over them, and a layer allocates the largest row's.

Token level (per KV head): H2O-style eviction keeping `n_sink` sinks + the recent window M + the
top N by accumulated attention, N:M = 3:1; an evicted token is merged into its most similar
kept token (cosine similarity of keys) when that similarity reaches the EMA threshold
    tau_t = ema_beta * max_sim_t + (1 - ema_beta) * tau_{t-1} (the paper's beta),  tau_0 = mean max similarity at prefill,
with weights from exp(similarity) (the kept token's own weight is e = exp(1), its self-similarity):
    k_j <- (e k_j + sum_i exp(u_ij) k_i) / (e + sum_i exp(u_ij)),  values with the same weights.
This happens at prefill compression and at every decode eviction (`merge=false` skips it: an ablation).
"""
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from cache.base import EvictionPolicy
from cache.params import Budget, HeadAgg, param, sink_param
from cache.scoring import NEVER, column_scores, cosine, reduce_heads, split_integer
from cache.shard import shard_of


def column_variance(acc: Tensor, q_pos: Tensor) -> Tensor:
    """Variance over the prompt's tokens (q_pos [B, T] >= 0) of their accumulated attention acc [B, H, T], averaged
    over rows and heads: a layer's density (a 0-d tensor)."""
    valid = (q_pos >= 0)[:, None, :].float()
    n = valid.sum(-1)
    mean = (acc * valid).sum(-1) / n
    return ((((acc - mean[..., None]) ** 2) * valid).sum(-1) / (n - 1).clamp(min=1)).mean()


@dataclass(eq=False)
class D2OPolicy(HeadAgg, Budget, EvictionPolicy):
    admission = "batch"     # layer budgets come from the batch's prompt attention variances
    name = "d2o"
    n_sink: int = sink_param(4)
    gate: float = param(-1.0, "the paper's g: layers whose variance is at or below it are dense and get "
                              "dense_factor * S (the paper uses 100; -1: dense_share decides)")
    dense_share: float = param(0.1, "portable gate: the lowest-variance share of the layers is dense (0.1: the "
                                    "paper's Figure 4, its 3 shallowest of 32 layers)")
    dense_factor: float = param(2.0, "the paper's alpha: budget factor of the dense layers (paper: 2 to 4)")
    ema_beta: float = param(0.7, "the paper's beta: EMA smoothing of the merge threshold (paper: 0.5 to 0.9)")
    recent_share: float = param(0.25, "share of the non-sink budget for the recent window (N:M = 3:1)")
    conserve_total: bool = param(True, "budgets sum to n_layers * budget (else S = budget)")
    merge: bool = param(True, "merge evicted tokens into their most similar kept token (false: the layer budgets "
                              "with H2O's token eviction, an ablation)")
    renamed = {"alpha": "dense_factor", "beta": "ema_beta"}
    decode_attention = True
    defer_compression = True

    def validate(self) -> None:
        if self.n_sink < 0 or (self.budget is not None and self.budget < self.min_budget()):
            raise ValueError(f"budget ({self.budget}) must be at least n_sink ({self.n_sink}) + 2")
        super().validate()
        if not 0 <= self.dense_share <= 1:
            raise ValueError(f"dense_share must be in [0, 1], got {self.dense_share}")
        if self.dense_factor < 1 or not 0 < self.ema_beta <= 1 or not 0 < self.recent_share < 1:
            raise ValueError("need dense_factor >= 1, 0 < ema_beta <= 1, 0 < recent_share < 1")

    def min_budget(self) -> int:
        return self.n_sink + 2

    def setup(self, args, max_batch_size, max_seq_length, dtype, device) -> None:
        self.weights = [1.0] * args.n_layers        # every layer sparse until plan
        super().setup(args, max_batch_size, max_seq_length, dtype, device)
        self.variances = [None] * args.n_layers
        self.tau: list = [None] * args.n_layers

    # ---------------------------------------------------------------- layer level
    def prefill_stats(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> dict:
        return {"acc": column_scores(q, k, q_pos, None, self.sliding_window, agg=self.head_agg, k_pos=k_pos)}

    def prefill_queries(self) -> None:
        return None     # every query's attention, summed (the variance is taken in plan, over the whole prompt)

    def plan(self, stats: list[dict]) -> None:
        self.decide(torch.stack([column_variance(s["acc"], self.q_pos) for s in stats]))

    def decide(self, variances: Tensor) -> None:
        """The layers' variances [n_layers] -> dense layers and weights (one host sync; under --tp the mean over
        every process's heads: one all-reduce)."""
        self.variances = shard_of(self.args).mean(variances).tolist()
        self.weights = [self.dense_factor if dense else 1.0 for dense in self.dense_layers(self.variances)]

    def layer_budgets(self, budget: int, length: int) -> list[int]:
        """A row's token `budget` split over the layers by their weights (dense: dense_factor)."""
        if self.conserve_total:
            budgets = split_integer(len(self.weights) * budget, self.weights)
        else:
            budgets = [round(budget * w) for w in self.weights]
        return [max(b, self.min_budget()) for b in budgets]

    def dense_layers(self, variances: list[float]) -> list[bool]:
        """The paper's absolute gate (`gate` >= 0), else the `dense_share` of layers with the lowest
        variance (the variance grows with the prompt length, so an absolute gate does not carry over)."""
        if self.gate >= 0:
            return [var <= self.gate for var in variances]
        n_dense = round(self.dense_share * len(variances))
        lowest = set(sorted(range(len(variances)), key=lambda i: variances[i])[:n_dense])
        return [i in lowest for i in range(len(variances))]

    def recent_window(self, layer: int, budget: int) -> int:
        return max(1, round((budget - self.n_sink) * self.recent_share))

    # ---------------------------------------------------------------- token level
    def keep_scores(self, layer: int, stats: dict, q_pos: Tensor, n_heads: int) -> Tensor:
        return stats["acc"]

    def on_compress(self, layer: int, k: Tensor, v: Tensor, idx: Tensor, valid: Tensor, stats: dict,
                    kc: Tensor, vc: Tensor) -> None:
        """Merge the prompt tokens left out into their most similar kept token (kc, vc, in place)."""
        if not self.merge:
            return
        B, H, T, D = k.shape
        n = idx.shape[-1]
        sim = cosine(k, kc)                                                        # [B, H, T, n]
        sim = sim.masked_fill(~valid[:, :, None, :], NEVER)
        best, target = sim.max(-1)                                                 # [B, H, T]
        kept = torch.zeros(B, H, T, dtype=torch.bool, device=k.device).scatter(2, idx, valid)
        evicted = (self.q_pos >= 0)[:, None, :] & ~kept
        n_evicted = evicted.sum(-1)
        tau = torch.where(n_evicted > 0, (best * evicted).nan_to_num(0.0).sum(-1) / n_evicted.clamp(min=1), 1.0)
        self.tau[layer] = tau                                                      # [B, H]
        weight = torch.where(evicted & (best >= tau[..., None]), best.exp(), 0.0)  # [B, H, T]
        for cache, src in ((kc, k), (vc, v)):
            num = torch.zeros(B, H, n, D, dtype=torch.float32, device=k.device)
            num.scatter_add_(2, target[..., None].expand(-1, -1, -1, D), weight[..., None] * src.float())
            den = torch.zeros(B, H, n, dtype=torch.float32, device=k.device).scatter_add_(2, target, weight)
            cache.copy_(((math.e * cache.float() + num) / (math.e + den[..., None])).to(cache.dtype))

    def observe(self, layer: int, p_old: Tensor, p_new: Tensor) -> None:
        self.score[layer] += reduce_heads(p_old, self.head_agg)

    def on_evict(self, layer: int, slot: Tensor) -> None:
        """Merge the token leaving `slot` [B, H] into its most similar remaining slot (through the
        storage's slot reads/writes, so a packed target is requantized correctly)."""
        if not self.merge:
            return
        pc = self.pos[layer]
        k_out, v_out = self.read_slots(layer, slot)                               # [B, H, 1, D]
        real = pc.gather(2, slot[:, :, None])[..., 0] >= 0                         # evicting a token?
        sim = self.key_cosine(layer, k_out)                                        # [B, H, C]
        others = (pc >= 0).scatter(2, slot[:, :, None], False)
        best, target = sim.masked_fill(~others, NEVER).max(-1)                     # [B, H]
        tau = self.ema_beta * best + (1 - self.ema_beta) * self.tau[layer]
        self.tau[layer].copy_(torch.where(real, tau, self.tau[layer]))      # in place: no decode allocation
        merge = real & (best >= tau)
        weight = torch.where(merge, best.exp(), 0.0)[..., None, None]
        k_t, v_t = self.read_slots(layer, target)
        k_new, v_new = ((math.e * old.float() + weight * src.float()) / (math.e + weight)
                        for old, src in ((k_t, k_out), (v_t, v_out)))
        self.write_slots(layer, target, k_new, v_new, where=merge)

    def describe(self) -> dict:
        d = super().describe()
        if self.prompt_length:
            d["layer_budgets"] = list(self.budgets)
            d["layer_variances"] = [round(x, 3) for x in self.variances] if self.variances[0] is not None else None
        return d

