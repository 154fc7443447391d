"""kvpress as a peer in the eval suite: its own pipeline on the same checkpoint, prompts and protocol.

    python -m eval.suite --tasks needle --protocol agnostic --peers kvpress \\
        --policies 'full; snapkv:ratio=0.5; knorm:ratio=0.5' --peer-ratios 0.5 --out runs/kvp
    python -m eval.suite ... --peers kvpress --kvpress-python /path/to/kvpress-venv/bin/python

kvpress (NVIDIA's KV-compression library) pins a transformers older than ours (kvpress 0.5.5:
transformers < 5.3), so it lives in its own environment: `pip install -e '.[kvpress]'` in a venv of
its own (the extra pins kvpress and transformers 5.2.0), and the suite reaches it through
--kvpress-python (default: the suite's own interpreter).  Its side always runs in a child process,
`python -m eval.kvpress_child JOB.json`, which imports only the standard library, torch,
transformers and kvpress (never this project's engine), loads the checkpoint with
AutoModelForCausalLM (the suite's dtype, sdpa attention; eager for ObservedAttentionPress, which reads
the attention weights) and answers every request with kvpress's KVPressTextGenerationPipeline._forward:
the context prefilled once with the press active (compressed to int(n * (1 - ratio)) tokens per
layer and KV head), then the question appended whole and answered greedily (its own decode loop,
stopping at the model's EOS).  The suite sends token ids, not text: both sides see exactly the same
prompt tokens, split where the task's question starts (agnostic); aware sends all but the prompt's
last token as the context (kvpress's query-aware setting: the question inside the compressed part).
The answers come back as text and are scored by this project's rules (needle: all keywords;
RULER: string_match_all/part), so only the compression and the decode loop differ.

Methods (the suite's policy names; the pairing key with our rows):
  full -> no press; snapkv -> SnapKVPress; streaming -> StreamingLLMPress; tova -> TOVAPress;
  pyramidkv -> PyramidKVPress; knorm -> KnormPress; h2o -> ObservedAttentionPress;
  expected_attention -> ExpectedAttentionPress (no counterpart here).
Each at --peer-ratios (kvpress's compression_ratio: the fraction of the context removed), paired with
our rows `NAME:ratio=r` (same method, ratio, protocol and task) in results.md's side-by-side table.
"""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from eval import common, metrics, needle, ruler

ROOT = Path(__file__).resolve().parent.parent
PRESSES = {"full": None, "snapkv": "SnapKVPress", "streaming": "StreamingLLMPress", "tova": "TOVAPress",
           "pyramidkv": "PyramidKVPress", "knorm": "KnormPress", "h2o": "ObservedAttentionPress",
           "expected_attention": "ExpectedAttentionPress"}
RATIOS = "0.25,0.5,0.75"
INSTALL = ("pip install -e '.[kvpress]' (in a venv of its own: kvpress pins transformers<5.3), then pass its "
           "python as --kvpress-python")


class PeerError(Exception):
    """kvpress is missing or the peer options are bad (the suite turns it into a one-line error)."""


# --------------------------------------------------------------------------- the suite's side

@dataclass
class Item:
    """One prompt: its ids, where the question starts, and how a (stripped) answer is scored, 0..1."""
    ids: list[int]
    split: int
    max_new_tokens: int
    score: Callable[[str], float]


def needle_items(tokenizer, text: str, lengths: list[int], depths: list[float]) -> list[Item]:
    """eval/needle.py's prompts at its defaults (question after the text, 32 new tokens, all keywords)."""
    haystack = needle.Haystack.from_text(tokenizer, text, min_tokens=max(lengths))
    keywords = needle.KEYWORDS.split(",")
    prompts = [needle.build_prompt(tokenizer, haystack, needle.NEEDLE, needle.QUESTION, n, d)
               for n in lengths for d in depths]
    return [Item(p.ids, p.question_start, 32, lambda a: float(needle.is_hit(a, keywords))) for p in prompts]


def ruler_items(tokenizer, rows: list[dict], metric: str, max_new_tokens: int, protocol: str) -> list[Item]:
    """eval/ruler.py's prompts (a row's max_new_tokens wins) and its RULER scoring."""
    items = []
    for row in rows:
        ids, split = ruler.row_ids(tokenizer, row, protocol)
        outputs = [str(o) for o in row["outputs"]]
        score = (lambda outs: lambda a: ruler.MATCH[metric](metrics.ruler_postprocess(a), outs))(outputs)
        items.append(Item(ids, split, int(row.get("max_new_tokens") or max_new_tokens), score))
    return items


