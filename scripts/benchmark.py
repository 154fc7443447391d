"""Benchmark every KV-cache policy in the registry: end-to-end decode throughput, attention-operator
latency, decode cost versus context length, and the largest batch that fits a memory limit.

    OMP_WAIT_POLICY=ACTIVE python scripts/benchmark.py --checkpoint checkpoints/SmolLM2-135M-Instruct \\
        --policies full,streaming,h2o --policy-args 'hshare:preset=long,layer_ratio=0.5' \\
        --batch-sizes 1,8,16 --context-lengths 1024,2048,4096 --decode-steps 64 --kv-bits 16,4 \\
        --compile --repeats 3 --speedup-vs full --json out.json --csv out.csv --plot out.png

Modes (one per run):
  (default)            end-to-end: prefill a prompt of exactly C tokens for B sequences, then time
                       --decode-steps greedy decode steps (prefill excluded); policies x batch sizes
                       x contexts x kv-bits x compile.
  --op attention       attention-operator latency only: dense SDPA over the whole cache ("dense_sdpa")
                       next to each policy's decode attention (its `begin` + `decode` hooks of all
                       layers, on the q/k/v of a real decode step after a real prefill), like HShare's
                       Table 4.  Reported per layer and per step (all layers).
  --sweep-context [R]  decode step time versus context length (R = START:STOP doubling, or a list;
                       default 256:8192, capped to the model's context): the cost-growth curve.
  --memory-limit L     largest batch per policy that fits L (e.g. 8GiB, or a list 4GiB,8GiB) for a
                       prompt of each --context-lengths plus --decode-steps generated tokens.

Measurement:
  * Prefill runs in --prefill-chunk chunks, or in one pass for policies that compress the prompt
    (`prefill_in_one_pass`), as engine.generate does.
  * Synthetic prompts are random token ids (seeded, identical for every policy), or --prompt-file
    (tokenized, repeated if short, cut to the exact length; sequence b starts at a different offset).
  * Each configuration gets one untimed warm-up run first (the full-size run when compiled, so
    compilation and any shape specialisation happen before timing; a 64-token run when eager).
    Every timed run then does its own prefill and `--warmup-steps` untimed decode steps.
  * Repeats are interleaved: round r runs every configuration of a (batch, context) group once, so
    noise on a shared machine hits all policies alike; the median of the repeats is reported.
  * Decode tok/s = B * decode_steps / wall time of the decode loop (argmax sampling included,
    prefill excluded); per sequence = decode_steps / time.
  * Bandwidth bound: bytes one decode step must read = unique weight bytes + the KV bytes the policy
    reads per step (`cache.kv_bytes()["read_per_step"]`, mean of the start and end of the timed
    loop), divided by the read bandwidth measured at start-up (scripts/compare_hf.py's median of
    streaming reads; --bandwidth-gbs overrides).  bandwidth_bound_tokens_per_s = B * bw / bytes.
  * Peak memory per row: CPU = peak RSS of the process during the row (VmHWM, reset per run by
    writing 5 to /proc/self/clear_refs; it includes weights and the runtime), CUDA = max allocated.
  * --compile: prefill and decode steps from engine.compiled_steps (Inductor on CPU; on CUDA
    mode="reduce-overhead", i.e. CUDA graphs).  `--compile both` runs eager and compiled rows side by
    side and adds compile_speedup.  decode_recompiles counts graphs compiled during timed decode
    loops (torch._dynamo counters); it must be 0.  On CUDA, cuda_graphs_recorded counts CUDA
    graphs recorded inside the timed loops (cudagraph trees record a graph per new set of input
    shapes and replay it afterwards): 0 means every step replayed a graph captured during warm-up.
    A cache whose attention length is the live length (the dense `full` cache) changes shape every
    step, so there it counts one recording per step; fixed-shape policies should show 0.
  * Memory-limit model: total(B) = base + state_fixed + B * state_per_seq + workspace_fixed +
    B * workspace_per_seq, where base = process RSS (CUDA: allocated bytes) with the model loaded and
    warmed up and no cache; state = bytes of every tensor the policy object holds after
    setup_caches (KV buffers and bookkeeping) plus the RoPE tables; workspace = peak minus resident
    during a real prefill + decode of the prompt.  Both are measured at B=1 and at a probe batch
    P >= 2 (at least 2048 prompt tokens in all, at most 64) and fitted linearly.  The answer is
    floor((limit * (1 - headroom) - base - fixed) / per_seq) (model_batch_size); --memory-headroom
    (default 5%) keeps room for allocator slack.  Then, while a run fits this machine and is
    estimated to take at most --verify-seconds, that batch is actually run (prompt + generation) and
    the line refitted through the two largest real peaks (B=1's included), for at most --verify-runs
    runs per limit (later limits start from the runs already made);
    max_batch_size is the largest run batch whose peak stayed within the limit (verified = true),
    else the model's answer (verified = null: not run; false: runs exceeded the limit).  Workspace
    is not always linear in B (a one-pass prefill at B=9 needed 12% more than the B=1/B=2 line), so
    an unverified answer is an estimate.

JSON (--json): a list of row objects, rewritten atomically (tmp file + os.replace) after every
finished row, so an interrupted run (Ctrl-C: exit status 130) keeps every finished row.
--csv writes the same rows.  Keys of end-to-end and sweep rows:
  mode ("e2e"|"sweep"), policy, policy_args (the k=v,... string), policy_config (describe()),
  batch_size, context_length, kv_bits, decode_steps, warmup_steps, repeats,
  prefill_tokens_per_s, decode_tokens_per_s (aggregate over the batch, prefill excluded),
  decode_tokens_per_s_per_seq, decode_step_ms, decode_tokens_per_s_samples (one per repeat),
  kv_bytes_allocated, kv_bytes_live (end of the run), kv_bytes_read_per_step, weight_bytes,
  bytes_per_step, read_bandwidth_gbs, bandwidth_bound_tokens_per_s, fraction_of_bound,
  peak_memory_bytes, peak_memory_kind, decode_recompiles, device, dtype, torch_version,
  compile (bool), compile_mode, omp_wait_policy, num_threads, cpu, prompt, status ("ok"|"skipped"|
  "error"), error (the reason, or null), and with --speedup-vs NAME: speedup_vs_NAME (decode tok/s
  over NAME's in the same run, same batch/context/kv-bits/compile), with --compile both:
  compile_speedup.  Skipped/error rows carry null measurements.
Attention rows (mode "attention"): policy ("dense_sdpa" = the reference), batch_size,
  context_length, kv_bits, n_layers, attention_us_per_layer, attention_ms_per_step (medians),
  kv_bytes_read_per_step, bandwidth_bound_us_per_layer, speedup_vs_dense_sdpa, device, dtype, ...
Memory rows (mode "memory"): policy, policy_args, kv_bits, context_length, decode_steps,
  memory_limit_bytes, max_batch_size, model_batch_size, predicted_bytes (of model_batch_size),
  base_bytes, state_bytes_fixed, state_bytes_per_seq, kv_bytes_allocated_per_seq,
  workspace_bytes_fixed, workspace_bytes_per_seq, probe_batch_size, verified (bool, or null when
  not run), verified_batch_size, verified_peak_bytes, verified_within_limit, prediction_error
  (model_batch_size's real peak / predicted - 1), verify_runs ([batch, peak] pairs), verify_note.

CPU: set OMP_WAIT_POLICY=ACTIVE (recommended; the header prints the setting in effect): PyTorch's
OpenMP threads otherwise sleep between ops, which costs milliseconds per op on small CPUs.  Run on
an otherwise idle machine; the median of interleaved repeats damps but cannot remove noise.
--kv-bits 16,4 runs every configuration at both storage precisions (KIVI-packed with
--kv-group-size/--kv-residual; policies without a packed format, pod and the sparse readers, are
reported as skipped at 4 or 2 bits).
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import gc
import io
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import engine  # noqa: E402
from cache import PolicyError, make_policy, policy_names  # noqa: E402
from cache.quantized import check_format, with_kv_bits  # noqa: E402
from model import grouped_attention  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"
CAPACITY_MARGIN = 16          # spare slots: a cache filled to the last slot is a special shape
SWEEP_DEFAULT = "256:8192"
E2E_KEYS = ["mode", "policy", "policy_args", "batch_size", "context_length", "kv_bits", "decode_steps",
            "prefill_tokens_per_s", "decode_tokens_per_s", "decode_tokens_per_s_per_seq", "decode_step_ms",
            "kv_bytes_allocated", "kv_bytes_live", "kv_bytes_read_per_step", "peak_memory_bytes",
            "bandwidth_bound_tokens_per_s", "fraction_of_bound", "device", "dtype", "torch_version", "compile"]


class BenchmarkError(ValueError):
    """Bad command line: reported as one `error:` line, exit status 2."""


class Unsupported(Exception):
    """A configuration this build cannot run (row reported as skipped, the run goes on)."""


# --------------------------------------------------------------------------- parsing

def parse_int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchmarkError(f"{flag} expects comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise BenchmarkError(f"{flag} expects positive integers, got {text!r}")
    return values


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'8GiB' -> 8589934592; KiB/MiB/GiB and bare K/M/G are binary, KB/MB/GB decimal."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise BenchmarkError(f"cannot parse memory size {text!r}; use e.g. 8GiB, 512MiB, 8GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_policy_arg_map(text: Optional[str]) -> dict[str, str]:
    """'name:k=v,k=v;name2:k=v' -> {'name': 'k=v,k=v', 'name2': 'k=v'}."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(";"))):
        name, sep, args = item.partition(":")
        name = name.strip()
        if not sep or not name:
            raise BenchmarkError(f"malformed --policy-args item {item!r}: expected name:k=v,k=v "
                                 f"(items separated by ';')")
        if name in out:
            raise BenchmarkError(f"--policy-args gives arguments for {name!r} twice")
        out[name] = args.strip()
    return out


