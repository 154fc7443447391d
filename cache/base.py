"""Shared mechanics of the policies that keep a subset of tokens (the eviction family).

Storage per layer l (capacity C_l slots, allocated when the prompt arrives, never in decode):
    k, v   [B, H_kv, C_l, D]  keys (rotated at their absolute position) and values, held by the
                              policy's K/V format object `slots` (DenseSlots: the compute dtype;
                              cache/quantized.py's KIVISlots: KIVI-packed, chosen by --kv-bits)
    pos    [B, H_kv, C_l]     absolute position held by each slot, -1 = empty
    score  [B, H_kv, C_l]     fp32 keep score per slot, in evicting layers (and with decode_attention):
                              accumulated attention (H2O, D2O) or the policy's `token_scores`
Each KV head keeps its own tokens.  Policies read and write K/V only through the K/V-format delegates
(`write_kept`, `write_slots`, `read_slots`, `key_cosine`, `attend_and_probs`, `attend`, `dense_kv`).
The contract: cache/contract.py.

Prefill: attention over the prompt is full and causal (so the first generated token equals the full
cache's).  The policy's `prefill_stats` summarises what it needs from the layer (e.g. window scores);
then `compress` keeps the top `layer_budget` of `keep_scores` per KV head (by default the tokens' own
`token_scores`), the first `n_sink` and the last `recent_window` tokens always.  Policies whose per-layer budgets
depend on every layer (D2O, SimLayerKV) set `defer_compression`: the prompt's K/V wait in
`pending` until `end_prefill`, where `plan` fixes the budgets on the host.

The prompt comes in one pass (engine.generate, the evals), or in chunks when the instance holds rows that
join a running batch (decode_room set: engine.RowBatch interleaves the chunks with the other rows' decode
steps; `prefill_in_one_pass`).  Chunks are *staged*: the prompt's K/V wait uncompressed in `staged` (per
layer [B, H_kv, T, D], T the prompt's length), each chunk attends causally to everything staged so far,
and the keep decision runs once, at `end_prefill`, on the whole prompt, exactly as in one pass.  The
statistics come out the same because the policy says which queries they read (`prefill_queries`): the
last n (the window's queries are staged too, [B, H_q, n, D], and read once the prompt is complete), or
every query (then each chunk's statistics, column sums over the keys staged so far, add up).

Decode, per layer, without host syncs: an *appending* layer (SnapKV, PyramidKV, SimLayerKV's
full layers) writes the new token into the next empty slot (capacity = kept prompt tokens +
room for every generated token); an *evicting* layer (StreamingLLM, H2O, D2O, lazy layers)
overwrites the slot `decode_victim` names (by default the unprotected slot of lowest `score`;
the sinks and the recent window are protected), so its size never grows.  Attention reads the C_l
slots (empty ones masked): the cost follows what is kept, never max_seq_length.
A question appended after a compressed context (the agnostic protocol, `hold_question`) is held whole:
while a row appends it, an evicting layer never picks its tokens as victims (they count as protected,
like the sinks and the recent window), so the victims come from the context; from the row's first
answer token on they are ordinary tokens again.
Policies that need the step's attention probabilities (H2O, D2O) attend over the old slots plus
the new token with one joint softmax (`attend_with_new`) before choosing the victim, exactly as
if the cache briefly held C_l + 1 tokens, without copying it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from cache.params import param, param_values, policy_params  # noqa: F401  (param, policy_params: for policies)
from kernels.cpu import decode_attention
from model import ModelArgs, attention_mask, grouped_attention

NEVER = float("-inf")    # a keep score that is never selected
ALWAYS = float("inf")    # a keep score that is always selected (sinks, windows)


# --------------------------------------------------------------------------- scoring mechanics

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


HEAD_AGG = ("mean", "max", "query")


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


def sink_param(default: int):
    """The n_sink parameter of the base's sinks-and-recent-window option, with a policy's default."""
    return param(default, "first tokens of the sequence, always kept (attention sinks)")


def recent_param(default: int, help: str = "most recent tokens, always kept (in decode the new token is one)"):
    """The n_recent parameter of the same option (EvictionPolicy.recent_window), with a policy's default."""
    return param(default, help)


@dataclass(eq=False)
class HeadAgg:
    """Parameter of the policies and readers that reduce a KV head's query heads to one score per token."""
    head_agg: str = param("mean", "how a KV head's query heads score a token: mean, max (per query), "
                                  "or query (each query head keeps its own tokens: G x the KV memory)")


@dataclass(eq=False)
class DecodeEviction:
    """Parameter of the policies whose layers evict during decode (memory flat): `decode_evict=false` makes
    them compress at prefill only and append every decode token, as kvpress's presses do (memory then
    grows with the question and the answer, as an appending policy's)."""
    decode_evict: bool = param(True, "evict a kept token for each decode token, so memory stays flat (false: "
                                     "compress at prefill only and append decode tokens, as kvpress)")


DEFAULT_BUDGET = 256      # tokens per layer and KV head when neither budget nor ratio is given


