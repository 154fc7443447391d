"""LongBench-format tasks: any LongBench jsonl, its official prompt, generation length and metric.

    python -m eval.longbench --data multi_news --limit 20 --max-context 2048 --policy snapkv
    python -m eval.longbench --data path/to/hotpotqa.jsonl --policy h2o --policy-args budget=512

Rows are JSON objects with `input`, `context`, `answers` (a list), `all_classes` and `dataset`
(LongBench's own files; `length` and `_id` are ignored).  --data is a .jsonl path or a dataset
name looked up in --data-dir (default: data/downloaded/longbench, where `python scripts/download.py
longbench` puts every task, then data/longbench, the 30-row multi_news sample in the repository).  The dataset's template,
maximum generation length, metric and chat/first-line rules come from eval/longbench_tasks.json
(the 16 English tasks); a file named like `hotpotqa_e.jsonl` (LongBench-E) uses hotpotqa's.

As in LongBench's pred.py: the prompt is the template filled with the row; when it is longer
than --max-context tokens, the middle is cut, keeping the first and last halves; the chat
template is applied except for trec, triviaqa, samsum, lcc and repobench-p; decoding is greedy
for the dataset's maximum generation length.  Here the budget counts the chat template too,
so a prompt is never longer than --max-context (default: the model's context length minus the
generation length).  As in LongBench's scorer: trec, triviaqa and samsum predictions are cut
to their first line; a row scores the best metric value over its answers; the task score is
the mean x 100.

The literal `NEWLINE_CHAR` in some LongBench files (multi_news) becomes a newline before
tokenization; --keep-newline-char feeds it unchanged, as LongBench's own pred.py does.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import json  # noqa: E402
import re  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable, Optional, Sequence  # noqa: E402

from eval import common, measure, metrics, prompts  # noqa: E402
from eval.common import UsageError  # noqa: E402

TASKS_FILE = Path(__file__).resolve().parent / "longbench_tasks.json"
DATA_DIR = common.DATA / "longbench"                      # the sample bundled with the repository
DOWNLOADED_DIR = common.DATA / "downloaded" / "longbench"   # what scripts/download.py longbench fetches
NEWLINE_CHAR = "NEWLINE_CHAR"


def load_tasks() -> dict[str, dict]:
    return json.loads(TASKS_FILE.read_text())["tasks"]


@dataclass
class Task:
    name: str
    prompt: str             # template with {context} and {input}
    max_new_tokens: int
    metric: str
    chat: bool
    first_line: bool

    @classmethod
    def named(cls, name: str) -> "Task":
        tasks = load_tasks()
        key = re.sub(r"_e$", "", name)             # LongBench-E files share the task's settings
        if key not in tasks:
            raise UsageError(f"unknown LongBench task {name!r}; known: {', '.join(sorted(tasks))}")
        t = tasks[key]
        return cls(key, t["prompt"], t["max_new_tokens"], t["metric"], t["chat"], t["first_line"])


def resolve_data(spec: str, data_dir=None) -> Path:
    """A .jsonl path, or a dataset name looked up in data_dir (default: the tasks scripts/download.py
    fetched, then the sample bundled in data/longbench)."""
    path = Path(spec)
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise UsageError(f"LongBench data {path} does not exist")
        return path
    dirs = [Path(data_dir)] if data_dir else [DOWNLOADED_DIR, DATA_DIR]
    for d in dirs:
        if (d / f"{spec}.jsonl").is_file():
            return d / f"{spec}.jsonl"
    raise UsageError(f"no LongBench task {spec!r} in {' or '.join(map(str, dirs))}: fetch it with "
                     f"`python scripts/download.py longbench --tasks {spec}`")


def read_jsonl(path, limit: Optional[int], required: Sequence[str]) -> list[dict]:
    """The first `limit` rows (all if None) of a jsonl file, each checked for `required` fields."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path} line {n} is not JSON: {e.msg}") from None
            missing = [k for k in required if not isinstance(row, dict) or k not in row]
            if missing:
                raise UsageError(f"{path} line {n} has no field(s) {', '.join(missing)}")
            rows.append(row)
    if not rows:
        raise UsageError(f"{path} has no rows")
    return rows


def read_rows(path, limit: Optional[int] = None) -> list[dict]:
    rows = read_jsonl(path, limit, ("input", "context", "answers"))
    for n, row in enumerate(rows, 1):
        if not isinstance(row["answers"], list) or not row["answers"]:
            raise UsageError(f"{path} row {n}: `answers` must be a non-empty list")
    return rows


def task_for(path: Path, rows: list[dict], name: Optional[str] = None) -> Task:
    """The task named by --dataset, else by the rows' `dataset` field, else by the file name."""
    return Task.named(name or rows[0].get("dataset") or path.stem)


