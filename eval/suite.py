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
import csv  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Callable, Optional, Sequence  # noqa: E402

import atomic_io  # noqa: E402
import engine  # noqa: E402
from cache import POLICIES, PolicyError, parse_spec, policy_params  # noqa: E402
from cache.base import EvictionPolicy  # noqa: E402
from eval import agreement, common, kvpress_peer, longbench, needle, passkey, perplexity, ruler, ruler_synth  # noqa: E402
from eval.common import UsageError  # noqa: E402

# every registered eviction policy that takes a token budget (a policy registered later joins the presets)
BUDGETED = tuple(name for name, cls in POLICIES.items() if issubclass(cls, EvictionPolicy) and "budget" in policy_params(cls))
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
SIMPLE_TASKS = ("needle", "passkey", "perplexity", "agreement", "proximal")
QUESTION_TASKS = ("needle", "passkey", "longbench", "ruler", "ruler_synth")   # run under each --protocol
PEER_TASKS = ("needle", "ruler", "ruler_synth")                               # --peers kvpress runs these
LOWER_IS_BETTER = {"perplexity"}


# --------------------------------------------------------------------------- specs

@dataclass(frozen=True)
class PolicySpec:
    name: str                 # registry name (STORAGE+READER allowed)
    label: str                # @label, or ""
    args: str                 # k=v,... as given, kv_bits removed
    kv_bits: Optional[int]    # from kv_bits=N, or None: every --kv-bits value

    def row(self, kv_bits: int) -> str:
        head = self.name + (f"@{self.label}" if self.label else "") + (f":{self.args}" if self.args else "")
        return head + (f" kv{kv_bits}" if kv_bits != 16 else "")


def parse_policies(texts) -> list[PolicySpec]:
    """'full; snapkv:budget=256,obs_window=16; hshare@a:preset=long' (or the values of a repeated
    --policies) -> specs, the argument kv_bits=N taken out (see the module doc); None (no --policies, which
    resolve_options allows with --peers only) -> none: kvpress's rows alone."""
    if texts is None:
        return []
    specs = []
    for text in [texts] if isinstance(texts, str) else texts:
        for item in filter(str.strip, text.split(";")):
            try:
                spec = parse_spec(item)
            except PolicyError as e:
                raise UsageError(f"--policies: {e}") from None
            args = spec.arg_dict
            try:
                bits = int(args.pop("kv_bits")) if "kv_bits" in args else None
            except ValueError:
                raise UsageError(f"--policies: kv_bits={spec.arg_dict['kv_bits']!r} is not an integer") from None
            specs.append(PolicySpec(spec.name, spec.label, ",".join(f"{k}={v}" for k, v in args.items()), bits))
    if not specs:
        raise UsageError("--policies is empty")
    for i, spec in enumerate(specs):
        if spec in specs[:i]:
            raise UsageError(f"--policies lists {spec.row(spec.kv_bits or 16)!r} twice (NAME@LABEL tells variants apart)")
    return specs


def parse_tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise UsageError("--tasks is empty")
    for t in tasks:
        kind, colon, arg = t.partition(":")
        if kind in SIMPLE_TASKS and not colon:
            continue
        if kind in ("longbench", "ruler") and arg or kind == "ruler_synth" and arg in ruler_synth.TASKS:
            continue
        raise UsageError(f"unknown task {t!r}; tasks: {', '.join(SIMPLE_TASKS)}, longbench:NAME|PATH, ruler:PATH, "
                         f"ruler_synth:NAME (NAME one of {', '.join(ruler_synth.TASKS)})")
    if len(set(tasks)) != len(tasks):
        raise UsageError(f"--tasks lists a task twice: {text}")
    return tasks


# --------------------------------------------------------------------------- cells