def registry_name(name: str) -> str:
    """'hshare@half' -> 'hshare': a label after '@' runs the same policy with other arguments
    in the same run (--policies hshare@a,hshare@b --policy-args 'hshare@a:...;hshare@b:...');
    compositions ('snapkv+hshare') are registry names too."""
    return name.partition("@")[0]


def resolve_policies(names_text: str, args_text: Optional[str]) -> list[tuple[str, str]]:
    """[(name, args)] from --policies ('all' = every registered policy) and --policy-args;
    every name and argument is validated here, before any model is loaded."""
    available = policy_names()
    names = available if names_text.strip() == "all" else [n.strip() for n in names_text.split(",") if n.strip()]
    if not names:
        raise BenchmarkError("--policies is empty")
    unknown = [n for n in names if not all(part in available for part in registry_name(n).split("+"))]
    if unknown:
        raise BenchmarkError(f"unknown policy {', '.join(map(repr, unknown))}; registered: {', '.join(available)}")
    if len(set(names)) != len(names):
        raise BenchmarkError(f"--policies lists a policy twice: {names_text}")
    arg_map = parse_policy_arg_map(args_text)
    stray = [n for n in arg_map if n not in names]
    if stray:
        raise BenchmarkError(f"--policy-args for {', '.join(map(repr, stray))}, which is not in --policies "
                             f"({', '.join(names)})")
    out = []
    for n in names:
        try:
            make_policy(registry_name(n), arg_map.get(n, ""))
        except PolicyError as e:
            raise BenchmarkError(str(e)) from None
        out.append((n, arg_map.get(n, "")))
    return out


def parse_sweep(text: str, max_context: int, reserve: int) -> list[int]:
    """'256:8192' (doubling) or '256:8192:4' (factor) or '256,512,1000' -> contexts, the top capped
    so prompt + decode steps fit the model's context."""
    try:
        if ":" in text:
            parts = [int(x) for x in text.split(":")]
            if len(parts) not in (2, 3) or parts[0] < 1 or parts[1] < parts[0] or (len(parts) == 3 and parts[2] < 2):
                raise ValueError
            start, stop, factor = parts[0], parts[1], parts[2] if len(parts) == 3 else 2
            values = []
            while start <= stop:
                values.append(start)
                start *= factor
        else:
            values = parse_int_list(text, "--sweep-context")
    except ValueError:
        raise BenchmarkError(f"--sweep-context expects START:STOP[:FACTOR] or a list, got {text!r}") from None
    limit = max_context - reserve
    capped = sorted({min(v, limit) for v in values})
    if capped != sorted(set(values)):
        print(f"note: sweep contexts capped at {limit} (model context {max_context} - {reserve} decode slots)",
              file=sys.stderr)
    return capped


# --------------------------------------------------------------------------- machine

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
    def _status(field: str) -> Optional[int]:
        try:
            m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
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
        return self._status("VmRSS") or 0

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self._status("VmHWM") or engine.peak_memory_bytes(self.device)

    def available(self) -> int:
        """Bytes this process could still use (CUDA: free device memory; CPU: MemAvailable)."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        return int(m.group(1)) * 1024 if m else 0


def release(model) -> None:
    """Drop the model's cache (and everything a previous run left) before the next allocation."""
    model.cache = None
    gc.collect()
    if model.output.weight.device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        _malloc_trim()


def measure_bandwidth(device: torch.device, rounds: int = 3) -> float:
    """Read bandwidth in GB/s: CPU = scripts/compare_hf.read_bandwidth_gbs (the better of its two
    medians, as compare_hf reports), median of `rounds` calls (single calls on the shared VM ranged
    from 38 to 60 GB/s); CUDA = median of full reads of a 1 GiB tensor."""
    if device.type == "cuda":
        x = torch.empty(1 << 28, device=device)
        x.sum()
        times = []
        for _ in range(5):
            sync(device)
            t = time.perf_counter()
            x.sum()
            sync(device)
            times.append(time.perf_counter() - t)
        return x.numel() * 4 / statistics.median(times) / 1e9
    from compare_hf import read_bandwidth_gbs
    samples = []
    for _ in range(rounds):
        samples.append(max(read_bandwidth_gbs().values()))
        gc.collect()
        _malloc_trim()
    print(f"# read bandwidth samples (GB/s): {', '.join(f'{x:.1f}' for x in samples)}", file=sys.stderr)
    return statistics.median(samples)


def unique_weight_bytes(model) -> int:
    """Bytes of every distinct parameter (tied embeddings counted once)."""
    seen = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


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


def cpu_name() -> str:
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        if m:
            return m.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------- configurations

@dataclass(frozen=True)
class Config:
    policy: str
    policy_args: str
    kv_bits: int
    compile: bool
    kv_group: int = 32          # KIVI G and R (used when kv_bits != 16)
    kv_residual: int = 32

    @property
    def label(self) -> str:
        s = self.policy + (f"({self.policy_args})" if self.policy_args else "")
        if self.kv_bits != 16:
            s += f" kv{self.kv_bits}"
        return s + (" compiled" if self.compile else "")


def build_policy(cfg: Config):
    """A fresh policy object for one run, its K/V stored at cfg.kv_bits (a policy without a packed
    format at 4 or 2 bits is Unsupported: its rows are reported as skipped)."""
    policy = make_policy(registry_name(cfg.policy), cfg.policy_args)
    try:
        return with_kv_bits(policy, cfg.kv_bits, cfg.kv_group, cfg.kv_residual)
    except ValueError as e:
        raise Unsupported(str(e)) from None


def skip_reason(cfg: Config) -> Optional[str]:
    try:
        build_policy(cfg)
    except Unsupported as e:
        return str(e)
    return None