def parse_presses(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PRESSES]
    if bad or not names:
        raise PeerError(f"--peer-presses: unknown {', '.join(bad) or '(empty)'}; known: {', '.join(PRESSES)}")
    return list(dict.fromkeys(names))


def parse_ratios(text: str) -> list[float]:
    try:
        ratios = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise PeerError(f"--peer-ratios must be numbers in (0, 1), got {text!r}") from None
    if not ratios or any(not 0 < r < 1 for r in ratios):
        raise PeerError(f"--peer-ratios must be numbers in (0, 1), got {text!r}")
    return list(dict.fromkeys(ratios))


def check_available(python: str, checkpoint: str) -> None:
    """PeerError (one line) unless `python` imports kvpress and `checkpoint` is a HF folder."""
    if not (Path(checkpoint) / "config.json").is_file():
        raise PeerError(f"--peers kvpress loads the checkpoint with transformers: {checkpoint} is not a HF folder "
                        f"(config.json + safetensors)")
    try:
        found = subprocess.run([python, "-c", "import kvpress"], capture_output=True, timeout=300).returncode == 0
    except OSError as e:
        raise PeerError(f"--kvpress-python {python}: {e.strerror}; {INSTALL}") from None
    if not found:
        raise PeerError(f"--peers kvpress: kvpress is not installed for {python}: {INSTALL}")


def jobs(presses: list[str], ratios: list[float]) -> list[tuple[str, float]]:
    """(method, ratio) pairs to run: full once (ratio 0), every other press at every ratio."""
    return [("full", 0.0)] * ("full" in presses) + [(p, r) for p in presses if p != "full" for r in ratios]


def row_name(method: str, ratio: float, protocol: Optional[str]) -> str:
    return f"kvpress:{method}" + (f" ratio={ratio:g}" if method != "full" else "") + \
        (" agnostic" if protocol == "agnostic" else "")


def request(item: Item, protocol: str) -> dict:
    """The token ids kvpress sees: agnostic splits at the question, aware before the last token."""
    split = item.split if protocol == "agnostic" else len(item.ids) - 1
    if not 0 < split < len(item.ids):
        raise ValueError(f"the question must start inside the prompt: split {split} of {len(item.ids)} tokens")
    return {"context": item.ids[:split], "question": item.ids[split:], "max_new_tokens": item.max_new_tokens}


def record(method: str, ratio: float, protocol: str, task: str, params: dict, metric: str, items: list[Item],
           answers: list[str], seconds: float) -> dict:
    """A suite cell record for one kvpress (method, ratio) over a task's items."""
    answers = [a.strip() for a in answers]
    scores = [item.score(a) for item, a in zip(items, answers)]
    return {"row": row_name(method, ratio, protocol), "task": task, "policy": "kvpress", "label": method,
            "policy_args": f"ratio={ratio:g}" if method != "full" else "", "kv_bits": 16, "protocol": protocol,
            "params": params, "peer": "kvpress", "method": method, "ratio": ratio, "press": PRESSES[method],
            "status": "ok", "score": 100 * sum(scores) / len(scores), "metric": metric, "seconds": seconds,
            "results": [{"answer": a, "score": x, "prompt_tokens": len(i.ids)} for i, a, x in zip(items, answers, scores)],
            "higher_is_better": True}


