"""The suite's report: KV compression ratios, results.md's table, results.csv, results.json and the
score-vs-compression plot, from the cells' records (eval/suite.py)."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Optional

import atomic_io
from eval import common, kvpress_peer


def compression(records: list[dict]) -> None:
    """Add kv_ratio / read_ratio to every ok record: the full cache's bytes for the same task
    (policy full without arguments, 16 bits) over the record's."""
    full = {(r["task"], r.get("protocol")): r["usage"] for r in records if r["status"] == "ok"
            and r["policy"] == "full" and not r["policy_args"] and not r["label"] and r["kv_bits"] == 16
            and r.get("usage")}
    for r in records:
        u, f = r.get("usage"), full.get((r["task"], r.get("protocol")))
        r["kv_ratio"] = f["kv_allocated"] / u["kv_allocated"] if u and f and u["kv_allocated"] else None
        r["read_ratio"] = f["kv_read"] / u["kv_read"] if u and f and u["kv_read"] else None


def row_summary(rs: list[dict]) -> dict:
    """KV ratios over all of a row's tasks (byte-weighted) and its decode tokens/s."""
    ok = [r for r in rs if r["status"] == "ok" and r.get("usage")]
    with_ratio = [r for r in ok if r.get("kv_ratio")]
    full_alloc = sum(r["usage"]["kv_allocated"] * r["kv_ratio"] for r in with_ratio)
    full_read = sum(r["usage"]["kv_read"] * r["read_ratio"] for r in with_ratio if r.get("read_ratio"))
    steps = sum(r["usage"]["decode_steps"] for r in ok)
    seconds = sum(r["usage"]["decode_seconds"] for r in ok)
    return {"kv_ratio": full_alloc / sum(r["usage"]["kv_allocated"] for r in with_ratio) if with_ratio else None,
            "read_ratio": (full_read / sum(r["usage"]["kv_read"] for r in with_ratio if r.get("read_ratio"))
                           if full_read else None),
            "decode_tokens_per_s": steps / seconds if seconds else None}


def column_title(task: str, records: list[dict]) -> str:
    metric = next((r["metric"] for r in records if r["task"] == task and r.get("metric")), "")
    short = {"accuracy": "acc %", "perplexity": "ppl, lower is better", "token_agreement": "token agreement %",
             "rouge_l": "ROUGE-L", "qa_f1": "F1", "code_sim": "edit sim", "classification": "acc",
             "retrieval": "acc", "count": "acc"}.get(metric, metric)
    name = task.split(":", 1)[1] if ":" in task else task
    name = Path(name).stem if name.endswith(".jsonl") else name
    return f"{name} ({short})" if short else name


def format_score(r: Optional[dict]) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    if r["metric"] == "perplexity":
        return f"{r['score']:.2f}"
    return f"{r['score']:.1f}"


def fmt(x: Optional[float], spec: str) -> str:
    return "" if x is None else format(x, spec)


