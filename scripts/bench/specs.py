"""The grid one benchmark run measures: command-line values, policy specs, configurations, prompts.

Everything here is checked before the model is loaded: a bad value raises BenchmarkError, which
the CLI reports as one `error:` line with exit status 2.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from cache import PolicyError, PolicySpec, make_policy, parse_spec, parse_spec_list, policy_names
from cache.kv_dtype import kv_storage
from cache.quantized import RESIDUAL

CAPACITY_MARGIN = 16          # spare slots: a cache filled to the last slot is a special shape
KV_BITS = (32, 16, 4, 2)      # storage precisions a row can have (16 = the compute dtype or --kv-dtype; 32 = fp32)
COMPILES = {"off": [False], "on": [True], "both": [False, True]}   # --compile -> rows per config


class BenchmarkError(ValueError):
    """Bad command line: reported as one `error:` line, exit status 2."""


class Unsupported(Exception):
    """A configuration this build cannot run (row reported as skipped, the run goes on)."""


# --------------------------------------------------------------------------- values

def require_positive(o, *flags: str) -> None:
    """Each option (attribute names, e.g. "decode_steps") must be at least 1."""
    for flag in flags:
        if getattr(o, flag) < 1:
            raise BenchmarkError(f"--{flag.replace('_', '-')} must be at least 1")


def parse_int_list(text: str, flag: str) -> list[int]:
    """'1,8,16' -> [1, 8, 16]; every value a positive integer."""
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


def parse_context_range(text: str) -> list[int]:
    """'256:8192' (doubling), '256:8192:4' (factor) or '256,512,1000' -> the contexts, uncapped."""
    try:
        if ":" not in text:
            return parse_int_list(text, "--sweep-context")
        parts = [int(x) for x in text.split(":")]
        if len(parts) not in (2, 3) or parts[0] < 1 or parts[1] < parts[0] or (len(parts) == 3 and parts[2] < 2):
            raise ValueError
    except (ValueError, BenchmarkError):
        raise BenchmarkError(f"--sweep-context expects START:STOP[:FACTOR] or a list, got {text!r}") from None
    start, stop, factor = parts[0], parts[1], parts[2] if len(parts) == 3 else 2
    values = []
    while start <= stop:
        values.append(start)
        start *= factor
    return values


def parse_sweep(text: str, max_context: int, reserve: int) -> list[int]:
    """parse_context_range, the top capped so prompt + `reserve` decode slots fit the model's context."""
    values = parse_context_range(text)
    limit = max_context - reserve
    capped = sorted({min(v, limit) for v in values})
    if capped != sorted(set(values)):
        print(f"note: sweep contexts capped at {limit} (model context {max_context} - {reserve} decode slots)",
              file=sys.stderr)
    return capped


# --------------------------------------------------------------------------- policy specs

def parse_policies(texts: Iterable[str]) -> list[PolicySpec]:
    """The values of --policies (each a ';'-separated spec list; 'all' = every registered policy) ->
    validated specs.  Every name and argument is checked here, before any model is loaded."""
    items = [item.strip() for text in texts for item in text.split(";")]
    items = [name for item in items for name in (policy_names() if item == "all" else [item])]
    try:
        specs = parse_spec_list(items)
    except PolicyError as e:
        raise BenchmarkError("--policies is empty" if not any(items) else str(e)) from None
    for spec in specs:
        check_spec(spec, "")
    return specs


def check_spec(spec: PolicySpec, flag: str) -> None:
    """Build the policy once (and drop it): unknown names and bad arguments are BenchmarkErrors."""
    try:
        make_policy(spec)
    except PolicyError as e:
        raise BenchmarkError(f"{flag}{e}") from None


