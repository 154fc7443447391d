"""Re-run the tables the docs publish, one JSON per table, and render docs/results.md from them.

    python scripts/reproduce.py --quick      # minutes on 2 cores (<= 20 min): small sizes -> results/quick/
    python scripts/reproduce.py --full       # the published sizes -> results/, renders docs/results.md
    python scripts/reproduce.py --render     # only re-render docs/results.md (and the README's headline)

Tables (--tables, default all):
  speed     decode throughput per policy at batch 8 (scripts/benchmark.py, against `full` in the same run)
  kivi      KV storage: fp32, bf16, KIVI 4/2-bit under `full` (scripts/benchmark.py --kv-bits)
  memory    largest batch per policy under a memory limit (scripts/benchmark.py --memory-limit)
  accuracy  needle and perplexity per policy (scripts/accuracy_table.py; --quick: a small eval.suite run)
  peers     batch-1 decode against llama.cpp and HF transformers where installed (scripts/peers.py)

The tools write their own outputs into runs/reproduce/quick|full/ (kept, git-ignored); each table
is written as OUT/TOPIC.json: {"section", "title", "topic", "size", "command", "date",
"machine", "columns", "rows", "notes"}.  The machine is captured once per run: CPU model, ISA level
(torch.backends.cpu.get_cpu_capability()), logical CPUs, torch threads, the read bandwidth the speed
run measured (scripts/compare_hf.read_bandwidth_gbs, as the benchmark reports it), torch version,
OMP_WAIT_POLICY (set to ACTIVE for the children unless the environment sets it), Python, git commit.
A table whose tool fails is written with its error and the run exits 1.

docs/results.md is rendered from every results/*.json (the published tables, including the ones
transcribed from earlier runs, which carry the machine as recorded then); --quick renders its own
results/quick/results.md instead, so quick numbers never replace published ones.  History lives in
git, not in the file.
"""
from __future__ import annotations

import argparse
import collections
import datetime as dt
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import atomic_io  # noqa: E402

RESULTS = ROOT / "results"
RUNS = ROOT / "runs" / "reproduce"          # the tools' own outputs (git-ignored), kept for inspection
DOC = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
CKPT = "checkpoints/SmolLM2-135M-Instruct"
GGUF = "checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf"
HEADLINE = ("<!-- headline: rendered by scripts/reproduce.py from results/peers.json -->",
            "<!-- /headline -->")
MIB = 2 ** 20


# --------------------------------------------------------------------------- the machine

def git_commit() -> Optional[str]:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def machine(bandwidth_gbs: Optional[float]) -> dict:
    """What the tables ran on: the CPU, and the read bandwidth the run's first benchmark measured (else
    measured here, as the benchmark does: scripts/compare_hf.read_bandwidth_gbs)."""
    import torch
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench.measure import device_name
    if bandwidth_gbs is None:
        from bench.roofline import measure_bandwidth
        bandwidth_gbs = measure_bandwidth(torch.device("cpu"), rounds=1)
    return {"cpu": device_name(torch.device("cpu")), "isa": torch.backends.cpu.get_cpu_capability(),
            "logical_cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "read_bandwidth_gbs": None if bandwidth_gbs is None else round(bandwidth_gbs, 1),
            "torch": torch.__version__, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "python": platform.python_version(), "commit": git_commit()}


# --------------------------------------------------------------------------- the tables

@dataclass(frozen=True)
class Table:
    topic: str
    section: str            # the results.md section it renders under
    title: str
    argv: Callable[[bool, Path], list[str]]       # (quick, output path) -> the command after `python`
    rows: Callable[[Path], tuple[list[str], list[list]]]   # the tool's output -> (columns, rows)
    notes: str = ""
    order: int = 0          # place among the section's tables


def _f(x, spec: str = ".1f") -> str:
    return "" if x is None else format(x, spec)


