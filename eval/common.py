"""What every eval shares: the command-line flags, loading, the policy, progress and JSON output.

An eval module builds its parser with `base_parser()`, adds its own flags, and runs through
`main_wrapper(run, parser, argv)`, which turns bad input into a one-line `error:` and exit 2.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402

import atomic_io  # noqa: E402
import engine  # noqa: E402
from cache import PolicyError, make_policy, policy_names  # noqa: E402
from checkpoint import CheckpointError  # noqa: E402
from model import Transformer  # noqa: E402
from runtime.steps import UsageError, compiled_steps, decode_step, prefill_step, warm_up, warmup_length  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"
DATA = ROOT / "data"                        # data shipped with the repository (data/README.md)
ESSAYS = DATA / "paul_graham_essays"


# --------------------------------------------------------------------------- flags

def base_parser(description: str) -> argparse.ArgumentParser:
    """The flags every eval takes: model, policy, storage, device, --compile, --json."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT),
                   help="HF/converted model directory or .gguf file (default: %(default)s)")
    p.add_argument("--policy", default="full", help=f"KV-cache policy spec NAME[:key=value,...], e.g. snapkv:budget=128 "
                                                    f"or snapkv+hshare:preset=short; NAME one of {', '.join(policy_names())}")
    p.add_argument("--policy-args", default="", help="more policy parameters, k=v,k=v (--policy X --policy-args k=v "
                                                     "is the same as --policy X:k=v)")
    engine.add_kv_flags(p)
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=list(engine.DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return p


def add_protocol_flag(p: argparse.ArgumentParser) -> None:
    """--protocol, for the tasks that ask a question about a context (docs/design.md, "Protocols")."""
    p.add_argument("--protocol", choices=["aware", "agnostic"], default="aware",
                   help="aware (default): the prompt with its question is compressed; agnostic: the context is "
                        "compressed without the question, then the question is appended whole")


def parse_floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated numbers") from None
    if not values:
        raise UsageError(f"{flag} is empty")
    return values


def parse_ints(text: str, flag: str) -> list[int]:
    values = parse_floats(text, flag)
    if any(v != int(v) for v in values):
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers")
    return [int(v) for v in values]


# --------------------------------------------------------------------------- policy and model

def new_policy(args):
    """A fresh policy object from --policy/--policy-args and its storage from --kv-bits/--kv-group-size/
    --kv-residual (raises PolicyError/UsageError).  Every run gets its own, so no state leaks from one
    cell to the next."""
    return engine.kv_policy(make_policy(args.policy, args.policy_args), args)


@dataclass
class Loaded:
    model: Transformer
    tokenizer: Tokenizer
    device: torch.device
    prefill: Callable = prefill_step
    decode: Callable = decode_step

    @property
    def context_length(self) -> int:
        return self.model.args.max_position_embeddings


def load(args) -> Loaded:
    """Validate the policy flags, then load the checkpoint (compiled steps with --compile)."""
    new_policy(args)                        # fail on a bad policy before spending time loading
    device = engine.resolve_device(args.device)
    model, tokenizer = engine.load_model(args.checkpoint, device, args.dtype)
    engine.check_kv_fits(args, model.args)
    loaded = Loaded(model, tokenizer, device)
    new_policy(args).prepare(model, tokenizer)          # calibration files the policy needs, made once
    if args.compile:
        loaded.prefill, loaded.decode = compiled_steps(device)
        policy = new_policy(args)
        warm_up(model, loaded.prefill, loaded.decode,
                       torch.zeros(1, warmup_length(policy), dtype=torch.long, device=device), policy)
    return loaded


def check_fits(loaded: Loaded, tokens: int, what: str) -> None:
    if tokens > loaded.context_length:
        raise UsageError(f"{what} = {tokens} tokens exceeds the model's context length {loaded.context_length}")


# --------------------------------------------------------------------------- text

def read_text_folder(folder) -> str:
    """The .txt files of a folder in sorted name order, joined by blank lines."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"haystack folder {folder} does not exist" if not folder.exists()
                         else f"haystack {folder} is not a folder of .txt files")
    texts = [t for t in (p.read_text(encoding="utf-8", errors="replace").strip()
                         for p in sorted(folder.glob("*.txt"))) if t]
    if not texts:
        raise UsageError(f"haystack folder {folder} has no non-empty .txt files")
    return "\n\n".join(texts)


def read_text_file(path) -> str:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise UsageError(f"cannot read --text {path}: {e.strerror}") from None
    if not text.strip():
        raise UsageError(f"--text {path} is empty")
    return text


# --------------------------------------------------------------------------- reporting

class Progress:
    """One line per finished cell on stderr: `[i/n] label  result  (cell s, total s)`."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.t0 = self.t_cell = time.perf_counter()

    def start(self) -> None:
        self.t_cell = time.perf_counter()

    def finish(self, label: str, result: str = "") -> float:
        """Print the cell's line; returns its seconds."""
        now = time.perf_counter()
        self.done += 1
        seconds = now - self.t_cell
        print(f"[{self.done}/{self.total}] {label}  {result}  ({seconds:.1f} s, {now - self.t0:.1f} s total)",
              file=self.stream, flush=True)
        self.t_cell = now
        return seconds


def report_header(args) -> dict:
    """The fields every eval's JSON starts with."""
    return {"policy": args.policy, "policy_args": args.policy_args, "protocol": getattr(args, "protocol", None),
            "kv_bits": args.kv_bits,
            "kv_dtype": getattr(args, "kv_dtype", None), "kv_group_size": args.kv_group_size,
            "kv_residual": args.kv_residual, "checkpoint": str(args.checkpoint)}


def write_json(path, obj: dict) -> None:
    """Write atomically (a temporary file renamed over the target)."""
    atomic_io.write_json(path, obj, indent=2)


def main_wrapper(run: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser,
                 argv: Optional[Sequence[str]] = None) -> int:
    """Parse argv and run; bad input -> `error: ...` on stderr and exit status 2."""
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (UsageError, CheckpointError, PolicyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
