"""The `full` policy: every token kept (model.py's plain DenseCache), with rows that join and leave a running batch.

While every row has seen the same tokens ("aligned": a static batch, left padding included) a forward's T tokens
go to slots [n_filled, n_filled + T) of every row, as in model.DenseCache.  Once a row has been released or
adopted (rows at their own lengths), a decode token goes to its row's own next slot (`length` [B]); attention
reads slots [0, n_filled) with n_filled = the longest row.  Rows may read a kept prefix in place (adopt(prefix=)):
one copy of a shared prompt prefix serves every row that started from it (prefix_attention, a loader's kernel).
The storage variants of `full` subclass this class: cache/kv_dtype.py (another dtype), cache/quantized.py (KIVI).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from model import DenseCache, ModelArgs, prefix_attention


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

    length = rows = own_from = None     # per row [B]: slots held, index, first own slot (setup)
    prefix = None                       # the kept prefix rows read in place (adopt(prefix=)), or None

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
        super().setup(args, max_batch_size, max_seq_length, dtype, device)

    def reset(self) -> None:
        super().reset()
        self.length.zero_()
        self.aligned = True     # every row's next slot is n_filled (else each row's own: `length`)
        self.own_from.zero_()
        self.prefix = None

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
        if self.prefix is None:
            return super().decode(layer, q, k, v)
        self.store(layer, k, v)                           # rows read a kept prefix in place (adopt)
        n, P = self.n_filled, self.prefix.n_filled
        attend = self.prefix_kernel or prefix_attention
        return attend(q, self.k[layer][:, :, :n], self.v[layer][:, :, :n], self.decode_visible,
                      self.prefix.k[layer][:, :, :P], self.prefix.v[layer][:, :, :P], self.own_from)

    # ----------------------------------------------------------------- rows that join and leave
    def row_tensors(self, row: int, n: int) -> list[Tensor]:
        """What row `row` holds in its first n slots (k, v of every layer, positions)."""
        return [t[row, :, :n] for t in self.k + self.v] + [self.pos[row, :n]]

    def release(self, row: int) -> None:
        """Forget row `row`'s request (host side): its slots become empty; the other rows go on."""
        if self.aligned:                # each row held n_filled slots
            self.length.fill_(self.n_filled)
            self.aligned = False
        self.pos[row] = -1
        self.length[row] = 0
        self.n_filled = int(self.length.max())
        if self.prefix is not None:
            self.own_from[row] = 0
            if not bool(self.own_from.any()):     # no row reads the kept prefix any more
                self.prefix = None

    def adopt(self, row: int, other: "FullCache", other_row: int = 0, prefix: Optional["FullCache"] = None) -> None:
        """Take over request `other_row` of `other` (set up like this cache but for its batch size, its
        prompt complete) into the free row `row` (host side, between decode steps).

        prefix: a kept one-row instance whose P filled slots are the first P of that request's (prefix_reuse:
        the request started from it).  Where this cache can (`shares_prefix`), the row then reads those P
        slots from `prefix` in place at decode (prefix_attention; one prefix at a time, shared by every row
        that adopts it) and only the rest is copied; else the whole request is copied."""
        n = other.n_filled
        if n > self.capacity:
            raise ValueError(f"a request of {n} tokens does not fit the cache's {self.capacity} slots")
        self.release(row)
        share = prefix is not None and self.shares_prefix(prefix)
        first = prefix.n_filled if share else 0
        if share:                                  # this class's storage: K/V after the prefix, every position
            if first > n:
                raise ValueError(f"a prefix of {first} tokens is longer than the request's {n}")
            for dst, src in zip(self.k + self.v, other.k + other.v):
                dst[row, :, first:n] = src[other_row, :, first:n]
            self.pos[row, :n] = other.pos[other_row, :n]
            self.prefix = prefix
            self.own_from[row] = first
        else:
            for dst, src in zip(self.row_tensors(row, n), other.row_tensors(other_row, n)):
                dst.copy_(src)
        self.length[row] = n
        self.n_filled = max(self.n_filled, n)
        # one row: its next slot is n_filled, a prompt may go on (not while it reads a prefix: decode only)
        self.aligned = self.pos.shape[0] == 1 and self.prefix is None

    def shares_prefix(self, prefix: "FullCache") -> bool:
        """Whether rows may read `prefix` in place (adopt): `full` in the compute dtype (its decode is this
        class's), no sliding window, and no other prefix read by a row now."""
        return (self.storage_kind == "dense" and not self.sliding_window
                and (self.prefix is None or self.prefix is prefix))

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
        if self.prefix is not None:                 # a shared prefix counts once; rows skip their copy's slots
            saved = int(self.own_from.sum()) - self.prefix.n_filled
            live, read = live - per_slot * saved // B, read - per_slot * saved // B
        return {"allocated": per_slot * self.capacity, "live": live, "read_per_step": read}

    def describe(self) -> dict:
        return {**super().describe(), "policy": self.name}