def _bench_rows(path: Path, mode: str = "e2e") -> list[dict]:
    return [r for r in json.loads(path.read_text()) if r.get("mode") == mode]


def speed_argv(quick: bool, out: Path) -> list[str]:
    size = (["--policies", "full; streaming; h2o; snapkv; ds; hshare", "--context-lengths", "1024",
             "--decode-steps", "16", "--repeats", "1"] if quick else
            ["--policies", "all", "--context-lengths", "4096", "--decode-steps", "32", "--repeats", "3"])
    return ["scripts/benchmark.py", *size, "--batch-sizes", "8", "--speedup-vs", "full", "--json", str(out)]


def speed_rows(path: Path):
    cols = ["policy", "decode tok/s", "vs full", "step ms", "KV allocated", "of bound"]
    rows = []
    for r in _bench_rows(path):
        name = f"`{r['policy']}{':' + r['policy_args'] if r['policy_args'] else ''}`"
        if r["status"] != "ok":
            rows.append([name, r["status"], "", "", "", r.get("error") or ""])
            continue
        rows.append([name, _f(r["decode_tokens_per_s"]), _f(r.get("speedup_vs_full"), ".2f") + "x",
                     _f(r["decode_step_ms"]), f"{r['kv_bytes_allocated'] / MIB:.1f} MiB",
                     _f(100 * (r["fraction_of_bound"] or 0), ".0f") + "%"])
    return cols, rows


KIVI_POLICIES = "full; ds; hshare:ratios=1/2-1/2-1/2"      # the storage table's columns (issue 34)


def kivi_argv(quick: bool, out: Path) -> list[str]:
    size = (["--context-lengths", "1024", "--decode-steps", "16", "--repeats", "1"] if quick else
            ["--context-lengths", "4096", "--decode-steps", "32", "--repeats", "2"])
    return ["scripts/benchmark.py", "--policies", KIVI_POLICIES, "--kv-bits", "32,16,4,2", "--kv-dtype", "bfloat16",
            "--batch-sizes", "8", *size, "--speedup-vs", "full", "--json", str(out)]


def kivi_rows(path: Path):
    """Decode tok/s by storage (rows) x policy (columns), each cell with its ratio over the same policy's
    fp32 storage and over `full` at the same storage; a storage a policy cannot use says why."""
    names = {32: "fp32 (kv32)", 16: "bfloat16 (kv16)", 4: "KIVI 4-bit", 2: "KIVI 2-bit"}
    got = {(r["kv_bits"], r["policy"]): r for r in _bench_rows(path)}
    labels = {r["policy"]: f"`{r['policy']}{':' + r['policy_args'] if r['policy_args'] else ''}`" for r in got.values()}
    policies = sorted(labels, key=lambda p: p != "full")                               # full first, then as run
    tps = {key: r["decode_tokens_per_s"] for key, r in got.items() if r["status"] == "ok"}

    def ratio(v: float, base: Optional[float]) -> str:
        return f"{v / base:.2f}x" if base else "-x"

    def cell(bits: int, policy: str) -> str:
        v = tps.get((bits, policy))
        if v is None:
            return got[(bits, policy)]["status"]
        return f"{v:.1f} ({ratio(v, tps.get((32, policy)))}, {ratio(v, tps.get((bits, 'full')))})"
    cols = ["storage"] + [f"{labels[p]} tok/s (x its fp32, x `full`)" for p in policies] + ["KV allocated, `full`"]
    rows = []
    for bits in sorted({b for b, _ in got}, reverse=True):                             # fp32, 16-bit, 4, 2
        full = got.get((bits, "full"))
        rows.append([names.get(bits, str(bits)), *(cell(bits, p) for p in policies),
                     f"{full['kv_bytes_allocated'] / MIB:.1f} MiB" if (bits, "full") in tps else ""])
    return cols, rows


