"""KV memory admission (`serve.py --kv-memory`): sizes in bytes, what a row of a policy costs, how many fit.

A RowBatch built with kv_memory=BYTES holds at most that many bytes of K/V in its rows (the policy's
kv_bytes()["allocated"]; the prefill scratch (--prefill-batch rows) and the kept prefixes are outside it):

  - a policy whose row has a fixed size (every compressing policy: budget + decode room per layer, each layer
    its own budget; `full` in KIVI storage) gets rows = min(max_batch, kv_memory // row_bytes), fixed;
  - `full` in a plain dtype sizes its rows to the requests (`SizedRows`): every row of the batch holds the
    capacity of the longest request in it, rounded up to a class of SIZE_STEP tokens, and the batch holds as
    many rows as fit kv_memory at that capacity; a request that fits neither that shape nor a new one waits.

    rows = rows_that_fit(model, lambda: make_policy("snapkv"), 2 ** 30, 8, 2048, 128)
"""
from __future__ import annotations

import re
from typing import Callable, Optional

from cache.full import FullCache

SIZE_STEP = 256         # full's row capacity classes: multiples of this many tokens (docs/serving.md, measured)
UNITS = {"": 1, "b": 1, "k": 2 ** 10, "kb": 10 ** 3, "kib": 2 ** 10, "m": 2 ** 20, "mb": 10 ** 6, "mib": 2 ** 20,
         "g": 2 ** 30, "gb": 10 ** 9, "gib": 2 ** 30, "t": 2 ** 40, "tb": 10 ** 12, "tib": 2 ** 40}


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', '300MB', '4096' (bytes) -> bytes; ValueError naming the accepted forms."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in UNITS:
        raise ValueError(f"cannot read the size {text!r}: write a number and a unit, e.g. 2GiB, 512MiB, 1.5G, "
                         f"300MB (K/M/G/T are binary, KB/MB/GB/TB decimal, no unit: bytes)")
    size = int(float(m.group(1)) * UNITS[unit])
    if size < 1:
        raise ValueError(f"the size {text!r} is not positive")
    return size


def sized_rows(policy) -> bool:
    """Whether the policy's rows are sized to the requests (full's dense storage, its bytes linear in tokens)."""
    return policy.storage_kind in ("dense", "dense_dtype")        # FullCache and its dtype storage


def row_bytes(model, make_policy: Callable, max_seq_length: int, max_new_tokens: int,
              tokens: Optional[int] = None) -> int:
    """K/V bytes of one row of the policy as RowBatch sets its rows up (decode_room = max_new_tokens, storage
    for the longest prompt, every layer at its own budget; a layer without a budget, e.g. simlayerkv's before
    it is found lazy, holds the whole prompt; storage made per prompt, pod's: full's row, its bound); tokens: a
    sized row's capacity (sized_rows) instead of max_seq_length.  Measured on a one-row instance
    (kv_bytes()["allocated"])."""
    policy, current = make_policy(), getattr(model, "cache", None)
    policy.decode_room = max_new_tokens
    if tokens is not None:
        if not sized_rows(policy):
            raise ValueError(f"policy {policy.name!r} has rows of a fixed size: give no tokens")
        policy.row_capacity = tokens
    try:
        model.setup_caches(1, max_seq_length, policy)
        allocate = getattr(policy, "allocate_layer", None)
        if allocate is not None and not policy.kv_bytes()["allocated"]:     # storage allocated per prompt: for
            policy.prompt_length = max_seq_length - max_new_tokens          # the longest a row may take
            for layer in range(model.args.n_layers):
                allocate(layer)
        allocated = policy.kv_bytes()["allocated"]
        if not allocated:           # storage made per prompt, of no size before one (pod): full's row bounds it
            return row_bytes(model, FullCache, max_seq_length, max_new_tokens)
        return allocated
    finally:
        model.use_cache(current)


def rows_that_fit(model, make_policy: Callable, kv_memory: int, max_batch: int, max_seq_length: int,
                  max_new_tokens: int, tokens: Optional[int] = None) -> int:
    """Rows of the policy (row_bytes; tokens: sized rows of that capacity) that kv_memory bytes hold, at most
    max_batch."""
    return min(max_batch, kv_memory // row_bytes(model, make_policy, max_seq_length, max_new_tokens, tokens))


def size_class(tokens: int, max_seq_length: int) -> int:
    """A sized row's capacity for `tokens` (prompt + new tokens): rounded up to SIZE_STEP, at most max_seq_length."""
    return min(-(-tokens // SIZE_STEP) * SIZE_STEP, max_seq_length)