@dataclass
class Cell:
    policy: Optional[PolicySpec]     # None: a policy-independent task (proximal)
    kv_bits: int
    task: str
    params: dict                     # the task settings that determine the result
    protocol: Optional[str] = None   # aware or agnostic (None: a task without a question)

    @property
    def row(self) -> str:
        name = self.policy.row(self.kv_bits) if self.policy else "(model)"
        return name + (" agnostic" if self.protocol == "agnostic" else "")

    def identity(self, checkpoint: str, dtype: str) -> dict:
        p = self.policy
        # an aware cell keeps the identity cells had before protocols existed, so older runs resume
        protocol = {"protocol": self.protocol} if self.protocol == "agnostic" else {}
        return {"checkpoint": checkpoint, "dtype": dtype, "task": self.task, "params": self.params,
                "policy": p and p.name, "label": p and p.label, "policy_args": p and p.args,
                "kv_bits": self.kv_bits, **protocol}

    def filename(self, checkpoint: str, dtype: str) -> str:
        digest = hashlib.sha1(json.dumps(self.identity(checkpoint, dtype), sort_keys=True).encode()).hexdigest()[:12]
        slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{self.row}__{self.task}")[:80]
        return f"{slug}-{digest}.json"


@dataclass
class Context:
    """What every cell of a run shares."""
    loaded: common.Loaded
    opts: argparse.Namespace
    out: Path
    inner: Optional[Callable[[int], "InnerProgress"]] = None
    cache: dict = field(default_factory=dict)


class InnerProgress(common.Progress):
    """Indented item lines inside a cell."""

    def finish(self, label: str, result: str = "") -> float:
        now = time.perf_counter()
        self.done += 1
        seconds = now - self.t_cell
        print(f"      ({self.done}/{self.total}) {label}  {result}  ({seconds:.1f} s)", file=self.stream, flush=True)
        self.t_cell = now
        return seconds


def task_params(task: str, o: argparse.Namespace) -> dict:
    kind, _, arg = task.partition(":")
    if kind == "needle":     # the question after the text (needle.py's default since 2026-11-24)
        return {"lengths": o.lengths, "depths": o.depths, "question_position": "after"}
    if kind == "passkey":
        return {"lengths": o.lengths, "depths": o.depths}
    if kind == "perplexity":
        return {"context_length": o.context_length, "eval_tokens": o.eval_tokens, "samples": o.samples}
    if kind == "agreement":
        return {"context_length": o.context_length, "new_tokens": o.new_tokens, "samples": o.samples}
    if kind == "proximal":
        return {"context_length": o.context_length, "samples": o.samples, "sizes": o.proximal, "n_sink": o.n_sink,
                "last": o.last}
    if kind == "longbench":
        return {"data": str(longbench.resolve_data(arg)), "limit": o.limit, "max_context": o.max_context,
                "max_new_tokens": o.max_new_tokens}
    if kind == "ruler_synth":
        cap = {"max_new_tokens": o.max_new_tokens} if o.max_new_tokens else {}   # absent: older cells resume
        return {"length": o.ruler_length, "samples": o.ruler_samples, "seed": 0, "chat": True, **cap}
    return {"data": str(Path(arg).resolve()), "limit": o.limit, "max_new_tokens": o.max_new_tokens}


def essays(ctx: Context) -> str:
    if "essays" not in ctx.cache:
        ctx.cache["essays"] = common.read_text_folder(common.ESSAYS)
    return ctx.cache["essays"]


def windows(ctx: Context, window: int) -> list:
    """--samples consecutive windows of the essays (tokenized once per size)."""
    if ("windows", window) not in ctx.cache:
        ctx.cache["windows", window] = perplexity.text_windows(ctx.loaded.tokenizer, essays(ctx), window,
                                                               ctx.opts.samples)
    return ctx.cache["windows", window]


