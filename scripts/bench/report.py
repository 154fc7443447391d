"""Reporting: the row writer (JSON/CSV rewritten atomically after every row), the ratios derived
between rows of one run, the printed header and tables, the summary of rows not measured, the plot.
"""
from __future__ import annotations

import csv
import io
import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

import atomic_io
from bench.measure import device_name
from bench.specs import config_label
from runtime.stats import format_bytes

# the CSV's first columns (the rest follow in the order rows first use them)
E2E_KEYS = ["mode", "policy", "policy_args", "batch_size", "context_length", "kv_bits", "decode_steps",
            "prefill_tokens_per_s", "decode_tokens_per_s", "decode_tokens_per_s_per_seq", "decode_step_ms",
            "kv_bytes_allocated", "kv_bytes_live", "kv_bytes_read_per_step", "peak_memory_bytes",
            "bandwidth_bound_tokens_per_s", "fraction_of_bound", "device", "dtype", "torch_version", "compile"]


# --------------------------------------------------------------------------- files

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
    """Readers never see half a file (`atomic_io.write_text`)."""
    atomic_io.write_text(path, text)


def to_csv(rows: list[dict]) -> str:
    """E2E_KEYS first, then every other key in first-use order; dicts and lists as JSON."""
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


# --------------------------------------------------------------------------- ratios

def add_ratios(rows: list[dict], reference: Optional[str]) -> None:
    """Pairwise ratios inside this run: speedup_vs_NAME and compile_speedup (throughput rows), or
    speedup_vs_dense_sdpa (attention rows: reference latency / row latency).  A ratio is null
    when either row of the pair is not measured."""
    ok = {_pair_key(r, r["policy"], r["kv_bits"], r["compile"]): r for r in reversed(rows)
          if r.get("status") == "ok" and r.get("mode") in ("attention", "e2e", "sweep")}
    for r in rows:
        if r["mode"] == "attention":
            for name in ["dense_sdpa"] + ([reference] if reference else []):
                ref = ok.get(_pair_key(r, name, 16 if name == "dense_sdpa" else r["kv_bits"], r["compile"]))
                r[f"speedup_vs_{name}"] = _ratio(ref, r, "attention_us_per_layer")
        elif r["mode"] in ("e2e", "sweep"):
            if reference:
                ref = ok.get(_pair_key(r, reference, r["kv_bits"], r["compile"]))
                r[f"speedup_vs_{reference}"] = _ratio(r, ref, "decode_tokens_per_s")
            if "compile_speedup" in r:
                eager = ok.get(_pair_key(r, r["policy"], r["kv_bits"], False))
                r["compile_speedup"] = _ratio(r, eager, "decode_tokens_per_s") if r["compile"] else None


def _pair_key(row: dict, policy: str, kv_bits: int, compiled: bool) -> tuple:
    return row["mode"], policy, row["batch_size"], row["context_length"], kv_bits, compiled


def _ratio(num: Optional[dict], den: Optional[dict], key: str) -> Optional[float]:
    ok = num is not None and den is not None and num.get("status") == "ok" and den.get("status") == "ok"
    return num[key] / den[key] if ok else None


# --------------------------------------------------------------------------- printing

def fmt_bytes(n) -> str:
    return "-" if n is None else format_bytes(n)


def fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def row_label(r: dict) -> str:
    return config_label(r["policy"], r["policy_args"], r["kv_bits"], r["compile"], r.get("kv_dtype"))


def print_header(o, model, device: torch.device, bandwidth: Optional[float], meter_kind: str,
                 weight_bytes: int) -> None:
    """Three '#' lines: the machine, the model, the measurement settings."""
    a = model.args
    print(f"# kvpolicy-engine benchmark | torch {torch.__version__} | device {device} ({device_name(device)}) | "
          f"dtype {str(model.norm.weight.dtype).replace('torch.', '')} | threads {torch.get_num_threads()} | "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset; ACTIVE recommended)')}")
    print(f"# model {o.checkpoint.name}: {a.n_layers} layers, {a.n_heads} q / {a.n_kv_heads} kv heads, head_dim "
          f"{a.head_dim}, context {a.max_position_embeddings}; weights {fmt_bytes(weight_bytes)}")
    print(f"# read bandwidth {fmt(bandwidth)} GB/s | compile {o.compile} | repeats {o.repeats} (interleaved, "
          f"median) | decode steps {o.decode_steps} (+{o.warmup_steps} warm-up) | peak memory: {meter_kind} | "
          f"prompt {o.prompt_file or 'random ids'}", flush=True)
    if o.tp > 1:
        print(f"# tensor parallel: {o.tp} processes, {o.tp_head} output head; the model line, weights, bandwidth "
              f"and KV bytes are rank 0's shard; tp_collective_share per row (bench/collectives.py)", flush=True)


