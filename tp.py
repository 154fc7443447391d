"""Tensor parallelism over torch.distributed: N processes (launched by torchrun) each hold 1/N of
every layer, sharded by KV head, and run the same request in lockstep.

    torchrun --nproc-per-node 2 engine.py --checkpoint C --tp 2 [--policy SPEC]
    torchrun --nproc-per-node 2 scripts/benchmark.py --tp 2 --policies 'full; snapkv:budget=128'
    # two machines with 4 GPUs each (NCCL), the same command on both (not tested here):
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint node0:29500 \\
        --rdzv-id demo engine.py --checkpoint C --tp 8

Layout of process r of N (H_q query heads, H_kv KV heads, D head_dim, I intermediate size): it holds
KV heads [r H_kv/N, (r+1) H_kv/N) with their query heads (whole GQA groups), so attention and the
KV cache of those heads never leave the process.
    wqkv  rows of its q heads | its k heads | its v heads        column-parallel (fused as usual)
    wo    the columns of its q heads                             row-parallel, then all-reduce
    w13   [its gate rows; its up rows], rows [r I/N, (r+1) I/N)   column-parallel
    w2    the same columns                                       row-parallel, then all-reduce
    tok_embeddings, norms                                        replicated
    output                                                       head="vocab": rows [r V/N, (r+1) V/N),
                                                                 logits all-gathered; "replicated": whole;
                                                                 "auto" (default): vocab on CUDA, replicated
                                                                 on CPU (measured: docs/results.md); whole
                                                                 when N does not divide V
Two all-reduces of B x T x dim activations per layer, and with a vocab-parallel head one all-gather of
B x V logits per step: it saves reading (N-1)/N of the head per process for one more collective,
which pays where collectives take microseconds (NCCL), not where they take milliseconds (gloo on a
shared CPU: replicated was 5-8% faster at --tp 3 on the default model).
Every process ends a step with bit-identical logits (an all-reduce or all-gather hands every
process the same result), so sampling with a shared seed picks the same tokens everywhere; rank 0
prints.  Backend: gloo on CPU, NCCL on CUDA (device cuda:LOCAL_RANK).

Slicing happens on the HuggingFace-named tensors before any module is built
(`checkpoint.build_model` then fuses q|k|v and gate|up per process as for one), so what the loader
builds from them (fused linears, quantized linears) is built per shard.  Weight-quantized checkpoints
(`quantize.py` directories, GGUF Q8_0/Q4_0/Q4_1) are sharded as stored, code for code: q/k/v and
gate/up by rows (codes, scales and mins alike), o/down by columns at whole scale groups (a weight
with one group per row takes any column slice; otherwise a group that would straddle two processes
is a TPError naming a --groupsize that fits).  A quantized output head stays replicated.

Policies see the per-process ModelArgs (n_heads / N, n_kv_heads / N; `args.shard` is the
GroupShard below), so each runs on its own KV heads; decisions that span heads use the shard's
collectives (cache/shard.py; the rule of every policy is in docs/policies.md).
"""
from __future__ import annotations

import dataclasses
import os
import random
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from cache.shard import Shard
from checkpoint import build_model, on_meta
from kernels.qlinear import MIN_GROUP, QWeight
from model import Linear, ModelArgs, Transformer

HEADS = ("auto", "vocab", "replicated")     # how the output head is placed (auto: vocab on CUDA)


class TPError(ValueError):
    """A bad tensor-parallel launch or configuration: one line, exit status 2."""


# --------------------------------------------------------------------------- launch

def launched_size() -> Optional[int]:
    """Processes torchrun started (its WORLD_SIZE), or None outside torchrun."""
    size = os.environ.get("WORLD_SIZE")
    return int(size) if size else None


def is_leader() -> bool:
    """Rank 0 (or no torchrun): the process that prints."""
    return os.environ.get("RANK", "0") == "0"


def check_launch(tp: int) -> None:
    """TPError unless --tp (>= 1) matches how the processes were started."""
    size = launched_size()
    if size is None:
        if tp > 1:
            raise TPError(f"--tp {tp} needs {tp} processes started by torchrun: "
                          f"torchrun --nproc-per-node {tp} engine.py ... --tp {tp}")
    elif size != tp:
        raise TPError(f"torchrun started {size} processes but --tp is {tp}: the number of processes "
                      f"(--nproc-per-node x --nnodes) must equal --tp")