def memory_argv(quick: bool, out: Path) -> list[str]:
    size = (["--memory-limit", "2GiB", "--policies", "full; streaming; snapkv", "--context-lengths", "1024",
             "--decode-steps", "16", "--verify-runs", "1", "--verify-seconds", "30"] if quick else
            ["--memory-limit", "8GiB", "--policies", "full; streaming; snapkv; ds", "--kv-bits", "16,4",
             "--context-lengths", "4096", "--decode-steps", "64"])
    return ["scripts/benchmark.py", *size, "--json", str(out)]


def memory_rows(path: Path):
    cols = ["policy", "kv bits", "limit", "largest batch", "verified", "per sequence (state + workspace)", "base"]
    rows = []
    for r in _bench_rows(path, "memory"):
        if r.get("status", "ok") != "ok":
            rows.append([f"`{r['policy']}`", r["kv_bits"], "", r["status"], "", "", r.get("error") or ""])
            continue
        rows.append([f"`{r['policy']}{':' + r['policy_args'] if r['policy_args'] else ''}`", r["kv_bits"],
                     f"{r['memory_limit_bytes'] / 2 ** 30:.0f} GiB", r["max_batch_size"],
                     {True: "yes", False: "no", None: "estimate"}[r["verified"]],
                     f"{(r['state_bytes_per_seq'] + r['workspace_bytes_per_seq']) / MIB:.1f} MiB",
                     f"{r['base_bytes'] / MIB:.0f} MiB"])
    return cols, rows


def accuracy_argv(quick: bool, out: Path) -> list[str]:
    if not quick:
        return ["scripts/accuracy_table.py", "--out", str(out), "--no-plot", "--quiet"]
    return ["-m", "eval.suite", "--policies",
            "full; streaming:budget=128; snapkv:budget=128; ds:n_critical=128,preset=short; full@kv4:kv_bits=4",
            "--tasks", "needle,perplexity", "--lengths", "1000", "--depths", "0.5", "--context-length", "1024",
            "--eval-tokens", "64", "--samples", "1", "--out", str(out), "--no-plot", "--quiet"]


def _score(cell: Optional[dict]) -> str:
    if cell is None:
        return ""
    if cell["status"] != "ok":
        return cell["status"]
    return _f(cell["score"], ".2f" if cell["metric"] == "perplexity" else ".1f")


def accuracy_rows(out: Path):
    """The suite's results.json -> one row per policy row: each task's score, KV bytes read per step
    (of the row's last task with usage: the perplexity cell, as the published table)."""
    report = json.loads((out / "results.json").read_text())
    tasks = [t for t in report["tasks"] if t != "proximal"]
    by = {(c["row"], c["task"]): c for c in report["cells"]}
    metric = {t: next((c["metric"] for c in report["cells"] if c["task"] == t and c.get("metric")), t) for t in tasks}
    cols = ["row"] + [t if metric[t] == t else f"{t} ({metric[t]})" for t in tasks] + ["KV read per step"]
    rows = []
    for row in report["rows"]:
        cells = [by.get((row, t)) for t in tasks]
        used = next((c["usage"] for c in reversed(cells) if c and c.get("usage")), None)
        rows.append([f"`{row}`", *map(_score, cells), f"{used['kv_read'] / MIB:.1f} MiB" if used else ""])
    return cols, rows


def installed_peers() -> str:
    found = {"llama.cpp": "llama_cpp", "hf": "transformers"}
    return ",".join(p for p, mod in found.items() if importlib.util.find_spec(mod) is not None)


def peers_argv(quick: bool, out: Path) -> list[str]:
    sides = ["--ours", CKPT, "--ours", GGUF]
    size = (["--contexts", "512", "--steps", "16", "--repeats", "1"] if quick else
            ["--contexts", "512,2048,4096", "--steps", "32", "--repeats", "2",
             "--ours", f"{GGUF}:policy=snapkv,policy_args=budget=256"])
    return ["scripts/peers.py", *size, "--warmup", "4", "--peers", installed_peers(), *sides, "--json", str(out)]


