"""The suite's policy specs and cells: parsing --policies / --tasks, one cell (policy x KV bits x task
x protocol) run by its task module's evaluate() into a record, and kvpress's peer rows (eval/suite.py)."""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from cache import PolicyError, parse_spec
from eval import agreement, common, kvpress_peer, longbench, needle, passkey, perplexity, ruler, ruler_synth
from eval.common import UsageError

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
            raise UsageError(f"--policies lists {spec.row(spec.kv_bits or 16)!r} twice "
                             "(NAME@LABEL tells variants apart)")
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
