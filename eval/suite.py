"""One command for a policy comparison: policies x KV bits x tasks, resumable, with a report.

    python -m eval.suite --preset quick --out runs/quick
    python -m eval.suite --checkpoint C --policies 'full; snapkv:budget=256; hshare:preset=long' \\
        --tasks needle,perplexity,passkey,longbench:multi_news,agreement --limit 20 --kv-bits 16,4 --out DIR

Policies: specs in the one syntax of every command (cache/spec.py), `NAME[@LABEL][:k=v,k=v...]`,
separated by `;` or given by repeating --policies (`@LABEL` tells two entries of one policy apart).
The argument `kv_bits=N` sets that entry's KV storage bits; entries without it run once per
--kv-bits value.  Every
registered policy name works (`STORAGE+READER` compositions too); a name the registry does not
know, bad arguments, or KV bits the storage does not support make that row's cells `skipped`
with the reason, and a cell that fails while running is an `error`: the run goes on.

Tasks: needle, passkey, perplexity, agreement (token agreement with the full cache; its
reference continuations are computed once and kept in DIR), longbench:NAME|PATH.jsonl,
ruler:PATH.jsonl, ruler_synth:NAME (eval/ruler_synth.py's generated RULER tasks, --ruler-length
tokens, --ruler-samples rows, seed 0), and proximal (POD Figure 1(c): next-token agreement when attending only to
proximal tokens; a property of the model, run once, not per policy).  Task sizes come from the
preset and the flags below (flags win).

Protocols (--protocol aware|agnostic|both, docs/design.md): aware compresses the prompt with its
question, agnostic the context alone and then appends the question whole.  The tasks that ask a
question (needle, passkey, longbench, ruler, ruler_synth) run once per protocol, agnostic rows
named `SPEC agnostic`; perplexity, agreement and proximal have no question and run once (protocol
null in their records).

Peers (--peers kvpress, eval/kvpress_peer.py): kvpress's own pipeline on the same checkpoint (HF
form), the same prompt tokens and the same protocols, for the needle, ruler and ruler_synth tasks:
full, and each of --peer-presses (SnapKV, StreamingLLM, TOVA, PyramidKV, Knorm, ObservedAttention as
h2o, ExpectedAttention) at each of --peer-ratios, in a child process under --kvpress-python (a venv
with `pip install -e '.[kvpress]'`: kvpress pins an older transformers).  Its rows are named
`kvpress:METHOD ratio=R`; results.md adds a side-by-side table pairing them with our rows
`METHOD:ratio=R` (and bare `full`).  Without kvpress: a one-line error naming the install command.

Resuming: every finished cell is written at once to DIR/cells/ under a name derived from
everything that determines its result (checkpoint, dtype, policy and arguments, KV bits, task
and task settings); running the same command again skips finished cells and retries skipped
and failed ones.  Ctrl-C writes the report for the cells finished so far.

Output in DIR: results.json (every cell: score, metric, KV bytes from the policy's kv_bytes(),
decode steps and seconds, per-item details), results.csv (one line per cell), results.md (the
table: policy x task, KV compression = bytes the full cache allocated for the same requests /
bytes the policy allocated, read ratio = the same for bytes read per decode step, decode
tokens/s over all of the row's decode steps), and score_vs_compression.png (one panel per task;
needs matplotlib: pip install -e '.[eval]').

Presets (--preset):
  quick       the eval suite's comparison (docs/results.md, section 7): full, every eviction policy that takes
              a budget (BUDGETED: streaming, h2o, snapkv, pyramidkv, d2o, tova, knorm, from the
              registry), simlayerkv, ds, hshare, pod at a 256-token budget per layer and
              head (simlayerkv: lazy layers keep 256; ds/hshare read 256; pod: 256 proximal
              tokens), and full with 4-bit KIVI storage; needle and passkey at
              2000 tokens x depths 0.1/0.5/0.9, perplexity 2048 + 128, multi_news (3 rows, 2048-
              token truncation, generation capped at 128 tokens), agreement (2048 + 64), proximal
              (64..1024 proximal tokens, last 100 of 2048).  Under 30 minutes on the 2-core CPU.
  multi_news  the same policies on LongBench multi_news: 20 rows, 2048-token truncation, the
              official 512-token generation length.
  ruler4k     the RULER-format tasks at 4096 tokens (eval/ruler_synth.py, 10 rows each) in both
              protocols: full, and snapkv, streaming, tova, knorm, h2o at 2048 and 1024 tokens per layer
              and head (half and a quarter of the prompt kept: kvpress's ratios 0.5 and 0.75).
  accuracy    the table a user reads to choose a policy (scripts/accuracy_table.py): every policy
              at its defaults with 64, 128 and 256 tokens per layer and KV head (accuracy_policies),
              KIVI 4 and 2 bits; needle at 1000 and 3000 tokens x depths 0.1/0.5/0.9 (the question
              after the text), perplexity over 2048 + 256 essay tokens; KV bytes per row.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

import engine  # noqa: E402
from cache import POLICIES, policy_params  # noqa: E402
from cache.base import EvictionPolicy  # noqa: E402
from eval import common, kvpress_peer, longbench, ruler, ruler_synth  # noqa: E402
from eval.common import UsageError  # noqa: E402
from eval.suite_cells import (PEER_TASKS, QUESTION_TASKS, Cell, Context, InnerProgress,  # noqa: E402
                              PolicySpec, construct, essays, execute, parse_policies, parse_tasks,
                              policy_namespace, run_peers, task_params, windows)
from eval.suite_report import report_markdown, write_reports  # noqa: E402

# every registered eviction policy that takes a token budget (a policy registered later joins the presets)
BUDGETED = tuple(name for name, cls in POLICIES.items()
                 if issubclass(cls, EvictionPolicy) and "budget" in policy_params(cls))
QUICK_POLICIES = "; ".join(["full", *(f"{name}:budget=256" for name in BUDGETED), "simlayerkv:n_recent=252",
                            "ds:n_critical=256", "hshare:n_critical=256", "pod:n_recent=240", "full:kv_bits=4"])


def accuracy_policies(budgets=(64, 128, 256)) -> str:
    """The accuracy table's rows: every policy at its defaults with `budgets` tokens per layer and KV
    head (readers: read per step, the HShare paper's short preset below 256 and long from 256, and its
    two sharing settings; simlayerkv: its lazy layers; pod: proximal tokens), and KIVI 4 and 2 bits."""
    rows = ["full", "full@kv4:kv_bits=4", "full@kv2:kv_bits=2"]
    for b in budgets:
        preset = "short" if b < 256 else "long"
        rows += [f"{name}@{b}:budget={b}" for name in BUDGETED]
        rows += [f"simlayerkv@{b}:n_recent={b - 4}", f"pod@{b}:n_recent={b - 16}",
                 f"ds@{b}:n_critical={b},preset={preset}", f"quest@{b}:n_critical={b},preset={preset}",
                 f"hshare@{b}-7/8:n_critical={b},preset={preset},ratios=7/8-3/4-1/2",
                 f"hshare@{b}-1/2:n_critical={b},preset={preset},ratios=1/2-1/2-1/2"]
    return "; ".join(rows)


PRESETS = {
    "quick": dict(policies=QUICK_POLICIES, tasks="needle,passkey,perplexity,longbench:multi_news,agreement,proximal",
                  kv_bits="16", lengths="2000", depths="0.1,0.5,0.9", context_length=2048, eval_tokens=128,
                  new_tokens=64, samples=1, limit=3, max_context=2048, max_new_tokens=128,
                  proximal="64,128,256,512,1024"),
    "multi_news": dict(policies=QUICK_POLICIES, tasks="longbench:multi_news", kv_bits="16", limit=20,
                       max_context=2048),
    "ruler4k": dict(policies="; ".join(["full"] + [f"{n}@{b}:budget={b}" for b in (2048, 1024)
                                                   for n in ("snapkv", "streaming", "tova", "knorm", "h2o")]),
                    tasks=",".join(f"ruler_synth:{n}" for n in ruler_synth.TASKS), protocol="both",
                    ruler_length=4096, ruler_samples=10),
    "accuracy": dict(policies=accuracy_policies(), tasks="needle,perplexity", kv_bits="16", lengths="1000,3000",
                     depths="0.1,0.5,0.9", context_length=2048, eval_tokens=256, samples=1),
}
DEFAULTS = dict(kv_bits="16", lengths="1000,2000", depths="0.1,0.5,0.9", context_length=2048, eval_tokens=256,
                new_tokens=64, samples=1, limit=None, max_context=None, max_new_tokens=None,
                proximal="64,128,256,512,1024", n_sink=16, last=100, protocol="aware", ruler_length=4096,
                ruler_samples=10)


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(common.DEFAULT_CHECKPOINT), help="default: %(default)s")
    p.add_argument("--preset", choices=sorted(PRESETS), help="policies, tasks and sizes (flags override)")
    p.add_argument("--policies", action="append", help="policy specs NAME[@LABEL][:k=v,...] separated by ';', "
                                                        "or the flag repeated (see above); none with --peers: "
                                                        "kvpress's rows alone")
    p.add_argument("--tasks", help="needle,passkey,perplexity,agreement,proximal,longbench:NAME|PATH,ruler:PATH")
    p.add_argument("--kv-bits", help="comma-separated KV storage bits for every policy without kv_bits= (default 16)")
    p.add_argument("--out", required=True, help="output folder (finished cells are kept here and not redone)")
    g = p.add_argument_group("task sizes (default: the preset's, else the eval modules')")
    g.add_argument("--lengths", help="needle and passkey prompt lengths")
    g.add_argument("--depths", help="needle and passkey depths")
    g.add_argument("--context-length", type=int, help="perplexity, agreement and proximal window")
    g.add_argument("--eval-tokens", type=int, help="perplexity tokens teacher-forced by decode steps")
    g.add_argument("--new-tokens", type=int, help="agreement: reference tokens compared")
    g.add_argument("--samples", type=int, help="perplexity, agreement and proximal windows")
    g.add_argument("--limit", type=int, help="LongBench/RULER rows (default: all)")
    g.add_argument("--max-context", type=int, help="LongBench prompt budget (default: context - generation length)")
    g.add_argument("--max-new-tokens", type=int, help="LongBench/RULER generation length (default: the dataset's); "
                                                                "ruler_synth: a cap on RULER's per-task lengths")
    g.add_argument("--proximal", help="proximal sizes for the proximal task")
    g.add_argument("--ruler-length", type=int, help="ruler_synth: tokens of prompt + generation (default 4096)")
    g.add_argument("--ruler-samples", type=int, help="ruler_synth: rows per task (default 10)")
    g.add_argument("--n-sink", type=int, help="proximal: initial tokens among the proximal ones (default 16)")
    g.add_argument("--last", type=int, help="proximal: positions compared per window (default 100)")
    p.add_argument("--protocol", choices=["aware", "agnostic", "both"],
                   help="aware (default): the prompt with its question is compressed; agnostic: the context alone, "
                        "the question appended whole; both: every question task under each")
    g = p.add_argument_group("peers (eval/kvpress_peer.py)")
    g.add_argument("--peers", choices=["kvpress"], help="also run kvpress's pipeline on the same prompts and "
                                                        "protocols (needle, ruler, ruler_synth tasks)")
    g.add_argument("--peer-presses", default=",".join(kvpress_peer.PRESSES),
                   help="kvpress presses by our method names (default: %(default)s)")
    g.add_argument("--peer-ratios", default=kvpress_peer.RATIOS, help="kvpress compression ratios, the fraction of "
                                                                      "the context removed (default: %(default)s)")
    g.add_argument("--kvpress-python", default=sys.executable,
                   help="the python of a venv with kvpress (pip install -e '.[kvpress]'; default: this one)")
    p.add_argument("--device", help="cpu or cuda")
    p.add_argument("--dtype", choices=list(engine.DTYPES))
    p.add_argument("--compile", action="store_true")
    p.add_argument("--no-plot", action="store_true", help="skip the plot")
    p.add_argument("--quiet", action="store_true", help="one line per cell, no per-item lines")
    return p


def resolve_options(o: argparse.Namespace) -> argparse.Namespace:
    preset = PRESETS.get(o.preset, {})
    for key, default in DEFAULTS.items():
        if getattr(o, key) is None:
            setattr(o, key, preset.get(key, default))
    for key in ("policies", "tasks"):
        if getattr(o, key) is None:
            if key == "policies" and o.peers and key not in preset:
                continue                        # kvpress's rows alone
            if key not in preset:
                raise UsageError(f"--{key} is required without --preset")
            setattr(o, key, preset[key])
    o.kv_bits_list = common.parse_ints(o.kv_bits, "--kv-bits")
    o.protocols = ruler_synth.protocols(o.protocol)
    for name in ("context_length", "eval_tokens", "new_tokens", "samples", "last", "ruler_length", "ruler_samples"):
        if getattr(o, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("limit", "max_context", "max_new_tokens"):
        if getattr(o, name) is not None and getattr(o, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if any(not 0 <= d <= 1 for d in common.parse_floats(o.depths, "--depths")):
        raise UsageError(f"--depths must lie in [0, 1], got {o.depths}")
    common.parse_ints(o.lengths, "--lengths")
    o.peer_pairs = []
    if o.peers:
        try:
            o.peer_pairs = kvpress_peer.jobs(kvpress_peer.parse_presses(o.peer_presses),
                                             kvpress_peer.parse_ratios(o.peer_ratios))
        except kvpress_peer.PeerError as e:
            raise UsageError(str(e)) from None
    return o


def plan(o: argparse.Namespace, specs: list[PolicySpec], tasks: list[str]) -> list[Cell]:
    cells, rows = [], set()
    if "proximal" in tasks:
        cells.append(Cell(None, 16, "proximal", task_params("proximal", o)))
    for spec in specs:
        for bits in ([spec.kv_bits] if spec.kv_bits else o.kv_bits_list):
            if spec.row(bits) in rows:
                raise UsageError(f"--policies with --kv-bits {o.kv_bits} runs {spec.row(bits)!r} twice")
            rows.add(spec.row(bits))
            for t in tasks:
                if t.partition(":")[0] in QUESTION_TASKS:
                    cells += [Cell(spec, bits, t, task_params(t, o), protocol) for protocol in o.protocols]
                elif t != "proximal":
                    cells.append(Cell(spec, bits, t, task_params(t, o)))
    return cells


def prepare(ctx: Context, tasks: list[str]) -> None:
    """Check every task's input before the first cell, so bad input stops the run at once."""
    o, loaded = ctx.opts, ctx.loaded
    if any(t in tasks for t in ("needle", "perplexity", "agreement", "proximal")):
        essays(ctx)
    for t in tasks:
        kind, _, arg = t.partition(":")
        if kind in ("needle", "passkey"):
            for n in common.parse_ints(o.lengths, "--lengths"):
                common.check_fits(loaded, n + 32, f"{kind} length {n} + answer")
        elif kind == "perplexity":
            common.check_fits(loaded, o.context_length + o.eval_tokens, "--context-length + --eval-tokens")
            windows(ctx, o.context_length + o.eval_tokens)
        elif kind in ("agreement", "proximal"):
            common.check_fits(loaded, o.context_length + (o.new_tokens if kind == "agreement" else 0),
                              "--context-length + --new-tokens")
            windows(ctx, o.context_length)
            if kind == "proximal":
                sizes = common.parse_ints(o.proximal, "--proximal")
                if any(n <= o.n_sink for n in sizes) or o.last > o.context_length:
                    raise UsageError("proximal: every size must exceed --n-sink and --last must not exceed "
                                     "--context-length")
        elif kind == "longbench":
            path = longbench.resolve_data(arg)
            rows = longbench.read_rows(path, o.limit)
            task = longbench.task_for(path, rows)
            new = o.max_new_tokens or task.max_new_tokens
            common.check_fits(loaded, (o.max_context or loaded.context_length - new) + new,
                              f"{t}: --max-context + generation length")
            ctx.cache["rows", t] = len(rows)
        elif kind == "ruler":
            rows = ruler.read_rows(arg, o.limit)
            for protocol in o.protocols:        # agnostic needs rows split into context and question
                for row in rows:
                    ruler.row_ids(loaded.tokenizer, row, protocol)
            ctx.cache["rows", t] = len(rows)
        elif kind == "ruler_synth":
            common.check_fits(loaded, o.ruler_length, f"{t}: --ruler-length")
            rows = ruler_synth.generate(loaded.tokenizer, arg, o.ruler_length, o.ruler_samples)
            if o.max_new_tokens:     # a cap on RULER's per-task generation lengths; the prompts stay the same
                rows = [{**r, "max_new_tokens": min(r["max_new_tokens"], o.max_new_tokens)} for r in rows]
            ctx.cache["synth", t], ctx.cache["rows", t] = rows, len(rows)