def peers_rows(path: Path):
    """peers.py rows -> side, context, tok/s, ratio to the first peer present (llama.cpp, else HF), RSS."""
    data = json.loads(path.read_text())
    ref = next((p for p in ("llama.cpp", "hf") if any(r["side"] == p and r.get("tok_s") for r in data)), None)
    base = {r["context"]: r["tok_s"] for r in data if r["side"] == ref and r.get("tok_s")}
    cols = ["side", "context", "decode tok/s", f"vs {ref or 'a peer'}", "peak RSS", "model RSS"]
    rows = []
    for r in data:
        if r.get("error"):
            rows.append([r["side"], r["context"], "error", "", "", r["error"]])
            continue
        ratio = _f(r["tok_s"] / base[r["context"]], ".2f") + "x" if r["context"] in base else ""
        rows.append([r["side"], r["context"], _f(r["tok_s"]), ratio, f"{r['peak_rss'] / MIB:.0f} MiB",
                     f"{r['model_rss'] / MIB:.0f} MiB"])
    return cols, rows


TABLES = {t.topic: t for t in (
    Table("speed", "2. Decode throughput per policy at batch 8", "Every policy against `full`, same run",
          speed_argv, speed_rows, "Random prompt ids; decode tok/s aggregate over the batch, prefill excluded."),
    Table("kivi", "6. KIVI 2/4-bit storage", "Decode speed per KV storage and policy", kivi_argv, kivi_rows,
          order=3),
    Table("memory", "15. Largest batch under a memory limit", "Per policy", memory_argv, memory_rows,
          "verified: the batch was run and its peak stayed within the limit; estimate: the linear model's answer."),
    Table("accuracy", "13. Accuracy table", "Needle and perplexity per policy", accuracy_argv, accuracy_rows,
          order=1),
    Table("peers", "9. Weight quantization", "Decode speed against the peers (batch 1)", peers_argv, peers_rows,
          order=2),
)}


# --------------------------------------------------------------------------- running

def command_text(argv: list[str]) -> str:
    """The command as a user types it (repository-relative paths, OMP_WAIT_POLICY shown)."""
    shown = [a.replace(str(ROOT) + "/", "") for a in argv]
    return f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} python " + shlex.join(shown)


def run_table(t: Table, quick: bool, work: Path, extra: list[str]) -> dict:
    """Run one table's tool and turn its output into the table's record (with `error` on failure)."""
    target = work / t.topic if t.topic == "accuracy" else work / f"{t.topic}.json"
    if target.is_file():
        target.unlink()             # never read a previous run's output (the suite's folder resumes: same cells)
    argv = t.argv(quick, target)
    if argv[0] == "scripts/benchmark.py":
        argv += extra
    record = {"topic": t.topic, "section": t.section, "title": t.title, "order": t.order,
              "size": "quick" if quick else "full",
              "command": command_text(argv), "notes": t.notes}
    print(f"# {t.topic}: {record['command']}", file=sys.stderr, flush=True)
    started = dt.datetime.now(dt.timezone.utc)
    status, tail = run_streaming([sys.executable, *argv])
    record["date"] = started.strftime("%Y-%m-%d %H:%M UTC")
    record["seconds"] = round((dt.datetime.now(dt.timezone.utc) - started).total_seconds())
    try:
        record["columns"], record["rows"] = t.rows(target)
    except (OSError, KeyError, ValueError, TypeError) as e:
        record["columns"], record["rows"] = [], []
        record["error"] = f"exit status {status}: {type(e).__name__}: {e}; {tail}"
    if status != 0 and "error" not in record:
        record["error"] = f"exit status {status}: {tail}"
    return record


def run_streaming(argv: list[str]) -> tuple[int, str]:
    """Run a tool in the repository root, its output shown as it comes -> (exit status, the last
    lines of its stderr)."""
    last = collections.deque(maxlen=8)
    with subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True) as proc:
        for line in proc.stderr:
            sys.stderr.write(line)
            last.append(line.rstrip())
    return proc.returncode, " | ".join(last)


