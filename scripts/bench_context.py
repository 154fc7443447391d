"""Compress once, ask many: wall time of one prefill_context + N questions against N separate requests.

    OMP_NUM_THREADS=1 python scripts/bench_context.py --policies 'full;snapkv:budget=256' --questions 8

For each policy: (once) the context compressed once, then every question answered from a copy of its rows;
(agnostic x N) each question with a context compressed for it alone, the answers compared with once's;
(aware x N) each question as one prompt, context + question, compressed together (the usual request).
The context is the first --context-tokens of the essays inside the chat template's user turn; greedy
answers of at most --max-new-tokens.  Prints one markdown row per policy.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402
from cache import make_policy  # noqa: E402
from eval import common  # noqa: E402
from runtime.context import encode_question, prefill_context  # noqa: E402

QUESTIONS = ["What is the text about?", "Who is the author of the text?", "What does the author say about startups?",
             "Name one company mentioned in the text.", "What advice does the text give?",
             "Summarize the first paragraph in one sentence.", "What is the tone of the text?",
             "Which programming language is mentioned in the text?"]


def timed(f):
    t0 = time.perf_counter()
    out = f()
    return out, time.perf_counter() - t0


def bench(model, tok, text: str, spec: str, questions: list[str], new_tokens: int) -> dict:
    new_policy = lambda: make_policy(spec)   # noqa: E731
    room = max(len(tok.encode(q)) for q in questions) + 16 + new_tokens
    prefill = lambda: prefill_context(model, tok, text, new_policy, room, chat=True)   # noqa: E731
    once, t_once = timed(lambda: engine.generate(model, tok, questions, new_tokens, context=prefill()))
    alone, t_alone = timed(lambda: [engine.generate(model, tok, [q], new_tokens, context=prefill()).tokens[0]
                                    for q in questions])
    ctx = prefill()
    joined = [ctx.ids + encode_question(tok, q, ctx) for q in questions]
    aware, t_aware = timed(lambda: [engine.generate(model, tok, [ids], new_tokens, policy=new_policy()).tokens[0]
                                    for ids in joined])
    return {"policy": spec, "context_tokens": len(ctx.ids), "once_s": t_once, "agnostic_s": t_alone,
            "aware_s": t_aware, "equal_to_agnostic": once.tokens == alone,
            "equal_to_aware": sum(a == b for a, b in zip(once.tokens, aware)),
            "context_prefill_s": once.stats["context_prefill_seconds"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(common.DEFAULT_CHECKPOINT))
    p.add_argument("--policies", default="full;snapkv:budget=256")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--context-tokens", type=int, default=3000)
    p.add_argument("--max-new-tokens", type=int, default=32)
    o = p.parse_args(argv)
    model, tok = engine.load_model(o.checkpoint)
    ids = tok.encode(common.read_text_folder(common.ESSAYS), add_special_tokens=False)[:o.context_tokens]
    text = "Read the text and answer the question after it.\n\n" + tok.decode(ids) + "\n\n"
    questions = [f"Question: {q}" for q in (QUESTIONS * o.questions)[:o.questions]]
    engine.generate(model, tok, ["warm up"], 4)
    print("| policy | context tokens | compress once + N questions (s) | N separate agnostic (s) | ratio | "
          "N separate aware (s) | ratio | answers = separate agnostic | = aware |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in filter(str.strip, o.policies.split(";")):
        r = bench(model, tok, text, spec.strip(), questions, o.max_new_tokens)
        print(f"| `{r['policy']}` | {r['context_tokens']} | {r['once_s']:.1f} (prefill {r['context_prefill_s']:.1f}) | "
              f"{r['agnostic_s']:.1f} | {r['once_s'] / r['agnostic_s']:.2f} | {r['aware_s']:.1f} | "
              f"{r['once_s'] / r['aware_s']:.2f} | {'yes' if r['equal_to_agnostic'] else 'NO'} | "
              f"{r['equal_to_aware']}/{len(questions)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