def check(args: ModelArgs, tp: int) -> None:
    """TPError for a bad --tp (not positive, not dividing the KV heads) or a launch that does not
    match it; cheap, so the loader calls it before building anything."""
    if tp < 1:
        raise TPError(f"--tp must be at least 1, got {tp}")
    check_heads(args, tp)
    check_launch(tp)


def fail(message: str, wait: float = 1.0) -> int:
    """Report a bad-input error the way every process meets it: rank 0 prints `error: message`; the
    others wait a moment before exiting, so torchrun (which stops every process when one exits
    non-zero) does not stop rank 0 before it has printed.  -> exit status 2."""
    if is_leader():
        print(f"error: {message}", file=sys.stderr, flush=True)
    elif launched_size():
        time.sleep(wait)
    return 2


def check_heads(args: ModelArgs, tp: int) -> None:
    """TPError unless tp divides the KV heads (each process holds whole KV heads and their groups)."""
    if args.n_kv_heads % tp:
        ok = [str(d) for d in range(args.n_kv_heads, 0, -1) if args.n_kv_heads % d == 0]
        choices = ok[0] if len(ok) == 1 else f"{', '.join(ok[:-1])} or {ok[-1]}"
        raise TPError(f"--tp {tp} does not divide the model's {args.n_kv_heads} KV heads (each process holds "
                      f"whole KV heads with their query heads): use --tp {choices}")


class GroupShard(Shard):
    """This process's place in a torch.distributed group (the collectives of cache/shard.Shard).
    Eager steps call torch.distributed's in-place collectives (on gloo, the functional ones cost
    about 4x their latency); compiled steps trace the functional ones."""

    OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.writes_files = self.rank == 0

    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        return self.all_reduce_(x.to(self.device, copy=True), op).to(x.device)

    def all_reduce_(self, x: Tensor, op: str = "sum") -> Tensor:
        """all_reduce in place where it can (eager): x itself, reduced."""
        if torch.compiler.is_compiling():
            return funcol.all_reduce(x, op, self.group)
        dist.all_reduce(x, self.OPS[op], self.group)
        return x

    def mean(self, x: Tensor) -> Tensor:
        return self.all_reduce(x, "sum") / self.size

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        x = x.to(self.device).contiguous()
        if torch.compiler.is_compiling():
            return funcol.all_gather_single(x, dim % x.dim(), self.group)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, self.group)
        return torch.cat(parts, dim)

    def any(self, flag: bool) -> bool:
        return bool(self.all_reduce(torch.tensor([int(flag)]), "max").item())

    def barrier(self) -> None:
        dist.barrier(self.group)

    def shared_seed(self) -> int:
        """A random seed drawn by rank 0, the same on every process."""
        mine = random.randrange(2 ** 31) if self.rank == 0 else 0
        return int(self.all_reduce(torch.tensor([mine]), "sum").item())


def init_group(tp: int, device: torch.device) -> GroupShard:
    """Join torchrun's process group (gloo on CPU, NCCL on CUDA, device cuda:LOCAL_RANK)."""
    check_launch(tp)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return GroupShard(dist.group.WORLD, device)