def bandwidth_of(path: Path) -> Optional[float]:
    """The read bandwidth a benchmark run measured (its rows' read_bandwidth_gbs), or None."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    found = [r["read_bandwidth_gbs"] for r in rows if isinstance(r, dict) and r.get("read_bandwidth_gbs")]
    return found[0] if found else None


def reproduce(topics: list[str], quick: bool, out: Path) -> int:
    """Run the tables in order, write OUT/TOPIC.json each, return 1 if any failed."""
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
    out.mkdir(parents=True, exist_ok=True)
    work = RUNS / ("quick" if quick else "full")
    work.mkdir(parents=True, exist_ok=True)
    status, records, bw = 0, [], None
    for topic in topics:         # the first benchmark run measures the bandwidth, the later ones reuse it
        records.append(run_table(TABLES[topic], quick, work, [] if bw is None else ["--bandwidth-gbs", f"{bw:.1f}"]))
        bw = bw or bandwidth_of(work / f"{topic}.json")
    facts = machine(bw)
    for record in records:
        record["machine"] = facts
        atomic_io.write_json(out / f"{record['topic']}.json", record, indent=1)
        status |= "error" in record
    return int(status)


# --------------------------------------------------------------------------- rendering

PREAMBLE = """# Results

Generated by `python scripts/reproduce.py` from the JSON files in [`results/`](../results/): one
current table per topic, each with the command that produced it, its date and its machine. Do not
edit this file; edit or re-run the JSON. Earlier runs, superseded tables and their discussion are in
this file's git history (its last hand-written version: commit 7f71c92).

Conventions: the model is the default checkpoint, SmolLM2-135M-Instruct (Llama architecture, 30
layers, 9 query and 3 KV heads, head_dim 64, 8K context), float32 compute on CPU. Commands omit
`--checkpoint checkpoints/SmolLM2-135M-Instruct` where it is the default (the benchmark, the evals,
`compare_hf.py`). The CPU rows come from a shared 2-core VM (`CPU-2c`) whose neighbours' load moves
timings between runs: compare rows of one table only. One small model with 3 KV heads: several
orderings of the papers do not hold here, and the accuracy samples are small.
"""


def machine_text(m: dict) -> str:
    """One line for a machine dict (captured, or as recorded: then `recorded` is free text)."""
    if "recorded" in m:
        return m["recorded"]
    bw = f", read bandwidth {m['read_bandwidth_gbs']} GB/s" if m.get("read_bandwidth_gbs") else ""
    return (f"{m['cpu']} ({m['isa']}), {m['logical_cpus']} logical CPUs, {m['threads']} threads{bw}, "
            f"torch {m['torch']}, OMP_WAIT_POLICY={m.get('omp_wait_policy') or 'unset'}, "
            f"Python {m['python']}, commit {m.get('commit') or 'unknown'}")


def markdown_table(columns: list[str], rows: list[list]) -> list[str]:
    if not columns:
        return []
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {row!r} has {len(row)} cells for {len(columns)} columns")
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return lines


def wrap(text: str, indent: str = "") -> list[str]:
    """Lines of at most 100 characters, never broken inside a word or a flag (commands stay intact)."""
    return textwrap.wrap(text, 100, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def render_table(t: dict) -> list[str]:
    """One table: its title, command(s), date, machine, the table, its notes."""
    commands = t["command"] if isinstance(t["command"], list) else [t["command"]]
    lines = [f"### {t['title']}", ""]
    lines += wrap("- **Command**: " + "; ".join(f"`{c}`" for c in commands), "  ")
    lines += [f"- **Date**: {t['date']}" + (f" ({t['size']} size)" if t.get("size") == "quick" else "")]
    lines += wrap(f"- **Machine**: {machine_text(t['machine'])}", "  ") + [""]
    if t.get("error"):
        lines += wrap(f"**Failed**: {t['error'].strip()}") + [""]
    lines += markdown_table(t["columns"], t["rows"])
    if t.get("notes"):
        lines += [""] + wrap(t["notes"])
    return lines + [""]


def section_key(section: str) -> tuple:
    number = section.split(".", 1)[0]
    return (int(number), section) if number.isdigit() else (10 ** 6, section)


def render(tables: list[dict]) -> str:
    """docs/results.md: the preamble, then each section's tables (by their `order`, then topic)."""
    lines = [PREAMBLE.rstrip(), ""]
    sections: dict[str, list[dict]] = {}
    for t in sorted(tables, key=lambda t: (t.get("order", 0), t["topic"])):
        sections.setdefault(t["section"], []).append(t)
    for section in sorted(sections, key=section_key):
        lines += [f"## {section}", ""]
        for t in sections[section]:
            lines += render_table(t)
    return "\n".join(lines).rstrip() + "\n"


