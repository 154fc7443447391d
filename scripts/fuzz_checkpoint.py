"""Seeded fuzzing of the checkpoint readers: corrupt copies of a real GGUF file and of a converted
safetensors directory, each checked by `checkpoint.validate_checkpoint` (everything the loader checks
before it reads tensor data).  Every case must either load or raise CheckpointError, within seconds;
any other exception, or a case slower than --case-limit seconds, is a failure (exit status 1).

    python scripts/fuzz_checkpoint.py --cases 2000 --seed 1            # both targets, in-process
    python scripts/fuzz_checkpoint.py --cases 50 --cli                 # through engine.py (exit 0 or 2)

GGUF cases: truncation (mostly inside the header, some in the tensor data), bit flips in the fixed
header, the metadata and the tensor infos, absurd 64-bit values written over tensor-info fields
(dims, types, offsets) and over counts, bytes flipped in the tensor data.  Directory cases:
safetensors headers that lie (shapes, offsets, dtypes, header length), missing / extra / duplicate
tensors, a truncated data section, flipped header bytes, absurd or broken config.json fields,
corrupt / truncated / missing tokenizer files, a broken chat template, an index naming a file
outside the directory.  The directory's data section is sparse (zeros): validation reads headers only.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checkpoint import CheckpointError, validate_checkpoint  # noqa: E402
from checkpoint.gguf_file import _Cursor, _gguf_metadata, _gguf_tensor_info  # noqa: E402

DEFAULT_GGUF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"
ABSURD = [2**64 - 1, 2**63, 2**40, 2**32 + 7, 0, 1, 3, 0xFFFFFFFF]
DIR_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


# --------------------------------------------------------------------------- GGUF

class GGUFTarget:
    """A working copy of a GGUF file; each case mutates it in place and restores it."""

    def __init__(self, source: Path, work: Path):
        self.path = work / "fuzz.gguf"
        shutil.copyfile(source, self.path)
        self.orig = source.read_bytes()
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            c = _Cursor(buf, self.path)
            c.pos = 8
            n_tensors, n_kv = c.uint(8, ""), c.uint(8, "")
            _gguf_metadata(c, n_kv)
            self.info_start = c.pos
            for i in range(n_tensors):
                _gguf_tensor_info(c, i)
            self.header_end = c.pos

    def case(self, rng: random.Random) -> tuple[str, Callable, Callable]:
        """(label, apply, undo) of one random mutation."""
        kind = rng.choices(["truncate", "flip", "absurd", "data"], [3, 4, 3, 1])[0]
        if kind == "truncate":
            at = rng.randrange(self.header_end + 64) if rng.random() < 0.8 else rng.randrange(len(self.orig))
            return (f"truncate at {at}", lambda: os.truncate(self.path, at), lambda: self._restore_tail(at))
        if kind == "absurd":
            at = rng.randrange(8, 24) if rng.random() < 0.2 else rng.randrange(self.info_start, self.header_end - 8)
            value = rng.choice(ABSURD).to_bytes(8, "little")
            return f"absurd {value.hex()} at {at}", lambda: self._write(at, value), lambda: self._write(at, self.orig[at:at + 8])
        if kind == "data":
            at = rng.randrange(self.header_end, len(self.orig))
        else:
            region = rng.choice([(0, 24), (24, self.info_start), (self.info_start, self.header_end)])
            at = rng.randrange(*region)
        bit = rng.randrange(8)
        flipped = bytes([self.orig[at] ^ (1 << bit)])
        return f"{kind} bit {bit} at {at}", lambda: self._write(at, flipped), lambda: self._write(at, self.orig[at:at + 1])

    def _write(self, at: int, data: bytes) -> None:
        with open(self.path, "r+b") as f:
            f.seek(at)
            f.write(data)

    def _restore_tail(self, at: int) -> None:
        with open(self.path, "r+b") as f:
            f.seek(at)
            f.write(self.orig[at:])


# --------------------------------------------------------------------------- safetensors directory

class DirTarget:
    """A working copy of a converted directory (config, tokenizer files, model.safetensors with its real
    header and a sparse data section); each case mutates it and restores it."""

    def __init__(self, source: Path, work: Path):
        self.path = work / "fuzz-dir"
        self.path.mkdir()
        self.files = {name: (source / name).read_bytes() for name in DIR_FILES}
        st = source / "model.safetensors"
        with open(st, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            self.st_head = n.to_bytes(8, "little") + f.read(n)
        self.st_size = st.stat().st_size
        self.header = json.loads(self.st_head[8:])
        self.restore()

    def restore(self) -> None:
        for name, data in self.files.items():
            (self.path / name).write_bytes(data)
        for extra in set(os.listdir(self.path)) - set(DIR_FILES) - {"model.safetensors"}:
            os.remove(self.path / extra)
        self.write_st(self.st_head)

    def write_st(self, head: bytes, size: int = -1) -> None:
        with open(self.path / "model.safetensors", "wb") as f:
            f.write(head)
        os.truncate(self.path / "model.safetensors", self.st_size if size < 0 else size)

    def lie(self, edit: Callable[[dict], None]) -> None:
        """Rewrite the header after edit(header); the data section keeps its size and place when it fits."""
        header = json.loads(json.dumps(self.header))
        edit(header)
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * max(0, len(self.st_head) - 8 - len(text))
        self.write_st(len(text).to_bytes(8, "little") + text, 8 + len(text) + self.st_size - len(self.st_head))

    def case(self, rng: random.Random) -> tuple[str, Callable, Callable]:
        names = [k for k in self.header if k != "__metadata__"]
        name = rng.choice(names)
        kind = rng.choice(list(DIR_CASES))
        return f"{kind} ({name})", lambda: DIR_CASES[kind](self, rng, name), self.restore


def _flip(data: bytes, rng: random.Random, lo: int = 0) -> bytes:
    at = rng.randrange(lo, len(data))
    return data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:]


def _config(t: DirTarget, key: str, value) -> None:
    config = json.loads(t.files["config.json"])
    config[key] = value
    (t.path / "config.json").write_text(json.dumps(config))


def _set(header: dict, name: str, key: str, value) -> None:
    header[name][key] = value


DIR_CASES = {
    "shape lies": lambda t, r, n: t.lie(lambda h: _set(h, n, "shape", [d + r.choice([-1, 1]) for d in h[n]["shape"]])),
    "huge shape": lambda t, r, n: t.lie(lambda h: _set(h, n, "shape", [2**62, 2**62])),
    "offsets past end": lambda t, r, n: t.lie(lambda h: _set(h, n, "data_offsets", [h[n]["data_offsets"][0], 2**50])),
    "offsets reversed": lambda t, r, n: t.lie(lambda h: _set(h, n, "data_offsets", h[n]["data_offsets"][::-1])),
    "offsets overlap": lambda t, r, n: t.lie(lambda h: _set(h, n, "data_offsets", [0, h[n]["data_offsets"][1] - h[n]["data_offsets"][0]])),
    "offsets not ints": lambda t, r, n: t.lie(lambda h: _set(h, n, "data_offsets", ["0", None])),
    "dtype F16": lambda t, r, n: t.lie(lambda h: _set(h, n, "dtype", "F16")),
    "dtype I64": lambda t, r, n: t.lie(lambda h: _set(h, n, "dtype", "I64")),
    "dtype unknown": lambda t, r, n: t.lie(lambda h: _set(h, n, "dtype", "Q9")),
    "entry not an object": lambda t, r, n: t.lie(lambda h: h.__setitem__(n, [1, 2])),
    "missing tensor": lambda t, r, n: t.lie(lambda h: h.pop(n)),
    "extra tensor": lambda t, r, n: t.lie(lambda h: h.__setitem__("model.layers.99.mlp.extra.weight", {
        "dtype": "F32", "shape": [0], "data_offsets": [h[n]["data_offsets"][1]] * 2})),
    "renamed tensor": lambda t, r, n: t.lie(lambda h: h.__setitem__(n.replace("weight", "wieght"), h.pop(n))),
    "header not an object": lambda t, r, n: t.write_st(b"\x02\0\0\0\0\0\0\0[]"),
    "header length huge": lambda t, r, n: t.write_st(r.choice(ABSURD).to_bytes(8, "little") + t.st_head[8:]),
    "header bit flip": lambda t, r, n: t.write_st(_flip(t.st_head, r, 8)),
    "truncated data": lambda t, r, n: t.write_st(t.st_head, r.randrange(len(t.st_head), t.st_size)),
    "truncated header": lambda t, r, n: t.write_st(t.st_head[:r.randrange(len(t.st_head))], 0),
    "empty weights": lambda t, r, n: t.write_st(b"", 0),
    "config bit flip": lambda t, r, n: (t.path / "config.json").write_bytes(_flip(t.files["config.json"], r)),
    "config truncated": lambda t, r, n: (t.path / "config.json").write_bytes(t.files["config.json"][:r.randrange(60)]),
    "config absurd": lambda t, r, n: _config(t, r.choice(["num_hidden_layers", "hidden_size", "num_attention_heads",
                                                           "vocab_size", "rope_theta", "rms_norm_eps", "head_dim"]),
                                             r.choice([0, -1, 10**12, 2**64, "7", None, 1.5, [], float("nan")])),
    "config rope scaling": lambda t, r, n: _config(t, "rope_scaling", r.choice([{"rope_type": "linear"}, {"factor": 0},
                                                                              {"rope_type": "llama3", "factor": "x"}, 7])),
    "config missing": lambda t, r, n: os.remove(t.path / "config.json"),
    "tokenizer bit flip": lambda t, r, n: (t.path / "tokenizer.json").write_bytes(_flip(t.files["tokenizer.json"], r)),
    "tokenizer truncated": lambda t, r, n: (t.path / "tokenizer.json").write_bytes(
        t.files["tokenizer.json"][:r.randrange(len(t.files["tokenizer.json"]))]),
    "tokenizer missing": lambda t, r, n: os.remove(t.path / "tokenizer.json"),
    "tokenizer not bpe": lambda t, r, n: (t.path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": 3}})),
    "tokenizer_config broken": lambda t, r, n: (t.path / "tokenizer_config.json").write_text(
        r.choice(['{"chat_template": "{% if %}"}', '{"added_tokens_decoder": {"x": 1}}', '{"bos_token": 5}', "[", '{"chat_template": 3}'])),
    "index outside dir": lambda t, r, n: (t.path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: r.choice(["../fuzz.gguf", "/etc/passwd", "..", "sub/x.safetensors"])}})),
    "index broken": lambda t, r, n: (t.path / "model.safetensors.index.json").write_text(r.choice(['{"weight_map": 3}', "{", "[]"])),
}


# --------------------------------------------------------------------------- running

def run_case(path: Path) -> str:
    """'ok' or 'error: ...' (a CheckpointError); any other exception propagates."""
    try:
        validate_checkpoint(path)
        return "ok"
    except CheckpointError as e:
        return f"error: {e}"


def fuzz(target, n: int, seed: int, case_limit: float = 10.0, log=None) -> dict:
    """Run n seeded cases on target -> {"ok", "error", "failures": [(label, problem)], "seconds"}."""
    rng = random.Random(seed)
    out = {"ok": 0, "error": 0, "failures": [], "slowest": 0.0}
    t_all = time.perf_counter()
    for i in range(n):
        label, apply, undo = target.case(rng)
        apply()
        t0 = time.perf_counter()
        try:
            result = run_case(target.path)
            out["ok" if result == "ok" else "error"] += 1
        except Exception as e:  # noqa: BLE001 - a crash is what this looks for
            result = f"CRASH {type(e).__name__}: {e}"
            out["failures"].append((label, result))
        seconds = time.perf_counter() - t0
        out["slowest"] = max(out["slowest"], seconds)
        if seconds > case_limit:
            out["failures"].append((label, f"took {seconds:.1f} s"))
        if log:
            log(f"{i:5d} {label}: {result[:160]} ({seconds:.2f} s)")
        undo()
    out["seconds"] = time.perf_counter() - t_all
    return out


def cli_case(target, rng: random.Random, timeout: float = 120.0) -> tuple[str, str]:
    """One random case through `engine.py` -> (label, problem or '')."""
    label, apply, undo = target.case(rng)
    apply()
    try:
        r = subprocess.run([sys.executable, str(ROOT / "engine.py"), "--checkpoint", str(target.path), "--prompt", "hi",
                            "--max-new-tokens", "1", "--device", "cpu"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return label, f"no answer within {timeout} s"
    finally:
        undo()
    bad_err = r.returncode == 2 and not (r.stderr.startswith("error: ") and r.stderr.count("\n") == 1)
    if r.returncode not in (0, 2) or "Traceback" in r.stderr or bad_err:
        return label, f"exit {r.returncode}: {r.stderr[-400:]}"
    return label, ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=500, help="cases per target (default 500)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="a converted (safetensors) model directory")
    p.add_argument("--target", choices=["gguf", "dir", "both"], default="both")
    p.add_argument("--cli", action="store_true", help="run each case through engine.py instead (slow)")
    p.add_argument("--case-limit", type=float, default=10.0, help="seconds a case may take (default 10)")
    p.add_argument("--verbose", action="store_true", help="print every case")
    p.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    a = p.parse_args(argv)
    import tempfile
    with tempfile.TemporaryDirectory(dir=a.work) as work:
        targets = {"gguf": lambda: GGUFTarget(a.gguf, Path(work)), "dir": lambda: DirTarget(a.dir, Path(work))}
        failed = 0
        for name in (["gguf", "dir"] if a.target == "both" else [a.target]):
            target = targets[name]()
            if a.cli:
                rng = random.Random(a.seed)
                problems = [pr for pr in (cli_case(target, rng) for _ in range(a.cases)) if pr[1]]
                print(f"{name}: {a.cases} CLI cases, {len(problems)} failures")
            else:
                r = fuzz(target, a.cases, a.seed, a.case_limit, print if a.verbose else None)
                problems = r["failures"]
                print(f"{name}: {a.cases} cases in {r['seconds']:.1f} s: {r['ok']} load, {r['error']} clean errors, "
                      f"{len(problems)} failures (slowest case {r['slowest']:.2f} s)")
            for label, problem in problems:
                print(f"  FAIL {label}: {problem}")
            failed += len(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
