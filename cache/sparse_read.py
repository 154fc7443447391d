"""Shared mechanics of the query-aware sparse readers (Double Sparsity, Quest, HShare).

A sparse reader keeps an *inner* storage policy (`full`, cache/full.py, by default, or an eviction
policy such as SnapKV) and replaces only decode attention:

    prefill      delegated to the inner policy (dense, causal attention over the prompt)
    end_prefill  inner.end_prefill(), then the reader builds its index structure from the inner
                 storage in one pass (label cache / page bounds), host side, once per request
    decode       the inner policy stores the new token (DenseCache: the next slot; EvictionPolicy:
                 `store`, which returns the slot [B, H_kv]); the reader updates its structure at that
                 slot, selects `n_critical` slots per KV head and attends exactly over them with
                 `kernels.sparse_decode_attention`.  Cost: the selection pass over C/D of the keys
                 (labels) or 1/page of them (Quest), plus N_c rows of K/V, never the whole cache.

Storage positions.  Every slot's absolute position comes from the inner storage (`pos`), so sinks and
recent tokens are defined by *position*, not by slot: with left padding or an eviction policy's
slot order the first `n_sink` tokens of the sequence and its last `n_recent` (the current token
included) are forced into the selection (score +inf); empty, padding and out-of-window slots get
-inf.  The scores are padded with N_c columns of -inf before top-k, so the index list always has
N_c entries (a fixed shape: no guard on the cache length) and, while the cache holds <= N_c visible
tokens, it covers all of them (valid mask False on the rest): reading everything needs no branch.

The label cache of Double Sparsity and HShare (heavy channels, `LabelReader`) is cache/labels.py.

GQA: one selection per KV head, shared by its G query heads (approximate scores summed over the
group, `kernels.approx_scores(group="kv")`), and attention reads each selected row once per group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from cache.base import EvictionPolicy
from cache.params import HEAD_AGG, HeadAgg, param, param_values, policy_params  # noqa: F401  (for readers)
from kernels import sparse_decode_attention
from kernels.cpu import cpu_kernels_available, select_top_cpu, use_cpu_kernel
from kernels.kivi_attention import kivi_attention
from cache.full import FullCache
from model import DenseCache, ModelArgs

INF = float("inf")
PRESETS = {"short": (128, 8, 32), "long": (512, 16, 64)}   # (n_critical, n_sink, n_recent), HShare sec. 5


# --------------------------------------------------------------------------- parameter parsing

def ratio(text) -> float:
    """A sharing ratio in (0, 1]: '0.75' or '3/4'."""
    value = float(Fraction(str(text).strip()))
    if not 0 < value <= 1:
        raise ValueError(f"a sharing ratio must be in (0, 1], got {text}")
    return value


def parse_ratios(text: str) -> tuple[float, float, float]:
    """'layer-head-query' as the paper writes it: '3/4-3/4-1/2' or '0.75-0.75-0.5'."""
    parts = str(text).split("-")
    if len(parts) != 3:
        raise ValueError(f"ratios must be layer-head-query, e.g. 3/4-3/4-1/2, got {text!r}")
    return tuple(ratio(p) for p in parts)


def n_sources(share_ratio: float, n: int) -> int:
    """How many of n layers/heads select their own tokens: ratio = 1 - k/n (HShare eq. 4), i.e.
    round(ratio * n) sources (halves round up: the less aggressive choice), at least 1."""
    return max(1, min(n, math.floor(share_ratio * n + 0.5)))


# --------------------------------------------------------------------------- inner storage adapter

class InnerStorage:
    """Uniform access to the storage of the policy a reader wraps.

    DenseCache ("uniform": every layer and KV head holds the same tokens in the same slots, slot
    order = arrival order; a decode step reads its first n_read slots: n_filled, or a static step's bound, the
    slots past n_filled empty) or an EvictionPolicy
    (per layer and head slot tables, fixed capacity, `store` returns the slot).  Either may keep
    KIVI-packed slots (`--kv-bits`, cache/quantized.py: `packed`): then the reader never sees K/V
    tensors; attention reads the N selected rows through the packed storage's own op (`attend`), each
    dequantized in registers with its own group's scale and minimum (residual ones from the
    full-precision ring), and the label cache / page bounds are built once from a dequantized copy
    after prefill."""

    def __init__(self, inner):
        self.inner = inner
        self.uniform = isinstance(inner, DenseCache)
        self.packed = inner.kv_bits != 16
        if not self.uniform and not isinstance(inner, EvictionPolicy):
            raise ValueError(f"a sparse reader can wrap the full cache or an eviction policy, not {type(inner).__name__}")

    def store(self, layer: int, k: Tensor, v: Tensor):
        """Write the decode token k, v [B, H_kv, 1, D]; returns its slot: an int (uniform, rows aligned) or
        LongTensor [B, H_kv]."""
        slot = self.inner.store(layer, k, v)
        return slot[:, None].expand(-1, k.shape[1]) if isinstance(slot, Tensor) and slot.dim() == 1 else slot

    def keep_slot_major(self, layers: int, row: Optional[int] = None) -> None:
        """Packed slots on the CPU: have every layer's SlotStore keep its words slot-major too (what `attend`
        reads: one contiguous read per selected slot; SlotStore.keep_slot_major), and refresh `row`'s copy
        (after the row was adopted: its words were copied in whole)."""
        if not self.packed:
            return
        for layer in range(layers):
            store = self.inner.stores[layer] if self.uniform else self.inner.slots.k[layer]
            if store is not None and store.k_packed.device.type == "cpu":
                store.keep_slot_major()
                if row is not None:
                    store.refresh_slot_major(row)

    def positions(self, layer: int) -> tuple[Tensor, Tensor]:
        """(visible [B, 1 or H_kv, S], pos [B, 1 or H_kv, S]) of the slots this decode step reads."""
        inner = self.inner
        if self.uniform:
            pos = inner.pos[:, None, :inner.n_read]
            return pos >= 0, pos
        return inner.visible(layer), inner.pos[layer]

    def attend(self, layer: int, q: Tensor, idx: Tensor, valid: Tensor, backend: str, workspace=None) -> Tensor:
        """Exact attention of q [B, H_q, 1, D] over the slots idx/valid [B, H_kv or H_q, N]: the selected
        K/V rows read in place (kernels.sparse_decode_attention), or, for packed slots, the same op as
        the packed storage's own attention (kernels.kivi_attention: each selected row dequantized in
        registers, residual ones from the ring; no gathered copy).  Entries of idx past the readable
        slots (invalid selections) are ignored through valid."""
        inner = self.inner
        if self.packed:
            store, pos, now = inner.kv_store(layer)
            return kivi_attention(q, store.reader_buffers, pos, None, now, pos.shape[2], None, idx, valid,
                                  backend=backend)
        if self.uniform:
            n = inner.n_read
            k, v = inner.k[layer][:, :, :n], inner.v[layer][:, :, :n]
        else:
            k, v = inner.k[layer], inner.v[layer]
        return sparse_decode_attention(q, k, v, idx, valid, backend=backend, workspace=workspace)

    def keys_at(self, layer: int, slots: Tensor) -> Tensor:
        """Keys [B, H_kv, m, D] of slots [B, H_kv, m] (< capacity), in the compute dtype."""
        if self.packed:
            store, _, now = self.inner.kv_store(layer)
            return store.gather(slots, self.full_positions(layer), now)[0].to(store.dtype)
        k = self.inner.k[layer]
        return k.gather(2, slots[..., None].expand(*slots.shape, k.shape[3]))

    def full_positions(self, layer: int) -> Tensor:
        """Positions of every allocated slot [B, 1 or H_kv, capacity] (-1 = empty)."""
        return self.inner.pos[:, None] if self.uniform else self.inner.pos[layer]

    def full_keys(self, layer: int) -> Tensor:
        """Keys of every allocated slot [B, H_kv, capacity, D] (packed: a dequantized copy, host-side
        one-offs only)."""
        if self.packed:
            return self.dequantized_keys(layer, self.capacity(layer))
        return self.inner.k[layer]

    def filled_keys(self, layer: int) -> Tensor:
        """Keys of the slots that may hold tokens [B, H_kv, S, D] (without computing visibility;
        packed: a dequantized copy, for building index structures once after prefill)."""
        n = self.inner.n_filled if self.uniform else self.capacity(layer)
        if self.packed:
            return self.dequantized_keys(layer, n)
        return self.inner.k[layer][:, :, :n]

    def dequantized_keys(self, layer: int, n: int) -> Tensor:
        store, _, now = self.inner.kv_store(layer)
        return store.dequantized(self.full_positions(layer), now, n)[0].to(store.dtype)

    def capacity(self, layer: int) -> int:
        return self.full_positions(layer).shape[2]

    def row_bytes(self) -> int:
        """Bytes of one token's K and V in one layer for the whole batch (all KV heads); packed: its
        words, value scales/minimums and its share of the key group's scales/minimums."""
        if self.packed:
            return self.inner.kv_store(0)[0].slot_bytes()
        k = self.inner.k[0]
        return 2 * k.shape[0] * k.shape[1] * k.shape[3] * k.element_size()


