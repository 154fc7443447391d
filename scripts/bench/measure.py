"""One measurement: the process's memory meter, a timed end-to-end run (prefill + warm-up steps +
timed decode steps), the untimed warm-up before a configuration's first run, an untimed request
(prompt + generation) for the memory model, and a timed loop of any step function.

Shapes: tokens [B, T] int64 prompt ids; token [B, 1] the last sampled ids; pos [B, 1] positions.
"""
from __future__ import annotations

import ctypes
import gc
import platform
import re
import time
from pathlib import Path
from typing import Callable, Optional

import torch

import runtime.stats
import runtime.steps
from bench.specs import CAPACITY_MARGIN, Config, build_policy


# --------------------------------------------------------------------------- the machine

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def malloc_trim() -> None:
    """Hand freed heap pages back to the OS (glibc), so RSS reflects what is live."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def release(model) -> None:
    """Drop the model's cache (and everything a previous run left) before the next allocation."""
    model.use_cache(None)
    gc.collect()
    if model.output.weight.device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        malloc_trim()


def device_name(device: torch.device) -> str:
    """The CPU's model name (/proc/cpuinfo) or the CUDA device's name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        if m:
            return m.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class MemoryMeter:
    """Resident memory now and its peak since reset(): CPU from /proc/self/status (VmRSS, VmHWM;
    reset by writing 5 to /proc/self/clear_refs), CUDA from the caching allocator."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "rss_hwm_per_row"
        if device.type == "cpu" and not self._clear_refs():
            self.kind = "rss_hwm_process"  # cannot reset: the process-lifetime peak

    @staticmethod
    def _clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _proc_kib(path: str, field: str) -> Optional[int]:
        """Bytes of a 'Field:  N kB' line of a /proc file, or None."""
        try:
            m = re.search(rf"^{field}:\s+(\d+) kB", Path(path).read_text(), re.M)
        except OSError:
            return None
        return int(m.group(1)) * 1024 if m else None

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind == "rss_hwm_per_row":
            self._clear_refs()

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self._proc_kib("/proc/self/status", "VmRSS") or 0

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self._proc_kib("/proc/self/status", "VmHWM") or runtime.stats.peak_memory_bytes(self.device)

    def available(self) -> int:
        """Bytes this process could still use (CUDA: free device memory; CPU: MemAvailable)."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        return self._proc_kib("/proc/meminfo", "MemAvailable") or 0


def tensor_bytes(obj, _seen=None, _depth=0) -> int:
    """Bytes of the distinct tensor storages reachable from `obj` (attributes, lists, dicts)."""
    seen = {} if _seen is None else _seen
    if _depth > 6:
        return 0
    if isinstance(obj, torch.Tensor):
        s = obj.untyped_storage()
        seen[(s.device.type, s.data_ptr())] = s.nbytes()
    elif isinstance(obj, (list, tuple, set)):
        for x in obj:
            tensor_bytes(x, seen, _depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            tensor_bytes(x, seen, _depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for x in vars(obj).values():
            tensor_bytes(x, seen, _depth + 1)
    return sum(seen.values()) if _seen is None else 0


def unique_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (torch._dynamo counters)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def cuda_graphs_recorded(device: torch.device) -> Optional[int]:
    """CUDA graphs recorded so far by torch.compile(mode="reduce-overhead") on `device` (the id of
    cudagraph_trees' next graph), or None off CUDA.  Read, never patched: a diagnostic only."""
    if device.type != "cuda":
        return None
    try:
        from torch._inductor.cudagraph_trees import get_container
        manager = get_container(device.index or 0).tree_manager
        return 0 if manager is None else int(re.search(r"\d+", repr(manager.graph_counter)).group())
    except Exception:  # private API: absent or changed in this torch version
        return None


def static_steps(decode) -> Optional[int]:
    """Static (CUDA-graph) decode steps a GraphDecode step has run so far (runtime.steps.graph_report), or None."""
    report = runtime.steps.graph_report(decode)
    return None if report is None else report["static_steps"]


# --------------------------------------------------------------------------- runs

def steps_for(cfg: Config, device: torch.device) -> tuple[Callable, Callable]:
    """(prefill, decode) step functions: runtime.steps.compiled_steps when cfg.compile, else eager."""
    if cfg.compile:
        return runtime.steps.compiled_steps(device, cfg.compile_prefill)
    return runtime.steps.prefill_step, runtime.steps.decode_step


def run_prefill(model, prefill, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    """runtime.steps.run_prefill for an unpadded batch tokens [B, T] -> last logits [B, V]."""
    B, T = tokens.shape
    pos = torch.arange(T, device=tokens.device).repeat(B, 1)
    return runtime.steps.run_prefill(model, tokens, pos, prefill, chunk)


def run_decode(model, decode, token: torch.Tensor, pos: torch.Tensor, steps: int, first: int = 0):
    """`steps` greedy decode steps numbered from `first` (as engine.generate's loop, without the
    EOS check); token [B, 1], pos [B, 1] -> the next (token, pos)."""
    for i in range(first, first + steps):
        logits = runtime.steps.run_decode(model, token, pos, i, decode)
        token = logits.argmax(-1, keepdim=True)
        pos = pos + 1
    return token, pos


def prefill_fresh(model, cfg: Config, prefill, tokens: torch.Tensor, capacity: int, chunk: int):
    """A fresh cache of `capacity` slots for cfg, then the prompt tokens [B, T]: (first sampled
    token [B, 1], its position [B, 1], prefill seconds).  Call inside torch.inference_mode()."""
    B, T = tokens.shape
    model.setup_caches(B, capacity, build_policy(cfg))
    sync(tokens.device)
    t0 = time.perf_counter()
    logits = run_prefill(model, prefill, tokens, chunk)
    token = logits.argmax(-1, keepdim=True)
    sync(tokens.device)
    return token, torch.full((B, 1), T, dtype=torch.long, device=tokens.device), time.perf_counter() - t0


def measure_e2e(model, cfg: Config, tokens: torch.Tensor, steps: int, warmup_steps: int, chunk: int,
                meter: MemoryMeter) -> dict:
    """One timed run: fresh cache, prefill of `tokens` [B, T], warm-up steps, `steps` timed steps."""
    device = tokens.device
    prefill, decode = steps_for(cfg, device)
    release(model)
    meter.reset()
    with torch.inference_mode():
        capacity = tokens.shape[1] + warmup_steps + steps + CAPACITY_MARGIN
        token, pos, prefill_s = prefill_fresh(model, cfg, prefill, tokens, capacity, chunk)
        cache = model.cache
        token, pos = run_decode(model, decode, token, pos, warmup_steps)
        kv0 = cache.kv_bytes()
        graphs, cuda_graphs, static = unique_graphs(), cuda_graphs_recorded(device), static_steps(decode)
        sync(device)
        t0 = time.perf_counter()
        run_decode(model, decode, token, pos, steps, first=warmup_steps)
        sync(device)
        decode_s = time.perf_counter() - t0
        recompiles = unique_graphs() - graphs
        cuda_graphs = None if cuda_graphs is None else cuda_graphs_recorded(device) - cuda_graphs
        static = None if static is None else static_steps(decode) - static
        kv1 = cache.kv_bytes()
    return {"prefill_s": prefill_s, "decode_s": decode_s, "kv_allocated": kv1["allocated"], "kv_live": kv1["live"],
            "kv_read": (kv0["read_per_step"] + kv1["read_per_step"]) / 2, "peak": meter.peak(),
            "decode_recompiles": recompiles, "cuda_graphs_recorded": cuda_graphs, "static_steps": static,
            "policy_config": cache.describe()}


def warm_up(model, cfg: Config, tokens: torch.Tensor, steps: int, warmup_steps: int, chunk: int,
            meter: MemoryMeter) -> None:
    """Untimed run before a configuration's first timed run: full size when compiled (compiles and
    specialises everything the timed runs will meet), a 64-token run when eager."""
    if cfg.compile:
        measure_e2e(model, cfg, tokens, min(steps, 4), warmup_steps, chunk, meter)
    else:
        short = tokens[:, :min(tokens.shape[1], 64)]
        measure_e2e(model, cfg, short, min(steps, 4), warmup_steps, min(chunk, 32), meter)


def run_request(model, cfg: Config, tokens: torch.Tensor, steps: int, chunk: int, meter: MemoryMeter) -> dict:
    """One untimed-loop request as a server would run it: fresh cache, prompt tokens [B, T], `steps`
    generated tokens.  Returns state (bytes of every tensor the policy holds after setup, RoPE
    tables included), kv (allocated KV bytes), workspace (peak - resident before the prefill),
    prefill_s, decode_s and peak (bytes, since the meter's reset here)."""
    prefill, decode = steps_for(cfg, tokens.device)
    release(model)
    meter.reset()
    with torch.inference_mode():
        model.setup_caches(tokens.shape[0], tokens.shape[1] + steps + CAPACITY_MARGIN, build_policy(cfg))
        state = tensor_bytes(model.cache) + tensor_bytes([model.rope_cos, model.rope_sin])
        kv = model.cache.kv_bytes()["allocated"]
        before = meter.current()
        t0 = time.perf_counter()
        logits = run_prefill(model, prefill, tokens, chunk)
        sync(tokens.device)
        t1 = time.perf_counter()
        pos = torch.full((tokens.shape[0], 1), tokens.shape[1], dtype=torch.long, device=tokens.device)
        run_decode(model, decode, logits.argmax(-1, keepdim=True), pos, steps)
        sync(tokens.device)
        t2 = time.perf_counter()
        peak = meter.peak()
    release(model)
    return {"state": state, "kv": kv, "workspace": max(0, peak - before), "prefill_s": t1 - t0,
            "decode_s": t2 - t1, "peak": peak}


def time_calls(fn: Callable[[], object], iters: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds of each of `iters` calls of fn() after `warmup` untimed ones (device synced around each)."""
    times = []
    for i in range(warmup + iters):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times