def finish() -> None:
    """Leave the process group (if one was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the model

def span(n: int, shard: Shard, unit: int = 1) -> slice:
    """Rows [r n / N, (r+1) n / N) of n, in units of `unit` rows (a head's head_dim)."""
    r, N = shard.rank, shard.size
    return slice(r * n // N * unit, (r + 1) * n // N * unit)


def rows_of(t, rows: slice):
    """Output rows `rows` of a weight or bias (a float tensor or a QWeight: codes, scales, mins)."""
    return t.map(lambda x: x[rows]) if isinstance(t, QWeight) else t[rows]


def columns_of(t, cols: slice, name: str):
    """Input columns `cols` of a weight (a float tensor, or a QWeight cut at whole scale groups)."""
    if not isinstance(t, QWeight):
        return t[:, cols].contiguous()
    width = cols.stop - cols.start
    one_group = t.scales.shape[1] == 1                 # a scale (and min) per row: any slice keeps it
    if one_group and width % MIN_GROUP == 0:
        group, groups = width, slice(0, 1)
    elif not one_group and cols.start % t.group == 0 and width % t.group == 0:
        group, groups = t.group, slice(cols.start // t.group, cols.stop // t.group)
    else:
        fits = [g for g in range(MIN_GROUP, width + 1, MIN_GROUP) if width % g == 0]
        raise TPError(f"--tp: quantized weight {name} has scale groups of {t.group} input channels, which do not "
                      f"split into this process's {width} columns; quantize with a --groupsize dividing {width} "
                      f"({', '.join(map(str, fits)) or 'none'}) or load it with --weights float")
    per_byte = 8 // t.bits
    cut = lambda x, c: None if x is None else x[:, c].contiguous()
    return QWeight(cut(t.qweight, slice(cols.start // per_byte, cols.stop // per_byte)), cut(t.scales, groups),
                   cut(t.mins, groups), t.bits, group)


def shard_tensors(args: ModelArgs, hf: dict, shard: Shard) -> tuple[ModelArgs, dict]:
    """(this process's ModelArgs, its slices of the HuggingFace-named tensors): q/k/v and gate/up
    rows, o/down columns (float tensors or QWeights); everything else as it is."""
    q, kv = span(args.n_heads, shard, args.head_dim), span(args.n_kv_heads, shard, args.head_dim)
    ffn = span(args.intermediate_size, shard)
    out = dict(hf)
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        for name, rows in (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv),
                           ("mlp.gate_proj", ffn), ("mlp.up_proj", ffn)):
            for key in (f"{p}{name}.weight", f"{p}{name}.bias"):
                if key in out:
                    out[key] = rows_of(out[key], rows)
        for key, cols in ((f"{p}self_attn.o_proj.weight", q), (f"{p}mlp.down_proj.weight", ffn)):
            if key in out:
                out[key] = columns_of(out[key], cols, key)
    rank_args = dataclasses.replace(args, n_heads=args.n_heads // shard.size, n_kv_heads=args.n_kv_heads // shard.size,
                                    intermediate_size=ffn.stop - ffn.start, shard=shard)
    return rank_args, out


class VocabParallelHead(Linear):
    """The output head's rows of this process's vocabulary slice; forward returns the logits of the
    whole vocabulary [..., V] (all-gathered in rank order)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.shard.all_gather(super().forward(x), -1)


def vocab_parallel_head(model: Transformer, shard: Shard) -> VocabParallelHead:
    """The model's output head cut to this process's vocabulary rows (a view of a tied embedding,
    a copy of an untied head so the rest is freed)."""
    weight = model.output.weight
    rows = span(weight.shape[0], shard)
    with on_meta():
        head = VocabParallelHead(weight.shape[1], rows.stop - rows.start, bias=False)
    part = weight.detach()[rows]
    head.weight = torch.nn.Parameter(part if model.args.tie_word_embeddings else part.clone(), requires_grad=False)
    head.shard = shard
    return head


def parallelize(model: Transformer, shard: GroupShard, head: str = "auto") -> Transformer:
    """All-reduce after each row-parallel projection (wo, w2: forward hooks, so any Linear-like module
    the loader built works) and place the output head (HEADS)."""
    if head == "auto":
        head = "vocab" if shard.device.type == "cuda" else "replicated"
    def all_reduce(module, inputs, out):
        return shard.all_reduce_(out)

    for layer in model.layers:
        layer.attention.wo.register_forward_hook(all_reduce)
        layer.feed_forward.w2.register_forward_hook(all_reduce)
    if head == "vocab" and model.args.vocab_size % shard.size == 0 and type(model.output) is Linear:
        model.output = vocab_parallel_head(model, shard)
    return model


def build(args: ModelArgs, hf: dict, device: torch.device, dtype: torch.dtype, tp: int,
          head: str = "auto") -> Transformer:
    """This process's part of the model from the whole checkpoint's HF-named tensors (joins the
    process group; TPError for a bad launch or a tp that does not divide the KV heads)."""
    check(args, tp)
    shard = init_group(tp, device)
    rank_args, rank_tensors = shard_tensors(args, hf, shard)
    return parallelize(build_model(rank_args, rank_tensors, shard.device, dtype), shard, head)