def agreement_references(ctx: Context, wins: list, params: dict) -> list[list[int]]:
    """The full cache's continuations, computed once per settings and kept in DIR/references."""
    key = hashlib.sha1(json.dumps({**params, "checkpoint": ctx.opts.checkpoint, "dtype": ctx.opts.dtype},
                                  sort_keys=True).encode()).hexdigest()[:12]
    path = ctx.out / "references" / f"agreement-{key}.json"
    if path.exists():
        return json.loads(path.read_text())["references"]
    refs = [agreement.reference(ctx.loaded, ids, params["new_tokens"]) for _, ids in wins]
    common.write_json(path, {**params, "references": refs})
    return refs


def run_task(ctx: Context, cell: Cell, new_policy: Callable) -> dict:
    """One cell -> {score, metric, usage, ...} (the task module's evaluate())."""
    o, loaded, p = ctx.opts, ctx.loaded, cell.params
    kind, _, arg = cell.task.partition(":")
    items = _item_count(ctx, cell)
    progress = ctx.inner(items) if ctx.inner else None
    lengths, depths = common.parse_ints(o.lengths, "--lengths"), common.parse_floats(o.depths, "--depths")
    if kind == "needle":
        return needle.evaluate(loaded, new_policy, essays(ctx), lengths, depths, progress=progress,
                               compile=o.compile, protocol=cell.protocol)
    if kind == "passkey":
        return passkey.evaluate(loaded, new_policy, lengths, depths, progress=progress, compile=o.compile,
                                protocol=cell.protocol)
    if kind == "perplexity":
        return perplexity.evaluate(loaded, new_policy, windows(ctx, o.context_length + o.eval_tokens),
                                   o.context_length, progress)
    if kind == "agreement":
        wins = windows(ctx, o.context_length)
        return agreement.evaluate(loaded, new_policy, wins, o.new_tokens, agreement_references(ctx, wins, p),
                                  progress)
    if kind == "proximal":
        sizes = common.parse_ints(o.proximal, "--proximal")
        shares = agreement.proximal_agreement(loaded, windows(ctx, o.context_length), sizes, o.n_sink, o.last,
                                              progress)
        return {"score": None, "metric": "proximal_agreement", "proximal_agreement": {str(n): s for n, s in
                                                                                       shares.items()}}
    if kind == "longbench":
        path = Path(p["data"])
        rows = longbench.read_rows(path, o.limit)
        task = longbench.task_for(path, rows)
        max_context = o.max_context or longbench.default_max_context(loaded, task, o.max_new_tokens)
        return longbench.evaluate(loaded, new_policy, rows, task, max_context, o.max_new_tokens, progress=progress,
                                  compile=o.compile, protocol=cell.protocol)
    if kind == "ruler_synth":
        return ruler.evaluate(loaded, new_policy, ctx.cache["synth", cell.task], "all", 128, arg, progress,
                              o.compile, cell.protocol)
    rows = ruler.read_rows(arg, o.limit)
    name = ruler.task_name(arg, rows)
    return ruler.evaluate(loaded, new_policy, rows, ruler.pick_metric("auto", name), o.max_new_tokens or 128, name,
                          progress, o.compile, cell.protocol)


def _item_count(ctx: Context, cell: Cell) -> int:
    o, kind = ctx.opts, cell.task.partition(":")[0]
    if kind in ("needle", "passkey"):
        return len(common.parse_ints(o.lengths, "--lengths")) * len(common.parse_floats(o.depths, "--depths"))
    if kind == "proximal":
        return o.samples * len(common.parse_ints(o.proximal, "--proximal"))
    if kind in ("perplexity", "agreement"):
        return o.samples
    return ctx.cache.get(("rows", cell.task), 0)


def policy_namespace(o: argparse.Namespace, spec: Optional[PolicySpec], kv_bits: int) -> argparse.Namespace:
    """The flags eval/common.py builds a policy from (its defaults for whatever the suite does
    not set), so KV storage options reach the policy by the same path as in every eval."""
    ns = common.base_parser("").parse_args([])
    ns.checkpoint, ns.device, ns.dtype, ns.compile = o.checkpoint, o.device, o.dtype, o.compile
    ns.policy, ns.policy_args, ns.kv_bits = (spec.name, spec.args, kv_bits) if spec else ("full", "", 16)
    return ns