def check_composable(inner) -> None:
    """Readers replace decode attention; policies whose decode needs that attention cannot be read sparsely."""
    name = inner.name
    if inner.decode_attention:
        raise ValueError(f"{name} cannot be combined with a sparse reader: its decode eviction needs every "
                         f"step's attention probabilities over all kept tokens, which a sparse reader never computes")
    if not inner.reader_composable:
        raise ValueError(f"{name} with these arguments measures a decode step's full attention "
                         f"({inner.describe()}); it cannot be combined with a sparse reader")
    InnerStorage(inner)


# --------------------------------------------------------------------------- selection helpers

def read_bias(pos: Tensor, visible: Tensor, q_pos: Tensor, n_sink: int, n_recent: int, pad: int,
              sliding_window: Optional[int] = None) -> Tensor:
    """Additive selection bias [B, h, S + pad] (fp32) for slots at positions pos [B, h, S]: +inf for the
    forced tokens (position < n_sink, or within the last n_recent positions up to the query's q_pos
    [B, 1]: the current token is one of them), -inf for slots that may not be read (empty, padding,
    not visible, beyond the sliding window) and for the `pad` trailing columns, 0 otherwise."""
    qp = q_pos.reshape(-1, 1, 1)
    vis = visible & (pos >= 0) & (pos <= qp)
    if sliding_window:
        vis = vis & (qp - pos < sliding_window)
    force = vis & ((pos < n_sink) | (pos > qp - n_recent))
    bias = torch.zeros(pos.shape, dtype=torch.float32, device=pos.device)
    bias = bias.masked_fill(~vis, -INF).masked_fill(force, INF)
    return F.pad(bias, (0, pad), value=-INF)