def run(o: argparse.Namespace) -> int:
    o = resolve_options(o)
    specs, tasks = parse_policies(o.policies), parse_tasks(o.tasks)
    if o.peers:
        if not any(t.partition(":")[0] in PEER_TASKS for t in tasks):
            raise UsageError(f"--peers kvpress runs the tasks {', '.join(PEER_TASKS)}; --tasks has none of them")
        try:                 # here, not in resolve_options: the docs' quoted commands parse without kvpress
            kvpress_peer.check_available(o.kvpress_python, o.checkpoint)
        except kvpress_peer.PeerError as e:
            raise UsageError(str(e)) from None
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cells").mkdir(exist_ok=True)
    cells = plan(o, specs, tasks)
    loaded = common.load(policy_namespace(o, None, 16))
    ctx = Context(loaded, o, out, None if o.quiet else (lambda n: InnerProgress(n)))
    prepare(ctx, tasks)
    checkpoint, dtype = str(Path(o.checkpoint).resolve()), str(next(loaded.model.parameters()).dtype)
    factories = {}
    for spec in specs:
        for bits in ([spec.kv_bits] if spec.kv_bits else o.kv_bits_list):
            factories[spec, bits] = construct(o, spec, bits, loaded)
    rows = list(dict.fromkeys(c.row for c in cells if c.policy))
    header = {"checkpoint": checkpoint, "dtype": dtype, "preset": o.preset, "policies": o.policies,
              "tasks": tasks, "kv_bits": o.kv_bits_list,
              "settings": {k: getattr(o, k) for k in DEFAULTS}, "rows": rows}

    records, t0, ran, times = [], time.perf_counter(), 0, []
    todo = [c for c in cells if not _finished(out, c, checkpoint, dtype)]
    print(f"{len(cells)} cells: {len(cells) - len(todo)} finished before, {len(todo)} to run "
          f"({len(rows)} policy rows x {len(tasks)} tasks) -> {out}", file=sys.stderr, flush=True)
    try:
        for cell in cells:
            path = out / "cells" / cell.filename(checkpoint, dtype)
            record = _finished(out, cell, checkpoint, dtype)
            if record is None:
                ran += 1
                factory, skip = factories.get((cell.policy, cell.kv_bits), (None, None))
                if not skip:
                    print(f"[{ran}/{len(todo)}] {cell.row} x {cell.task} ...", file=sys.stderr, flush=True)
                t_cell = time.perf_counter()
                record = execute(ctx, cell, factory, skip)
                elapsed = time.perf_counter() - t_cell
                if not skip:
                    times.append(elapsed)
                record["identity"] = cell.identity(checkpoint, dtype)
                common.write_json(path, record)
                runnable = sum(1 for c in todo[ran:] if not factories.get((c.policy, c.kv_bits), (0, None))[1])
                left = runnable * sum(times) / len(times) if times else 0.0
                print(f"[{ran}/{len(todo)}] {cell.row} x {cell.task}: {_summary(record)}  ({elapsed:.1f} s, "
                      f"{time.perf_counter() - t0:.0f} s total, ~{left / 60:.1f} min left)", file=sys.stderr,
                      flush=True)
            records.append(record)
        if o.peers:
            peers = run_peers(ctx, tasks, checkpoint, dtype)
            records += peers
            rows += list(dict.fromkeys(r["row"] for r in peers))
    except KeyboardInterrupt:
        write_reports(out, records, tasks, rows, {**header, "interrupted": True}, plots=False)
        print(f"interrupted: {len(records)}/{len(cells)} cells finished and kept in {out}/cells; "
              f"run the same command again to resume", file=sys.stderr)
        return 130
    note = write_reports(out, records, tasks, rows, {**header, "seconds": time.perf_counter() - t0},
                         plots=not o.no_plot)
    print(report_markdown(records, tasks, rows))
    if note:
        print(f"note: {note}", file=sys.stderr)
    print(f"{ran} cells run in {time.perf_counter() - t0:.0f} s; results.json, results.csv, results.md"
          f"{'' if note or o.no_plot else ', score_vs_compression.png'} in {out}", file=sys.stderr)
    return 0


def _finished(out: Path, cell: Cell, checkpoint: str, dtype: str) -> Optional[dict]:
    """The cell's record when it finished in an earlier run (skipped and failed cells are retried)."""
    path = out / "cells" / cell.filename(checkpoint, dtype)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if record.get("status") != "ok" or record.get("identity") != cell.identity(checkpoint, dtype):
        return None
    return record


def _summary(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r['error']}"
    if r["score"] is None:
        return ", ".join(f"{n}: {s:.3f}" for n, s in r.get("proximal_agreement", {}).items())
    return f"{r['metric']} {r['score']:.2f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.main_wrapper(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
