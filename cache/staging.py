"""A prompt in chunks for the eviction family (a mixin of EvictionPolicy, cache/base.py, whose state it reads).

The prompt comes in one pass (engine.generate, the evals), or in chunks when the instance holds rows that
join a running batch (decode_room set: runtime.rows.RowBatch interleaves the chunks with the other rows' decode
steps; `prefill_in_one_pass`).  Chunks are *staged*: the prompt's K/V wait uncompressed in `staged` (per
layer [B, H_kv, T, D], T the prompt's length), each chunk attends causally to everything staged so far,
and the keep decision runs once, at `end_prefill`, on the whole prompt, exactly as in one pass.  The
statistics come out the same because the policy says which queries they read (`prefill_queries`): the
last n (the window's queries are staged too, [B, H_q, n, D], and read once the prompt is complete), or
every query (then each chunk's statistics, column sums over the keys staged so far, add up).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model import grouped_attention


class ChunkStaging:
    """EvictionPolicy's staged prefill: `start_staging` at the first chunk, `prefill_staged` for each."""

    def start_staging(self) -> None:
        """Host side, at the first of several prompt chunks: per layer the prompt's K, V [B, H_kv, T, D], the
        queries of its last prefill_queries() positions [B, H_q, n, D] (None: every query counts) and the
        statistics summed so far; all dropped once the prompt is compressed (end_prefill)."""
        B, T, D = self.batch, self.prompt_length, self.args.head_dim
        n = self.prefill_queries()
        self.staged_window = None if n is None else min(n, T)
        z = dict(dtype=self.dtype, device=self.device)
        self.staged = [{"k": torch.empty(B, self.args.n_kv_heads, T, D, **z),
                        "v": torch.empty(B, self.args.n_kv_heads, T, D, **z),
                        "q": None if n is None else torch.empty(B, self.args.n_heads, self.staged_window, D, **z),
                        "stats": {}} for _ in range(self.args.n_layers)]

    def prefill_staged(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One chunk (q [B, H_q, T, D], k, v [B, H_kv, T, D]) of a staged prompt: staged, attended over all staged
        so far; after the last chunk the layer's prompt waits in `pending` for end_prefill."""
        start, end, T = self.chunk_start, self.n_filled, self.prompt_length
        st = self.staged[layer]
        st["k"][:, :, start:end], st["v"][:, :, start:end] = k, v
        ks, vs = st["k"][:, :, :end], st["v"][:, :, :end]
        out = grouped_attention(q, ks, vs, self.mask)
        if self.staged_window is None:      # every query: add this chunk's column sums
            stats = self.prefill_stats(layer, q, ks, self.q_pos, self.prompt_pos[:, :end])
            st["stats"] = {name: F.pad(x, (0, T - x.shape[-1])) + st["stats"].get(name, 0) for name, x in stats.items()}
        else:                               # the window's queries (prompt columns [w0, T)) in this chunk
            w0 = T - self.staged_window
            lo = max(start, w0)
            if lo < end:
                st["q"][:, :, lo - w0:end - w0] = q[:, :, lo - start:]
            if end == T:
                st["stats"] = self.prefill_stats(layer, st["q"], st["k"], self.prompt_pos[:, w0:], self.prompt_pos)
        if end == T:
            self.pending[layer] = (st["k"], st["v"], st["stats"])
        return out
