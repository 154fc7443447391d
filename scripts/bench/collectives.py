"""Under --tp: the share of a decode step spent in the tensor-parallel collectives, from a profile.

One untimed run per configuration row: fresh cache, prefill, 2 decode steps, then `steps` decode steps
under torch.profiler.  Collective time = the duration of the backend's own events (gloo:all_reduce /
gloo:all_gather on the gloo worker thread; NCCL kernels on CUDA, from their device time), which
includes waiting for the slowest process to arrive; share = that time / the steps' wall time.
"""
from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.measure import prefill_fresh, release, run_decode, steps_for, sync
from bench.specs import CAPACITY_MARGIN, Config

COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather")


def is_collective(name: str) -> bool:
    """A backend event of an all-reduce / all-gather (gloo's record function, an NCCL kernel)."""
    low = name.lower()
    return low.startswith(("gloo:", "nccl")) and any(c in low for c in COLLECTIVES)


def collective_share(model, cfg: Config, tokens: torch.Tensor, steps: int, chunk: int) -> dict:
    """{"tp_collective_ms_per_step", "tp_collective_share", "tp_collectives_per_step"} of `steps`
    profiled decode steps after a prefill of tokens [B, T]."""
    device = tokens.device
    prefill, decode = steps_for(cfg, device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    release(model)
    with torch.inference_mode():
        token, pos, _ = prefill_fresh(model, cfg, prefill, tokens, tokens.shape[1] + steps + 2 + CAPACITY_MARGIN, chunk)
        token, pos = run_decode(model, decode, token, pos, 2)
        with profile(activities=activities) as prof:
            sync(device)
            t0 = time.perf_counter()
            run_decode(model, decode, token, pos, steps, first=2)
            sync(device)
            wall = time.perf_counter() - t0
    release(model)
    events = [e for e in prof.events() if is_collective(e.name)]
    if cuda:
        events = [e for e in events if e.device_time_total > 0]
    spent = sum((e.device_time_total if cuda else e.cpu_time_total) for e in events) / 1e6
    return {"tp_collective_ms_per_step": 1000 * spent / steps, "tp_collective_share": spent / wall,
            "tp_collectives_per_step": len(events) / steps}
