"""Passkey retrieval: a random number hidden at a chosen depth of generated filler, then asked for.

    python -m eval.passkey --policy snapkv --lengths 1000,2000,4000 --depths 0,0.25,0.5,0.75,1 --samples 2

The filler is the classic passkey task's ("The grass is green. The sky is blue. ..."), repeated;
the passkey line ("The pass key is 48213. Remember it. 48213 is the pass key.") goes at the
sentence boundary nearest to `depth` (0 = start, 1 = end) of the filler, and the prompt (chat
template included; --no-chat for base models) is exactly `length` tokens, built like the needle
eval's.  Keys are random 5-digit numbers from --seed, one per (length, depth, sample).  A cell
is a hit when the greedy answer contains the key.

--write-ruler FILE writes the same prompts as RULER-format jsonl (`input` = the prompt text,
`outputs` = [key]) for `eval.ruler` or any RULER-format harness, without running a model.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import json  # noqa: E402
import random  # noqa: E402
from typing import Callable, Optional, Sequence  # noqa: E402

import atomic_io  # noqa: E402
from eval import common, measure, needle  # noqa: E402
from eval.common import UsageError  # noqa: E402

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
CONTENT = "{intro}\n\n{haystack}\n\n{question}"


def keys(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [str(rng.randint(10000, 99999)) for _ in range(n)]


def grid(lengths: Sequence[int], depths: Sequence[float], samples: int, seed: int) -> list[tuple[int, float, int, str]]:
    """[(length, depth, sample, key)] in run order."""
    cells = [(n, d, s) for n in lengths for d in depths for s in range(samples)]
    return [(n, d, s, k) for (n, d, s), k in zip(cells, keys(len(cells), seed))]


def filler(tokenizer, length: int) -> needle.Haystack:
    return needle.Haystack.from_text(tokenizer, " ".join([FILLER] * 4), min_tokens=length)


def build_prompt(tokenizer, haystack: needle.Haystack, key: str, length: int, depth: float,
                 chat: bool = True) -> needle.Prompt:
    content = CONTENT.replace("{intro}", INTRO)
    return needle.build_prompt(tokenizer, haystack, KEY_LINE.format(key=key), QUESTION, length, depth,
                               content=content, chat=chat)


def evaluate(loaded: common.Loaded, new_policy: Callable, lengths: Sequence[int], depths: Sequence[float],
             samples: int = 1, seed: int = 0, max_new_tokens: int = 16, chat: bool = True,
             progress: Optional[common.Progress] = None, compile: bool = False, protocol: str = "aware") -> dict:
    """Every (length, depth, sample) with a fresh policy under `protocol` (measure.answer; agnostic: the
    intro and filler are the context, the question after it is appended) -> {score (accuracy %), results,
    usage}."""
    for n in lengths:
        common.check_fits(loaded, n + max_new_tokens, f"length {n} + --max-new-tokens {max_new_tokens}")
    haystack = filler(loaded.tokenizer, max(lengths))
    usage, results = measure.Usage(), []
    for n, d, s, key in grid(lengths, depths, samples, seed):
        prompt = build_prompt(loaded.tokenizer, haystack, key, n, d, chat)
        answer, policy = measure.answer(loaded, new_policy, prompt.ids, prompt.question_start, max_new_tokens,
                                        protocol, usage, compile)
        hit = key in answer
        results.append({"length": n, "depth": d, "sample": s, "protocol": protocol, "key": key, "hit": hit,
                        "answer": answer,
                        "key_token": prompt.needle_start, "key_depth": round(prompt.depth, 4)})
        if progress:
            progress.finish(f"length {n} depth {d:g} sample {s}", f"{'hit ' if hit else 'miss'} {answer[:40]!r}")
    accuracy = 100 * sum(r["hit"] for r in results) / len(results)
    return {"score": accuracy, "metric": "accuracy", "results": results, "usage": usage.as_dict(),
            "describe": policy.describe()}


def format_table(results: list[dict], lengths: Sequence[int], depths: Sequence[float]) -> str:
    """hits/samples per (length, depth)."""
    def cell(n, d):
        rs = [r for r in results if r["length"] == n and r["depth"] == d]
        return f"{sum(r['hit'] for r in rs)}/{len(rs)}"
    rows = [["length \\ depth"] + [f"{d:g}" for d in depths]] + [[str(n)] + [cell(n, d) for d in depths]
                                                                  for n in lengths]
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def write_ruler(path, tokenizer, lengths, depths, samples, seed, chat) -> int:
    haystack = filler(tokenizer, max(lengths))
    with atomic_io.atomic_file(path, "w", encoding="utf-8") as f:
        for i, (n, d, s, key) in enumerate(grid(lengths, depths, samples, seed)):
            prompt = build_prompt(tokenizer, haystack, key, n, d, chat)
            f.write(json.dumps({"index": i, "input": tokenizer.decode(prompt.ids), "outputs": [key], "length": n,
                                "depth": d, "task": "passkey"}) + "\n")
    return i + 1


def build_parser():
    p = common.base_parser(__doc__)
    p.add_argument("--lengths", default="1000,2000,4000", help="prompt lengths in tokens, template included")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="key depths in the filler, 0..1")
    p.add_argument("--samples", type=int, default=1, help="keys per (length, depth) (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--no-chat", dest="chat", action="store_false", help="plain prompt, no chat template")
    p.add_argument("--write-ruler", metavar="FILE", help="write the prompts as RULER-format jsonl and exit")
    common.add_protocol_flag(p)
    return p


def run(args) -> int:
    lengths, depths = common.parse_ints(args.lengths, "--lengths"), common.parse_floats(args.depths, "--depths")
    if any(not 0 <= d <= 1 for d in depths):
        raise UsageError(f"--depths must lie in [0, 1], got {args.depths}")
    if args.samples < 1 or args.max_new_tokens < 1:
        raise UsageError("--samples and --max-new-tokens must be at least 1")
    common.new_policy(args)
    loaded = common.load(args)
    if args.write_ruler:
        n = write_ruler(args.write_ruler, loaded.tokenizer, lengths, depths, args.samples, args.seed, args.chat)
        print(f"wrote {n} RULER-format rows to {args.write_ruler}")
        return 0
    progress = common.Progress(len(lengths) * len(depths) * args.samples)
    result = evaluate(loaded, lambda: common.new_policy(args), lengths, depths, args.samples, args.seed,
                      args.max_new_tokens, args.chat, progress, args.compile, args.protocol)
    print(format_table(result["results"], lengths, depths))
    print(f"accuracy {result['score']:.1f}% ({sum(r['hit'] for r in result['results'])}/{len(result['results'])}), "
          f"policy {result['describe']}")
    if args.json:
        common.write_json(args.json, {**common.report_header(args), **result})
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.main_wrapper(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