def select_slots(scores: Tensor, bias: Tensor, n: int, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Top-n slots of scores [B, h, S] + bias [B, 1 or h, S + n] -> (idx, valid) [B, h, n].

    valid is False for entries that had to take a -inf column (fewer than n readable slots); their
    idx may point past S and must not be read (the attention kernel ignores them).  On fp32 CPU
    tensors the C++ radix select (kernels/cpu.py) returns the same set (ties to the lower slot) in
    ascending slot order; torch.topk otherwise."""
    if use_cpu_kernel(backend, scores.device.type == "cpu" and scores.dtype == bias.dtype == torch.float32):
        return select_top_cpu(scores, bias, n)
    s = F.pad(scores, (0, n)) + bias
    vals, idx = torch.topk(s, n, dim=-1, sorted=False)
    return idx, vals > -INF


# --------------------------------------------------------------------------- the reader base

@dataclass(eq=False)
class SparseReader(HeadAgg):
    """Base of the query-aware readers: wraps an inner storage policy (contract: cache/contract.py).

    Subclasses implement `build(layer)` (index structure from the inner storage after prefill),
    `update(layer, k, slot)` (the decode token's entry) and `select(layer, q)` -> (idx, valid)
    [B, H_kv, N] slots to read.  The rest (delegation, sink/recent bias, attention) lives here."""

    name = "sparse"
    inner: object = field(default=None, repr=False)     # storage policy read (None: `full`)
    preset: str = param("long", "paper preset: short (N_c=128: 8 sinks/32 recent/88 middle) or long "
                                "(N_c=512: 16/64/432)")
    n_critical: int = param(0, "N_c, tokens read per attention (0 = from preset)")
    n_sink: int = param(-1, "x, first tokens always read (-1 = from preset)")
    n_recent: int = param(-1, "y, most recent tokens always read, the current one included (-1 = from preset)")
    backend: str = param("auto", "kernels: auto (Triton on CUDA, C++ on CPU when built, else torch), torch, "
                                 "triton or cpp")
    head_aggs = HEAD_AGG            # the head aggregations a reader supports
    renamed = {}
    is_sparse_reader = True
    storage_kind = "reader"        # reads its inner policy's storage (`inner.storage_kind`)
    decode_attention = False
    reader_composable = False       # one reader per policy
    prefix_reuse = False            # adopt builds the index of a complete prompt

    @classmethod
    def full_cache_args(cls, n_tokens: int):
        """Reading N_c >= every token reads them all (sinks + recent of the default preset fit in it)."""
        nc, x, y = PRESETS["long"]
        return {"n_critical": max(n_tokens, x + y)}

    @property
    def kv_bits(self) -> int:
        return self.inner.kv_bits

    @property
    def kv_group(self) -> int:
        return self.inner.kv_group

    def __post_init__(self):
        self.inner = self.inner if self.inner is not None else FullCache()
        self.args = None                # the model's shape (setup)
        self.built = False              # the index is built over a complete prompt (end_prefill, adopt)
        check_composable(self.inner)
        self.resolve()
        self.validate()
        self.storage_ = InnerStorage(self.inner)
        self.record_reads = False       # tests/eval: keep the last (idx, valid) per layer in `last_read`

    def resolve(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        nc, x, y = PRESETS[self.preset]
        self.n_critical = self.n_critical or nc
        self.n_sink = x if self.n_sink < 0 else self.n_sink
        self.n_recent = y if self.n_recent < 0 else self.n_recent

    def validate(self) -> None:
        if self.n_recent < 1:
            raise ValueError("n_recent must be at least 1 (the current token is always read)")
        if self.n_sink < 0 or self.n_critical < self.n_sink + self.n_recent:
            raise ValueError(f"n_critical ({self.n_critical}) must hold n_sink ({self.n_sink}) + n_recent "
                             f"({self.n_recent})")
        if self.head_agg not in self.head_aggs:
            raise ValueError(f"{self.name}: head_agg must be one of {', '.join(self.head_aggs)}, got {self.head_agg!r}")
        if self.backend not in ("auto", "torch", "triton", "cpp"):
            raise ValueError(f"backend must be auto, torch, triton or cpp, got {self.backend!r}")

    # ----------------------------------------------------------------- delegated contract
    @property
    def n_filled(self):
        return self.inner.n_filled

    @n_filled.setter
    def n_filled(self, value):
        self.inner.n_filled = value

    @property
    def prefill_in_one_pass(self) -> bool:
        return self.inner.prefill_in_one_pass

    @property
    def admission(self) -> str:
        """Rows join and leave as the storage's do, unless the reader decides for the whole batch."""
        return self.inner.admission

    @property
    def decode_room(self):
        return self.inner.decode_room

    @decode_room.setter
    def decode_room(self, value):
        self.inner.decode_room = value

    def prepare(self, model, tokenizer) -> None:
        self.inner.prepare(model, tokenizer)

    def setup(self, args: ModelArgs, max_batch_size: int, max_seq_length: int, dtype, device) -> None:
        self.inner.setup(args, max_batch_size, max_seq_length, dtype, device)
        self.args = args
        self.group = args.n_heads // args.n_kv_heads
        self.sliding_window = args.sliding_window
        self.max_seq_length = max_seq_length
        self.batch, self.dtype, self.device = max_batch_size, dtype, device
        self.workspace: dict = {}
        if self.backend in ("auto", "cpp") and torch.device(device).type == "cpu":
            cpu_kernels_available()     # build (or find) the C++ kernels now, not inside a traced step
        self.reset()

    def reset(self) -> None:
        self.inner.reset()
        self.built = False
        self.q_pos = None
        self.decoding = False
        self.static_step = False        # this forward is a static decode step (begin_static)
        self.last_read: dict = {}
        self.steps_read: list = []     # entries read per layer at the last step (host ints, for kv_bytes)

    def before_prefill(self, input_pos: Tensor) -> None:
        self.inner.before_prefill(input_pos)

    def begin(self, input_pos: Tensor, n_filled: Optional[int] = None) -> None:
        if n_filled is not None:
            self.n_filled = n_filled
        T = input_pos.shape[1]
        self.decoding = T == 1 and self.inner.n_filled > 0
        if self.decoding and not self.built:      # the prompt came through model(...) directly
            self.end_prefill()
        self.inner.begin(input_pos)
        self.q_pos, self.static_step = input_pos, False
        if self.decoding:
            self.begin_read(input_pos)

    def begin_read(self, input_pos: Tensor) -> None:
        """A decode step's reader state, once the inner storage has begun the step (input_pos [B, 1])."""
        if self.storage_.uniform:
            # one bias per step shared by all layers (same slots, same positions)
            visible, pos = self.storage_.positions(0)
            self.step_bias = read_bias(pos, visible, input_pos, self.n_sink, self.n_recent, self.n_slots(),
                                       self.sliding_window)

    # ----------------------------------------------------------------- the static decode step
    @property
    def static_decode(self) -> bool:
        """A static step where the inner storage has one (the reader's own state has fixed shapes)."""
        return self.inner.static_decode

    def begin_static_step(self) -> int:
        """Host side: the index is built (a prompt that went through model(...) directly), then the inner
        storage's begin_static_step -> its read bound."""
        if not self.built:
            self.end_prefill()
        return self.inner.begin_static_step()

    def begin_static(self, input_pos: Tensor, n_read: int) -> None:
        self.inner.begin_static(input_pos, n_read)
        self.q_pos, self.decoding, self.static_step = input_pos, True, True
        self.begin_read(input_pos)

    def static_tensors(self) -> list[Tensor]:
        """The inner storage's buffers and the reader's index (what a decode step reads and writes in place)."""
        return self.inner.static_tensors() + self.index_static_tensors()

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = self.inner.prefill(layer, q, k, v)
        self.observe_prefill(layer, q, k)
        return out

    def observe_prefill(self, layer: int, q: Tensor, k: Tensor) -> None:
        """What the reader needs from the prompt (subclasses)."""

    def end_prefill(self) -> None:
        self.inner.end_prefill()
        if self.inner.n_filled == 0:
            return
        for layer in range(self.args.n_layers):
            self.build(layer)
        self.storage_.keep_slot_major(self.args.n_layers)
        self.built = True

    def before_decode_step(self, step: int) -> None:
        self.inner.before_decode_step(step)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        slot = self.storage_.store(layer, k, v)
        self.update(layer, k, slot)
        idx, valid = self.select(layer, q)
        return self.attend(layer, q, idx, valid)

    def storage(self, layer: int):
        return self.inner.storage(layer)

    def release(self, row: int) -> None:
        self.inner.release(row)

    def question_room(self, row: int) -> Optional[int]:
        return self.inner.question_room(row)

    def hold_question(self, row: int, start: int, end: int) -> None:
        self.inner.hold_question(row, start, end)      # the storage evicts; the reader only reads

    def adopt(self, row: int, other: "SparseReader", other_row: int = 0) -> None:
        """The inner storage's row, then the reader's index rows (built here first if this batch has none)."""
        if self.admission != "row":
            raise ValueError(f"{self.name} admits whole batches (admission 'batch'): rows cannot join a running batch")
        self.inner.adopt(row, other.inner, other_row)
        self.storage_.keep_slot_major(self.args.n_layers, row)
        if not self.built:
            self.adopt_decisions(other)
            for layer in range(self.args.n_layers):
                self.build(layer)
            self.built = True
        for layer in range(self.args.n_layers):
            for dst, src in zip(self.index_tensors(layer, row), other.index_tensors(layer, other_row)):
                dst.copy_(src)

    def kept_positions(self, layer: int) -> Tensor:
        return self.inner.kept_positions(layer)

    @property
    def capacity(self):
        return self.inner.capacity

    # ----------------------------------------------------------------- mechanics
    def bias(self, layer: int, heads: Optional[Tensor] = None) -> Tensor:
        """Selection bias [B, 1 or h, S + N_c] of the layer at this step (heads: a head subset/order)."""
        if self.storage_.uniform:
            return self.step_bias
        visible, pos = self.storage_.positions(layer)
        if heads is not None:
            visible, pos = visible.index_select(1, heads), pos.index_select(1, heads)
        return read_bias(pos, visible, self.q_pos, self.n_sink, self.n_recent, self.n_slots(),
                         self.sliding_window)

    def n_slots(self):
        """N_c as the selection's shape (HShare reads it from a tensor's shape, see there)."""
        return self.n_critical

    def reduce_query_scores(self, s: Tensor) -> Tensor:
        """Per-query-head scores [B, H_q, S] -> what selects: [B, H_kv, S] (head_agg mean or max over the
        group) or [B, H_q, S] (head_agg=query: every query head its own list, N_c indices per query head)."""
        if self.head_agg == "query":
            return s
        B, Hq, S = s.shape
        s = s.view(B, Hq // self.group, self.group, S)
        return s.mean(2) if self.head_agg == "mean" else s.amax(2)

    def select_bias(self, layer: int, heads: int) -> Tensor:
        """The selection bias for `heads` selecting heads (H_q under head_agg=query: each query head takes
        its KV head's bias)."""
        bias = self.bias(layer)
        if bias.shape[1] not in (1, heads):
            bias = bias.repeat_interleave(heads // bias.shape[1], 1)
        return bias

    def max_reads(self) -> int:
        """Most tokens one decode attention reads per (row, KV head)."""
        return self.n_critical

    def readable_length(self, layer: int):
        """Slots that may hold tokens now: n_filled (uniform) or the layer's capacity (host side)."""
        return self.inner.n_filled if self.storage_.uniform else self.storage_.capacity(layer)

    def step_length(self, layer: int):
        """Slots a decode step's selection scores cover: the inner storage's n_read (uniform: n_filled, or a
        static step's bound, its slots past n_filled empty and never selected) or the layer's capacity."""
        return self.inner.n_read if self.storage_.uniform else self.storage_.capacity(layer)

    def attend(self, layer: int, q: Tensor, idx: Tensor, valid: Tensor) -> Tensor:
        """Exact attention of q [B, H_q, 1, D] over the slots idx/valid [B, H_kv, N]."""
        if self.record_reads:
            self.last_read[layer] = (idx, valid)
        workspace = None if torch.compiler.is_compiling() else self.workspace
        return self.storage_.attend(layer, q, idx, valid, self.backend, workspace)

    def read_positions(self, layer: int) -> list:
        """Positions read by the last decode step's attention of `layer` (needs record_reads = True):
        per batch row and KV head, sorted lists."""
        idx, valid = self.last_read[layer]
        pos = self.storage_.full_positions(layer)
        if pos.shape[1] not in (1, idx.shape[1]):                   # per-query-head lists (head_agg=query)
            pos = pos.repeat_interleave(idx.shape[1] // pos.shape[1], 1)
        pos = pos.expand(-1, idx.shape[1], -1)
        got = pos.gather(2, idx.clamp(0, pos.shape[2] - 1))
        out = []
        for b in range(idx.shape[0]):
            out.append([sorted(int(p) for p, ok in zip(got[b, h].tolist(), valid[b, h].tolist()) if ok)
                        for h in range(idx.shape[1])])
        return out

    # ----------------------------------------------------------------- subclass hooks
    def build(self, layer: int) -> None:
        raise NotImplementedError

    def index_tensors(self, layer: int, row: int) -> list[Tensor]:
        """Row `row` of the layer's index structures (what build made and update keeps current)."""
        return []

    def index_static_tensors(self) -> list[Tensor]:
        """Every tensor of the reader's own that a decode step reads or writes (static_tensors)."""
        return []

    def adopt_decisions(self, other: "SparseReader") -> None:
        """Before the first adopted row is built: take the request-independent decisions of `other`."""

    def update(self, layer: int, k: Tensor, slot) -> None:
        raise NotImplementedError

    def select(self, layer: int, q: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    # ----------------------------------------------------------------- introspection
    def index_bytes(self, live: bool) -> int:
        """Bytes of the reader's own structures (labels, page bounds, index caches)."""
        return 0

    def read_bytes_per_step(self) -> float:
        """Bytes one decode step reads from the reader's structures and the K/V it selects."""
        return 0.0

    def kv_bytes(self) -> dict:
        inner = self.inner.kv_bytes()
        return {"allocated": inner["allocated"] + self.index_bytes(live=False),
                "live": inner["live"] + self.index_bytes(live=True),
                "read_per_step": self.read_bytes_per_step() if self.built else inner["read_per_step"]}

    def kv_row_bytes(self) -> int:
        """Bytes of one token's K and V in one layer for the whole batch (all KV heads)."""
        return self.storage_.row_bytes()

    def describe(self) -> dict:
        d = {"policy": self.name, **param_values(self),
             "n_middle": self.n_critical - self.n_sink - self.n_recent}
        if self.args is None:                               # not set up yet
            d["inner"] = getattr(self.inner, "name", type(self.inner).__name__)
        elif self.inner.storage_kind == "dense":
            d["capacity"] = self.inner.capacity
        else:
            d["inner"] = self.inner.describe()
        return d