def with_reference(specs: list[PolicySpec], text: Optional[str]) -> tuple[list[PolicySpec], Optional[str]]:
    """--speedup-vs NAME[@LABEL] (or a whole spec when it is not in --policies, which then adds it):
    the specs with the reference first (it runs first in every group), and its NAME@LABEL."""
    if not text:
        return specs, None
    try:
        ref = parse_spec(text)
    except PolicyError as e:
        raise BenchmarkError(f"--speedup-vs: {e}") from None
    listed = [s for s in specs if s.variant == ref.variant]
    if listed and ref.args and listed[0] != ref:
        raise BenchmarkError(f"--speedup-vs {text!r}: {ref.variant} is in --policies as {str(listed[0])!r}; "
                             f"give only its NAME[@LABEL]")
    if not listed:
        check_spec(ref, "--speedup-vs: ")
        print(f"note: --speedup-vs {text}: added {ref} to --policies", file=sys.stderr)
    first = listed[0] if listed else ref
    return [first] + [s for s in specs if s.variant != ref.variant], ref.variant


# --------------------------------------------------------------------------- configurations

def config_label(policy: str, policy_args: str, kv_bits: int, compiled: bool, kv_dtype: Optional[str] = None) -> str:
    """'snapkv(budget=128) kv4 compiled': how tables, progress lines and plots name a row."""
    s = policy + (f"({policy_args})" if policy_args else "")
    if kv_bits != 16:
        s += f" kv{kv_bits}"
    elif kv_dtype:
        s += f" {kv_dtype}"
    return s + (" compiled" if compiled else "")


@dataclass(frozen=True)
class Config:
    """One measured configuration: a policy spec at a KV storage precision, eager or compiled."""
    spec: PolicySpec
    kv_bits: int
    compile: bool
    kv_group: int = 32          # KIVI G and R (used when kv_bits is 4 or 2)
    kv_residual: int = RESIDUAL
    kv_dtype: Optional[str] = None              # storage dtype of the kv_bits 16 rows (None: the compute dtype)
    compute_dtype: Optional[torch.dtype] = None
    compile_prefill: bool = False               # with compile: the prefill step compiled too

    @property
    def policy(self) -> str:
        """The rows' `policy` field: NAME@LABEL (or NAME)."""
        return self.spec.variant

    @property
    def policy_args(self) -> str:
        """The rows' `policy_args` field: 'k=v,...' as written in the spec."""
        return self.spec.arg_text

    @property
    def label(self) -> str:
        return config_label(self.policy, self.policy_args, self.kv_bits, self.compile, self.row_kv_dtype)

    @property
    def row_kv_dtype(self) -> Optional[str]:
        """The rows' `kv_dtype` field: --kv-dtype for 16-bit rows, else None."""
        return self.kv_dtype if self.kv_bits == 16 else None


def grid(o) -> list[Config]:
    """Every configuration of the run: specs x --kv-bits x --compile, in that nesting order."""
    return [Config(spec, bits, c, o.kv_group_size, o.kv_residual, o.kv_dtype, getattr(o, "compute_dtype", None),
                   c and getattr(o, "compile_prefill", False))
            for spec in o.policy_list for bits in o.kv_bits_list for c in COMPILES[o.compile]]


def build_policy(cfg: Config):
    """A fresh policy object for one run, its K/V stored at cfg.kv_bits / cfg.kv_dtype (cache/kv_dtype.py; a
    policy without that storage is Unsupported: its rows are reported as skipped)."""
    policy = make_policy(cfg.spec)
    try:
        return kv_storage(policy, cfg.kv_bits, cfg.kv_group, cfg.kv_residual, cfg.row_kv_dtype, cfg.compute_dtype)
    except ValueError as e:
        raise Unsupported(str(e)) from None


def skip_reason(cfg: Config) -> Optional[str]:
    """Why `cfg` cannot run in this build (its rows are skipped), or None."""
    try:
        build_policy(cfg)
    except Unsupported as e:
        return str(e)
    return None


def context_problem(max_context: int, context: int, extra: int) -> Optional[str]:
    """Why a prompt of `context` tokens + `extra` decode steps does not fit the model, or None."""
    if context + extra + CAPACITY_MARGIN > max_context:
        return (f"context {context} + {extra} decode steps + {CAPACITY_MARGIN} spare slots exceeds the "
                f"model's context length {max_context}")
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