def build_ids(tokenizer, task: Task, row: dict, max_context: int, keep_newline_char: bool = False,
              protocol: str = "aware") -> tuple[list, int, int]:
    """(prompt ids of at most max_context tokens, tokens cut from the middle, index of the first token after
    the context; aware: after the whole body).  aware: the filled template is tokenized whole and its middle cut, as LongBench does;
    agnostic: the template up to the end of {context} and the rest (the question, the template's end) are
    tokenized apart, and only the first piece's middle is cut, so the question is whole."""
    context, question = str(row["context"]), str(row["input"])
    if not keep_newline_char:
        context, question = context.replace(NEWLINE_CHAR, "\n"), question.replace(NEWLINE_CHAR, "\n")
    prefix, suffix = prompts.wrap(tokenizer, prompts.SENTINEL, task.chat)
    budget = max_context - len(prefix) - len(suffix)
    if protocol == "aware":
        body = tokenizer.encode(task.prompt.format(context=context, input=question), add_special_tokens=False)
        tail = []
    else:
        head, tail_text = context_split(task)
        body = tokenizer.encode(head.format(context=context), add_special_tokens=False)
        tail = tokenizer.encode(tail_text.format(input=question), add_special_tokens=False)
        budget -= len(tail)
    if budget < 2:
        raise UsageError(f"--max-context {max_context} leaves no room for the prompt after the template")
    kept = prompts.truncate_middle(body, budget)
    return prefix + kept + tail + suffix, len(body) - len(kept), len(prefix) + len(kept)


def context_split(task: Task) -> tuple[str, str]:
    """The task's template cut after {context}: (head with {context}, tail with {input} if any)."""
    head, _, tail = task.prompt.partition("{context}")
    if "{input}" in head:
        raise UsageError(f"{task.name}'s template puts the question before the context: --protocol agnostic "
                         f"does not apply")
    return head + "{context}", tail


def score(task: Task, prediction: str, row: dict) -> float:
    """The row's score in [0, 1]: the task's metric, best over the row's answers."""
    if task.first_line:
        prediction = prediction.lstrip("\n").split("\n")[0]
    answers = [str(a) for a in row["answers"]]
    return metrics.best_of(metrics.METRICS[task.metric], prediction, answers, all_classes=row.get("all_classes"))


def evaluate(loaded: common.Loaded, new_policy: Callable, rows: list[dict], task: Task, max_context: int,
             max_new_tokens: Optional[int] = None, keep_newline_char: bool = False,
             progress: Optional[common.Progress] = None, compile: bool = False, protocol: str = "aware") -> dict:
    """Run the rows with a fresh policy each under `protocol` (build_ids, measure.answer) -> {score (0-100),
    results, usage}."""
    max_new_tokens = max_new_tokens or task.max_new_tokens
    common.check_fits(loaded, max_context + max_new_tokens, f"--max-context {max_context} + {max_new_tokens} "
                                                             f"generated tokens")
    usage, results = measure.Usage(), []
    for i, row in enumerate(rows):
        ids, cut, split = build_ids(loaded.tokenizer, task, row, max_context, keep_newline_char, protocol)
        prediction, policy = measure.answer(loaded, new_policy, ids, split, max_new_tokens, protocol, usage, compile)
        value = score(task, prediction, row)
        results.append({"row": i, "id": row.get("_id"), "protocol": protocol, "score": value, "prompt_tokens": len(ids),
                        "truncated_tokens": cut, "prediction": prediction})
        if progress:
            progress.finish(f"{task.name} row {i}", f"{task.metric} {100 * value:.2f}  {prediction[:50]!r}")
    mean = 100 * sum(r["score"] for r in results) / len(results)
    return {"task": task.name, "metric": task.metric, "score": mean, "max_context": max_context,
            "max_new_tokens": max_new_tokens, "results": results, "usage": usage.as_dict(),
            "describe": policy.describe()}


def default_max_context(loaded: common.Loaded, task: Task, max_new_tokens: Optional[int]) -> int:
    """LongBench's per-model budget: the context length less room for the answer."""
    return loaded.context_length - (max_new_tokens or task.max_new_tokens)


def build_parser():
    p = common.base_parser(__doc__)
    p.add_argument("--data", required=True, help="a LongBench .jsonl, or a dataset name in --data-dir")
    p.add_argument("--data-dir", help=f"where dataset names are looked up (default: {DOWNLOADED_DIR}, then {DATA_DIR})")
    p.add_argument("--dataset", help="task settings to use (default: the rows' `dataset` field, else the file name)")
    p.add_argument("--limit", type=int, help="first N rows only")
    p.add_argument("--max-context", type=int, help="prompt budget in tokens, chat template included "
                                                   "(default: model context - generation length)")
    p.add_argument("--max-new-tokens", type=int, help="override the dataset's maximum generation length")
    p.add_argument("--keep-newline-char", action="store_true", help="leave the literal NEWLINE_CHAR in the text")
    common.add_protocol_flag(p)
    return p


def run(args) -> int:
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be at least 1")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    common.new_policy(args)
    path = resolve_data(args.data, args.data_dir)
    rows = read_rows(path, args.limit)
    task = task_for(path, rows, args.dataset)
    loaded = common.load(args)
    max_context = args.max_context or default_max_context(loaded, task, args.max_new_tokens)
    result = evaluate(loaded, lambda: common.new_policy(args), rows, task, max_context, args.max_new_tokens,
                      args.keep_newline_char, common.Progress(len(rows)), args.compile, args.protocol)
    print(f"{task.name}: {task.metric} {result['score']:.2f} over {len(rows)} rows "
          f"(max context {max_context}, policy {result['describe']})")
    if args.json:
        common.write_json(args.json, {**common.report_header(args), "data": str(path), **result})
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.main_wrapper(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
