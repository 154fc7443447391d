"""Reuse of shared prompt prefixes: a byte-bounded LRU of prefilled one-row cache snapshots, keyed by tokens.

runtime.rows.RowBatch keeps one when built with prefix_bytes > 0 and its policy declares `prefix_reuse`
(cache/contract.py; `full` only: the reuse is exact).  A request whose prompt starts with a kept prefix
copies that snapshot into its scratch (`adopt`) and prefills only the rest of its prompt; its row may then read the
snapshot in place (cache/full.py, several prefixes at once): RowBatch holds a reference (`acquire`, `drop`) while a
row reads it, and a referenced prefix is never dropped to make room (it is held once, wherever rows read it).

Where a prefix ends (`boundary`, chosen when a request's prefill begins):
  - the request's explicit `prefix_len` (the caller knows: a system prompt, a document), else
  - else a prefix it shares with prompts seen recently or still waiting, at least `min_tokens` long: of the
    lengths c it shares with each of them, the one that saves the most prefill, c x (prompts sharing at
    least c tokens).  So the first of several requests about one document snapshots the document (when the
    others already wait; a question's first word shared with one of them does not move the boundary), or
    the second does, and every later one reuses it; a short system prompt shared by many loses to a long
    document shared by a few.
Never the whole prompt: at least its last token is prefilled, for the last position's logits.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Optional, Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (list compares run in C: a binary search)."""
    a, b = list(a), list(b)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCache:
    """Snapshots (one-row cache policies holding a prefilled prefix) by their tokens, least recently used
    dropped first so that their bytes stay <= max_bytes; those rows read in place (referenced) are never dropped.
    Counters for /metrics: hits, misses (lookups that found a prefix or none), reused_tokens, evictions, bytes,
    entries, referenced (entries rows read now)."""

    def __init__(self, max_bytes: int, min_tokens: int = 32, recent: int = 64):
        if max_bytes <= 0 or min_tokens < 1:
            raise ValueError(f"prefix cache needs max_bytes > 0 and min_tokens >= 1, got {max_bytes}, {min_tokens}")
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.entries: OrderedDict = OrderedDict()    # tuple of token ids -> (snapshot, bytes), oldest first
        self.recent: deque = deque(maxlen=recent)    # prompts seen, for choosing boundaries
        self.refs: dict = {}                          # id(snapshot) -> rows reading it in place (acquire)
        self.bytes = self.hits = self.misses = self.evictions = self.reused_tokens = 0

    def peek(self, ids: Sequence[int], shortest: int = 1) -> tuple[int, Optional[object]]:
        """`lookup` without counting it or touching the LRU order."""
        ids = list(ids)
        best = max((k for k in self.entries if shortest <= len(k) < len(ids) and ids[:len(k)] == list(k)), key=len,
                   default=None)
        return (0, None) if best is None else (len(best), self.entries[best][0])

    def lookup(self, ids: Sequence[int], shortest: int = 1) -> tuple[int, Optional[object]]:
        """The longest kept prefix of `ids` shorter than ids and at least `shortest` tokens long -> (its length,
        snapshot), or (0, None); counted, and made the most recently used."""
        n, snapshot = self.peek(ids, shortest)
        if snapshot is None:
            self.misses += 1
            return 0, None
        self.entries.move_to_end(tuple(ids[:n]))
        self.hits += 1
        self.reused_tokens += n
        return n, snapshot

    def boundary(self, ids: Sequence[int], waiting: Sequence[Sequence[int]] = (), prefix_len: Optional[int] = None,
                 remember: bool = True) -> int:
        """Where to snapshot the prefill of `ids` (module docstring; 0: nowhere).  Remembers ids (unless not
        `remember`: a request asked about before it starts)."""
        if prefix_len is not None:
            n = min(prefix_len, len(ids) - 1)
        else:       # the shared length that saves the most prefill: c x (prompts sharing at least c tokens)
            shared = [min(common_prefix(ids, o), len(ids) - 1) for o in [*self.recent, *waiting]]
            shared = [c for c in shared if c >= self.min_tokens]
            n = max(shared, key=lambda c: (c * sum(s >= c for s in shared), c), default=0)
        if remember:
            self.recent.append(tuple(ids))
        return 0 if n < 1 or tuple(ids[:n]) in self.entries else n

    def insert(self, key: tuple, snapshot, nbytes: int) -> bool:
        """Keep `snapshot` (nbytes) for the prefix `key`, dropping the least recently used ones to make room
        -> whether it is kept (not when larger than max_bytes alone)."""
        if key in self.entries and not self.evict(key):
            return False                            # rows read the one kept now: it stays
        free = self.max_bytes - sum(b for s, b in self.entries.values() if id(s) in self.refs)
        if nbytes > free:
            return False                            # (larger than max_bytes less the referenced prefixes)
        while self.bytes + nbytes > self.max_bytes:
            oldest = next(k for k, (s, _) in self.entries.items() if id(s) not in self.refs)
            self.evict(oldest)
            self.evictions += 1
        self.entries[key] = (snapshot, nbytes)
        self.bytes += nbytes
        return True

    def evict(self, key: tuple) -> bool:
        """Drop the kept prefix `key` -> False (kept) while rows read it in place (acquire)."""
        snapshot, nbytes = self.entries[key]
        if id(snapshot) in self.refs:
            return False
        del self.entries[key]
        self.bytes -= nbytes
        return True

    def acquire(self, snapshot) -> None:
        """A row reads `snapshot` in place: it is not dropped until every such row `drop`s it."""
        self.refs[id(snapshot)] = self.refs.get(id(snapshot), 0) + 1

    def drop(self, snapshot) -> None:
        """A row stopped reading `snapshot` (acquire)."""
        n = self.refs.get(id(snapshot), 0) - 1
        if n < 0:
            raise ValueError("drop of a prefix no row acquired")
        if n:
            self.refs[id(snapshot)] = n
        else:
            del self.refs[id(snapshot)]

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "reused_tokens": self.reused_tokens,
                "evictions": self.evictions, "bytes": self.bytes, "entries": len(self.entries),
                "max_bytes": self.max_bytes, "referenced": sum(id(s) in self.refs for s, _ in self.entries.values())}
