"""RULER-format tasks: jsonl rows holding the whole prompt, scored by string matching like RULER.

    python -m eval.ruler --data niah_single_1.jsonl --policy snapkv --policy-args budget=512
    python -m eval.passkey --lengths 2000 --write-ruler passkey.jsonl && python -m eval.ruler --data passkey.jsonl

Rows are JSON objects with `input` (the full prompt text, template included: it is tokenized as
is, with the tokenizer's BOS if it adds one) and `outputs` (the list of expected strings);
optional `answer_prefix` is appended to the input when the input does not already end with it,
and optional `max_new_tokens` overrides --max-new-tokens for that row.  Optional `context` and
`question` (both, with input == context + question, as eval/ruler_synth.py writes them) split the
input where the question starts: such a row is tokenized as those two pieces (the context with the
tokenizer's BOS, the question + answer prefix without) in either --protocol, and only such rows run
under --protocol agnostic (the context compressed alone, the question appended whole).  No truncation: a prompt
longer than the model's context is an error.  The greedy prediction is cleaned like RULER does
(control characters become newlines, then stripped) and scored with
  string_match_all   share of `outputs` found in the prediction (case-insensitive): RULER's
                     metric for every task but QA
  string_match_part  1 if any of `outputs` is found: RULER's QA metric
(--metric auto picks part for a task whose name starts with "qa", from the rows' `task` field or
the file name, and all otherwise).  The task score is the mean x 100.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

from typing import Callable, Optional, Sequence  # noqa: E402

from eval import common, measure, metrics  # noqa: E402
from eval.common import UsageError  # noqa: E402
from eval.longbench import read_jsonl  # noqa: E402

MATCH = {"all": metrics.string_match_all, "part": metrics.string_match_part}


def read_rows(path, limit: Optional[int] = None) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"RULER data {path} does not exist")
    rows = read_jsonl(path, limit, ("input", "outputs"))
    for n, row in enumerate(rows, 1):
        outs = row["outputs"]
        if not isinstance(outs, list) or not outs or not all(isinstance(o, (str, int)) for o in outs):
            raise UsageError(f"{path} row {n}: `outputs` must be a non-empty list of strings")
        if not str(row["input"]).strip():
            raise UsageError(f"{path} row {n}: `input` is empty")
        split = ("context" in row, "question" in row)
        if any(split) and (not all(split) or row["input"] != str(row["context"]) + str(row["question"])):
            raise UsageError(f"{path} row {n}: `context` + `question` must both be given and equal `input`")
    return rows


def task_name(path, rows: list[dict]) -> str:
    return str(rows[0].get("task") or Path(path).stem)


def pick_metric(metric: str, task: str) -> str:
    if metric == "auto":
        return "part" if task.lower().startswith("qa") else "all"
    return metric


def prompt_text(row: dict) -> str:
    text, prefix = str(row["input"]), str(row.get("answer_prefix") or "")
    return text if not prefix or text.endswith(prefix) else text + prefix


def row_ids(tokenizer, row: dict, protocol: str = "aware") -> tuple[list[int], int]:
    """(prompt ids, index where the question starts: len(ids) for a row without context/question)."""
    if "context" in row:
        context = tokenizer.encode(str(row["context"]))
        question = str(row["question"]) + str(row.get("answer_prefix") or "")
        return context + tokenizer.encode(question, add_special_tokens=False), len(context)
    if protocol == "agnostic":
        raise UsageError("--protocol agnostic needs rows with `context` and `question` (eval/ruler_synth.py "
                         "writes them)")
    ids = tokenizer.encode(prompt_text(row))
    return ids, len(ids)


def evaluate(loaded: common.Loaded, new_policy: Callable, rows: list[dict], metric: str = "all",
             max_new_tokens: int = 128, task: str = "ruler", progress: Optional[common.Progress] = None,
             compile: bool = False, protocol: str = "aware") -> dict:
    """Every row with a fresh policy under `protocol` (measure.answer) -> {score (0-100), results, usage}."""
    match = MATCH[metric]
    prepared = []
    for n, row in enumerate(rows):
        ids, split = row_ids(loaded.tokenizer, row, protocol)
        new = int(row.get("max_new_tokens") or max_new_tokens)
        common.check_fits(loaded, len(ids) + new, f"row {n}: {len(ids)} prompt tokens + {new} generated tokens")
        prepared.append((ids, split, new))
    usage, results = measure.Usage(), []
    for n, (row, (ids, split, new)) in enumerate(zip(rows, prepared)):
        answer, policy = measure.answer(loaded, new_policy, ids, split, new, protocol, usage, compile)
        prediction = metrics.ruler_postprocess(answer)
        outputs = [str(o) for o in row["outputs"]]
        value = match(prediction, outputs)
        results.append({"row": n, "index": row.get("index", n), "protocol": protocol, "score": value,
                        "prompt_tokens": len(ids),
                        "outputs": outputs, "prediction": prediction})
        if progress:
            progress.finish(f"{task} row {n}", f"{value:.2f}  {prediction[:50]!r}")
    mean = 100 * sum(r["score"] for r in results) / len(results)
    return {"task": task, "metric": f"string_match_{metric}", "score": mean, "results": results,
            "usage": usage.as_dict(), "describe": policy.describe()}


def build_parser():
    p = common.base_parser(__doc__)
    p.add_argument("--data", required=True, help="RULER-format .jsonl")
    p.add_argument("--limit", type=int, help="first N rows only")
    p.add_argument("--metric", choices=["auto", "all", "part"], default="auto")
    p.add_argument("--max-new-tokens", type=int, default=128, help="unless a row sets it (default: %(default)s)")
    common.add_protocol_flag(p)
    return p


def run(args) -> int:
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be at least 1")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    common.new_policy(args)
    rows = read_rows(args.data, args.limit)
    task = task_name(args.data, rows)
    metric = pick_metric(args.metric, task)
    loaded = common.load(args)
    result = evaluate(loaded, lambda: common.new_policy(args), rows, metric, args.max_new_tokens, task,
                      common.Progress(len(rows)), args.compile, args.protocol)
    print(f"{task}: {result['metric']} {result['score']:.2f} over {len(rows)} rows, policy {result['describe']}")
    if args.json:
        common.write_json(args.json, {**common.report_header(args), "data": str(args.data), **result})
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.main_wrapper(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
