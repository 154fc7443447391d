"""What a generation returns (GenerationResult) and its statistics: throughput, KV bytes, peak memory."""
from __future__ import annotations

import resource
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class GenerationResult:
    texts: list[str]
    tokens: list[list[int]]            # generated ids per sequence, up to (excluding) EOS
    prompt_lengths: list[int]
    stats: dict = field(default_factory=dict)


def generation_stats(cache, lengths: list[int], steps: int, prefill_s: float, decode_s: float, device,
                     graphs: Optional[dict] = None) -> dict:
    """graphs: runtime.steps.graph_report of the decode step (CUDA graphs), or None."""
    B, kv = len(lengths), cache.kv_bytes()
    return {
        "batch_size": B,
        "prompt_tokens": lengths,
        "prefill_seconds": prefill_s,
        "prefill_tokens_per_s": sum(lengths) / prefill_s,
        "decode_steps": steps,
        "decode_seconds": decode_s,
        "decode_tokens_per_s_per_seq": steps / decode_s if steps else float("nan"),
        "decode_tokens_per_s": B * steps / decode_s if steps else float("nan"),
        "kv_bytes_allocated": kv["allocated"],
        "kv_bytes_live": kv["live"],
        "peak_memory_bytes": peak_memory_bytes(device),
        "policy": cache.describe(),
        "cuda_graphs": graphs,
    }


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA allocation, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def format_stats(s: dict) -> str:
    return (f"prompt tokens {s['prompt_tokens']} | prefill {s['prefill_tokens_per_s']:.1f} tok/s | "
            f"decode {s['decode_tokens_per_s_per_seq']:.2f} tok/s/seq, {s['decode_tokens_per_s']:.2f} tok/s "
            f"aggregate ({s['decode_steps']} steps) | KV cache {format_bytes(s['kv_bytes_allocated'])} allocated, "
            f"{format_bytes(s['kv_bytes_live'])} live | peak memory {format_bytes(s['peak_memory_bytes'])}"
            + format_graphs(s.get("cuda_graphs")))


def format_graphs(g: Optional[dict]) -> str:
    """The stats line's CUDA-graph part (runtime.steps.graph_report), or "" without graphs."""
    if g is None:
        return ""
    dynamic = ""
    if g["dynamic_steps"]:
        dynamic = f", {g['dynamic_steps']} dynamic ({'; '.join(g['dynamic_caches'])}: no static step)"
    return f" | CUDA graphs {g['graphs']} (batch x bucket), {g['static_steps']} static steps{dynamic}"
