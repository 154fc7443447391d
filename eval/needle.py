"""Needle in a haystack: a fact hidden at a chosen depth of long text, then asked about.

    python -m eval.needle --policy streaming --policy-args budget=256 --lengths 1000,2000,4000

For each (length, depth) cell the prompt is the chat-formatted request "text + question" (the
field's convention; `--question-position both` asks before the text too) of exactly `length` tokens: the haystack (Paul Graham's essays, or any folder of .txt with
--haystack; repeated if too short) is cut to fit, and the needle goes at the sentence boundary
nearest to `depth` (0 = start, 1 = end) of the haystack part.  The model answers greedily;
a cell is a hit when the answer contains ALL of --answer-keywords (case-insensitive), so
"a sandwich" alone does not count for the default needle: it must name Dolores Park too.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import re  # noqa: E402
from dataclasses import dataclass  # noqa: E402
import time  # noqa: E402
from typing import Callable, Optional, Sequence  # noqa: E402

import engine  # noqa: E402
from eval import common, measure, prompts  # noqa: E402
from eval.common import UsageError  # noqa: E402

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
KEYWORDS = "sandwich,Dolores"
INSTRUCTION = "Read the following text and answer the question after it."
SENTINEL = prompts.SENTINEL
TEMPLATES = {   # --question-position: where the question stands around the haystack
    "after": "{instruction}\n\n{haystack}\n\nQuestion: {question}",
    "both": "{instruction} Question: {question}\n\n{haystack}\n\nQuestion: {question}",
}
SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s*$")


@dataclass
class Haystack:
    """The haystack tokenized once; `ends[i]` is True when token i ends a sentence."""
    ids: list[int]
    ends: list[bool]

    @classmethod
    def from_text(cls, tokenizer, text: str, min_tokens: int = 0) -> "Haystack":
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise UsageError("the haystack is empty")
        if len(ids) < min_tokens:  # too short: repeat it, as the original needle test does
            ids = tokenizer.encode("\n\n".join([text] * (min_tokens // len(ids) + 1)), add_special_tokens=False)
        ending = {i for i in set(ids) if SENTENCE_END.search(tokenizer.decode([i]))}
        return cls(ids, [i in ending for i in ids])


@dataclass
class Prompt:
    ids: list[int]          # exactly `length` tokens
    needle_start: int       # index in ids of the needle's first token
    cut: int                # haystack tokens before the needle
    n_haystack: int         # haystack tokens in the prompt
    question_start: int     # index in ids of the first token after the haystack (the question, template end)

    @property
    def depth(self) -> float:
        """The needle's actual depth in the haystack part, 0..1."""
        return self.cut / self.n_haystack


def build_prompt(tokenizer, haystack: Haystack, needle: str, question: str, length: int, depth: float,
                 content: Optional[str] = None, chat: bool = True, question_position: str = "after") -> Prompt:
    """The chat-formatted prompt of exactly `length` tokens with the needle at about `depth`.

    The ids are assembled from separately tokenized pieces (template prefix, haystack tokens
    before the needle, the needle, the rest of the haystack, template suffix), so the count is
    exact by construction (re-tokenizing the decoded prompt could merge a token or two at the
    seams).  The needle follows the haystack token that ends the sentence nearest to
    depth * n_haystack, or opens the haystack if its start is nearer; the haystack's end is cut
    at whatever token makes the length exact.  `content` replaces the user message: a format
    string with `{question}` and `{haystack}` (where the haystack goes), else TEMPLATES[question_position]
    ("after": the question follows the text, the convention; "both": before and after it, where
    SmolLM2-135M finds more needles at 3000 tokens but a SnapKV-style observation window splits its
    attention between the two copies); `chat=False` leaves out the chat template."""
    content = content or TEMPLATES[question_position]
    content = content.format(instruction=INSTRUCTION, question=question, haystack=SENTINEL)
    prefix, suffix = prompts.wrap(tokenizer, content, chat)
    needle = needle.strip()
    within = tokenizer.encode(" " + needle, add_special_tokens=False)   # after a sentence: " The best..."
    n = length - len(prefix) - len(suffix) - len(within)
    if n < 1:
        raise UsageError(f"length {length} is too short: the template, question and needle alone take "
                         f"{length - n} tokens")
    if n > len(haystack.ids):
        raise ValueError(f"haystack has {len(haystack.ids)} tokens, {n} needed")  # from_text(min_tokens=) avoids this
    target = depth * n
    candidates = [0] + [i + 1 for i in range(n) if haystack.ends[i]]     # the start, or after a sentence
    cut = min(candidates, key=lambda i: (abs(i - target), i))
    needle_ids = within if cut else tokenizer.encode(needle + " ", add_special_tokens=False)
    n = length - len(prefix) - len(suffix) - len(needle_ids)           # the same n, or one less/more at cut 0
    ids = prefix + haystack.ids[:cut] + needle_ids + haystack.ids[cut:n] + suffix
    return Prompt(ids, len(prefix) + cut, cut, n, len(ids) - len(suffix))


def check_protocol(protocol: str, question_position: str) -> None:
    if protocol == "agnostic" and question_position != "after":
        raise UsageError("--protocol agnostic compresses the text without the question: it needs "
                         "--question-position after")