def construct(o, spec, kv_bits, loaded: common.Loaded) -> tuple[Optional[Callable], Optional[str]]:
    """(policy factory, None) or (None, why the row is skipped); makes the calibration files the policy
    needs (once per checkpoint)."""
    ns = policy_namespace(o, spec, kv_bits)
    try:
        common.new_policy(ns).prepare(loaded.model, loaded.tokenizer)
    except (PolicyError, UsageError, ValueError, NotImplementedError) as e:
        return None, str(e).splitlines()[0] if str(e) else type(e).__name__
    return (lambda: common.new_policy(ns)), None


def execute(ctx: Context, cell: Cell, factory: Optional[Callable], skip: Optional[str]) -> dict:
    """Run one cell -> its record (status ok, skipped or error; never raises but KeyboardInterrupt)."""
    record = {"row": cell.row, "task": cell.task, "policy": cell.policy.name if cell.policy else None,
              "label": cell.policy.label if cell.policy else None,
              "policy_args": cell.policy.args if cell.policy else None, "kv_bits": cell.kv_bits,
              "protocol": cell.protocol, "params": cell.params}
    if skip:
        return {**record, "status": "skipped", "error": skip}
    t0 = time.perf_counter()
    try:
        result = run_task(ctx, cell, factory or (lambda: None))
    except KeyboardInterrupt:
        raise
    except Exception as e:    # noqa: BLE001 - one failing cell must not end the run
        message = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
        return {**record, "status": "error", "error": message, "traceback": traceback.format_exc(),
                "seconds": time.perf_counter() - t0}
    return {**result, **record, "status": "ok", "seconds": time.perf_counter() - t0,
            "higher_is_better": result.get("metric") not in LOWER_IS_BETTER}


def peer_items(ctx: Context, task: str, protocol: str) -> tuple[str, list]:
    """(metric, kvpress_peer items) for a PEER_TASKS task: the prompts and scoring its own evaluate() uses."""
    o, tokenizer = ctx.opts, ctx.loaded.tokenizer
    kind, _, arg = task.partition(":")
    if kind == "needle":
        return "accuracy", kvpress_peer.needle_items(tokenizer, essays(ctx), common.parse_ints(o.lengths, "--lengths"),
                                                     common.parse_floats(o.depths, "--depths"))
    if kind == "ruler_synth":
        return "string_match_all", kvpress_peer.ruler_items(tokenizer, ctx.cache["synth", task], "all", 128, protocol)
    rows = ruler.read_rows(arg, o.limit)
    metric = ruler.pick_metric("auto", ruler.task_name(arg, rows))
    return f"string_match_{metric}", kvpress_peer.ruler_items(tokenizer, rows, metric, o.max_new_tokens or 128,
                                                              protocol)


def run_peers(ctx: Context, tasks: list[str], checkpoint: str, dtype: str) -> list[dict]:
    """kvpress's records for every PEER_TASKS task and protocol (--peers kvpress)."""
    o, records = ctx.opts, []
    for task in tasks:
        if task.partition(":")[0] not in PEER_TASKS:
            continue
        for protocol in o.protocols:
            metric, items = peer_items(ctx, task, protocol)
            records += kvpress_peer.run(ctx.out, o.kvpress_python, checkpoint, dtype.removeprefix("torch."), task,
                                        task_params(task, o), protocol, metric, items, o.peer_pairs,
                                        ctx.loaded.device.type)
    return records


# --------------------------------------------------------------------------- report

def compression(records: list[dict]) -> None:
    """Add kv_ratio / read_ratio to every ok record: the full cache's bytes for the same task
    (policy full without arguments, 16 bits) over the record's."""
    full = {(r["task"], r.get("protocol")): r["usage"] for r in records if r["status"] == "ok"
            and r["policy"] == "full" and not r["policy_args"] and not r["label"] and r["kv_bits"] == 16 and r.get("usage")}
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