def print_e2e_header(reference: Optional[str], both: bool) -> None:
    print(f"{'policy':28s} {'B':>3s} {'ctx':>5s} {'bits':>4s} {'prefill t/s':>11s} {'decode t/s':>10s} "
          f"{'t/s/seq':>8s} {'step ms':>8s} {'KV alloc':>10s} {'KV live':>10s} {'peak mem':>10s} "
          f"{'bound t/s':>9s} {'of bound':>8s}" + (f" {'vs ' + reference:>9s}" if reference else "")
          + (f" {'vs eager':>9s}" if both else ""))


def print_e2e(r: dict, reference: Optional[str], both: bool) -> None:
    """One table line of an e2e/sweep row (a failed row: its status and reason)."""
    head = f"{row_label(r)[:28]:28s} {r['batch_size']:3d} {r['context_length']:5d} {r['kv_bits']:4d} "
    if r["status"] != "ok":
        print(f"{head}{r['status']}: {r['error']}", flush=True)
        return
    extra = f" {fmt(r.get(f'speedup_vs_{reference}'), '.2f') + 'x':>9s}" if reference else ""
    if both:
        extra += f" {fmt(r.get('compile_speedup'), '.2f') + 'x' if r['compile'] else '':>9s}"
    print(f"{head}{r['prefill_tokens_per_s']:11.1f} {r['decode_tokens_per_s']:10.2f} "
          f"{r['decode_tokens_per_s_per_seq']:8.2f} {r['decode_step_ms']:8.1f} "
          f"{fmt_bytes(r['kv_bytes_allocated']):>10s} {fmt_bytes(r['kv_bytes_live']):>10s} "
          f"{fmt_bytes(r['peak_memory_bytes']):>10s} {fmt(r['bandwidth_bound_tokens_per_s']):>9s} "
          f"{fmt(100 * r['fraction_of_bound'] if r['fraction_of_bound'] else None, '.0f') + '%':>8s}{extra}",
          flush=True)


def print_attention_header() -> None:
    print(f"{'policy':28s} {'B':>3s} {'ctx':>5s} {'bits':>4s} {'us/layer':>10s} {'ms/step':>8s} "
          f"{'bound us/layer':>14s} {'vs dense_sdpa':>13s}")


def print_attention(r: dict) -> None:
    """One table line of a measured attention row (failed rows are reported on stderr only)."""
    if r["status"] != "ok":
        return
    print(f"{row_label(r)[:28]:28s} {r['batch_size']:3d} {r['context_length']:5d} {r['kv_bits']:4d} "
          f"{r['attention_us_per_layer']:10.1f} {r['attention_ms_per_step']:8.2f} "
          f"{fmt(r['bandwidth_bound_us_per_layer']):>14s} "
          f"{fmt(r.get('speedup_vs_dense_sdpa'), '.2f') + 'x':>13s}", flush=True)


def print_memory_header() -> None:
    print(f"{'policy':28s} {'ctx':>5s} {'gen':>4s} {'limit':>10s} {'max batch':>9s} {'predicted':>10s} "
          f"{'per seq':>10s} {'verified peak':>13s}")


def print_memory(r: dict) -> None:
    """One table line of a measured memory row."""
    print(f"{row_label(r)[:28]:28s} {r['context_length']:5d} {r['decode_steps']:4d} "
          f"{fmt_bytes(r['memory_limit_bytes']):>10s} {r['max_batch_size']:9d} "
          f"{fmt_bytes(r['predicted_bytes']):>10s} "
          f"{fmt_bytes(r['state_bytes_per_seq'] + r['workspace_bytes_per_seq']):>10s} "
          f"{fmt_bytes(r['verified_peak_bytes']):>13s}"
          + (f"  ({r['verify_note']})" if r["verify_note"] else ""), flush=True)


def print_failure(r: dict) -> None:
    """The stderr line of a skipped or failed row, as it happens."""
    print(f"  {r['status']}: {r['policy']} B={r.get('batch_size')} ctx={r['context_length']} "
          f"kv_bits={r['kv_bits']}: {r['error']}", file=sys.stderr)


def print_summary(rows: list[dict]) -> None:
    """The rows not measured, again, at the end of the run (stderr)."""
    bad = [r for r in rows if r.get("status") != "ok"]
    if bad:
        print(f"# {len(bad)} row(s) not measured:", file=sys.stderr)
        for r in bad:
            print(f"#   {r['policy']} B={r.get('batch_size')} ctx={r['context_length']} kv_bits={r['kv_bits']}: "
                  f"{r['status']}: {r['error']}", file=sys.stderr)


def storage_label(r: dict) -> str:
    """A row's KV storage as a column name: fp32, the 16-bit dtype, kv4, kv2."""
    return {32: "fp32", 16: r.get("kv_dtype") or "16-bit"}.get(r["kv_bits"], f"kv{r['kv_bits']}")


