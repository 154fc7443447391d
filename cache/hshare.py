"""HShare (Wu et al., ICLR 2025): Double Sparsity's critical-token selection, shared across layers,
heads and queries.

Selection (as `ds`): x sinks + y recent tokens (the current one included) + the top-z middle tokens
by approximate scores (query heavy channels x label cache), N_c = x + y + z; presets `short`
(N_c=128: 8/32/88) and `long` (N_c=512: 16/64/432).

Sharing, decided once per request after prefill (host side, `end_prefill`):
  * critical-token sets: for each of the last `sim_queries` (16) prompt queries, every layer and KV
    head, the top-z *middle* tokens by the same approximate scores decode uses (sinks and recent
    tokens are common to every layer and head, so they are left out of the comparison, as in the
    reference implementation);
  * similarity (paper eq. 3) |A n B| / max(|A|, |B|) of two layers (same KV head, same query) or two
    KV heads of a layer (same query), averaged over queries, heads and batch rows: one configuration
    per batch, as the paper computes it "for each batch of samples";
  * Algorithm 1 (greedy): k = n - round(ratio * n) times, take the most similar pair (i, j), j < i,
    let i share j's indices and remove row and column i; a source picked earlier may itself become
    a sharer later, so every sharer is resolved to the root of its chain (a source: earlier layer /
    lower head).  Exactly round(ratio * n) layers (heads per layer) select.  `sharing=random` runs the
    same greedy on a random matrix (the paper's ablation).
Heads share at KV-head granularity: with GQA a selection already serves the G query heads of a KV
head (one gathered list read once per group by the kernel), so the shared unit is the KV head's
list; on MHA models this is the paper's per-head sharing.

Decode, with the configuration as data (tensors fixed after prefill):
  * query sharing: a = round(1 / query_ratio); decode steps 0, a, 2a, ... are *select* steps, the
    others *reuse* steps, decided by the host's own counter in `before_decode_step(step)` (a Python
    flag: under torch.compile exactly two graph variants, none depending on the request).  A reuse
    step reads the last select step's N_c slots plus the slots of the tokens generated since (at most
    a - 1, kept in a small per-layer ring with a valid mask), so the current token is always read;
    the index list has N_c + a - 1 entries in both variants.
  * layer sharing: at a select step a source layer selects and caches its lists; a sharing layer
    takes its root's cached lists.  In eager mode this is a Python branch on the host copy of the
    configuration; compiled, it is `torch.cond` on a per-layer bool tensor, so one graph serves every
    configuration (on CPU the predicate is a plain memory read; on CUDA each cond reads its predicate
    on the host).
  * head sharing: the label cache of every layer is stored with the selecting KV heads first (a
    permutation fixed after prefill), so approximate scores and top-k run over those heads only (a
    slice, no copy); the other heads take their root's list through an index map.
With an eviction policy underneath (`snapkv+hshare`), layers and heads hold different tokens in a
given slot, so shared lists travel as *positions* and are translated to each layer's/head's own
slots through a position -> slot table (a position a layer no longer holds is simply not read).

    python engine.py --checkpoint C --policy hshare --policy-args preset=long,ratios=3/4-3/4-1/2
    python engine.py --checkpoint C --policy snapkv+hshare --policy-args budget=1024,preset=short
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cache.labels import LabelReader, gather_channels
from cache.shard import shard_of
from cache.sparse_read import INF, n_sources, param, parse_ratios, policy_params, ratio, select_slots


# --------------------------------------------------------------------------- Algorithm 1

def greedy_sharing(sim, n_share: int) -> list[int]:
    """The paper's Algorithm 1 on a similarity matrix sim [n, n] (only entries j < i are used):
    n_share times take the largest S[i, j], set C[i] = j and clear row and column i.  Returns C
    (C[i] = i for layers/heads that keep their own selection; ties go to the lowest (i, j))."""
    S = torch.as_tensor(sim, dtype=torch.float64).clone()
    n = S.shape[0]
    if not 0 <= n_share < max(n, 1):
        raise ValueError(f"cannot make {n_share} of {n} share (at least one must select)")
    lower = torch.ones(n, n, dtype=torch.bool).tril(-1)
    S = S.masked_fill(~lower, -INF)
    config = list(range(n))
    for _ in range(n_share):
        flat = int(torch.argmax(S))
        i, j = divmod(flat, n)
        S[i, :] = -INF
        S[:, i] = -INF
        config[i] = j
    return config


def share_roots(config: list[int]) -> list[int]:
    """Resolve sharing chains (i -> j -> m) to their roots: the index whose selection is used."""
    roots = []
    for i in range(len(config)):
        r = i
        while config[r] != r:
            r = config[r]
        roots.append(r)
    return roots


def overlap_rows(onehot: Tensor, ids: Tensor, ok: Tensor, n_a: Tensor) -> Tensor:
    """Eq. 3 per row: |A n B| / max(|A|, |B|) with A given as onehot [R, U+1] (sizes n_a [R]) and B as
    ids/ok [R, z]; two empty sets count as identical (1)."""
    space = onehot.shape[1] - 1
    hit = onehot.gather(1, torch.where(ok, ids, space)) & ok
    denom = torch.maximum(n_a, ok.sum(1))
    return torch.where(denom > 0, hit.sum(1) / denom.clamp(min=1), torch.ones_like(denom, dtype=torch.float32))


def onehot_sets(ids: Tensor, ok: Tensor, space: int) -> Tensor:
    """ids/ok [R, z] -> bool [R, space + 1] membership (column `space` is a trash bin, kept False)."""
    out = torch.zeros(ids.shape[0], space + 1, dtype=torch.bool, device=ids.device)
    out.scatter_(1, torch.where(ok, ids, space), True)
    out[:, space] = False
    return out


def pairwise_similarity(sets: list, rows: Tensor, space: int) -> Tensor:
    """[n, n] eq.-3 similarity of set families i > j (0 elsewhere), averaged over the rows that
    count: sets[i] = (ids, ok) [R, z] (R rows, e.g. batch x head x query), rows [R] bool."""
    n, n_rows = len(sets), rows.sum().clamp(min=1)
    sim = torch.zeros(n, n)
    for i in range(n):
        onehot, n_i = onehot_sets(*sets[i], space), sets[i][1].sum(1)
        for j in range(i):
            sim[i, j] = float((overlap_rows(onehot, *sets[j], n_i) * rows).sum() / n_rows)
    return sim


def own_tensors(t: Tensor) -> list[Tensor]:
    """The rows of t as separate tensors with their own storage (views would carry storage offsets,
    which torch.compile treats as dynamic sizes and may specialize on)."""
    return [row.clone() for row in t]


# --------------------------------------------------------------------------- the policy

@dataclass(eq=False)
class HSharePolicy(LabelReader):
    admission = "batch"     # the sharing configuration is computed once per batch from its prompts
    name = "hshare"
    layer_ratio: float = param(0.75, "share of layers that select their own tokens (1 = no layer sharing)", ratio)
    head_ratio: float = param(0.75, "share of KV heads per layer that select (1 = no head sharing)", ratio)
    query_ratio: float = param(0.5, "1/a: indices are selected every a-th decode step (1 = every step)", ratio)
    ratios: str = param("", "layer-head-query in one, e.g. 3/4-3/4-1/2 (instead of the three above)")
    sharing: str = param("greedy", "greedy (Algorithm 1 on critical-set similarity) or random (ablation)")
    seed: int = param(0, "seed of sharing=random")
    sim_queries: int = param(16, "last prompt queries whose critical sets define the similarities")
    head_aggs = ("mean", "max")     # sharing is per KV head list: no per-query-head lists (head_agg=query)

    def resolve(self) -> None:
        super().resolve()
        names = ("layer_ratio", "head_ratio", "query_ratio")
        if self.ratios:
            if any(getattr(self, k) != policy_params(type(self))[k][1] for k in names):
                raise ValueError("give either ratios=layer-head-query or layer_ratio/head_ratio/query_ratio, not both")
            self.layer_ratio, self.head_ratio, self.query_ratio = parse_ratios(self.ratios)
            self.ratios = ""
        self.layer_ratio, self.head_ratio, self.query_ratio = (ratio(getattr(self, k)) for k in names)
        self.a = max(1, round(1 / self.query_ratio))

    def validate(self) -> None:
        super().validate()
        if self.sharing not in ("greedy", "random"):
            raise ValueError(f"sharing must be greedy or random, got {self.sharing!r}")
        if self.sim_queries < 1:
            raise ValueError("sim_queries must be at least 1")

    def setup(self, args, max_batch_size, max_seq_length, dtype, device) -> None:
        L, H = args.n_layers, args.n_kv_heads
        self.n_src_layers = n_sources(self.layer_ratio, L)
        self.n_src_heads = n_sources(self.head_ratio, H)
        self.layer_sharing = self.n_src_layers < L
        self.head_sharing = self.n_src_heads < H
        self.caching = self.layer_sharing or self.a > 1       # lists must outlive their layer/step
        super().setup(args, max_batch_size, max_seq_length, dtype, device)

    def reset(self) -> None:
        super().reset()
        L, H = self.args.n_layers, self.args.n_kv_heads
        # the last `sim_queries` prompt queries per layer and their positions (-1: none yet); fixed
        # shapes, so a compiled prefill has no guard on the chunk length or on the chunk's index
        w, a = self.sim_queries, self.args
        self.tail_q = [torch.zeros(self.batch, a.n_heads, w, a.head_dim, dtype=self.dtype, device=self.device)
                       for _ in range(L)]
        self.tail_pos = torch.full((self.batch, w), -1, dtype=torch.long, device=self.device)
        self.selecting = True
        self.roots = list(range(L))                      # host copy of the layer configuration
        self.head_roots = [list(range(H)) for _ in range(L)]
        self.layer_sim = self.head_sim = None
        self.slot_of = None
        self.idx_cache = self.ok_cache = self.pos_cache = self.sel_cache = self.tail_slot = self.tail_ok = None

    # ----------------------------------------------------------------- after prefill
    def observe_prefill(self, layer: int, q: Tensor, k: Tensor) -> None:
        super().observe_prefill(layer, q, k)
        if not (self.layer_sharing or self.head_sharing):
            return
        w = self.sim_queries
        self.tail_q[layer] = torch.cat([self.tail_q[layer], q], dim=2)[:, :, -w:].clone()
        if layer == 0:
            self.tail_pos = torch.cat([self.tail_pos, self.q_pos], dim=1)[:, -w:].clone()

    def end_prefill(self) -> None:
        was_built = self.built
        super().end_prefill()
        if self.built and not was_built:
            self.configure()

    def configure(self) -> None:
        """Sharing configuration (host, once per request) and the decode-time tensors."""
        L, H, B = self.args.n_layers, self.args.n_kv_heads, self.q_pos.shape[0]
        dev = self.device
        if self.layer_sharing or self.head_sharing:
            ids, ok = zip(*(self.critical_sets(layer) for layer in range(L)))
            space = self.readable_length(0) if self.storage_.uniform else self.max_seq_length
            row_ok = (self.tail_pos >= 0)                                       # [B, w]
            # under --tp: the mean over every process's heads (the same layer roots everywhere); head sharing
            # stays within the process's own heads (head_similarity of its heads only: docs/policies.md)
            self.layer_sim = shard_of(self.args).mean(self.layer_similarity(ids, ok, row_ok, space))
            self.head_sim = [self.head_similarity(ids[layer], ok[layer], row_ok, space) for layer in range(L)]
            g = torch.Generator().manual_seed(self.seed)
            if self.layer_sharing:
                sim = self.layer_sim if self.sharing == "greedy" else torch.rand(L, L, generator=g)
                self.roots = share_roots(greedy_sharing(sim, L - self.n_src_layers))
            if self.head_sharing:
                self.head_roots = []
                for layer in range(L):
                    sim = self.head_sim[layer] if self.sharing == "greedy" else torch.rand(H, H, generator=g)
                    self.head_roots.append(share_roots(greedy_sharing(sim, H - self.n_src_heads)))
        # data the decode step reads
        self.is_source = [self.roots[i] == i for i in range(L)]
        self.is_source_t = own_tensors(torch.tensor(self.is_source, device=dev))
        # per-layer tensors (list items, never indexed by a layer constant inside the step, so the
        # compiled selection subgraphs of all layers are identical and compile once)
        self.root_t = own_tensors(torch.tensor(self.roots, device=dev).view(L, 1))
        perms, maps = [], []
        for roots in self.head_roots:
            order = [h for h in range(H) if roots[h] == h] + [h for h in range(H) if roots[h] != h]
            perms.append(order)
            maps.append([order.index(roots[h]) for h in range(H)])
        self.perm = own_tensors(torch.tensor(perms, device=dev))                # [H] label-cache head order
        self.head_map = own_tensors(torch.tensor(maps, device=dev))             # [H] natural head -> row
        if self.head_sharing:
            for layer in range(L):
                self.labels.permute(layer, self.perm[layer])
                self.label_channels[layer] = self.channel_ids[layer].index_select(0, self.perm[layer])
        N = self.n_critical
        if not self.storage_.uniform and (self.layer_sharing or self.head_sharing):
            self.slot_of = [self.slot_table(layer) for layer in range(L)]
        if self.caching:
            self.idx_cache = torch.zeros(L, B, H, N, dtype=torch.long, device=dev)
            self.ok_cache = torch.zeros(L, B, H, N, dtype=torch.bool, device=dev)
            if not self.storage_.uniform:      # the positions selected (stale-slot checks, translation)
                self.pos_cache = torch.full((L, B, H, N), -1, dtype=torch.long, device=dev)
            if self.slot_of is not None:       # selected before translation (what sharing layers take)
                self.sel_cache = torch.zeros(L, B, H, N, dtype=torch.bool, device=dev)
        if self.a > 1:
            self.tail_slot = torch.zeros(L, B, H, self.a - 1, dtype=torch.long, device=dev)
            self.tail_ok = torch.zeros(L, B, H, self.a - 1, dtype=torch.bool, device=dev)
        self.selecting = True

    def critical_sets(self, layer: int) -> tuple[Tensor, Tensor]:
        """Top-z middle tokens of the last prompt queries by the approximate scores decode ranks by (the
        same head_agg over each KV head's query heads), in the space shared lists live in (slots for the
        full cache, positions otherwise): ids, ok [B, H, w, z]."""
        B, H, G = self.q_pos.shape[0], self.args.n_kv_heads, self.group
        q = self.tail_q[layer]                                                 # [B, H_q, w, D]
        w, D = q.shape[2], q.shape[3]
        S = self.readable_length(layer)
        ql = gather_channels(q.reshape(B, H, G, w, D), self.channel_ids[layer]).float()   # [B, H, G, w, C]
        per_head = ql @ self.labels.dense(layer, S)[:, :, None].transpose(-1, -2)  # [B, H, G, w, S]
        # the group's scores reduced as decode reduces them (head_agg mean or max)
        scores = self.reduce_query_scores(per_head.reshape(B, H * G, w * S)).view(B, H, w, S)
        pos = self.storage_.full_positions(layer)[:, :, None, :S]              # [B, 1|H, 1, S]
        qp = self.tail_pos[:, None, :, None]
        middle = (pos >= 0) & (pos <= qp) & (pos >= self.n_sink) & (pos <= qp - self.n_recent)
        if self.sliding_window:
            middle &= qp - pos < self.sliding_window
        z = min(self.n_critical - self.n_sink - self.n_recent, S)
        vals, idx = scores.masked_fill(~middle, -INF).topk(z, dim=-1)
        ok = vals > -INF
        if not self.storage_.uniform:
            idx = pos.expand(B, H, w, S).gather(-1, idx)
        return idx, ok

    @staticmethod
    def layer_similarity(ids, ok, row_ok: Tensor, space: int) -> Tensor:
        """[L, L] mean eq.-3 similarity of layers i > j (same head and query), 0 elsewhere."""
        rows = row_ok[:, None, :].expand(ids[0].shape[:3]).reshape(-1)         # [B*H*w]
        sets = [(i.reshape(-1, i.shape[-1]), o.reshape(-1, o.shape[-1])) for i, o in zip(ids, ok)]
        return pairwise_similarity(sets, rows, space)

    @staticmethod
    def head_similarity(ids: Tensor, ok: Tensor, row_ok: Tensor, space: int) -> Tensor:
        """[H, H] mean eq.-3 similarity of KV heads i > j of one layer (same query), ids/ok [B, H, w, z]."""
        sets = [(ids[:, h].reshape(-1, ids.shape[-1]), ok[:, h].reshape(-1, ok.shape[-1])) for h in range(ids.shape[1])]
        return pairwise_similarity(sets, row_ok.reshape(-1), space)

    def slot_table(self, layer: int) -> Tensor:
        """Position -> slot of every KV head of a layer [B, H, max_seq_length + 1] int32 (-1: not held)."""
        pos = self.storage_.full_positions(layer)
        B, H, cap = pos.shape
        P = self.max_seq_length
        table = torch.full((B, H, P + 1), -1, dtype=torch.int32, device=pos.device)
        slots = torch.arange(cap, dtype=torch.int32, device=pos.device).expand(B, H, cap)
        table.scatter_(2, torch.where(pos >= 0, pos, P), slots)
        table[:, :, P] = -1
        return table

    # ----------------------------------------------------------------- decode
    def index_static_tensors(self) -> list[Tensor]:
        """The label cache's, the per-layer configuration tensors and the index caches (fixed at configure)."""
        caches = (self.idx_cache, self.ok_cache, self.pos_cache, self.sel_cache, self.tail_slot, self.tail_ok)
        per_layer = (self.is_source_t, self.root_t, self.perm, self.head_map, self.slot_of or [])
        return super().index_static_tensors() + [t for t in caches if t is not None] + [t for ts in per_layer for t in ts]

    def before_decode_step(self, step: int) -> None:
        super().before_decode_step(step)
        self.selecting = step % self.a == 0

    def update(self, layer: int, k: Tensor, slot) -> None:
        if self.slot_of is not None:            # eviction storage: keep position -> slot current
            B, H = slot.shape
            self.slot_of[layer].scatter_(2, self.q_pos.reshape(B, 1, 1).expand(B, H, 1), slot.int()[..., None])
        if self.head_sharing:
            perm = self.perm[layer]
            k = k.index_select(1, perm)
            if isinstance(slot, Tensor):
                slot = slot.index_select(1, perm)
        super().update(layer, k, slot)

    def translate(self, layer: int, positions: Tensor, ok: Tensor) -> tuple[Tensor, Tensor]:
        """Positions [B, H, N] -> this layer's own slots per KV head (eviction storage); ok drops
        positions the head does not hold."""
        table = self.slot_of[layer]
        P = table.shape[2] - 1
        slots = table.gather(2, torch.where(ok, positions, P).clamp(0, P)).long()
        pos = self.storage_.full_positions(layer)
        held = pos.gather(2, slots.clamp(min=0)) == positions
        return slots.clamp(min=0), ok & (slots >= 0) & held

    def slot_positions(self, layer: int, idx: Tensor, heads: Tensor | None = None) -> Tensor:
        """Positions [B, h, N] held by the slots idx [B, h, N] (of `heads`, default all)."""
        pos = self.storage_.full_positions(layer)
        if heads is not None and pos.shape[1] > 1:
            pos = pos.index_select(1, heads)
        pos = pos.expand(-1, idx.shape[1], -1)
        return pos.gather(2, idx.clamp(0, pos.shape[2] - 1))

    def own_selection(self, layer: int, q: Tensor) -> tuple[Tensor, Tensor]:
        """A source layer's selection [B, H_kv, N_c] (natural head order): the selecting heads run the
        approximate scores and top-k, the other heads take their root head's list.  Slots (idx, ok),
        or with translation (eviction storage and layer/head sharing) the selected *positions*."""
        translated = self.slot_of is not None
        if not self.head_sharing:
            idx, ok = self.select(layer, q)
            return (self.slot_positions(layer, idx), ok) if translated else (idx, ok)
        B, Hq, _, D = q.shape
        H, h = self.args.n_kv_heads, self.n_src_heads
        perm, hmap = self.perm[layer], self.head_map[layer]
        q_perm = q.reshape(B, H, self.group, D).index_select(1, perm).reshape(B, Hq, 1, D)
        scores = self.scores(layer, q_perm, heads=h)                           # [B, h, S]
        idx, ok = select_slots(scores, self.bias(layer, perm[:h]), self.n_slots(), self.backend)
        if translated:
            idx = self.slot_positions(layer, idx, perm[:h])
        return idx.index_select(1, hmap), ok.index_select(1, hmap)

    def max_reads(self) -> int:
        """N_c + a - 1: a reuse step also reads the tokens generated since the last select step."""
        return self.n_critical + self.a - 1

    def n_slots(self):
        """N_c, from the index cache's shape when there is one: compiled with dynamic shapes, an int
        attribute becomes an unbounded symbol while a tensor size is known to be positive, and
        torch.cond needs both branches' outputs to have plainly contiguous strides."""
        return self.ok_cache.shape[-1] if self.ok_cache is not None else self.n_critical

    def shared_selection(self, layer: int, sel_cache: Tensor, ok_cache: Tensor) -> tuple[Tensor, Tensor]:
        """A sharing layer's selection: its root layer's, cached earlier in this step."""
        root = self.root_t[layer]
        return sel_cache.index_select(0, root)[0], ok_cache.index_select(0, root)[0]

    def select_step(self, layer: int, q: Tensor) -> tuple[Tensor, Tensor]:
        if not self.layer_sharing:
            return self.own_selection(layer, q)
        caches = (self.pos_cache, self.sel_cache) if self.slot_of is not None else (self.idx_cache, self.ok_cache)
        # compiled, the configuration is data (torch.cond): one graph for every configuration; but a CUDA graph replays
        # no control flow (Inductor disables cudagraphs around torch.cond), so the static step branches on the host's
        # copy: one graph per configuration, i.e. per batch (docs/design.md, CUDA graphs)
        if torch.compiler.is_compiling() and not self.static_step:
            def dense(pair):        # cond wants both branches' outputs with plain contiguous strides
                return tuple(t.contiguous() for t in pair)
            return torch.cond(self.is_source_t[layer], lambda q, *c: dense(self.own_selection(layer, q)),
                              lambda q, *c: dense(self.shared_selection(layer, *c)), (q, *caches))
        if self.is_source[layer]:
            return self.own_selection(layer, q)
        return self.shared_selection(layer, *caches)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        slot = self.storage_.store(layer, k, v)
        self.update(layer, k, slot)
        if self.selecting:
            idx, ok = sel, sel_ok = self.select_step(layer, q)
            if self.slot_of is not None:        # positions -> this layer's own slots per head
                idx, ok = self.translate(layer, sel, sel_ok)
            if self.caching:
                self.idx_cache[layer].copy_(idx)
                self.ok_cache[layer].copy_(ok)
                if self.slot_of is not None:
                    self.pos_cache[layer].copy_(sel)
                    self.sel_cache[layer].copy_(sel_ok)
                elif not self.storage_.uniform:
                    self.pos_cache[layer].copy_(self.slot_positions(layer, idx))
            if self.a > 1:
                self.tail_ok[layer].zero_()
        else:
            idx, ok = self.idx_cache[layer], self.ok_cache[layer]
            if not self.storage_.uniform:       # a slot overwritten since the select step is not that token
                ok = ok & (self.slot_positions(layer, idx) == self.pos_cache[layer])
            if self.sliding_window:             # tokens that left the window since the select step
                ok = ok & (self.q_pos.reshape(-1, 1, 1) - self.slot_positions(layer, idx) < self.sliding_window)
            B, H = idx.shape[:2]
            new = slot if isinstance(slot, Tensor) else idx.new_full((B, H), slot)
            self.tail_slot[layer].copy_(torch.cat([self.tail_slot[layer][..., 1:], new[..., None]], -1))
            self.tail_ok[layer].copy_(torch.cat([self.tail_ok[layer][..., 1:], ok.new_ones(B, H, 1)], -1))
        if self.a > 1:
            idx = torch.cat([idx, self.tail_slot[layer]], -1)
            ok = torch.cat([ok, self.tail_ok[layer]], -1)
        return self.attend(layer, q, idx, ok)

    # ----------------------------------------------------------------- introspection
    def index_bytes(self, live: bool) -> int:
        total = super().index_bytes(live)
        for name in ("idx_cache", "ok_cache", "pos_cache", "sel_cache", "tail_slot", "tail_ok"):
            t = getattr(self, name)
            if t is not None and self.built:
                total += t.numel() * t.element_size()
        for t in self.slot_of or []:
            total += t.numel() * t.element_size()
        return total

    def read_bytes_per_step(self) -> float:
        """Mean over the a steps of a query group: selecting layers read their selecting heads' labels
        at the select step; every layer reads N_c (+ the tail) K/V rows."""
        L, H = self.args.n_layers, self.args.n_kv_heads
        n = self.inner.n_filled if self.storage_.uniform else None
        labels = sum(self.labels.nbytes(layer, n) for layer in range(L) if self.is_source[layer])
        labels *= self.n_src_heads / H / self.a
        rows = sum(min(self.n_critical, self.readable_length(layer)) for layer in range(L)) + L * (self.a - 1) / 2
        return labels + rows * self.kv_row_bytes()

    def describe(self) -> dict:
        d = super().describe()
        d.update(layer_ratio=self.layer_ratio, head_ratio=self.head_ratio, query_ratio=self.query_ratio,
                 select_every=self.a)
        if self.args is not None:
            d.update(selecting_layers=self.n_src_layers, selecting_heads_per_layer=self.n_src_heads,
                     head_granularity="kv")
        if self.built:
            d["layer_roots"] = list(self.roots)
            if self.head_sharing:
                d["head_roots"] = [list(r) for r in self.head_roots]
            if self.layer_sim is not None and self.layer_sharing:
                shared = [(i, r) for i, r in enumerate(self.roots) if r != i]
                d["shared_layer_similarity"] = round(sum(float(self.layer_sim[i, r]) for i, r in shared)
                                                     / max(1, len(shared)), 4)
            if self.head_sim is not None and self.head_sharing:
                pairs = [(layer, h, r) for layer, roots in enumerate(self.head_roots) for h, r in enumerate(roots) if r != h]
                d["shared_head_similarity"] = round(sum(float(self.head_sim[layer][h, r]) for layer, h, r in pairs)
                                                    / max(1, len(pairs)), 4)
            d["config_source"] = (f"{self.sharing} sharing on the critical sets of the last "
                                  f"{self.sim_queries} prompt queries" if (self.layer_sharing or self.head_sharing)
                                  else "no layer/head sharing")
        return d