def load_tables(folder: Path) -> list[dict]:
    """Every table of `folder`; ValueError for one without a key, or without a command (a table the
    repository cannot reproduce stays in git history, not in docs/results.md)."""
    tables = []
    for path in sorted(folder.glob("*.json")):
        t = json.loads(path.read_text())
        missing = [k for k in ("topic", "section", "title", "command", "date", "machine", "columns", "rows")
                   if k not in t or (k == "command" and not t[k])]
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}")
        tables.append(t)
    return tables


def headline(peers: dict) -> str:
    """The README's headline block: the peers table, compact, with its date and command."""
    command = peers["command"] if isinstance(peers["command"], str) else peers["command"][0]
    lines = [HEADLINE[0], *markdown_table(peers["columns"], peers["rows"]), ""]
    lines += wrap(f"{peers['date']}; {machine_text(peers['machine'])}. Command: `{command}`.")
    return "\n".join(lines + [HEADLINE[1]])


def replace_headline(readme: str, peers: dict) -> str:
    start, end = readme.find(HEADLINE[0]), readme.find(HEADLINE[1])
    if start < 0 or end < start:
        raise ValueError("README.md has no headline markers")
    return readme[:start] + headline(peers) + readme[end + len(HEADLINE[1]):]


def render_files(folder: Path) -> list[Path]:
    """Render FOLDER's tables: docs/results.md and the README headline for results/, else
    FOLDER/results.md."""
    tables = load_tables(folder)
    if folder.resolve() != RESULTS.resolve():
        return [atomic_io.write_text(folder / "results.md", render(tables))]
    written = [atomic_io.write_text(DOC, render(tables))]
    peers = next((t for t in tables if t["topic"] == "peers"), None)
    if peers is not None:
        written.append(atomic_io.write_text(README, replace_headline(README.read_text(), peers)))
    return written


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--quick", action="store_true", help="small sizes, minutes on 2 cores -> results/quick/")
    size.add_argument("--full", action="store_true", help="the published sizes -> results/ and docs/results.md")
    size.add_argument("--render", action="store_true", help="only render docs/results.md from results/*.json")
    p.add_argument("--tables", default=",".join(TABLES), help=f"comma-separated, of {', '.join(TABLES)}")
    p.add_argument("--out", type=Path, help="results folder (default: results/, or results/quick/ with --quick)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    o = build_parser().parse_args(argv)
    topics = [t.strip() for t in o.tables.split(",") if t.strip()]
    unknown = [t for t in topics if t not in TABLES]
    if unknown or not topics:
        print(f"error: --tables {o.tables!r}: choose from {', '.join(TABLES)}", file=sys.stderr)
        return 2
    out = o.out or (RESULTS / "quick" if o.quick else RESULTS)
    status = 0 if o.render else reproduce(topics, o.quick, out)
    try:
        for path in render_files(out):
            print(f"wrote {path}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