def print_storage_table(rows: list[dict]) -> None:
    """Decode tok/s pivoted policy x storage, one block per (B, context, compile), with two ratios per
    cell: over the same policy's first storage column and over `full` at the same storage (the run's
    own rows; printed only when the run has several storages)."""
    ok = [r for r in rows if r.get("mode") == "e2e" and r.get("status") == "ok"]
    stores = list(dict.fromkeys(storage_label(r) for r in ok))
    if len(stores) < 2:
        return
    for group in dict.fromkeys((r["batch_size"], r["context_length"], r["compile"]) for r in ok):
        cell = {(r["policy"], storage_label(r)): r["decode_tokens_per_s"] for r in ok
                if (r["batch_size"], r["context_length"], r["compile"]) == group}
        policies = list(dict.fromkeys(p for p, _ in cell))
        print(f"# decode tok/s by KV storage, B={group[0]} ctx={group[1]} {'compiled' if group[2] else 'eager'}: "
              f"tok/s (x the policy's {stores[0]}, x full's same storage)")
        print(f"{'policy':20s}" + "".join(f" {s:>24s}" for s in stores))
        for p in policies:
            out = []
            for s in stores:
                v, first, full = cell.get((p, s)), cell.get((p, stores[0])), cell.get(("full", s))
                out.append("-" if v is None else f"{v:.1f} ({fmt(first and v / first, '.2f')}x, "
                                                   f"{fmt(full and v / full, '.2f')}x)")
            print(f"{p[:20]:20s}" + "".join(f" {c:>24s}" for c in out), flush=True)


# --------------------------------------------------------------------------- plot

CURVES = {  # mode -> (y key, y label, title) of the per-batch curves over context length
    "e2e": ("decode_tokens_per_s", "decode tokens/s (aggregate)", "end-to-end decode throughput"),
    "sweep": ("decode_step_ms", "decode step (ms)", "decode cost versus context"),
    "attention": ("attention_us_per_layer", "attention latency per layer (us)", "attention-operator latency"),
}


def plot(rows: list[dict], path: Path, mode: str) -> None:
    """A PNG of the measured rows: max batch per memory limit, or one panel per batch size of the
    mode's CURVES value against context length (e2e: with each policy's bandwidth bound dotted)."""
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
    kind = {"memory": _plot_memory, "soak": _plot_soak}.get(mode)
    fig = kind(plt, ok) if kind else _plot_curves(plt, ok, mode)
    fig.tight_layout()
    with atomic_io.atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    print(f"plot written to {path}", file=sys.stderr)


def _plot_memory(plt, ok: list[dict]):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list] = {}
    for r in ok:
        series.setdefault(row_label(r) + f" ctx {r['context_length']}", []).append(
            (r["memory_limit_bytes"] / 2**30, r["max_batch_size"]))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("memory limit (GiB)")
    ax.set_ylabel("max batch size")
    ax.set_title("largest batch under a memory limit")
    ax.legend(fontsize=7)
    return fig


def _plot_soak(plt, ok: list[dict]):
    """Resident memory and tokens/s per window against the decode step, one line per row."""
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in ok:
        steps = [w["step"] for w in r["soak_windows"]]
        label = f"{row_label(r)} B={r['batch_size']} ctx {r['context_length']}"
        mem.plot(steps, [w["rss_bytes"] / 2**20 for w in r["soak_windows"]], marker=".", label=label)
        speed.plot(steps, [w["tokens_per_s"] for w in r["soak_windows"]], marker=".", label=label)
    for ax, ylabel in ((mem, "resident memory (MiB)"), (speed, "decode tokens/s (window)")):
        ax.set_xlabel("decode step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    speed.set_ylim(bottom=0)
    fig.suptitle("soak: memory and speed over a long run")
    return fig


def _plot_curves(plt, ok: list[dict], mode: str):
    ykey, ylabel, title = CURVES[mode]
    batches = sorted({r["batch_size"] for r in ok})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches):
        series: dict[str, list] = {}
        for r in (r for r in ok if r["batch_size"] == b):
            series.setdefault(row_label(r), []).append((r["context_length"], r[ykey],
                                                        r.get("bandwidth_bound_tokens_per_s")))
        for label, pts in series.items():
            pts.sort()
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            if mode == "e2e" and all(p[2] for p in pts):
                ax.plot([p[0] for p in pts], [p[2] for p in pts], ls=":", color=line.get_color(),
                        label=f"{label} bandwidth bound")
        xs = sorted({r["context_length"] for r in ok if r["batch_size"] == b})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"batch {b}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title} ({ok[0]['device']}, {ok[0]['dtype']}, torch {ok[0]['torch_version']})")
    return fig