def is_hit(answer: str, keywords: Sequence[str]) -> bool:
    """All keywords present, case-insensitive."""
    return all(k.lower() in answer.lower() for k in keywords)


def run_cell(loaded: common.Loaded, policy, ids: list[int], max_new_tokens: int, compile: bool = False) -> str:
    """Greedy answer to one prompt with `policy` active."""
    result = engine.generate(loaded.model, loaded.tokenizer, [ids], max_new_tokens, policy=policy, compile=compile)
    return result.texts[0].strip()


def evaluate(loaded: common.Loaded, new_policy: Callable, text: str, lengths: Sequence[int], depths: Sequence[float],
             needle: str = NEEDLE, question: str = QUESTION, keywords: Sequence[str] = tuple(KEYWORDS.split(",")),
             max_new_tokens: int = 32, progress: Optional[common.Progress] = None, compile: bool = False,
             question_position: str = "after", protocol: str = "aware") -> dict:
    """Every (length, depth) cell with a fresh policy under `protocol` (measure.answer; agnostic: the
    instruction and haystack are the context, the question after it is appended) -> {score (accuracy %),
    results, usage, and the last policy's describe() and kv_bytes()}."""
    check_protocol(protocol, question_position)
    for n in lengths:
        common.check_fits(loaded, n + max_new_tokens, f"length {n} + --max-new-tokens {max_new_tokens}")
    haystack = Haystack.from_text(loaded.tokenizer, text, min_tokens=max(lengths))
    results, usage = [], measure.Usage()
    for n in lengths:
        for d in depths:
            prompt = build_prompt(loaded.tokenizer, haystack, needle, question, n, d,
                                  question_position=question_position)
            t0 = time.perf_counter()
            answer, policy = measure.answer(loaded, new_policy, prompt.ids, prompt.question_start, max_new_tokens,
                                            protocol, usage, compile)
            seconds = time.perf_counter() - t0
            hit = is_hit(answer, keywords)
            if progress:
                progress.finish(f"length {n} depth {d:g}", f"{'hit ' if hit else 'miss'} {answer[:60]!r}")
            results.append({"length": n, "depth": d, "protocol": protocol, "hit": hit, "answer": answer,
                            "prompt_tokens": len(prompt.ids), "needle_token": prompt.needle_start,
                            "needle_depth": round(prompt.depth, 4), "seconds": round(seconds, 3),
                            "kv_bytes": policy.kv_bytes()})
    return {"score": 100 * sum(r["hit"] for r in results) / len(results), "metric": "accuracy", "results": results,
            "usage": usage.as_dict(), "describe": policy.describe(), "kv_bytes": policy.kv_bytes()}


def build_parser():
    p = common.base_parser(__doc__)
    p.add_argument("--haystack", default=str(common.ESSAYS), help="folder of .txt files (default: %(default)s)")
    p.add_argument("--needle", default=NEEDLE)
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--answer-keywords", default=KEYWORDS,
                   help="comma-separated; a hit needs all of them in the answer, case-insensitive")
    p.add_argument("--lengths", default="1000,2000,4000", help="prompt lengths in tokens, chat template included")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths in the haystack, 0..1")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--question-position", choices=sorted(TEMPLATES), default="after",
                   help="the question after the text (the convention, default) or both before and after it")
    common.add_protocol_flag(p)
    return p


def format_table(results: list[dict], lengths: list[int], depths: list[float]) -> str:
    cell = {(r["length"], r["depth"]): "hit" if r["hit"] else "miss" for r in results}
    rows = [["length \\ depth"] + [f"{d:g}" for d in depths]]
    rows += [[str(n)] + [cell[n, d] for d in depths] for n in lengths]
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def run(args) -> int:
    lengths, depths = common.parse_ints(args.lengths, "--lengths"), common.parse_floats(args.depths, "--depths")
    keywords = [k.strip() for k in args.answer_keywords.split(",") if k.strip()]
    if not keywords:
        raise UsageError("--answer-keywords is empty")
    if any(not 0 <= d <= 1 for d in depths):
        raise UsageError(f"--depths must lie in [0, 1], got {args.depths}")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if not args.needle.strip() or not args.question.strip():
        raise UsageError("--needle and --question must not be empty")
    check_protocol(args.protocol, args.question_position)
    if args.protocol == "agnostic" and args.compile:
        raise UsageError("--compile is not supported with --protocol agnostic")
    common.new_policy(args)
    text = common.read_text_folder(args.haystack)
    loaded = common.load(args)
    r = evaluate(loaded, lambda: common.new_policy(args), text, lengths, depths, args.needle, args.question, keywords,
                 args.max_new_tokens, common.Progress(len(lengths) * len(depths)), args.compile, args.question_position,
                 args.protocol)
    results = r["results"]
    accuracy = sum(x["hit"] for x in results) / len(results)
    print(format_table(results, lengths, depths))
    print(f"accuracy {accuracy:.3f} ({sum(x['hit'] for x in results)}/{len(results)}), policy {r['describe']}")
    if args.json:
        common.write_json(args.json, {**common.report_header(args), "accuracy": accuracy,
                                      "needle": args.needle, "question": args.question, "answer_keywords": keywords,
                                      "max_new_tokens": args.max_new_tokens, "question_position": args.question_position,
                                      "results": results,
                                      "describe": r["describe"], "kv_bytes": r["kv_bytes"]})
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.main_wrapper(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