def run_side(python: str, job: dict, on_done: Callable[[dict], None]) -> Optional[str]:
    """Run `job` (eval/kvpress_child.py's format) in one child process under `python`, on_done(line) for each
    press as it finishes -> None, or the child's error (the last line of its stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        path, log = Path(tmp) / "job.json", Path(tmp) / "stderr.txt"
        path.write_text(json.dumps(job))
        with open(log, "w") as err:
            child = subprocess.Popen([python, "-m", "eval.kvpress_child", str(path)], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=err, text=True)
            for line in child.stdout:
                on_done(json.loads(line))
            child.wait()
        lines = [x for x in log.read_text().splitlines() if x.strip()]
    if child.returncode:
        return f"kvpress exited with status {child.returncode}: {lines[-1] if lines else 'no message'}"
    return None


def identity(checkpoint: str, task: str, params: dict, protocol: str, method: str, ratio: float) -> dict:
    return {"checkpoint": checkpoint, "task": task, "params": params, "protocol": protocol, "peer": "kvpress",
            "method": method, "ratio": ratio}


def cell_path(out: Path, ident: dict) -> Path:
    digest = hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{row_name(ident['method'], ident['ratio'], ident['protocol'])}__"
                                               f"{ident['task']}")[:80]
    return out / "cells" / f"{slug}-{digest}.json"


def run(out: Path, python: str, checkpoint: str, dtype: str, task: str, params: dict, protocol: str, metric: str,
        items: list[Item], pairs: list[tuple[str, float]], device: str = "cpu") -> list[dict]:
    """kvpress's records for one task and protocol, one per (method, ratio) of `pairs`: those finished in an
    earlier run read from out/cells, the rest run in one child process and written there."""
    checkpoint = str(Path(checkpoint).resolve())
    idents = {pair: identity(checkpoint, task, params, protocol, *pair) for pair in pairs}
    done = {}
    for pair, ident in idents.items():
        try:
            old = json.loads(cell_path(out, ident).read_text())
        except (OSError, ValueError):
            continue
        if old.get("status") == "ok" and old.get("identity") == ident:
            done[pair] = old
    todo = [pair for pair in pairs if pair not in done]
    if not todo:
        return [done[pair] for pair in pairs]

    def finished(line: dict) -> None:
        pair = (line["method"], line["ratio"])
        if "error" in line:              # not written to cells/: the next run retries it
            done[pair] = failed(*pair, protocol, task, params, line["error"])
            print(f"  {done[pair]['row']} x {task}: error: {line['error']}", file=sys.stderr, flush=True)
            return
        rec = {**record(*pair, protocol, task, params, metric, items, line["answers"], line["seconds"]),
               "identity": idents[pair]}
        common.write_json(cell_path(out, idents[pair]), rec)
        done[pair] = rec
        print(f"  {rec['row']} x {task}: {metric} {rec['score']:.1f} ({line['seconds']:.1f} s)", file=sys.stderr,
              flush=True)

    job = {"checkpoint": checkpoint, "dtype": dtype, "device": device, "threads": torch.get_num_threads(),
           "requests": [request(item, protocol) for item in items],
           "jobs": [{"method": m, "press": PRESSES[m], "ratio": r} for m, r in todo]}
    print(f"kvpress: {len(todo)} presses x {len(items)} prompts, {task} {protocol}", file=sys.stderr, flush=True)
    error = run_side(python, job, finished)
    for pair in todo:
        done.setdefault(pair, failed(*pair, protocol, task, params, error or "kvpress gave no answer"))
    return [done[pair] for pair in pairs]


def failed(method: str, ratio: float, protocol: str, task: str, params: dict, error: str) -> dict:
    return {"row": row_name(method, ratio, protocol), "task": task, "policy": "kvpress", "label": method,
            "policy_args": "", "kv_bits": 16, "protocol": protocol, "params": params, "peer": "kvpress",
            "method": method, "ratio": ratio, "status": "error", "error": error}


# --------------------------------------------------------------------------- pairing

SIDES = OURS, PREFILL_ONLY, KVPRESS = "ours", "ours decode_evict=false", "kvpress"   # table order


def side_of(r: dict) -> Optional[tuple[float, str]]:
    """(ratio, side) of a record: kvpress's; ours from `NAME:ratio=r` (0 for the bare full cache), or with
    decode_evict=false too (compressed at prefill only: kvpress's rule); None for any other of our rows."""
    if r.get("peer"):
        return r["ratio"], KVPRESS
    args = dict(kv.split("=", 1) for kv in (r.get("policy_args") or "").split(",") if "=" in kv)
    if r.get("kv_bits", 16) != 16:
        return None
    if r["policy"] == "full" and not args:
        return 0.0, OURS
    side = PREFILL_ONLY if args.pop("decode_evict", None) in ("false", "0") else OURS
    return (float(args["ratio"]), side) if set(args) == {"ratio"} else None


def sides(records: Iterable[dict]) -> dict:
    """{(method, ratio, protocol, task): {side: record}} over the finished records (sides: SIDES)."""
    cells: dict = {}
    for r in records:
        found = side_of(r)
        method = r["method"] if r.get("peer") else r["policy"]
        if found is None or method not in PRESSES or r["status"] != "ok" or r.get("score") is None:
            continue
        ratio, side = found
        cells.setdefault((method, ratio, r.get("protocol") or "aware", r["task"]), {})[side] = r
    return cells


def sides_present(cells: dict) -> list[str]:
    """SIDES in order, PREFILL_ONLY only where some record has it."""
    return [s for s in SIDES if s != PREFILL_ONLY or any(PREFILL_ONLY in pair for pair in cells.values())]


def paired(records: Iterable[dict]) -> tuple[list[str], list[list]]:
    """(columns, rows) with our score and kvpress's for each (method, ratio, protocol, task), ours from
    rows `NAME:ratio=r` (or bare full; a column for decode_evict=false where run), theirs from the peer; a side
    without a cell shows '-'."""
    cells = sides(records)
    order, present = list(PRESSES), sides_present(cells)
    rows = [[m, f"{ratio:g}", protocol, task] + [_score(pair.get(side)) for side in present]
            for (m, ratio, protocol, task), pair in sorted(cells.items(), key=lambda kv: (
                kv[0][3], kv[0][2], order.index(kv[0][0]), kv[0][1]))]
    return ["method", "ratio", "protocol", "task"] + present, rows


def _score(r: Optional[dict]) -> str:
    """A cell's score: hits/items for accuracy (the needle), else the mean score."""
    if r is None:
        return "-"
    if r["metric"] == "accuracy" and r.get("results"):
        return f"{round(r['score'] * len(r['results']) / 100)}/{len(r['results'])}"
    return f"{r['score']:.1f}"


def markdown(records: list[dict]) -> str:
    columns, rows = paired(records)
    if not rows:
        return ""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def doc_table(records: list[dict], tasks: list[str]) -> tuple[list[str], list[list]]:
    """(columns, rows) for docs/results.md: one row per (method, ratio, protocol, side), a column per task."""
    cells = sides(records)
    keys = sorted({k[:3] for k in cells}, key=lambda k: (k[2], list(PRESSES).index(k[0]), k[1]))
    rows = [[m, f"{ratio:g}", protocol, side] + [_score(cells.get((m, ratio, protocol, t), {}).get(side))
                                                 for t in tasks]
            for m, ratio, protocol in keys for side in sides_present(cells)
            if any(side in cells.get((m, ratio, protocol, t), {}) for t in tasks)]
    return ["method", "ratio", "protocol", "side"] + tasks, rows


def read_records(path: Path) -> list[dict]:
    """A suite run's records: its results.json's cells, or every cell file of a cells/ folder."""
    if path.is_dir():
        return [json.loads(f.read_text()) for f in sorted(path.glob("*.json"))]
    return json.loads(path.read_text())["cells"]


def main(argv=None) -> int:
    """Write a suite run's side-by-side table as a results/*.json table (scripts/reproduce.py renders it)."""
    import argparse
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("run", nargs="+", help="suite runs' results.json, or their cells/ folders (finished cells so "
                                          "far), read together")
    p.add_argument("--out", required=True)
    p.add_argument("--command", action="append", required=True, help="the command(s) that made the runs")
    p.add_argument("--date", required=True)
    p.add_argument("--machine", required=True, help="the machine, as free text")
    p.add_argument("--notes", default="")
    p.add_argument("--title", default="Both protocols: ours beside kvpress at the same compression ratios")
    p.add_argument("--order", type=int, default=2, help="the table's place in its section")
    p.add_argument("--tasks", help="the task columns, comma-separated (default: every task of the runs)")
    args = p.parse_args(argv)
    records = [r for path in args.run for r in read_records(Path(path))]
    tasks = args.tasks.split(",") if args.tasks else list(dict.fromkeys(r["task"] for r in records))
    columns, rows = doc_table(records, tasks)
    common.write_json(args.out, {"topic": "kvpress", "section": "13. Accuracy table", "title": args.title,
                                 "order": args.order, "size": "full", "command": args.command, "date": args.date,
                                 "machine": {"recorded": args.machine}, "columns": columns, "rows": rows,
                                 "notes": args.notes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
