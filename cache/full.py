"""The `full` policy: every token kept (model.py's plain DenseCache), with rows that join and leave a running batch.

While every row has seen the same tokens ("aligned": a static batch, left padding included) a forward's T tokens
go to slots [n_filled, n_filled + T) of every row, as in model.DenseCache.  Once a row has been released or
adopted (rows at their own lengths), a decode token goes to its row's own next slot (`length` [B]); attention
reads slots [0, n_filled) with n_filled = the longest row.  Rows may read a kept prefix in place (adopt(prefix=)):
one copy of a shared prompt prefix serves every row that started from it (prefix_attention, a loader's kernel);
several prefixes may be read at once (up to max_prefixes), one attention call each per layer.
`row_capacity` set before setup sizes the rows below max_seq_length (runtime/memory.py: rows sized to the
requests); `take_rows` moves the rows into an instance of another shape.
The storage variants of `full` subclass this class: cache/kv_dtype.py (another dtype), cache/quantized.py (KIVI).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from model import DenseCache, ModelArgs, prefix_attention


def read_bound(n: int, capacity: int) -> int:
    """The slots a static decode step reads when its longest row holds n tokens: n rounded up to a bucket, a
    multiple of 64 or of 1/32 of the power of two at or below n (at most 64 tokens or ~3% more than n; 32
    buckets per doubling), and at most capacity.  One CUDA graph serves every step inside a bucket."""
    grain = max(64, (1 << max(n.bit_length() - 1, 0)) // 32)
    return min(capacity, -(-n // grain) * grain)


class FullCache(DenseCache):
    """The `full` policy (cache/contract.py's capabilities; the storage hooks are model.DenseCache's)."""

    name = "full"
    renamed: dict = {}              # old parameter name -> new one (refused with a message naming it)
    storage_kind = "dense"          # K/V in the compute dtype, every token (its subclasses: their own kinds)
    prefill_in_one_pass = False     # prompts may come in chunks
    is_sparse_reader = False
    decode_attention = False
    kv_bits, kv_group = 16, 0       # compute-dtype storage
    reader_composable = True        # a sparse reader may replace its decode attention
    admission = "row"               # requests join and leave single rows of a running batch
    prefix_reuse = True             # a prefilled prefix can be copied (adopt) and its prompt continued
    decode_room = None              # generated tokens a row may hold (the full cache needs no bound)

    row_capacity = None             # slots per row when set before setup (at most max_seq_length; None: that)
    max_prefixes = 4                # kept prefixes read in place at once (each: one more attention call per layer)
    static_decode = True            # begin_static_step / begin_static (cache/contract.py)

    length = rows = own_from = None     # per row [B]: slots held, index, first own slot (setup)
    row_prefix = None                   # per row: the kept prefix it reads in place (adopt(prefix=)), or None
    groups = ()                         # per prefix read now: (prefix, own_from [B] of its call, its rows [B,1,1,1])

    @classmethod
    def full_cache_args(cls, n_tokens: int):
        return {}

    def prepare(self, model, tokenizer) -> None:
        pass

    def setup(self, args: ModelArgs, max_batch_size: int, max_seq_length: int,
              dtype: torch.dtype, device) -> None:
        self.length = torch.zeros(max_batch_size, dtype=torch.long, device=device)   # slots each row holds
        self.rows = torch.arange(max_batch_size, device=device)
        self.own_from = torch.zeros(max_batch_size, dtype=torch.long, device=device)  # see adopt(prefix=)
        slots = max_seq_length if self.row_capacity is None else min(self.row_capacity, max_seq_length)
        if slots < 1:
            raise ValueError(f"row_capacity must be at least 1, got {self.row_capacity}")
        super().setup(args, max_batch_size, slots, dtype, device)

    def reset(self) -> None:
        super().reset()
        self.length.zero_()
        self.aligned = True     # every row's next slot is n_filled (else each row's own: `length`)
        self.own_from.zero_()
        self.row_prefix = [None] * self.pos.shape[0]
        self.groups = []

    def claim(self, input_pos: Tensor, end: int) -> None:
        """Aligned rows: slots [n_filled, end) of every row; else one token per row, at its own next slot."""
        if self.aligned:
            return super().claim(input_pos, end)
        if input_pos.shape[1] != 1:
            raise ValueError("rows at their own lengths take one token per forward (prefill a request "
                             "alone, then adopt it)")
        self.slot = self.length.clone()
        self.pos[self.rows, self.slot] = input_pos[:, 0]
        self.length += input_pos[:, 0] >= 0           # released rows (position -1) stay empty

    def store(self, layer: int, k: Tensor, v: Tensor):
        """Write this forward's k, v [B, H_kv, T, D] into their slots; returns the slot: an int (aligned
        rows, the first of the T) or LongTensor [B] (rows at their own lengths)."""
        if self.aligned:
            return super().store(layer, k, v)
        kc, vc = self.k[layer], self.v[layer]
        kc[self.rows, :, self.slot] = k[:, :, 0].to(kc.dtype)
        vc[self.rows, :, self.slot] = v[:, :, 0].to(vc.dtype)
        return self.slot

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if not self.groups:
            return super().decode(layer, q, k, v)
        self.store(layer, k, v)                           # rows read kept prefixes in place (adopt)
        n, attend, out = self.n_read, self.prefix_kernel or prefix_attention, None
        k, v = self.k[layer][:, :, :n], self.v[layer][:, :, :n]
        for prefix, own_from, rows in self.groups:       # one call per prefix; each row keeps its own prefix's
            P = prefix.n_filled
            o = attend(q, k, v, self.decode_visible, prefix.k[layer][:, :, :P], prefix.v[layer][:, :, :P], own_from)
            out = o if out is None else torch.where(rows, o, out)
        return out

    def regroup(self) -> None:
        """Host side, after rows start or stop reading a prefix: `groups`, one per prefix read now.  The first
        call also serves the rows reading none (own_from 0); a row reading another prefix sees, in a call not
        its own, that prefix and none of its slots (own_from past them; its output there is dropped)."""
        prefixes = list(dict.fromkeys(p for p in self.row_prefix if p is not None))
        first, device = self.own_from.tolist(), self.own_from.device
        self.groups = []
        for i, prefix in enumerate(prefixes):
            mine = [p is prefix or (i == 0 and p is None) for p in self.row_prefix]
            own = [f if m else self.capacity for f, m in zip(first, mine)]
            self.groups.append((prefix, torch.tensor(own, dtype=torch.long, device=device),
                                torch.tensor(mine, device=device)[:, None, None, None]))

    # ----------------------------------------------------------------- the static decode step
    def begin_static_step(self) -> int:
        """Host side, before a static decode step (runtime.steps.static_decode_step): every row goes on at its
        own next slot (`length`, on the device), n_filled counts the step's token, and the step reads the
        bucket of slots read_bound gives -> that bound (the step's one shape int)."""
        self.own_lengths()
        self.n_filled += 1
        return read_bound(self.n_filled, self.capacity)

    def static_tensors(self) -> list[Tensor]:
        """The buffers a static step reads and writes in place (a CUDA graph keeps their addresses), the prefixes
        read in place and their rows included (a prefix's length is a shape: one graph per prefix length)."""
        groups = [t for prefix, own_from, rows in self.groups for t in prefix.kv_buffers() + [own_from, rows]]
        return self.kv_buffers() + [self.pos, self.length, self.rows, self.own_from] + groups

    def kv_buffers(self) -> list[Tensor]:
        """The K/V storage's tensors (a storage subclass: its own)."""
        return self.k + self.v

    def begin_static(self, input_pos: Tensor, n_read: int) -> None:
        """A static decode step's begin (input_pos [B, 1]): each row's token at its own next slot, attention over
        slots [0, n_read), a bucket whose unfilled slots are masked.  Reads no host count: what a CUDA graph
        replays."""
        self.claim(input_pos, n_read)
        self.read_slots(input_pos, n_read)

    # ----------------------------------------------------------------- rows that join and leave
    def row_tensors(self, row: int, n: int) -> list[Tensor]:
        """What row `row` holds in its first n slots (k, v of every layer, positions)."""
        return [t[row, :, :n] for t in self.k + self.v] + [self.pos[row, :n]]

    def own_lengths(self) -> None:
        """Rows at their own lengths (`length`) from now on; aligned rows each held n_filled slots."""
        if self.aligned:
            self.length.fill_(self.n_filled)
            self.aligned = False

    def release(self, row: int) -> None:
        """Forget row `row`'s request (host side): its slots become empty; the other rows go on."""
        self.own_lengths()
        self.pos[row] = -1
        self.length[row] = 0
        self.n_filled = int(self.length.max())
        if self.row_prefix[row] is not None:
            self.own_from[row] = 0
            self.row_prefix[row] = None
            self.regroup()

    def adopt(self, row: int, other: "FullCache", other_row: int = 0, prefix: Optional["FullCache"] = None) -> None:
        """Take over request `other_row` of `other` (set up like this cache but for its batch size, its
        prompt complete) into the free row `row` (host side, between decode steps).

        prefix: a kept one-row instance whose P filled slots are the first P of that request's (prefix_reuse:
        the request started from it).  Where this cache can (`shares_prefix`), the row then reads those P
        slots from `prefix` in place at decode (prefix_attention, shared by every row that adopts it; up to
        max_prefixes prefixes at once) and only the rest is copied; else the whole request is copied."""
        n = other.n_filled
        held = other.pos[other_row, :n] >= 0      # a left-padded scratch row (prompts prefilled together) has
        slots = None if bool(held.all()) else held.nonzero()[:, 0]     # empty slots: copied without them
        m = n if slots is None else len(slots)
        if m > self.capacity:
            raise ValueError(f"a request of {m} tokens does not fit the cache's {self.capacity} slots")
        self.release(row)
        share = prefix is not None and self.shares_prefix(prefix)
        first = prefix.n_filled if share else 0
        if first > m:
            raise ValueError(f"a prefix of {first} tokens is longer than the request's {m}")
        src = other.row_tensors(other_row, n)
        if slots is not None:                      # (K/V [H, n, D] per layer, then positions [n])
            src = [t.index_select(t.dim() - 2 if t.dim() > 1 else 0, slots) for t in src]
        dst = self.row_tensors(row, m)
        if share:                                  # this class's storage: K/V after the prefix, every position
            for d, t in zip(dst[:-1], src[:-1]):
                d[:, first:] = t[:, first:]
            dst[-1].copy_(src[-1])
            self.row_prefix[row] = prefix
            self.own_from[row] = first
            self.regroup()
        else:
            for d, t in zip(dst, src):
                d.copy_(t)
        self.length[row] = m
        self.n_filled = max(self.n_filled, m)
        # every row's next slot n_filled (one row, or a prefill scratch whose rows all took one kept prefix): a
        # prompt may go on (not while rows read a prefix in place: decode only)
        self.aligned = bool((self.length == self.n_filled).all()) and not self.groups

    def shares_prefix(self, prefix: "FullCache") -> bool:
        """Whether rows may read `prefix` in place (adopt): `full` in the compute dtype (its decode is this
        class's), no sliding window, and that prefix read now or fewer than max_prefixes others."""
        read = {id(p) for p in self.row_prefix if p is not None}
        return (self.storage_kind == "dense" and not self.sliding_window
                and (id(prefix) in read or len(read) < self.max_prefixes))

    def take_rows(self, other: "FullCache") -> None:
        """Take over every row of `other` (this policy set up with another batch size or row_capacity; its rows
        at or past this batch's size free, its requests' slots within this capacity), prefixes read in place
        included: a batch reshaped between two steps (runtime/memory.py)."""
        B = self.pos.shape[0]
        held = [b for b in range(other.pos.shape[0]) if int(other.length[b]) or bool((other.pos[b] >= 0).any())]
        if any(b >= B for b in held) or other.n_filled > self.capacity:
            raise ValueError(f"rows {held} of {other.n_filled} slots do not fit {B} rows of {self.capacity}")
        self.reset()
        n = other.n_filled
        for b in held:
            for dst, src in zip(self.row_tensors(b, n), other.row_tensors(b, n)):
                dst.copy_(src)
            self.length[b], self.own_from[b] = other.length[b], other.own_from[b]
            self.row_prefix[b] = other.row_prefix[b]
        self.n_filled, self.aligned = n, other.aligned and B == other.pos.shape[0]
        if other.aligned and not self.aligned:      # rows at their own lengths from now on: each held n slots
            self.length[held] = n
        self.regroup()

    def question_room(self, row: int) -> Optional[int]:
        return None                 # every token is kept

    def hold_question(self, row: int, start: int, end: int) -> None:
        pass                        # nothing is evicted: the question is held whole

    # ----------------------------------------------------------------- introspection
    def kv_bytes(self) -> dict:
        per_slot = sum(t[:, :, 0].numel() * t.element_size() for t in self.k + self.v)
        B = self.pos.shape[0]
        live = per_slot * self.n_filled if self.aligned else per_slot * int(self.length.sum()) // B
        read = per_slot * self.n_filled
        if self.groups:                             # a shared prefix counts once; rows skip their copy's slots
            saved = int(self.own_from.sum()) - sum(prefix.n_filled for prefix, _, _ in self.groups)
            live, read = live - per_slot * saved // B, read - per_slot * saved // B
        return {"allocated": per_slot * self.capacity, "live": live, "read_per_step": read}

    def describe(self) -> dict:
        return {**super().describe(), "policy": self.name}
