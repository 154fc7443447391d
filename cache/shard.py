"""Tensor parallelism as a cache policy sees it: which KV heads this process holds, and the few
collectives a policy may use to make a decision that spans heads the same on every process.

Under `torchrun --nproc-per-node N engine.py --tp N` (tp.py) every process holds H_kv / N whole KV
heads (with their query heads) of every layer, and the model it runs has per-process ModelArgs
(n_heads / N, n_kv_heads / N, ...) whose `shard` field is a `tp.GroupShard`.  A policy sees only its
own heads, so most policies need nothing; the few whose decisions average over the heads of a layer
(D2O's layer variance, SimLayerKV's lazy test, TOVA's layer-mean attention, HShare's layer
similarity) call `mean` on the per-process value, and policies that read per-checkpoint calibration
files (ds, hshare, pod) take their heads' part with `own`.  docs/policies.md lists the rule of each
policy.  Without tensor parallelism `shard_of(args)` is `SINGLE`, whose collectives are identities.

Rules for callers: a collective is called by every process in the same order (it is a rendezvous),
so call them only from code every process runs (prefill, decode, end_prefill, before_decode_step,
setup, prepare), never from describe() or kv_bytes() (rank 0 alone prints those).
"""
from __future__ import annotations

from typing import Sequence, Union

from torch import Tensor


class Shard:
    """One process holding every head: the collectives are identities."""

    rank = 0
    size = 1
    writes_files = True         # the process that writes shared side files (calibration)

    def mean(self, x: Tensor) -> Tensor:
        """The mean of x over the processes (each holds the same number of heads, so the mean of
        per-process means over heads is the mean over every head)."""
        return x

    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        """x reduced elementwise over the processes: op is sum, max or min."""
        return x

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        """Every process's x concatenated along `dim` in rank order (their heads -> all heads)."""
        return x

    def any(self, flag: bool) -> bool:
        """True on every process when `flag` is True on one (host side)."""
        return flag

    def barrier(self) -> None:
        """Wait until every process is here."""

    def whole(self, n_local: int) -> int:
        """Heads of the whole model, from this process's count."""
        return n_local * self.size

    def own(self, x: Union[Tensor, Sequence], dim: int = 0) -> Union[Tensor, Sequence]:
        """This process's part of something indexed by the whole model's heads along `dim` (a
        tensor, or a list for dim 0): the rank-th of `size` equal consecutive blocks."""
        n = (x.shape[dim] if isinstance(x, Tensor) else len(x)) // self.size
        if isinstance(x, Tensor):
            return x.narrow(dim, self.rank * n, n)
        return x[self.rank * n:(self.rank + 1) * n]


SINGLE = Shard()


def shard_of(args) -> Shard:
    """The shard a policy set up with ModelArgs `args` belongs to (SINGLE without tensor parallelism)."""
    return args.shard if args.shard is not None else SINGLE