def make_prompt(vocab_size: int, batch: int, length: int, seed: int, device, file_ids: Optional[list[int]]):
    """Token ids [batch, length]: random (seeded by (seed, batch, length): every policy sees the same
    prompt), or the prompt file's ids cycled to `length`, each sequence from a different offset."""
    if file_ids:
        n = len(file_ids)
        reps = (length + n * 2) // n + 1
        long_ids = torch.tensor(file_ids * reps)
        rows = [long_ids[(b * 997) % n:(b * 997) % n + length] for b in range(batch)]
        return torch.stack(rows).to(device)
    g = torch.Generator().manual_seed(seed * 1_000_003 + batch * 10_007 + length)
    return torch.randint(0, vocab_size, (batch, length), generator=g).to(device)


# --------------------------------------------------------------------------- one run

def run_prefill(model, prefill, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    """engine.run_prefill for an unpadded batch tokens [B, T] -> last logits [B, V]."""
    B, T = tokens.shape
    pos = torch.arange(T, device=tokens.device).repeat(B, 1)
    return engine.run_prefill(model, tokens, pos, prefill, chunk)


def run_decode(model, decode, token: torch.Tensor, pos: torch.Tensor, steps: int, first: int = 0):
    """`steps` greedy decode steps numbered from `first` (as engine.generate's loop, without
    the EOS check)."""
    for i in range(first, first + steps):
        logits = engine.run_decode(model, token, pos, i, decode)
        token = logits.argmax(-1, keepdim=True)
        pos = pos + 1
    return token, pos


def measure_e2e(model, cfg: Config, tokens: torch.Tensor, steps: int, warmup_steps: int, chunk: int,
                meter: MemoryMeter) -> dict:
    """One timed run: fresh cache, prefill of `tokens` [B, T], warm-up steps, `steps` timed steps."""
    device = tokens.device
    B, T = tokens.shape
    prefill, decode = engine.compiled_steps(device) if cfg.compile else (engine.prefill_step, engine.decode_step)
    release(model)
    policy = build_policy(cfg)
    meter.reset()
    with torch.inference_mode():
        model.setup_caches(B, T + warmup_steps + steps + CAPACITY_MARGIN, policy)
        cache = model.cache
        sync(device)
        t0 = time.perf_counter()
        logits = run_prefill(model, prefill, tokens, chunk)
        token = logits.argmax(-1, keepdim=True)
        sync(device)
        t1 = time.perf_counter()
        pos = torch.full((B, 1), T, dtype=torch.long, device=device)
        token, pos = run_decode(model, decode, token, pos, warmup_steps)
        kv0 = cache.kv_bytes()
        graphs, cuda_graphs = unique_graphs(), cuda_graphs_recorded(device)
        sync(device)
        t2 = time.perf_counter()
        run_decode(model, decode, token, pos, steps, first=warmup_steps)
        sync(device)
        t3 = time.perf_counter()
        recompiles = unique_graphs() - graphs
        cuda_graphs = None if cuda_graphs is None else cuda_graphs_recorded(device) - cuda_graphs
        kv1 = cache.kv_bytes()
    return {"prefill_s": t1 - t0, "decode_s": t3 - t2, "kv_allocated": kv1["allocated"], "kv_live": kv1["live"],
            "kv_read": (kv0["read_per_step"] + kv1["read_per_step"]) / 2, "peak": meter.peak(),
            "decode_recompiles": recompiles, "cuda_graphs_recorded": cuda_graphs,
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


# --------------------------------------------------------------------------- rows and output

class RowWriter:
    """Keeps the rows; rewrites --json/--csv atomically after every row (tmp file + os.replace)."""

    def __init__(self, json_path: Optional[Path], csv_path: Optional[Path], derive: Callable[[list], None]):
        self.rows: list[dict] = []
        self.json_path, self.csv_path, self.derive = json_path, csv_path, derive

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.write()

    def write(self) -> None:
        self.derive(self.rows)
        if self.json_path:
            atomic_write(self.json_path, json.dumps(self.rows, indent=1) + "\n")
        if self.csv_path:
            atomic_write(self.csv_path, to_csv(self.rows))


def atomic_write(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def to_csv(rows: list[dict]) -> str:
    columns: list[str] = []
    for key in E2E_KEYS + [k for r in rows for k in r]:
        if key not in columns and any(key in r for r in rows):
            columns.append(key)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow(["" if r.get(c) is None else json.dumps(r[c]) if isinstance(r.get(c), (dict, list)) else r[c]
                    for c in columns])
    return buf.getvalue()


def add_ratios(rows: list[dict], speedup_vs: Optional[str]) -> None:
    """Pairwise ratios inside this run: speedup_vs_NAME and compile_speedup (throughput rows), or
    speedup_vs_dense_sdpa (attention rows: reference latency / row latency)."""
    ok = [r for r in rows if r.get("status") == "ok"]

    def find(mode, policy, b, c, bits, comp):
        for r in ok:
            if (r["mode"], r["policy"], r["batch_size"], r["context_length"], r["kv_bits"], r["compile"]) == \
                    (mode, policy, b, c, bits, comp):
                return r
        return None

    for r in rows:
        if r["mode"] not in ("attention", "e2e", "sweep"):
            continue
        key = (r["mode"], r["batch_size"], r["context_length"])
        if r["mode"] == "attention":
            refs = ["dense_sdpa"] + ([speedup_vs] if speedup_vs else [])
            for name in refs:
                ref = find(key[0], name, key[1], key[2], 16 if name == "dense_sdpa" else r["kv_bits"], r["compile"])
                ok_pair = ref is not None and r.get("status") == "ok"
                r[f"speedup_vs_{name}"] = (ref["attention_us_per_layer"] / r["attention_us_per_layer"]
                                           if ok_pair else None)
            continue
        if speedup_vs:
            ref = find(key[0], speedup_vs, key[1], key[2], r["kv_bits"], r["compile"])
            r[f"speedup_vs_{speedup_vs}"] = (r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
                                            if ref is not None and r.get("status") == "ok" else None)
        if "compile_speedup" in r:
            ref = find(key[0], r["policy"], key[1], key[2], r["kv_bits"], False)
            r["compile_speedup"] = (r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
                                    if r["compile"] and ref is not None and r.get("status") == "ok" else None)


def fmt_bytes(n) -> str:
    return "-" if n is None else engine.format_bytes(n)


def fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


# --------------------------------------------------------------------------- the runner

class Bench:
    def __init__(self, model, opts, writer: RowWriter, meter: MemoryMeter, bandwidth_gbs: float,
                 file_ids: Optional[list[int]]):
        self.model, self.opts, self.writer, self.meter = model, opts, writer, meter
        self.device = model.output.weight.device
        self.dtype = model.norm.weight.dtype          # the compute dtype (linear layers may be quantized)
        self.bandwidth_gbs = bandwidth_gbs
        self.weight_bytes = unique_weight_bytes(model)
        self.file_ids = file_ids
        self.errors = 0

    # common row fields
    def base_row(self, mode: str, cfg: Config, batch: int, context: int) -> dict:
        o = self.opts
        compile_mode = None if not cfg.compile else ("reduce-overhead" if self.device.type == "cuda" else "inductor")
        return {"mode": mode, "policy": cfg.policy, "policy_args": cfg.policy_args, "batch_size": batch,
                "context_length": context, "kv_bits": cfg.kv_bits, "decode_steps": o.decode_steps,
                "warmup_steps": o.warmup_steps, "repeats": o.repeats,
                "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                "torch_version": torch.__version__, "compile": cfg.compile, "compile_mode": compile_mode,
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "num_threads": torch.get_num_threads(),
                "cpu": cpu_name() if self.device.type == "cpu" else torch.cuda.get_device_name(self.device),
                "prompt": str(o.prompt_file) if o.prompt_file else "random"}

    def prompt(self, batch: int, length: int) -> torch.Tensor:
        return make_prompt(self.model.args.vocab_size, batch, length, self.opts.seed, self.device, self.file_ids)

    def configs(self) -> list[Config]:
        o = self.opts
        compiles = {"off": [False], "on": [True], "both": [False, True]}[o.compile]
        return [Config(p, a, bits, c, o.kv_group_size, o.kv_residual)
                for (p, a) in o.policy_list for bits in o.kv_bits_list for c in compiles]

    def fits_context(self, context: int, extra: int) -> Optional[str]:
        limit = self.model.args.max_position_embeddings
        if context + extra + CAPACITY_MARGIN > limit:
            return (f"context {context} + {extra} decode steps + {CAPACITY_MARGIN} spare slots exceeds the "
                    f"model's context length {limit}")
        return None

    def fail_row(self, row: dict, status: str, reason: str, keys: Sequence[str]) -> dict:
        for k in keys:
            row.setdefault(k, None)
        row.update(status=status, error=reason)
        print(f"  {status}: {row['policy']} B={row['batch_size']} ctx={row['context_length']} "
              f"kv_bits={row['kv_bits']}: {reason}", file=sys.stderr)
        if status == "error":
            self.errors += 1
        return row

    # ---- end-to-end and sweep
    E2E_MEASURES = ["policy_config", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_tokens_per_s_per_seq",
                    "decode_step_ms", "decode_tokens_per_s_samples", "kv_bytes_allocated", "kv_bytes_live",
                    "kv_bytes_read_per_step", "weight_bytes", "bytes_per_step", "read_bandwidth_gbs",
                    "bandwidth_bound_tokens_per_s", "fraction_of_bound", "peak_memory_bytes", "peak_memory_kind",
                    "decode_recompiles", "cuda_graphs_recorded"]

    def e2e_row(self, mode: str, cfg: Config, batch: int, context: int, samples: list[dict]) -> dict:
        o = self.opts
        row = self.base_row(mode, cfg, batch, context)
        decode_s = statistics.median(s["decode_s"] for s in samples)
        prefill_s = statistics.median(s["prefill_s"] for s in samples)
        kv_read = statistics.median(s["kv_read"] for s in samples)
        last = samples[-1]
        bytes_per_step = self.weight_bytes + kv_read
        bound = batch * self.bandwidth_gbs * 1e9 / bytes_per_step if self.bandwidth_gbs else None
        tps = batch * o.decode_steps / decode_s
        row.update({
            "policy_config": last["policy_config"],
            "prefill_tokens_per_s": batch * context / prefill_s,
            "decode_tokens_per_s": tps,
            "decode_tokens_per_s_per_seq": o.decode_steps / decode_s,
            "decode_step_ms": 1000 * decode_s / o.decode_steps,
            "decode_tokens_per_s_samples": [batch * o.decode_steps / s["decode_s"] for s in samples],
            "kv_bytes_allocated": last["kv_allocated"], "kv_bytes_live": last["kv_live"],
            "kv_bytes_read_per_step": int(kv_read), "weight_bytes": self.weight_bytes,
            "bytes_per_step": int(bytes_per_step), "read_bandwidth_gbs": self.bandwidth_gbs,
            "bandwidth_bound_tokens_per_s": bound, "fraction_of_bound": tps / bound if bound else None,
            "peak_memory_bytes": max(s["peak"] for s in samples), "peak_memory_kind": self.meter.kind,
            "decode_recompiles": sum(s["decode_recompiles"] for s in samples),
            "cuda_graphs_recorded": (None if samples[0]["cuda_graphs_recorded"] is None
                                     else sum(s["cuda_graphs_recorded"] for s in samples)),
            "status": "ok", "error": None,
        })
        if o.compile == "both":
            row["compile_speedup"] = None
        if row["decode_recompiles"]:
            print(f"  WARNING: {row['decode_recompiles']} graph(s) compiled inside timed decode loops", file=sys.stderr)
        if row["cuda_graphs_recorded"]:
            print(f"  WARNING: {row['cuda_graphs_recorded']} CUDA graph(s) recorded inside timed decode loops "
                  f"(graphs are re-recorded for every new live length, not replayed)", file=sys.stderr)
        return row

    def print_e2e_header(self) -> None:
        ref = self.opts.speedup_vs
        print(f"{'policy':28s} {'B':>3s} {'ctx':>5s} {'bits':>4s} {'prefill t/s':>11s} {'decode t/s':>10s} "
              f"{'t/s/seq':>8s} {'step ms':>8s} {'KV alloc':>10s} {'KV live':>10s} {'peak mem':>10s} "
              f"{'bound t/s':>9s} {'of bound':>8s}" + (f" {'vs ' + ref:>9s}" if ref else "")
              + (f" {'vs eager':>9s}" if self.opts.compile == "both" else ""))

    def print_e2e(self, r: dict) -> None:
        label = Config(r["policy"], r["policy_args"], r["kv_bits"], r["compile"]).label
        if r["status"] != "ok":
            print(f"{label[:28]:28s} {r['batch_size']:3d} {r['context_length']:5d} {r['kv_bits']:4d} "
                  f"{r['status']}: {r['error']}", flush=True)
            return
        ref = self.opts.speedup_vs
        extra = f" {fmt(r.get(f'speedup_vs_{ref}'), '.2f') + 'x':>9s}" if ref else ""
        if self.opts.compile == "both":
            extra += f" {fmt(r.get('compile_speedup'), '.2f') + 'x' if r['compile'] else '':>9s}"
        print(f"{label[:28]:28s} {r['batch_size']:3d} {r['context_length']:5d} {r['kv_bits']:4d} "
              f"{r['prefill_tokens_per_s']:11.1f} {r['decode_tokens_per_s']:10.2f} "
              f"{r['decode_tokens_per_s_per_seq']:8.2f} {r['decode_step_ms']:8.1f} "
              f"{fmt_bytes(r['kv_bytes_allocated']):>10s} {fmt_bytes(r['kv_bytes_live']):>10s} "
              f"{fmt_bytes(r['peak_memory_bytes']):>10s} {fmt(r['bandwidth_bound_tokens_per_s']):>9s} "
              f"{fmt(100 * r['fraction_of_bound'] if r['fraction_of_bound'] else None, '.0f') + '%':>8s}{extra}",
              flush=True)

    def run_grid(self, mode: str, contexts: list[int]) -> None:
        o = self.opts
        configs = self.configs()
        self.print_e2e_header()
        for batch in o.batch_list:
            for context in contexts:
                tokens = None
                runnable = []
                for cfg in configs:
                    reason = skip_reason(cfg)
                    status = "skipped"
                    if reason is None and (reason := self.fits_context(context, o.warmup_steps + o.decode_steps)):
                        status = "error"
                    if reason:
                        row = self.fail_row(self.base_row(mode, cfg, batch, context), status, reason,
                                            self.E2E_MEASURES)
                        self.writer.add(row)
                        self.print_e2e(row)
                    else:
                        runnable.append(cfg)
                if not runnable:
                    continue
                tokens = self.prompt(batch, context)
                samples = {cfg: [] for cfg in runnable}
                failed = set()
                for r in range(o.repeats):
                    for cfg in runnable:
                        if cfg in failed:
                            continue
                        try:
                            if r == 0:
                                warm_up(self.model, cfg, tokens, o.decode_steps, o.warmup_steps, o.prefill_chunk,
                                        self.meter)
                            s = measure_e2e(self.model, cfg, tokens, o.decode_steps, o.warmup_steps,
                                            o.prefill_chunk, self.meter)
                        except (KeyboardInterrupt, SystemExit):
                            raise
                        except Exception as e:  # a failing policy never ends the run
                            failed.add(cfg)
                            release(self.model)
                            row = self.fail_row(self.base_row(mode, cfg, batch, context), "error",
                                                f"{type(e).__name__}: {e}", self.E2E_MEASURES)
                            self.writer.add(row)
                            self.print_e2e(row)
                            continue
                        samples[cfg].append(s)
                        print(f"  [{r + 1}/{o.repeats}] {cfg.label} B={batch} ctx={context}: decode "
                              f"{batch * o.decode_steps / s['decode_s']:.2f} tok/s, prefill "
                              f"{batch * context / s['prefill_s']:.1f} tok/s", file=sys.stderr, flush=True)
                        if r == o.repeats - 1:
                            row = self.e2e_row(mode, cfg, batch, context, samples[cfg])
                            self.writer.add(row)
                            self.print_e2e(row)
                release(self.model)

    # ---- attention operator
    ATT_MEASURES = ["policy_config", "n_layers", "attention_us_per_layer", "attention_ms_per_step",
                    "attention_us_samples", "kv_bytes_read_per_step", "read_bandwidth_gbs",
                    "bandwidth_bound_us_per_layer"]

    def attention_row(self, cfg: Config, batch: int, context: int, step_times: list[float], n_layers: int,
                      kv_read: float, policy_config) -> dict:
        row = self.base_row("attention", cfg, batch, context)
        step = statistics.median(step_times)
        row.update({
            "policy_config": policy_config, "n_layers": n_layers, "iterations": self.opts.op_iters,
            "attention_us_per_layer": 1e6 * step / n_layers, "attention_ms_per_step": 1e3 * step,
            "attention_us_samples": [1e6 * t / n_layers for t in step_times],
            "kv_bytes_read_per_step": int(kv_read), "read_bandwidth_gbs": self.bandwidth_gbs,
            "bandwidth_bound_us_per_layer": (1e6 * kv_read / n_layers / (self.bandwidth_gbs * 1e9)
                                             if self.bandwidth_gbs else None),
            "status": "ok", "error": None,
        })
        return row

    def time_steps(self, fn, iters: int, warmup: int) -> list[float]:
        times = []
        for i in range(warmup + iters):
            sync(self.device)
            t = time.perf_counter()
            fn()
            sync(self.device)
            if i >= warmup:
                times.append(time.perf_counter() - t)
        return times

    def dense_sdpa_times(self, batch: int, context: int, compiled: bool) -> tuple[list[float], int]:
        a = self.model.args
        g = torch.Generator(device=self.device).manual_seed(self.opts.seed)
        kw = dict(device=self.device, dtype=self.dtype, generator=g)
        layers = [(torch.randn(batch, a.n_heads, 1, a.head_dim, **kw),
                   torch.randn(batch, a.n_kv_heads, context, a.head_dim, **kw),
                   torch.randn(batch, a.n_kv_heads, context, a.head_dim, **kw)) for _ in range(a.n_layers)]
        step = dense_step_compiled() if compiled else dense_step
        with torch.inference_mode():
            times = self.time_steps(lambda: step(layers), self.opts.op_iters * self.opts.repeats,
                                    self.opts.warmup_steps)
        kv_read = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for _, k, v in layers)
        del layers
        return times, kv_read

    def policy_attention_times(self, cfg: Config, tokens: torch.Tensor):
        """Prefill the prompt for real, capture the q/k/v each layer's decode hook gets in one real
        decode step, then time `begin` + all layers' `decode` on those inputs."""
        model, o = self.model, self.opts
        B, T = tokens.shape
        iters = o.op_iters * o.repeats + o.warmup_steps
        release(model)
        with torch.inference_mode():
            model.setup_caches(B, T + 1 + iters + CAPACITY_MARGIN, build_policy(cfg))
            cache = model.cache
            logits = run_prefill(model, engine.prefill_step, tokens, o.prefill_chunk)
            captured = []
            real_decode = cache.decode

            def recorder(layer, q, k, v):
                captured.append((layer, q.clone(), k.clone(), v.clone()))
                return real_decode(layer, q, k, v)

            cache.decode = recorder
            pos = torch.full((B, 1), T, dtype=torch.long, device=self.device)
            engine.decode_step(model, logits.argmax(-1, keepdim=True), pos, cache.n_filled)
            del cache.decode
            step = attention_step_compiled() if cfg.compile else attention_step
            layers = [c[0] for c in captured]
            qkv = [c[1:] for c in captured]
            kv_read = cache.kv_bytes()["read_per_step"]
            times = self.time_steps(lambda: step(cache, pos + 1, layers, qkv, cache.n_filled), o.op_iters * o.repeats,
                                    o.warmup_steps)
            config = cache.describe()
        release(model)
        return times, len(layers), kv_read, config

    def run_attention(self) -> None:
        o = self.opts
        print(f"{'policy':28s} {'B':>3s} {'ctx':>5s} {'bits':>4s} {'us/layer':>10s} {'ms/step':>8s} "
              f"{'bound us/layer':>14s} {'vs dense_sdpa':>13s}")
        for batch in o.batch_list:
            for context in o.context_list:
                compiles = {"off": [False], "on": [True], "both": [False, True]}[o.compile]
                for comp in compiles:
                    ref = Config("dense_sdpa", "", 16, comp)
                    try:
                        times, kv_read = self.dense_sdpa_times(batch, context, comp)
                        row = self.attention_row(ref, batch, context, times, self.model.args.n_layers, kv_read,
                                                 {"policy": "dense_sdpa"})
                    except (KeyboardInterrupt, SystemExit):
                        raise
                    except Exception as e:
                        row = self.fail_row(self.base_row("attention", ref, batch, context), "error",
                                            f"{type(e).__name__}: {e}", self.ATT_MEASURES)
                    self.writer.add(row)
                    self.print_attention(row)
                tokens = None
                for cfg in self.configs():
                    row = self.base_row("attention", cfg, batch, context)
                    reason = skip_reason(cfg)
                    status = "skipped"
                    if reason is None and (reason := self.fits_context(context, 1 + o.op_iters * o.repeats
                                                                       + o.warmup_steps)):
                        status = "error"
                    if reason:
                        self.writer.add(self.fail_row(row, status, reason, self.ATT_MEASURES))
                        continue
                    if tokens is None:
                        tokens = self.prompt(batch, context)
                    try:
                        times, n_layers, kv_read, config = self.policy_attention_times(cfg, tokens)
                        row = self.attention_row(cfg, batch, context, times, n_layers, kv_read, config)
                    except (KeyboardInterrupt, SystemExit):
                        raise
                    except Exception as e:
                        release(self.model)
                        row = self.fail_row(row, "error", f"{type(e).__name__}: {e}", self.ATT_MEASURES)
                    self.writer.add(row)
                    self.print_attention(row)

    def print_attention(self, r: dict) -> None:
        if r["status"] != "ok":
            return
        label = Config(r["policy"], r["policy_args"], r["kv_bits"], r["compile"]).label
        print(f"{label[:28]:28s} {r['batch_size']:3d} {r['context_length']:5d} {r['kv_bits']:4d} "
              f"{r['attention_us_per_layer']:10.1f} {r['attention_ms_per_step']:8.2f} "
              f"{fmt(r['bandwidth_bound_us_per_layer']):>14s} "
              f"{fmt(r.get('speedup_vs_dense_sdpa'), '.2f') + 'x':>13s}", flush=True)

    # ---- memory-limit search
    MEM_MEASURES = ["max_batch_size", "model_batch_size", "predicted_bytes", "base_bytes", "state_bytes_fixed",
                    "state_bytes_per_seq", "kv_bytes_allocated_per_seq", "workspace_bytes_fixed",
                    "workspace_bytes_per_seq", "probe_batch_size", "verified", "verified_batch_size",
                    "verified_peak_bytes", "verified_within_limit", "prediction_error", "verify_runs", "verify_note"]

    def probe_batch(self, context: int) -> int:
        """The second batch size measured: large enough that per-sequence workspace stands out of
        the allocator's noise (at least 2048 prompt tokens in all), at most 64."""
        return max(2, min(64, math.ceil(2048 / context)))

    def memory_profile(self, cfg: Config, context: int) -> dict:
        """State and workspace bytes at B=1 and B=P (probe_batch), the resident base, run times."""
        model, o = self.model, self.opts
        prefill, decode = engine.compiled_steps(self.device) if cfg.compile else (engine.prefill_step,
                                                                                  engine.decode_step)
        cap = context + o.decode_steps + CAPACITY_MARGIN
        P = self.probe_batch(context)
        # weights paged in, kernels and graphs initialised: none of that is per-request workspace
        warm_up(model, cfg, self.prompt(1, context), o.decode_steps, 0, o.prefill_chunk, self.meter)
        prof = {}
        for B in (1, P):
            release(model)
            if B == 1:
                prof["base"] = self.meter.current()
            tokens = self.prompt(B, context)
            self.meter.reset()
            with torch.inference_mode():
                model.setup_caches(B, cap, build_policy(cfg))
                state = tensor_bytes(model.cache) + tensor_bytes([model.rope_cos, model.rope_sin])
                kv = model.cache.kv_bytes()["allocated"]
                before = self.meter.current()
                t0 = time.perf_counter()
                logits = run_prefill(model, prefill, tokens, o.prefill_chunk)
                sync(self.device)
                t1 = time.perf_counter()
                pos = torch.full((B, 1), context, dtype=torch.long, device=self.device)
                run_decode(model, decode, logits.argmax(-1, keepdim=True), pos, o.decode_steps)
                sync(self.device)
                t2 = time.perf_counter()
                peak = self.meter.peak()
            prof[B] = {"state": state, "kv": kv, "workspace": max(0, peak - before), "prefill_s": t1 - t0,
                       "decode_s": t2 - t1, "peak": peak}
            del tokens
        release(model)
        per_seq = max(1, math.ceil((prof[P]["state"] - prof[1]["state"]) / (P - 1)))
        ws_per_seq = max(0, math.ceil((prof[P]["workspace"] - prof[1]["workspace"]) / (P - 1)))
        return {"base": prof["base"], "probe_batch": P, "peak_b1": prof[1]["peak"], "state_per_seq": per_seq,
                "state_fixed": max(0, prof[1]["state"] - per_seq),
                "kv_per_seq": (prof[P]["kv"] - prof[1]["kv"]) // (P - 1), "ws_per_seq": ws_per_seq,
                "ws_fixed": max(0, prof[1]["workspace"] - ws_per_seq),
                "prefill_s": (prof[1]["prefill_s"], prof[P]["prefill_s"]),
                "decode_s": (prof[1]["decode_s"], prof[P]["decode_s"])}

    @staticmethod
    def estimate_seconds(prof: dict, batch: int) -> float:
        """Run time at `batch`, extrapolated linearly from B=1 and B=P (prefill and decode apart)."""
        P = prof["probe_batch"]
        return sum(t1 + max(0.0, (tp - t1) / (P - 1)) * (batch - 1) for t1, tp in (prof["prefill_s"], prof["decode_s"]))

    def verify_batch(self, cfg: Config, batch: int, context: int) -> int:
        """Actually run `batch` sequences of prompt + generation; the peak memory of that run."""
        model, o = self.model, self.opts
        prefill, decode = engine.compiled_steps(self.device) if cfg.compile else (engine.prefill_step,
                                                                                  engine.decode_step)
        release(model)
        tokens = self.prompt(batch, context)
        self.meter.reset()
        with torch.inference_mode():
            model.setup_caches(batch, context + o.decode_steps + CAPACITY_MARGIN, build_policy(cfg))
            logits = run_prefill(model, prefill, tokens, o.prefill_chunk)
            pos = torch.full((batch, 1), context, dtype=torch.long, device=self.device)
            run_decode(model, decode, logits.argmax(-1, keepdim=True), pos, o.decode_steps)
            sync(self.device)
            peak = self.meter.peak()
        del tokens
        release(model)
        return peak

    def run_memory(self) -> None:
        o = self.opts
        print(f"{'policy':28s} {'ctx':>5s} {'gen':>4s} {'limit':>10s} {'max batch':>9s} {'predicted':>10s} "
              f"{'per seq':>10s} {'verified peak':>13s}")
        for context in o.context_list:
            for cfg in self.configs():
                rows = [self.base_row("memory", cfg, None, context) | {"memory_limit_bytes": lim}
                        for lim in o.memory_limits]
                reason = skip_reason(cfg)
                status = "skipped"
                if reason is None and (reason := self.fits_context(context, o.decode_steps)):
                    status = "error"
                if reason is None:
                    try:
                        prof = self.memory_profile(cfg, context)
                    except (KeyboardInterrupt, SystemExit):
                        raise
                    except Exception as e:
                        release(self.model)
                        reason, status = f"{type(e).__name__}: {e}", "error"
                if reason:
                    for row in rows:
                        self.writer.add(self.fail_row(row, status, reason, self.MEM_MEASURES))
                    continue
                verified: dict[int, int] = {}
                for row in rows:
                    row.pop("batch_size")
                    self.fit_batch(cfg, context, prof, row, verified)
                    self.writer.add(row)
                    print(f"{cfg.label[:28]:28s} {context:5d} {o.decode_steps:4d} "
                          f"{fmt_bytes(row['memory_limit_bytes']):>10s} {row['max_batch_size']:9d} "
                          f"{fmt_bytes(row['predicted_bytes']):>10s} "
                          f"{fmt_bytes(row['state_bytes_per_seq'] + row['workspace_bytes_per_seq']):>10s} "
                          f"{fmt_bytes(row['verified_peak_bytes']):>13s}"
                          + (f"  ({row['verify_note']})" if row["verify_note"] else ""), flush=True)

    def fit_batch(self, cfg: Config, context: int, prof: dict, row: dict, verified: dict[int, int]) -> None:
        """The batch for row["memory_limit_bytes"]: the linear model's answer, then (when the runs
        are affordable) up to --verify-runs real runs, each refitting the line through the two
        largest real peaks (the B=1 peak while only one run exists); the answer is the largest run
        batch within the limit.  `verified` caches {batch: peak} across the limits of one policy,
        and a later limit starts from the line of the runs already made."""
        o = self.opts
        limit = row["memory_limit_bytes"]
        budget = limit * (1 - o.memory_headroom)
        per = prof["state_per_seq"] + prof["ws_per_seq"]
        fixed = prof["base"] + prof["state_fixed"] + prof["ws_fixed"]
        model_b = int(min(o.max_batch, max(0, (budget - fixed) // per)))
        predicted = fixed + model_b * per
        row.update({
            "max_batch_size": model_b, "model_batch_size": model_b, "predicted_bytes": predicted,
            "base_bytes": prof["base"], "state_bytes_fixed": prof["state_fixed"],
            "state_bytes_per_seq": prof["state_per_seq"], "kv_bytes_allocated_per_seq": prof["kv_per_seq"],
            "workspace_bytes_fixed": prof["ws_fixed"], "workspace_bytes_per_seq": prof["ws_per_seq"],
            "probe_batch_size": prof["probe_batch"], "verified": None, "prediction_error": None,
            "verified_batch_size": None, "verified_peak_bytes": None, "verified_within_limit": None,
            "verify_runs": [], "verify_note": None, "status": "ok", "error": None,
        })
        room = self.meter.available() + self.meter.current() - prof["base"]
        def refit():
            """The line through the two largest real runs (with the B=1 peak while there is one)."""
            points = sorted((rb, rp) for rb, rp in verified.items() if rp is not None and rb > 1)[-2:]
            (b0, p0), (b1, p1) = ([(1, prof["peak_b1"])] + points)[-2:]
            slope = max(1.0, (p1 - p0) / (b1 - b0))
            return slope, p1 - b1 * slope

        if any(rp is not None and rb > 1 for rb, rp in verified.items()):
            per, fixed = refit()  # runs made for another limit: start from their line
        b, runs = int(min(o.max_batch, max(0, (budget - fixed) // per))), []
        row["max_batch_size"] = b  # the best estimate until a run says otherwise
        while True:
            if b < 1:
                row["verify_note"] = "not even one sequence fits"
                break
            if b not in verified:
                if len(runs) >= o.verify_runs:
                    break
                est = self.estimate_seconds(prof, b)
                if fixed + b * per - prof["base"] > 0.8 * room:
                    row["verify_note"] = f"batch {b} not run: predicted {fmt_bytes(fixed + b * per)} exceeds this machine"
                    break
                if est > o.verify_seconds:
                    row["verify_note"] = f"batch {b} not run: estimated {est:.0f} s > --verify-seconds {o.verify_seconds:g}"
                    break
                try:
                    verified[b] = self.verify_batch(cfg, b, context)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except Exception as e:  # e.g. a real out-of-memory: counts as not fitting
                    release(self.model)
                    row["verify_note"] = f"batch {b} failed: {type(e).__name__}: {e}"
                    verified[b] = None
                    break
            runs.append((b, verified[b]))
            if verified[b] is None or b == 1:
                break
            per, fixed = refit()
            nxt = int(min(o.max_batch, max(0, (budget - fixed) // per)))
            if verified[b] <= limit and nxt <= b:
                break                           # fits, and the refit does not promise more
            if nxt in dict(runs):
                break                           # the refit points at a batch already run
            b = nxt
        row["verify_runs"] = [[rb, rp] for rb, rp in runs]
        fitting = [(rb, rp) for rb, rp in runs if rp is not None and rp <= limit]
        if model_b in verified and verified[model_b] is not None:
            row["prediction_error"] = verified[model_b] / predicted - 1
        if fitting:
            best, peak = max(fitting)
            row.update(max_batch_size=best, verified=True, verified_batch_size=best, verified_peak_bytes=peak,
                       verified_within_limit=True)
        elif runs:
            rb, rp = runs[-1]
            estimate = int(min(o.max_batch, max(0, (budget - fixed) // per)))
            row.update(max_batch_size=min(estimate, min(r[0] for r in runs) - 1), verified=False,
                       verified_batch_size=rb, verified_peak_bytes=rp, verified_within_limit=False)
            row["verify_note"] = row["verify_note"] or "no run batch fitted; answer from the refitted model"


# compiled helpers for the attention-operator mode (created on first use)

def dense_step(layers):
    return [grouped_attention(q, k, v, None) for q, k, v in layers]


def attention_step(cache, pos, layers, qkv, n_filled):
    """One decode step's attention for every layer: the policy's `begin` + `decode` hooks."""
    cache.n_filled = n_filled
    cache.begin(pos)
    return [cache.decode(layer, q, k, v) for layer, (q, k, v) in zip(layers, qkv)]


_compiled_ops: dict = {}


def dense_step_compiled():
    if "dense" not in _compiled_ops:
        _compiled_ops["dense"] = torch.compile(dense_step, dynamic=True)
    return _compiled_ops["dense"]


def attention_step_compiled():
    if "policy" not in _compiled_ops:
        _compiled_ops["policy"] = torch.compile(attention_step, dynamic=True)
    return _compiled_ops["policy"]


# --------------------------------------------------------------------------- plots

def plot(rows: list[dict], path: Path, mode: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: --plot needs matplotlib (pip install matplotlib==3.11.2); no plot written", file=sys.stderr)
        return
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        print("note: no finished rows to plot", file=sys.stderr)
        return
    if mode == "memory":
        fig, ax = plt.subplots(figsize=(7, 4.5))
        series: dict[str, list] = {}
        for r in ok:
            label = Config(r["policy"], r["policy_args"], r["kv_bits"], r["compile"]).label + f" ctx {r['context_length']}"
            series.setdefault(label, []).append((r["memory_limit_bytes"] / 2**30, r["max_batch_size"]))
        for label, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("memory limit (GiB)")
        ax.set_ylabel("max batch size")
        ax.set_title("largest batch under a memory limit")
        ax.legend(fontsize=7)
    else:
        batches = sorted({r["batch_size"] for r in ok})
        fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
        ykey, ylabel = {"e2e": ("decode_tokens_per_s", "decode tokens/s (aggregate)"),
                        "sweep": ("decode_step_ms", "decode step (ms)"),
                        "attention": ("attention_us_per_layer", "attention latency per layer (us)")}[mode]
        for ax, b in zip(axes[0], batches):
            series = {}
            for r in ok:
                if r["batch_size"] == b:
                    label = Config(r["policy"], r["policy_args"], r["kv_bits"], r["compile"]).label
                    series.setdefault(label, []).append((r["context_length"], r[ykey],
                                                         r.get("bandwidth_bound_tokens_per_s")))
            for label, pts in series.items():
                pts.sort()
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
                if mode == "e2e" and all(p[2] for p in pts):
                    ax.plot([p[0] for p in pts], [p[2] for p in pts], ls=":", color=line.get_color(),
                            label=f"{label} bandwidth bound")
            ax.set_xscale("log", base=2)
            xs = sorted({r["context_length"] for r in ok if r["batch_size"] == b})
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_ylim(bottom=0)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"batch {b}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        title = {"e2e": "end-to-end decode throughput", "sweep": "decode cost versus context",
                 "attention": "attention-operator latency"}[mode]
        fig.suptitle(f"{title} ({ok[0]['device']}, {ok[0]['dtype']}, torch {ok[0]['torch_version']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}", file=sys.stderr)


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                   help="HF/converted model directory or .gguf file (default: the SmolLM2-135M-Instruct checkout)")
    p.add_argument("--policies", default="all",
                   help=f"comma-separated registry names (name@label: the same policy again with other "
                        f"--policy-args; STORAGE+READER compositions), or 'all' "
                        f"(registered now: {', '.join(policy_names())})")
    p.add_argument("--policy-args", default="", help="per-policy arguments: 'name:k=v,k=v;name2:k=v'")
    p.add_argument("--batch-sizes", default="1", help="comma-separated (default 1)")
    p.add_argument("--context-lengths", default="1024", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--decode-steps", type=int, default=64, help="timed decode steps per run (memory mode: "
                   "generated tokens)")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps before the timed ones")
    p.add_argument("--kv-bits", default="16", help="comma-separated KV storage bits: 16 (compute dtype), 4, 2")
    p.add_argument("--kv-group-size", type=int, default=32, help="KIVI group G for --kv-bits 4|2 (default 32)")
    p.add_argument("--kv-residual", type=int, default=32, help="KIVI full-precision residual R (default 32)")
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                   help="torch.compile the steps (Inductor on CPU, CUDA graphs on CUDA); 'both' = eager and "
                        "compiled rows side by side")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median reported)")
    p.add_argument("--prefill-chunk", type=int, default=1024, help="prefill chunk length (as engine.generate)")
    p.add_argument("--prompt-file", type=Path, help="text file tokenized as the prompt (default: random ids)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=list(engine.DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--speedup-vs", metavar="POLICY",
                   help="add speedup_vs_POLICY: decode tok/s over POLICY's, pair by pair in this run "
                        "(POLICY is added to --policies if missing)")
    p.add_argument("--bandwidth-gbs", type=float,
                   help="read bandwidth for the bound column (default: measured at start-up; 0 = no bound)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--op", choices=["attention"], help="attention-operator latency only")
    mode.add_argument("--sweep-context", nargs="?", const=SWEEP_DEFAULT, metavar="START:STOP[:F]|LIST",
                      help=f"decode step time versus context (default range {SWEEP_DEFAULT}, doubling)")
    mode.add_argument("--memory-limit", metavar="SIZE[,SIZE]",
                      help="largest batch per policy under this memory (e.g. 8GiB or 4GiB,8GiB)")
    p.add_argument("--op-iters", type=int, default=20, help="--op attention: timed steps per repeat")
    p.add_argument("--verify-seconds", type=float, default=120.0,
                   help="--memory-limit: run the chosen batch when estimated to take at most this long")
    p.add_argument("--memory-headroom", type=float, default=0.05,
                   help="--memory-limit: fraction of the limit kept free for allocator slack and fragmentation "
                        "(the model's prediction error was 1-4%% on the CI machine)")
    p.add_argument("--verify-runs", type=int, default=3,
                   help="--memory-limit: at most this many real runs per policy and limit (refit after each)")
    p.add_argument("--max-batch", type=int, default=65536, help="--memory-limit: upper end of the search")
    p.add_argument("--peers", metavar="llama.cpp,hf", help="e2e: also run these peers (scripts/peers.py, each in a "
                                                          "subprocess) at the batch-1 contexts and print ours / theirs")
    p.add_argument("--json", type=Path, help="write the rows as a JSON list (atomically, after every row)")
    p.add_argument("--csv", type=Path, help="write the rows as CSV (atomically, after every row)")
    p.add_argument("--plot", type=Path, help="write a PNG plot (needs matplotlib)")
    return p


def check_options(o, parser) -> None:
    o.batch_list = parse_int_list(o.batch_sizes, "--batch-sizes")
    o.context_list = parse_int_list(o.context_lengths, "--context-lengths")
    o.kv_bits_list = parse_int_list(o.kv_bits, "--kv-bits")
    bad_bits = [b for b in o.kv_bits_list if b not in (16, 4, 2)]
    if bad_bits:
        raise BenchmarkError(f"--kv-bits {bad_bits[0]}: use 16, 4 or 2")
    for bits in set(o.kv_bits_list) - {16}:
        try:
            check_format(None, bits, o.kv_group_size, o.kv_residual)
        except ValueError as e:
            raise BenchmarkError(str(e)) from None
    if o.verify_runs < 0:
        raise BenchmarkError("--verify-runs must be >= 0")
    for flag in ("decode_steps", "repeats", "prefill_chunk", "op_iters", "max_batch"):
        if getattr(o, flag) < 1:
            raise BenchmarkError(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0 <= o.memory_headroom < 1:
        raise BenchmarkError("--memory-headroom must be in [0, 1)")
    if o.warmup_steps < 0:
        raise BenchmarkError("--warmup-steps must be >= 0")
    policies = o.policies
    if o.speedup_vs:
        if registry_name(o.speedup_vs) not in policy_names():
            raise BenchmarkError(f"--speedup-vs: unknown policy {o.speedup_vs!r}; registered: "
                                 f"{', '.join(policy_names())}")
        names = policy_names() if policies.strip() == "all" else [n.strip() for n in policies.split(",")]
        if o.speedup_vs not in names:
            print(f"note: --speedup-vs {o.speedup_vs}: added {o.speedup_vs} to --policies", file=sys.stderr)
            names = [o.speedup_vs] + names
        names = [o.speedup_vs] + [n for n in names if n != o.speedup_vs]  # the reference runs first
        policies = ",".join(names)
    o.policy_list = resolve_policies(policies, o.policy_args)
    o.memory_limits = [parse_bytes(x) for x in o.memory_limit.split(",")] if o.memory_limit else []
    if o.prompt_file is not None and not o.prompt_file.is_file():
        raise BenchmarkError(f"cannot read --prompt-file {o.prompt_file}")


def header(o, model, device, bandwidth: Optional[float], meter: MemoryMeter) -> None:
    a = model.args
    print(f"# kvpolicy-engine benchmark | torch {torch.__version__} | device {device} "
          f"({cpu_name() if device.type == 'cpu' else torch.cuda.get_device_name(device)}) | "
          f"dtype {str(model.norm.weight.dtype).replace('torch.', '')} | threads {torch.get_num_threads()} | "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset; ACTIVE recommended)')}")
    print(f"# model {o.checkpoint.name}: {a.n_layers} layers, {a.n_heads} q / {a.n_kv_heads} kv heads, head_dim "
          f"{a.head_dim}, context {a.max_position_embeddings}; weights {fmt_bytes(unique_weight_bytes(model))}")
    print(f"# read bandwidth {fmt(bandwidth)} GB/s | compile {o.compile} | repeats {o.repeats} (interleaved, "
          f"median) | decode steps {o.decode_steps} (+{o.warmup_steps} warm-up) | peak memory: {meter.kind} | "
          f"prompt {o.prompt_file or 'random ids'}", flush=True)


def print_summary(rows: list[dict]) -> None:
    bad = [r for r in rows if r.get("status") != "ok"]
    if bad:
        print(f"# {len(bad)} row(s) not measured:", file=sys.stderr)
        for r in bad:
            print(f"#   {r['policy']} B={r.get('batch_size')} ctx={r['context_length']} kv_bits={r['kv_bits']}: "
                  f"{r['status']}: {r['error']}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    o = parser.parse_args(argv)
    try:
        check_options(o, parser)
        device = engine.resolve_device(o.device)
        model, tokenizer = engine.load_model(o.checkpoint, device, o.dtype)
        for bits in set(o.kv_bits_list) - {16}:
            try:
                check_format(model.args.head_dim, bits, o.kv_group_size, o.kv_residual)
            except ValueError as e:
                raise BenchmarkError(str(e)) from None
    except (BenchmarkError, engine.UsageError, engine.CheckpointError, PolicyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mode = "memory" if o.memory_limit else "attention" if o.op else "sweep" if o.sweep_context else "e2e"
    try:
        contexts = o.context_list
        if mode == "sweep":
            contexts = parse_sweep(o.sweep_context, model.args.max_position_embeddings,
                                   o.warmup_steps + o.decode_steps + CAPACITY_MARGIN)
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    file_ids = None
    if o.prompt_file:
        file_ids = tokenizer.encode(o.prompt_file.read_text())
        if not file_ids:
            print(f"error: --prompt-file {o.prompt_file} gives no tokens", file=sys.stderr)
            return 2
    # every (policy, batch specialisation) may need its own graph: never fall back to eager silently
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(o.policy_list) + 8)
    meter = MemoryMeter(device)
    writer = RowWriter(o.json, o.csv, lambda rows: add_ratios(rows, o.speedup_vs))
    try:
        bandwidth = o.bandwidth_gbs if o.bandwidth_gbs is not None else measure_bandwidth(device)
        header(o, model, device, bandwidth, meter)
        bench = Bench(model, o, writer, meter, bandwidth or None, file_ids)
        if mode == "memory":
            bench.run_memory()
        elif mode == "attention":
            bench.run_attention()
        else:
            bench.run_grid(mode, contexts)
    except KeyboardInterrupt:
        writer.write()
        kept = sum(r.get("status") == "ok" for r in writer.rows)
        where = " and ".join(str(p) for p in (o.json, o.csv) if p) or "no file (use --json/--csv)"
        print(f"\ninterrupted: kept {len(writer.rows)} finished row(s) ({kept} measured) in {where}", file=sys.stderr)
        return 130
    print_summary(writer.rows)
    if o.peers and mode == "e2e":
        from peers import compare_with_rows
        compare_with_rows(writer.rows, o.peers, torch.get_num_threads(), o.decode_steps)
    if o.plot:
        plot(writer.rows, o.plot, mode)
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