@dataclass(eq=False)
class Budget:
    """Parameters of the policies that keep a token budget per layer and KV head: `budget` (tokens) or
    `ratio` (the share of each prompt removed), not both; neither: budget=DEFAULT_BUDGET.  A ratio resolves
    per request and per row (`EvictionPolicy.resolve_budget`)."""
    budget: Optional[int] = param(None, f"tokens kept per layer and KV head, window included ({DEFAULT_BUDGET} "
                                        f"when ratio is not given)", parse=int)
    ratio: Optional[float] = param(None, "instead of budget: the share of a prompt's tokens removed, in (0, 1) "
                                         "(kvpress's compression_ratio): a prompt of n tokens keeps "
                                         "int(n * (1 - ratio)) per layer and KV head", parse=float)


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


# --------------------------------------------------------------------------- K/V format: compute dtype

class DenseSlots:
    """How an eviction policy's slots hold K/V by default: in the compute dtype, per layer k, v [B, H, C, D]
    (None until the layer is allocated).  cache/quantized.py's `KIVISlots` holds them KIVI-packed behind
    the same methods (`with_kv_bits` puts one in `policy.slots`).  The methods that touch slots take the
    layer's slot table pos [B, H, C] (-1 = empty) and the current query positions q_pos [B, T]; this
    format needs neither."""

    bits, group, residual = 16, 0, 0      # kv_bits, kv_group, kv_residual of the policy

    def setup(self, n_layers: int, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Host side: the shapes; no layer allocated yet."""
        self.shape, self.dtype, self.device = (batch, heads, head_dim), dtype, device
        self.k: list = [None] * n_layers
        self.v: list = [None] * n_layers

    def allocate(self, layer: int, capacity: int) -> None:
        """The layer's buffers, `capacity` slots (host side)."""
        B, H, D = self.shape
        self.k[layer] = torch.zeros(B, H, capacity, D, dtype=self.dtype, device=self.device)
        self.v[layer] = torch.zeros(B, H, capacity, D, dtype=self.dtype, device=self.device)

    def row(self, layer: int, row: int) -> list[Tensor]:
        """Row `row` of the layer's buffers (release/adopt copy them)."""
        return [self.k[layer][row], self.v[layer][row]]

    def write_kept(self, layer: int, kc: Tensor, vc: Tensor, pos: Tensor, q_pos: Tensor) -> None:
        """The kept prompt tokens kc, vc [B, H, n, D] into slots [0, n) (pos already holds them)."""
        n = kc.shape[2]
        self.k[layer][:, :, :n] = kc
        self.v[layer][:, :, :n] = vc

    def write(self, layer: int, slot: Tensor, k: Tensor, v: Tensor, pos: Tensor, q_pos: Tensor,
              where: Tensor | None = None) -> None:
        """k, v [B, H, 1, D] into slot [B, H] (pos already holds it); where [B, H] bool: only there."""
        at = slot[:, :, None, None].expand(-1, -1, 1, k.shape[-1])
        kc, vc = self.k[layer], self.v[layer]
        if where is not None:
            keep = ~where[:, :, None, None]
            k = torch.where(keep, kc.gather(2, at), k.to(kc.dtype))
            v = torch.where(keep, vc.gather(2, at), v.to(vc.dtype))
        kc.scatter_(2, at, k.to(kc.dtype))
        vc.scatter_(2, at, v.to(vc.dtype))

    def read(self, layer: int, slot: Tensor, pos: Tensor, q_pos: Tensor) -> tuple[Tensor, Tensor]:
        """(k, v) [B, H, 1, D] held by slot [B, H]."""
        at = slot[:, :, None, None].expand(-1, -1, 1, self.k[layer].shape[3])
        return self.k[layer].gather(2, at), self.v[layer].gather(2, at)

    def cosine(self, layer: int, k: Tensor, pos: Tensor, q_pos: Tensor) -> Tensor:
        """Cosine similarity of k [B, H, 1, D] with every slot's key -> [B, H, C] fp32."""
        return cosine(k, self.k[layer])[:, :, 0]

    def attend(self, layer: int, q: Tensor, visible: Tensor, pos: Tensor, q_pos: Tensor) -> Tensor:
        """Decode attention of q [B, H_q, 1, D] over the visible [B, H, C] slots -> [B, H_q, 1, D]."""
        return decode_attention(q, self.k[layer], self.v[layer], visible)

    def attend_and_probs(self, layer: int, q: Tensor, k: Tensor, v: Tensor, visible: Tensor, pos: Tensor,
                         q_pos: Tensor):
        """`attend_with_new` over the layer's slots plus the new token -> (out, p_old, p_new)."""
        return attend_with_new(q, self.k[layer], self.v[layer], visible, k, v)

    def dense(self, layer: int, pos: Tensor, q_pos: Tensor) -> tuple[Tensor, Tensor]:
        """(k, v) [B, H, C, D] of every slot in the compute dtype (the buffers themselves)."""
        return self.k[layer], self.v[layer]

    def tensors(self, layer: int) -> tuple[Tensor, Tensor]:
        """(k, v) [B, H, C, D]: the buffers a sparse reader reads in place (`storage`)."""
        return self.k[layer], self.v[layer]

    def kv_store(self, layer: int, pos: Tensor, q_pos: Tensor):
        raise NotImplementedError("compute-dtype slots have no packed store: read them through storage(layer)")

    def nbytes(self, layer: int, n: int | None = None) -> int:
        """Bytes of the layer's buffers, or of those holding slots [0, n)."""
        k = self.k[layer]
        return 2 * k[:, :, 0].numel() * k.element_size() * (k.shape[2] if n is None else n)

    def describe(self) -> dict:
        return {}


# --------------------------------------------------------------------------- the policy base

@dataclass(eq=False)
class EvictionPolicy:
    """Base class.  A policy is a dataclass whose fields are its parameters (cache/params.py; groups:
    Budget, HeadAgg, sink_param/recent_param) and either scores each token by its own K/V
    (`token_scores`: prefill and decode) or overrides `keep_scores` (which prompt tokens to keep) and,
    for evicting layers, `decode_victim` or `observe`.  The first `n_sink` and the last
    `recent_window(layer)` tokens are always kept.  Optional hooks: `prefill_stats`,
    `plan` (with defer_compression), `layer_budget`, `on_evict`, `on_compress`.  docs/adding-a-policy.md."""

    name = "eviction"
    renamed = {}                   # old parameter name -> new one (refused with a message naming it)
    budget = None                  # tokens kept per layer and KV head (the Budget parameter; None: no budget)
    ratio = None                   # or the share of each prompt removed (the Budget parameter)
    is_sparse_reader = False
    decode_attention = False       # decode needs the step's attention probabilities
    head_agg = "mean"              # how the query heads of a KV head score a token (the HeadAgg parameter)
    head_aggs = HEAD_AGG           # the values head_agg may take
    defer_compression = False      # budgets need every layer's statistics (see module doc)
    appending = False              # default layer mode: append decode tokens instead of evicting
    decode_evict = True            # False: every layer appends (the DecodeEviction parameter)
    admission = "row"              # requests join and leave single rows (per-request plans: "batch")
    prefix_reuse = False           # the prompt is compressed as a whole: no prefix to continue
    decode_room = None             # generated tokens a row holds (None: up to max_seq_length; see capacity)
    n_sink, n_recent = 0, 0        # tokens always kept: the first n_sink, the last recent_window(layer)
    prompt_length = 0              # set per request (before_prefill); 0 before setup
    n_filled = 0                   # tokens seen so far (prompt + generated), a host int
    row_tokens = ()                # per row, the token budget its prompt resolved to (None: no request); set up
    budgets = None                 # per layer, the budget its storage holds (budgeted policies; set up)
    staged = None                  # per layer, a prompt coming in chunks: its K/V, window queries, statistics

    @property
    def prefill_in_one_pass(self) -> bool:
        """An instance holding rows that join a running batch (decode_room set) takes its prompt in chunks,
        staged (module doc); otherwise (engine.generate's batch) in one pass, where staging would hold the
        whole batch's prompts uncompressed beside the cache."""
        return self.decode_room is None

    @classmethod
    def full_cache_args(cls, n_tokens: int):
        """A budget of every token keeps them all (policies with more rules override)."""
        return {"budget": n_tokens}

    @property
    def reader_composable(self) -> bool:
        """A sparse reader may replace decode attention: not when decode needs the attention itself, nor
        over per-query-head storage (readers read KV heads)."""
        return not self.decode_attention and self.head_agg != "query"

    def __post_init__(self):
        self.slots = DenseSlots()       # K/V format (with_kv_bits: KIVISlots)
        if "budget" in policy_params(type(self)):
            self.check_budget()
        self.validate()

    def check_budget(self) -> None:
        """The Budget parameters: budget or ratio, not both (neither: budget=DEFAULT_BUDGET)."""
        if self.budget is not None and self.ratio is not None:
            raise ValueError(f"give budget ({self.budget}) or ratio ({self.ratio}), not both")
        if self.ratio is None and self.budget is None:
            self.budget = DEFAULT_BUDGET
        if self.ratio is not None and not 0 < self.ratio < 1:
            raise ValueError(f"ratio must be in (0, 1) (the share of the prompt removed), got {self.ratio}")

    @property
    def budgeted(self) -> bool:
        """The policy keeps a token budget (budget or ratio): each row keeps its own (plan_rows)."""
        return self.budget is not None or self.ratio is not None

    def validate(self) -> None:
        if self.head_agg not in self.head_aggs:
            raise ValueError(f"head_agg must be one of {', '.join(self.head_aggs)}, got {self.head_agg!r}")
        if not self.budgeted:
            return
        if self.n_sink < 0:
            raise ValueError(f"n_sink must not be negative, got {self.n_sink}")
        if self.budget is not None and self.budget < self.min_budget():
            raise ValueError(f"budget ({self.budget}) must be at least n_sink ({self.n_sink}) + n_recent "
                             f"({self.n_recent}), and positive")

    def min_budget(self) -> int:
        """The smallest budget the other parameters allow (a ratio's budget never goes below it)."""
        return max(1, self.n_sink + self.n_recent)

    def resolve_budget(self, n_tokens: int) -> int:
        """Tokens per layer and KV head a prompt of n_tokens keeps: `budget`, or with `ratio` kvpress's
        n_kept = int(n_tokens * (1 - ratio)) (ScorerPress), raised to min_budget() if below it."""
        if self.ratio is None:
            return self.budget
        return max(int(n_tokens * (1 - self.ratio)), self.min_budget())

    # ----------------------------------------------------------------- policy hooks
    def layer_budget(self, layer: int) -> int:
        """Prompt tokens layer `layer` keeps per KV head (its budget; rows with their own: the largest, or
        with fixed storage the bound fixed at setup; see plan_rows)."""
        return self.budgets[layer]

    def layer_budgets(self, budget: int, length: int) -> list[int]:
        """Per layer, the prompt tokens a row keeps per KV head when its token budget is `budget` and its prompt
        `length` tokens long.  Default: `budget` in every layer (PyramidKV and D2O: their schedules)."""
        return [budget] * self.args.n_layers

    def prefill_stats(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> dict:
        """What the policy needs from this layer's prompt attention (tensors): queries q [B, H_q, T, D] at
        q_pos [B, T] over the keys k [B, H_kv, L, D] at k_pos [B, L] (in one pass the same tokens; see
        `prefill_queries` for which queries a staged prompt passes)."""
        return {}

    def prefill_queries(self) -> Optional[int]:
        """Which prompt queries `prefill_stats` reads: the last n (0: none), or None: every query, and then each
        of its statistics is a sum over the queries of a tensor [..., L] over the keys (it adds up over chunks)."""
        return 0

    def plan(self, stats: list[dict]) -> None:
        """Host-side, with defer_compression: fix per-layer budgets/modes from all layers."""

    def recent_window(self, layer: int, budget: int) -> int:
        """Most recent tokens layer `layer` always keeps, at prefill and in decode (with the first n_sink), in a
        row whose budget in that layer is `budget`."""
        return self.n_recent

    def token_scores(self, layer: int, k: Tensor, v: Tensor, pos: Tensor) -> Tensor:
        """Keep priority [B, H_kv, T] (higher = keep) of tokens from their own k, v [B, H_kv, T, D] (as stored)
        at positions pos [B, H_kv, T]: the prompt's at prefill (keep_scores' default), each new token's in
        decode (written to its slot's `score`; decode_victim's default evicts the lowest).  Default: the
        position, so the newest tokens stay (StreamingLLM)."""
        return pos.float()

    def keep_scores(self, layer: int, stats: dict, q_pos: Tensor, n_heads: int) -> Tensor:
        """Keep priority [B, H_kv, T] of the prompt tokens (-inf: never keep); `compress` then keeps the
        sinks and the recent window whatever their score, and never padding.  Default: stats["token"],
        the prompt's token_scores.  The kept tokens' values start their slots' `score`."""
        return stats["token"]

    def decode_victim(self, layer: int) -> Tensor:
        """Slot [B, H_kv] an evicting layer overwrites: an empty slot while there is one, else the slot of
        lowest `score` outside the first n_sink and the recent window."""
        window = self.row_window[:, layer, None, None]          # each row's
        return self.lowest(layer, self.score[layer], self.protected(layer, self.n_sink, window))

    def observe(self, layer: int, p_old: Tensor, p_new: Tensor) -> None:
        """Decode attention probabilities (decode_attention policies): [B, H_kv, G, C], [.., 1]."""

    def on_evict(self, layer: int, slot: Tensor) -> None:
        """Called before the new token overwrites `slot` [B, H_kv] (D2O merges it away)."""

    def on_compress(self, layer: int, k: Tensor, v: Tensor, idx: Tensor, valid: Tensor, stats: dict,
                    kc: Tensor, vc: Tensor) -> None:
        """Called when a layer keeps prompt tokens idx [B, H_kv, n]: kc, vc [B, H_kv, n, D] are the kept
        keys/values (full precision), stored after this hook; D2O merges the others into them in place."""

    # ----------------------------------------------------------------- contract
    def prepare(self, model, tokenizer) -> None:
        """Host side, before the first setup: make missing per-checkpoint side data (none here)."""

    def setup(self, args: ModelArgs, max_batch_size: int, max_seq_length: int, dtype, device) -> None:
        self.args = args
        self.batch, self.dtype, self.device = max_batch_size, dtype, device
        self.group = args.n_heads // args.n_kv_heads
        # head_agg=query stores a copy of each KV head per query head (G x the K/V memory) so that every
        # query head keeps its own tokens; attention then reads storage head h with query head h
        self.store_heads = args.n_heads if self.head_agg == "query" else args.n_kv_heads
        self.store_group = args.n_heads // self.store_heads
        self.sliding_window = args.sliding_window
        self.max_seq_length = max_seq_length
        n = args.n_layers
        self.slots.setup(n, max_batch_size, self.store_heads, args.head_dim, dtype, device)
        self.pos: list = [None] * n
        self.score: list = [None] * n
        self.kept = [0] * n                   # prompt tokens kept per layer (host ints)
        self.layer_appends = [self.appending or not self.decode_evict] * n
        # each row's budget per layer [B, L] (an evicting layer's slots past it stay closed to that row) and
        # recent window [B, L], and its token budget (row_tokens, host ints): set per request by plan_rows
        self.row_budget = torch.zeros(max_batch_size, n, dtype=torch.long, device=device)
        self.row_window = torch.zeros(max_batch_size, n, dtype=torch.long, device=device)
        # each row's held question [B, 2]: positions [start, end) protected while the row is before `end`
        # (hold_question; 0, 0: none)
        self.row_question = torch.zeros(max_batch_size, 2, dtype=torch.long, device=device)
        # each adopted row's newest position [B] (-1: none): packed slots' `now` between adopt and the batch's
        # next forward, when q_pos is not yet the batch's (kv_store)
        self.row_now = torch.full((max_batch_size,), -1, dtype=torch.long, device=device)
        # per layer, the budget storage holds: until a prompt arrives, that of a max_seq_length-token prompt
        # (with a ratio the largest any prompt gets: the bound of fixed storage)
        if self.budgeted:
            self.budgets = self.layer_budgets(self.resolve_budget(max_seq_length), max_seq_length)
        # rows that join a running batch: storage allocated once here (at the bound above), reused by every request
        self.fixed_storage = self.decode_room is not None and self.admission == "row"
        if self.fixed_storage:
            for layer in range(n):
                self.allocate_layer(layer)
        self.reset()

    def reset(self) -> None:
        for p in self.pos:
            if p is not None:
                p.fill_(-1)
        self.row_question.zero_()
        self.row_now.fill_(-1)
        self.aligned = True     # every row holds a request that started with the others (else: adopt)
        self.row_tokens = [None] * self.batch
        self.n_filled = 0       # tokens seen so far (prompt + generated), a host int
        self.prompt_length = 0
        self.q_pos = None
        self.pending: dict = {}
        self.prepared = False   # before_prefill ran for this request
        self.staged = None      # a staged prompt's K/V, window queries and statistics (start_staging)

    def before_prefill(self, input_pos: Tensor) -> None:
        """Host side, before the prompt's first forward (input_pos [B, T], the whole prompt):
        validate, fix what the prompt keeps per layer and allocate those layers' storage.
        Done here rather than inside the (possibly compiled) prefill, so the graph never
        depends on the prompt length or max_seq_length through Python ints."""
        B, T = input_pos.shape
        if self.n_filled:
            raise ValueError(f"policy {self.name!r} takes the prompt in one pass; got a second chunk")
        if B != self.batch:
            raise ValueError(f"batch {B} does not match the cache's batch {self.batch}")
        if T > self.max_seq_length:
            raise ValueError(f"prompt of {T} tokens exceeds max_seq_length {self.max_seq_length}")
        self.prompt_length = T
        self.prompt_pos = input_pos
        self.lengths = (input_pos.amax(-1) + 1).tolist()    # each row's prompt length (one host sync)
        self.prepared = True
        if not self.defer_compression:
            self.plan_rows()
            for layer in range(len(self.k)):
                self.allocate(layer)

    def plan_rows(self) -> None:
        """Host side, once the layers' plans are known (before `allocate`): each row's token budget from its
        prompt length (`resolve_budget`), its per-layer budgets (`layer_budgets`) and recent windows, and the
        budget each layer's storage holds: the largest row's (fixed storage: the bound fixed at setup)."""
        rows = ([self.layer_budgets(self.resolve_budget(n), n) for n in self.lengths] if self.budgeted else
                [[self.layer_budget(layer) for layer in range(len(self.k))]] * len(self.lengths))
        if self.budgeted:
            self.row_tokens = [self.resolve_budget(n) for n in self.lengths]
            if not self.fixed_storage:
                self.budgets = [max(column) for column in zip(*rows)]
        windows = [[self.recent_window(layer, b) for layer, b in enumerate(row)] for row in rows]
        self.row_budget.copy_(torch.tensor(rows))
        self.row_window.copy_(torch.tensor(windows))

    def begin(self, input_pos: Tensor) -> None:
        B, T = input_pos.shape
        if self.pending:            # the prompt went through model(...) directly: finish it
            self.end_prefill()
        if not self.n_filled and not self.prepared:     # model(...) called without the engine
            self.before_prefill(input_pos)
        if not self.n_filled and not self.prefill_in_one_pass and T < self.prompt_length:
            self.start_staging()                        # the first of several chunks
        if not torch.compiler.is_compiling():           # the engine checks these on the host
            self.check_chunk(T)
        self.q_pos = input_pos
        if self.staged is not None:                     # this chunk over everything staged so far
            self.chunk_start = self.n_filled
            self.mask = attention_mask(input_pos, self.prompt_pos[:, :self.n_filled + T], self.group,
                                       self.sliding_window)
        elif not self.n_filled:
            self.mask = attention_mask(input_pos, input_pos, self.group, self.sliding_window)
        self.n_filled += T

    def check_chunk(self, T: int) -> None:
        """ValueError for a forward of T tokens the cache cannot take now (host side)."""
        if self.staged is not None:
            if self.n_filled + T > self.prompt_length:
                raise ValueError(f"prompt chunk ends at {self.n_filled + T}, past the prompt's "
                                 f"{self.prompt_length} tokens")
            if T == 1 and self.n_filled:
                raise ValueError("a later prompt chunk of one token would run as a decode step (model.forward): "
                                 "chunks after the first need at least 2 tokens (engine.chunk_end)")
        elif not self.n_filled and T < self.prompt_length:
            raise ValueError(f"policy {self.name!r} takes the prompt in one pass here (prefill_in_one_pass): got "
                             f"{T} of its {self.prompt_length} tokens")
        elif self.n_filled and T > 1:
            raise ValueError(f"policy {self.name!r} has its whole prompt already; got a second chunk")
        if self.n_filled >= self.max_seq_length:
            raise ValueError(f"KV cache full: position {self.n_filled} >= max_seq_length {self.max_seq_length}")

    def before_decode_step(self, step: int) -> None:
        pass

    def capacity(self, layer: int) -> int:
        """Slots layer `layer` allocates: its budget, plus room for every generated token when
        it appends (an evicting layer holds its budget): decode_room tokens, or, without one, up to
        max_seq_length after this prompt.  Slots the prompt leaves empty (budget > prompt) stay empty
        until decode fills them."""
        budget = self.layer_budget(layer)
        room = self.max_seq_length - self.prompt_length if self.decode_room is None else self.decode_room
        return budget + room if self.layer_appends[layer] else budget

    def allocate(self, layer: int) -> None:
        """Fix what the prompt keeps in layer `layer` and allocate its storage (host side, once the prompt
        length is known; storage fixed at setup is reused)."""
        self.kept[layer] = min(self.layer_budget(layer), self.prompt_length)
        if not self.fixed_storage:
            self.allocate_layer(layer)

    def allocate_layer(self, layer: int) -> None:
        B, H, cap = self.batch, self.store_heads, self.capacity(layer)
        self.slots.allocate(layer, cap)
        self.pos[layer] = torch.full((B, H, cap), -1, dtype=torch.long, device=self.device)
        scored = self.decode_attention or not self.layer_appends[layer]     # slots an eviction chooses among
        self.score[layer] = torch.zeros(B, H, cap, dtype=torch.float32, device=self.device) if scored else None

    def used_slots(self, layer: int) -> int:
        """Slots any sequence may have filled so far (empty slots fill lowest index first; rows that
        joined a running batch: counted from the slot table, a host sync)."""
        if not self.aligned:
            filled = (self.pos[layer] >= 0).any(0).any(0).nonzero()
            return int(filled[-1]) + 1 if len(filled) else 0
        return min(self.pos[layer].shape[2], self.kept[layer] + self.n_filled - self.prompt_length)

    # ----------------------------------------------------------------- rows that join and leave
    def row_tensors(self, layer: int, row: int) -> list[Tensor]:
        """Row `row` of what layer `layer` holds: slot table, slot scores, K/V (its format's)."""
        kept = [self.pos[layer][row]] + ([self.score[layer][row]] if self.score[layer] is not None else [])
        return kept + self.slots.row(layer, row)

    def release(self, row: int) -> None:
        """Forget row `row`'s request (host side): its slots become empty; the other rows go on."""
        for pos in self.pos:
            pos[row] = -1
        self.row_question[row] = 0
        self.row_now[row] = -1
        self.row_tokens[row] = None
        self.aligned = False
        self.n_filled = max(int(pos.amax()) + 1 for pos in self.pos)     # the longest row's tokens

    def adopt(self, row: int, other: "EvictionPolicy", other_row: int = 0) -> None:
        """Take over request `other_row` of `other` (this policy's spec, set up with the same decode_room
        and max_seq_length but its own batch size, its prompt complete) into row `row` (host side)."""
        if self.admission != "row":
            raise ValueError(f"{self.name} admits whole batches (admission 'batch'): rows cannot join a running batch")
        if self.decode_room is None or other.decode_room != self.decode_room:
            raise ValueError("rows join a running batch only with the same decode_room set before setup")
        self.release(row)
        for layer in range(len(self.pos)):
            for dst, src in zip(self.row_tensors(layer, row), other.row_tensors(layer, other_row)):
                dst.copy_(src)
        self.row_budget[row], self.row_window[row] = other.row_budget[other_row], other.row_window[other_row]
        self.row_tokens[row] = other.row_tokens[other_row]
        self.row_now[row] = other.q_pos[other_row].amax() if other.q_pos is not None else other.row_now[other_row]
        self.n_filled = max(self.n_filled, other.n_filled)
        self.prompt_length = max(self.prompt_length, other.prompt_length)
        self.kept = [max(a, b) for a, b in zip(self.kept, other.kept)]      # what describe() reports

    def question_room(self, row: int) -> Optional[int]:
        """The longest question row `row` can hold whole (`hold_question`): in each evicting layer its budget
        less the sinks (so a victim is left outside the sinks and the question); None when no layer evicts."""
        budgets = [int(self.row_budget[row, layer]) if self.budgeted else self.layer_budget(layer)
                   for layer, appends in enumerate(self.layer_appends) if not appends]
        return min(budgets) - self.n_sink if budgets else None

    def hold_question(self, row: int, start: int, end: int) -> None:
        """Host side (the agnostic protocol): positions [start, end) of row `row`, a question appended one decode
        step each after its context, are never an evicting layer's victims while the row's position is below
        `end` (`held`): all of them are held when its first answer token is sampled; after that they are
        ordinary tokens.  release, adopt and reset forget it.  ValueError when the question cannot be held
        whole (longer than question_room)."""
        room = self.question_room(row)
        if not 0 <= start < end:
            raise ValueError(f"a held question needs 0 <= start < end, got [{start}, {end})")
        if room is not None and end - start > room:
            raise ValueError(f"{self.name}: a question of {end - start} tokens cannot be held whole: an evicting "
                             f"layer keeps {room + self.n_sink} tokens per KV head, {self.n_sink} of them sinks")
        self.row_question[row, 0], self.row_question[row, 1] = start, end

    def held(self, layer: int) -> Tensor:
        """Slots [B, H, C] holding a question that is still being appended (hold_question)."""
        start, end = self.row_question[:, 0, None, None], self.row_question[:, 1, None, None]
        pos = self.pos[layer]
        return (pos >= start) & (pos < end) & (self.q_pos[:, None, :] < end)

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.staged is not None:
            return self.prefill_staged(layer, q, k, v)
        out = grouped_attention(q, k, v, self.mask)
        stats = self.prefill_stats(layer, q, k, self.q_pos, self.q_pos)
        if self.defer_compression:
            self.pending[layer] = (k, v, stats)
        else:
            self.compress(layer, k, v, stats)
        return out

    def end_prefill(self) -> None:
        if not self.pending:
            return
        if self.staged is not None:         # the staged prompt is complete: compress it as one pass would
            self.q_pos, self.staged = self.prompt_pos, None
        if self.defer_compression:
            self.plan([self.pending[i][2] for i in range(len(self.k))])
            self.plan_rows()
        for layer in range(len(self.k)):
            if self.defer_compression:
                self.allocate(layer)
            self.compress(layer, *self.pending.pop(layer))

    # ----------------------------------------------------------------- a prompt in chunks (module doc)
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

    def compress(self, layer: int, k: Tensor, v: Tensor, stats: dict) -> None:
        """Keep the prompt tokens with the best keep_scores, the sinks and the recent window in the layer's
        storage (its first layer_budget slots; those without a keepable token stay empty)."""
        k, v = self.to_store(k), self.to_store(v)
        H, D = k.shape[1], k.shape[3]
        pos = self.q_pos[:, None, :].expand(-1, H, -1)
        scores = self.keep_scores(layer, {**stats, "token": self.token_scores(layer, k, v, pos)}, self.q_pos, H)
        always = recent_and_sinks(self.q_pos, self.n_sink, self.row_window[:, layer, None])[:, None, :]
        ranked = scores.masked_fill(always, ALWAYS).masked_fill((self.q_pos < 0)[:, None, :], NEVER)
        idx, valid = select_top(ranked, self.layer_budget(layer), self.row_budget[:, layer] if self.budgeted else None)
        n = idx.shape[-1]
        gather = idx[..., None].expand(-1, -1, -1, D)
        kc, vc = k.gather(2, gather), v.gather(2, gather)
        self.pos[layer][:, :, :n] = torch.where(valid, pos.gather(2, idx), -1)
        if self.score[layer] is not None:
            self.score[layer][:, :, :n] = scores.gather(2, idx)
        self.on_compress(layer, k, v, idx, valid, stats, kc, vc)
        self.write_kept(layer, kc, vc)

    def to_store(self, x: Tensor) -> Tensor:
        """K or V [B, H_kv, T, D] as stored: repeated per query head under head_agg=query."""
        return x if x.shape[1] == self.store_heads else x.repeat_interleave(self.store_heads // x.shape[1], 1)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k, v = self.to_store(k), self.to_store(v)
        if self.decode_attention and not self.layer_appends[layer]:
            out, p_old, p_new = self.attend_and_probs(layer, q, k, v)
            self.observe(layer, p_old, p_new)
            slot = self.store(layer, k, v)
            self.score[layer].scatter_(2, slot[:, :, None], reduce_heads(p_new, self.head_agg))
            return out
        self.store(layer, k, v)
        return self.attend(layer, q)

    def store(self, layer: int, k: Tensor, v: Tensor) -> Tensor:
        """Write the new token k, v [B, H_kv, 1, D] into its slot (and, in an evicting layer, its
        token_scores into the slot's score: decode_attention policies score it in `decode`); returns the
        slot [B, H_kv].  Readers call this, not `decode`."""
        pc = self.pos[layer]
        evicts = not self.layer_appends[layer]
        slot = self.decode_victim(layer) if evicts else self.first_empty(layer)
        self.on_evict(layer, slot)
        pos = self.q_pos[:, None, :].expand(-1, pc.shape[1], 1)
        pc.scatter_(2, slot[:, :, None], pos)
        if evicts and not self.decode_attention:
            self.score[layer].scatter_(2, slot[:, :, None], self.token_scores(layer, k, v, pos))
        self.write_slots(layer, slot, k, v)
        return slot

    def attend(self, layer: int, q: Tensor) -> Tensor:
        """Decode attention of q [B, H_q, 1, D] over every slot of the layer (empty ones masked):
        the cost is bounded by what is kept, and the shape does not change as the cache fills
        (a compiled step would otherwise specialize).  Sparse readers replace this."""
        return self.slots.attend(layer, q, self.visible(layer), self.pos[layer], self.q_pos)

    def storage(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """Composition hook: (k, v [B, H_kv, C, D], visible [B, H_kv, C]) of the layer as the
        current query may read it; slots keep their index until overwritten."""
        return (*self.slots.tensors(layer), self.visible(layer))

    # ----------------------------------------------------------------- K/V format
    # How slots hold K/V is the object `self.slots` (DenseSlots: the compute dtype; cache/quantized.py's
    # KIVISlots: KIVI-packed, chosen by --kv-bits through with_kv_bits).  Policies reach stored K/V only
    # through these delegates (and `attend`, `storage`), which hand the format the layer's slot table.
    @property
    def k(self) -> list:
        """Per layer, the format's key storage (DenseSlots: [B, H_kv, C, D]; KIVISlots: a SlotStore)."""
        return self.slots.k

    @property
    def v(self) -> list:
        """Per layer, the format's value storage (KIVISlots: the same SlotStore as `k`)."""
        return self.slots.v

    @property
    def kv_bits(self) -> int:
        return self.slots.bits

    @property
    def kv_group(self) -> int:
        return self.slots.group

    @property
    def kv_residual(self) -> int:
        return self.slots.residual

    def write_kept(self, layer: int, kc: Tensor, vc: Tensor) -> None:
        """The kept prompt tokens kc, vc [B, H_kv, n, D] into slots [0, n) (pos already written)."""
        self.slots.write_kept(layer, kc, vc, self.pos[layer], self.q_pos)

    def write_slots(self, layer: int, slot: Tensor, k: Tensor, v: Tensor, where: Tensor | None = None) -> None:
        """k, v [B, H_kv, 1, D] into slot [B, H_kv] (pos already written); where [B, H_kv] bool: only there."""
        self.slots.write(layer, slot, k, v, self.pos[layer], self.q_pos, where)

    def read_slots(self, layer: int, slot: Tensor) -> tuple[Tensor, Tensor]:
        """(k, v) [B, H_kv, 1, D] held by slot [B, H_kv]."""
        return self.slots.read(layer, slot, self.pos[layer], self.q_pos)

    def key_cosine(self, layer: int, k: Tensor) -> Tensor:
        """Cosine similarity of k [B, H_kv, 1, D] with every slot's key -> [B, H_kv, C] fp32."""
        return self.slots.cosine(layer, k, self.pos[layer], self.q_pos)

    def attend_and_probs(self, layer: int, q: Tensor, k: Tensor, v: Tensor):
        """`attend_with_new` over the layer's slots plus the new token -> (out, p_old, p_new)."""
        return self.slots.attend_and_probs(layer, q, k, v, self.visible(layer), self.pos[layer], self.q_pos)

    def dense_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """(k, v) [B, H_kv, C, D] of every slot in the compute dtype, for host-side one-off reads
        (a packed format makes a copy here: never call it in the decode step)."""
        return self.slots.dense(layer, self.pos[layer], self.q_pos)

    def kv_store(self, layer: int):
        """(store, pos [B, H_kv, C], now [B]): the packed slots a sparse reader reads (KIVISlots only).  Before
        the batch's first forward (a reader building its index over the rows adopted so far) `now` is each
        row's newest position as adopt recorded it."""
        q_pos = self.q_pos if self.q_pos is not None else self.row_now[:, None]
        return self.slots.kv_store(layer, self.pos[layer], q_pos)

    def visible(self, layer: int) -> Tensor:
        """Slots [B, H_kv, C] the current query may attend (filled, within a sliding window)."""
        pc = self.pos[layer]
        visible = pc >= 0
        if self.sliding_window:
            visible &= self.q_pos[:, None, :] - pc < self.sliding_window
        return visible

    def first_empty(self, layer: int) -> Tensor:
        """The lowest empty slot [B, H_kv] (the appending layers' victim)."""
        return first_min((self.pos[layer] >= 0).float())

    def protected(self, layer: int, n_sink: int, window: "int | Tensor") -> Tensor:
        """Slots [B, H, C] an evicting layer never gives up at this step: the first n_sink
        tokens and the `window` most recent (an int, or per row [B, 1, 1]; the new token being one of them)."""
        pos = self.pos[layer]
        return (pos < n_sink) | (pos > self.q_pos[:, None, :] - window)

    def lowest(self, layer: int, score: Tensor, keep: Tensor) -> Tensor:
        """Victim [B, H]: an empty slot if any, else the slot of lowest score outside `keep` [B, H, C] and a
        question being appended (`held`).  A row never takes the slots past its own budget (a batch allocates
        the largest row's): they stay closed, so the row holds what it holds alone."""
        score = score.masked_fill(keep | self.held(layer), ALWAYS).masked_fill(self.pos[layer] < 0, NEVER)
        if self.budgeted:
            slots = torch.arange(score.shape[-1], device=score.device)
            score = score.masked_fill(slots >= self.row_budget[:, layer, None, None], ALWAYS)
        return first_min(score)

    def kept_positions(self, layer: int) -> Tensor:
        return self.pos[layer][:, :, :self.used_slots(layer)]

    def kv_bytes(self) -> dict:
        layers = [i for i, k in enumerate(self.k) if k is not None]
        allocated = sum(self.slots.nbytes(i) for i in layers)
        live = sum(self.slots.nbytes(i, self.used_slots(i)) for i in layers)
        return {"allocated": allocated, "live": live, "read_per_step": allocated}

    def describe(self) -> dict:
        d = {"policy": self.name, **param_values(self), **self.slots.describe()}
        rows = [b for b, tokens in enumerate(self.row_tokens) if tokens is not None]     # rows holding a request
        if rows:            # the token budget each row's prompt resolved to (one number when they agree)
            resolved = {self.row_tokens[b] for b in rows}
            d["resolved_budget"] = resolved.pop() if len(resolved) == 1 else list(self.row_tokens)
        if self.prompt_length and any(k is not None for k in self.k):
            d["kept_prompt_tokens_per_layer"] = list(self.kept)
            least = int(self.row_budget[rows].min()) if rows else min(map(self.layer_budget, range(len(self.k))))
            if self.prompt_length <= least:
                d["note"] = f"budget >= prompt ({self.prompt_length} tokens): the prompt is kept whole"
        return d
