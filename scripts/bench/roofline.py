"""The bandwidth (roofline) model: decode is bound by the bytes one step must read.

    bytes_per_step = unique weight bytes + KV bytes the policy reads per step
    bound (tok/s)  = B * read bandwidth / bytes_per_step

The read bandwidth is measured once at start-up (or given with --bandwidth-gbs).
"""
from __future__ import annotations

import gc
import statistics
import sys
import time
from typing import Optional

import torch

from bench.measure import malloc_trim, sync


def measure_bandwidth(device: torch.device, rounds: int = 3) -> float:
    """Read bandwidth in GB/s: CPU = scripts/compare_hf.read_bandwidth_gbs (the better of its two
    medians, as compare_hf reports), median of `rounds` calls (single calls on the shared VM ranged
    from 38 to 60 GB/s); CUDA = median of full reads of a 1 GiB tensor."""
    if device.type == "cuda":
        return _cuda_bandwidth(device)
    from compare_hf import read_bandwidth_gbs
    samples = []
    for _ in range(rounds):
        samples.append(max(read_bandwidth_gbs().values()))
        gc.collect()
        malloc_trim()
    print(f"# read bandwidth samples (GB/s): {', '.join(f'{x:.1f}' for x in samples)}", file=sys.stderr)
    return statistics.median(samples)


def _cuda_bandwidth(device: torch.device, repeats: int = 5) -> float:
    """GB/s of x.sum() over a float32 tensor of 2^28 elements (1 GiB), median of `repeats`."""
    x = torch.empty(1 << 28, device=device)
    x.sum()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        x.sum()
        sync(device)
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def unique_weight_bytes(model) -> int:
    """Bytes of every distinct parameter (tied embeddings counted once)."""
    seen = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def decode_bound(batch: int, weight_bytes: int, kv_read: float, bandwidth_gbs: Optional[float]):
    """(bytes one decode step reads, the bound in aggregate tokens/s or None without a bandwidth)."""
    bytes_per_step = weight_bytes + kv_read
    return bytes_per_step, (batch * bandwidth_gbs * 1e9 / bytes_per_step if bandwidth_gbs else None)


def attention_bound_us(kv_read: float, n_layers: int, bandwidth_gbs: Optional[float]) -> Optional[float]:
    """Microseconds per layer to read one step's KV bytes at the read bandwidth (None without one)."""
    return 1e6 * kv_read / n_layers / (bandwidth_gbs * 1e9) if bandwidth_gbs else None
