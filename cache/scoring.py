"""Scoring mechanics of the eviction family: attention probabilities and the scores built from them, the
top-k selection that keeps tokens, per-layer budget arithmetic, and decode attention over the slots plus the
new token.  Plain functions of tensors (shapes in each docstring) and host ints; no policy state.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from model import attention_mask

NEVER = float("-inf")    # a keep score that is never selected
ALWAYS = float("inf")    # a keep score that is always selected (sinks, windows)


def attention_probs(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, sliding_window=None) -> Tensor:
    """Causal attention probabilities in fp32, per KV head and group member.

    q [B, H_q, T, D] at positions q_pos [B, T]; k [B, H_kv, L, D] at k_pos [B, L].
    Returns [B, H_kv, G, T, L]; rows of padding queries (q_pos < 0) are zero."""
    B, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    logits = q.float().reshape(B, Hkv, G * T, D) @ k.float().transpose(-1, -2) / math.sqrt(D)
    visible = attention_mask(q_pos, k_pos, G, sliding_window)[:, None]           # [B, 1, G*T, L]
    probs = logits.masked_fill(~visible, NEVER).softmax(-1).view(B, Hkv, G, T, L)
    return probs * (q_pos >= 0)[:, None, None, :, None]


def last_rows(q: Tensor, q_pos: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """The last `rows` queries q [B, H, T, D] and their positions q_pos [B, T], left-padded
    with padding queries (position -1) when T < rows.  The output has exactly `rows` rows
    whatever T is, so a compiled prefill needs no T-vs-rows guard."""
    q = F.pad(q, (0, 0, rows, 0))[:, :, -rows:]
    return q, F.pad(q_pos, (rows, 0), value=-1)[:, -rows:]


def reduce_heads(probs: Tensor, agg: str) -> Tensor:
    """Attention of the G query heads of each KV head, probs [B, H_kv, G, ...] -> one score per KV head
    [B, H_kv, ...] ("mean" over the group, or its "max") or per query head [B, H_kv * G, ...] ("query":
    each query head selects its own tokens, as the authors' code of SnapKV/PyramidKV does by repeating
    the KV heads)."""
    if agg == "mean":
        return probs.mean(2)
    if agg == "max":
        return probs.amax(2)
    return probs.flatten(1, 2)


def column_scores(q: Tensor, k: Tensor, q_pos: Tensor, rows: int | None = None, sliding_window=None,
                  chunks: int = 16, agg: str = "mean", k_pos: Tensor | None = None) -> Tensor:
    """Attention each key receives, reduced over the query heads of its KV head by `agg` (reduce_heads)
    query by query, then summed over the last `rows` queries (all if None) -> [B, H_kv, T] fp32, or
    [B, H_q, T] for agg="query".

    With rows = w this is SnapKV's observation-window score; with all rows it is H2O's
    accumulated attention.  The queries go through in a fixed number of `chunks` (padded with
    position -1, which contribute nothing): memory O(T^2 / chunks), and the loop does not
    depend on T, so a compiled prefill does not specialize on the prompt length.  Keys k [B, H_kv, L, D] are
    at k_pos [B, L] (None: the queries' own positions, L = T); the result is [B, H, L]."""
    k_pos = q_pos if k_pos is None else k_pos
    if rows is not None:
        q, q_pos = last_rows(q, q_pos, rows)
        chunks = max(1, rows // 512)
    B, H, T, D = q.shape
    size = (T + chunks - 1) // chunks + 1     # + 1: a chunk of one row would be specialized
    q = F.pad(q, (0, 0, 0, chunks * size - T)).view(B, H, chunks, size, D)
    q_pos_chunks = F.pad(q_pos, (0, chunks * size - T), value=-1).view(B, chunks, size)
    total = 0
    for i in range(chunks):
        probs = attention_probs(q[:, :, i], k, q_pos_chunks[:, i], k_pos, sliding_window)
        total = total + reduce_heads(probs, agg).sum(-2)
    return total


def pool1d(scores: Tensor, kernel: int, kind: str = "max", within: Tensor | None = None) -> Tensor:
    """Smooth scores [..., T] along T: odd `kernel`, stride 1, padding kernel // 2 (SnapKV).

    `within` (bool, broadcastable to scores) limits the pool to those columns, as if the
    others were padding (e.g. SnapKV pools only the tokens before its window); the result at
    columns outside it is meaningless.  Written with masks and shifted copies (not slices at
    the boundary, not max_pool1d, whose shape function pins T), so a compiled prefill does not
    specialize on the prompt length."""
    if kernel <= 1:
        return scores
    r, T = kernel // 2, scores.shape[-1]
    within = torch.ones_like(scores, dtype=torch.bool) if within is None else within.expand(scores.shape)

    def windows(x: Tensor, pad: float) -> list[Tensor]:   # x[..., t - r + i] for i < kernel
        x = F.pad(x, (r, r), value=pad)
        return [x[..., i:i + T] for i in range(kernel)]

    if kind == "max":
        return torch.stack(windows(scores.masked_fill(~within, NEVER), NEVER)).amax(0)
    total = sum(windows(scores * within, 0.0))      # the mean over the in-range columns
    count = sum(windows(within.to(scores.dtype), 0.0))
    return total / count.clamp(min=1)


def select_top(scores: Tensor, capacity: int, limit: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The `capacity` best columns of scores [B, H, T]: the valid ones first, in column order.

    Returns (idx [B, H, capacity], valid [B, H, capacity]); valid is False where no keepable
    column was left (score -inf, or T < capacity) and, with limit [B], past row b's limit[b] best
    (its own budget); such idx point at a real column.  The output shape never depends on T, so
    compiled prefill graphs need no T-vs-capacity guard.  Equal scores go to the earlier column (a stable
    sort, not topk, whose choice among ties depends on T): a left-padded row keeps what it keeps alone, also
    where max pooling makes plateaus of equal scores (SnapKV)."""
    B, H, T = scores.shape
    padded = torch.cat([scores, scores.new_full((B, H, capacity), NEVER)], dim=-1)
    top, idx = padded.sort(dim=-1, descending=True, stable=True)
    top, idx = top[..., :capacity], idx[..., :capacity]        # best first
    valid = top > NEVER
    if limit is not None:
        valid &= torch.arange(capacity, device=scores.device) < limit[:, None, None]
    order = torch.where(valid, idx, idx + T + capacity).argsort(dim=-1)
    return idx.gather(-1, order).clamp(max=T - 1), valid.gather(-1, order)


def split_integer(total: int, weights: list[float]) -> list[int]:
    """Integers proportional to `weights` that sum exactly to `total` (largest remainders)."""
    raw = [total * w / sum(weights) for w in weights]
    out = [math.floor(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: out[i] - raw[i])[:total - sum(out)]:
        out[i] += 1
    return out


def pyramid_budgets(n_layers: int, budget: int, window: int, beta: float) -> list[int]:
    """PyramidKV's per-layer budgets (window included) summing exactly to n_layers * budget.

    The schedule applies to what is left after the window (the paper's "remaining" budget):
    top layer k^{m-1} = k_total / (beta m), bottom k^0 = 2 k_total / m - k^{m-1}, arithmetic in
    between; integer parts by largest remainders, so nothing overshoots."""
    remaining = n_layers * (budget - window)
    if n_layers == 1:
        return [budget]
    top = remaining / (beta * n_layers)
    bottom = 2 * remaining / n_layers - top
    steps = [bottom - (bottom - top) * i / (n_layers - 1) for i in range(n_layers)]
    return [window + b for b in split_integer(remaining, steps)]


def fill_to_cap(budgets: list[int], cap: int) -> list[int]:
    """Budgets capped at `cap` (what a layer can hold: the prompt length) with the surplus of the capped
    layers handed to the others in proportion to their own budgets, until none is left or every layer
    is full: the total is min(sum(budgets), len(budgets) * cap)."""
    out = [min(b, cap) for b in budgets]
    surplus = sum(budgets) - sum(out)
    while surplus > 0:
        room = [i for i, b in enumerate(out) if b < cap]
        if not room:
            break
        for i, extra in zip(room, split_integer(surplus, [max(budgets[i], 1) for i in room])):
            take = min(extra, cap - out[i])
            out[i] += take
            surplus -= take
    return out


def recent_and_sinks(q_pos: Tensor, n_sink: int, window: "int | Tensor") -> Tensor:
    """Mask [B, T]: the first n_sink tokens and the last `window` tokens (an int, or per row [B, 1]) of each
    sequence."""
    length = q_pos.max(dim=-1, keepdim=True).values + 1
    return (q_pos >= 0) & ((q_pos < n_sink) | (q_pos >= length - window))


def first_min(x: Tensor) -> Tensor:
    """Index of the first minimum along the last dim (ties -> lowest index, also when compiled:
    Inductor's argmin does not promise the first of equal values)."""
    index = torch.arange(x.shape[-1], device=x.device)
    return torch.where(x == x.amin(-1, keepdim=True), index, x.shape[-1]).amin(-1)


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Cosine similarity of every row of a [B, H, T, D] with every row of b [B, H, n, D] -> [B, H, T, n]."""
    return F.normalize(a.float(), dim=-1) @ F.normalize(b.float(), dim=-1).transpose(-1, -2)


def joint_softmax(s_old: Tensor, s_new: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the concatenation [s_old, s_new] of scores [..., C] and [..., 1], without making it."""
    top = torch.maximum(s_old.amax(-1, keepdim=True), s_new)
    e_old, e_new = (s_old - top).exp(), (s_new - top).exp()
    z = e_old.sum(-1, keepdim=True) + e_new
    return e_old / z, e_new / z


def attend_with_new(q: Tensor, kc: Tensor, vc: Tensor, visible: Tensor, k: Tensor, v: Tensor):
    """Decode attention over cached slots plus the new token, one joint softmax in fp32.

    q [B, H_q, 1, D]; kc, vc [B, H_kv, C, D]; visible [B, H_kv, C]; k, v [B, H_kv, 1, D].
    Returns (out [B, H_q, 1, D], probs of the slots [B, H_kv, G, C], prob of the new token
    [B, H_kv, G, 1]), i.e. softmax over C + 1 keys without concatenating the cache."""
    B, Hq, _, D = q.shape
    Hkv = kc.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv, D)
    s_old = (qg @ kc.transpose(-1, -2)).float() / math.sqrt(D)                      # [B, Hkv, G, C]
    s_old = s_old.masked_fill(~visible[:, :, None, :], NEVER)
    s_new = (qg.float() * k.float()).sum(-1, keepdim=True) / math.sqrt(D)           # [B, Hkv, G, 1]
    p_old, p_new = joint_softmax(s_old, s_new)
    out = (p_old.to(vc.dtype) @ vc).float() + p_new * v.float()
    return out.to(q.dtype).reshape(B, Hq, 1, D), p_old, p_new