def markdown(records: list[dict], tasks: list[str], rows: list[str]) -> str:
    table_tasks = [t for t in tasks if t != "proximal"]
    by = {(r["row"], r["task"]): r for r in records}
    has_agreement = "agreement" in table_tasks
    head = ["policy"] + [column_title(t, records) for t in table_tasks]
    head += (["first divergence"] if has_agreement else []) + ["KV compression", "read ratio", "decode tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        rs = [by[row, t] for t in table_tasks if (row, t) in by]
        s = row_summary(rs)
        cells = [f"`{row}`"] + [format_score(by.get((row, t))) for t in table_tasks]
        if has_agreement:
            a = by.get((row, "agreement"))
            cells.append(fmt(a.get("first_divergence"), ".1f") if a and a["status"] == "ok" else "")
        cells += [fmt(s["kv_ratio"], ".2f") + ("x" if s["kv_ratio"] else ""),
                  fmt(s["read_ratio"], ".2f") + ("x" if s["read_ratio"] else ""),
                  fmt(s["decode_tokens_per_s"], ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    failed: dict = {}
    for r in records:
        if r["status"] != "ok":
            failed.setdefault((r["row"], r["status"], r["error"]), []).append(r["task"])
    notes = [f"- `{row}` ({'all tasks' if len(ts) == len(table_tasks) else ', '.join(ts)}): {status}: {error}"
             for (row, status, error), ts in failed.items()]
    prox = next((r for r in records if r["task"] == "proximal" and r["status"] == "ok"), None)
    if prox:
        p = prox["params"]
        shares = ", ".join(f"{n}: {100 * s:.1f}%" for n, s in prox["proximal_agreement"].items())
        lines += ["", f"Proximal-only next-token agreement with full attention (POD Fig. 1(c); first {p['n_sink']} "
                      f"+ recent tokens, last {p['last']} positions of {p['samples']} x {p['context_length']} "
                      f"tokens): {shares}"]
    if notes:
        lines += ["", "Cells not run:"] + notes
    return "\n".join(lines) + "\n"


CSV_FIELDS = ["row", "policy", "label", "policy_args", "kv_bits", "protocol", "task", "status", "metric", "score",
              "first_divergence", "kv_ratio", "read_ratio", "kv_allocated", "kv_read", "decode_steps",
              "decode_seconds", "decode_tokens_per_s", "requests", "seconds", "error"]


def csv_text(records: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in records:
        u = r.get("usage") or {}
        w.writerow({**{k: r.get(k) for k in CSV_FIELDS}, **{k: u.get(k) for k in
                    ("kv_allocated", "kv_read", "decode_steps", "decode_seconds", "decode_tokens_per_s", "requests")}})
    return buf.getvalue()


def plot(records: list[dict], tasks: list[str], path: Path) -> Optional[str]:
    """Score vs KV compression, one panel per task -> None, or why there is no plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[eval]'): no plot"
    panels = [t for t in tasks if any(r["task"] == t and r["status"] == "ok" and r.get("kv_ratio")
                                      and r.get("score") is not None for r in records)]
    if not panels:
        return "no finished cell with a KV compression ratio (the full policy gives the reference): no plot"
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols + 3, 4 * rows), squeeze=False)
    names = list(dict.fromkeys(r["row"] for r in records if r["task"] in panels))
    colors, markers = plt.get_cmap("tab20").colors, "osD^v<>pP*Xh"
    style = {n: dict(color=colors[i % len(colors)], marker=markers[i % len(markers)]) for i, n in enumerate(names)}
    for ax, task in zip(axes.flat, panels):
        for r in records:
            if r["task"] == task and r["status"] == "ok" and r.get("kv_ratio"):
                ax.scatter(r["kv_ratio"], r["score"], s=45, alpha=0.85, label=r["row"], **style[r["row"]])
        ax.set_xscale("log", base=2)
        ax.margins(x=0.15, y=0.1)
        ax.set_xlabel("KV compression vs full (allocated bytes)")
        ax.set_ylabel(column_title(task, records))
        ax.set_title(task)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), loc="center right", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 2.6 / (5 * cols + 3), 1))
    with atomic_io.atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return None


def report_markdown(records: list[dict], tasks: list[str], rows: list[str]) -> str:
    """results.md: the table, then with --peers the side-by-side table of ours and kvpress's."""
    md = markdown(records, tasks, rows)
    if any(r.get("peer") for r in records):
        md += "\nSide by side with kvpress (ours: the rows `NAME:ratio=r` and bare `full`):\n\n" + \
            kvpress_peer.markdown(records)
    return md


def write_reports(out: Path, records: list[dict], tasks: list[str], rows: list[str], header: dict,
                  plots: bool = True) -> Optional[str]:
    compression(records)
    md = report_markdown(records, tasks, rows)
    common.write_json(out / "results.json", {**header, "table": md, "cells": records})
    _write_text(out / "results.csv", csv_text(records))
    _write_text(out / "results.md", md)
    return plot(records, tasks, out / "score_vs_compression.png") if plots else None


def _write_text(path: Path, text: str) -> None:
    atomic_io.write_text(path, text)
