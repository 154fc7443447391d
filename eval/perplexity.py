"""Decode-time perplexity: the policy is active while the continuation is teacher-forced.

    python -m eval.perplexity --policy streaming --policy-args budget=512 --context-length 2048

Each window of the text (default: Paul Graham's essays concatenated in sorted file order;
--text FILE for any file) is `--context-length` tokens of prompt, prefilled with the policy
active (so a compressing policy compresses it), then `--eval-tokens` tokens fed ONE DECODE
STEP AT A TIME, so decode-time eviction acts as it would during generation.  The NLL of the
first eval token comes from the prefill's last logits, that of eval token t+1 from decode step
t's.  `--samples N` averages over N consecutive non-overlapping windows from the start of the
text.  The text is tokenized without special tokens; a checkpoint that adds BOS gets it at the
start of every window (counted in the context length).
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import math  # noqa: E402
import time  # noqa: E402
from typing import Callable, Optional, Sequence  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from eval import common, measure  # noqa: E402
from eval.common import UsageError  # noqa: E402
from runtime.steps import decode_step, prefill_step  # noqa: E402


def window_nll(model, tokens: torch.Tensor, context_length: int, policy=None,
               prefill=prefill_step, decode=decode_step, usage=None) -> torch.Tensor:
    """Per-token NLL [E] (float32) of tokens[context_length:] (tokens: LongTensor [W], E = W - C).

    Prefill tokens[:C] with `policy` (`full` if None), then decode tokens[C:W-1] one step
    at a time; no host sync inside the loop (see `measure.forced_logits`)."""
    logits = measure.forced_logits(model, tokens, context_length, policy, prefill, decode, usage)
    return F.cross_entropy(logits, tokens[context_length:].to(logits.device), reduction="none")


def text_windows(tokenizer, text: str, window: int, samples: int) -> list[tuple[int, list[int]]]:
    """`samples` consecutive windows of `window` tokens -> [(start token in the text, ids)]."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None else []
    step = window - len(bos)
    if samples * step > len(ids):
        raise UsageError(f"the text has {len(ids)} tokens; {samples} sample(s) of {window} tokens need "
                         f"{samples * step}")
    return [(s * step, bos + ids[s * step:(s + 1) * step]) for s in range(samples)]


def evaluate(loaded: common.Loaded, new_policy: Callable, windows: list[tuple[int, list[int]]], context_length: int,
             progress: Optional[common.Progress] = None) -> dict:
    """Every window with a fresh policy -> {score (perplexity), mean_nll, results, usage, and the
    last policy's describe() and kv_bytes()}."""
    results, nlls, usage = [], [], measure.Usage()
    for i, (start, ids) in enumerate(windows):
        policy = new_policy()
        t0 = time.perf_counter()
        nll = window_nll(loaded.model, torch.tensor(ids), context_length, policy, loaded.prefill, loaded.decode, usage)
        seconds = time.perf_counter() - t0
        nlls.append(nll)
        mean = nll.double().mean().item()
        if progress:
            progress.finish(f"sample {i} (text tokens {start}..{start + len(ids)})",
                            f"nll {mean:.4f} ppl {math.exp(mean):.3f}")
        results.append({"sample": i, "start": start, "nll": mean, "perplexity": math.exp(mean),
                        "seconds": round(seconds, 3), "kv_bytes": policy.kv_bytes()})
    mean_nll = torch.cat(nlls).double().mean().item()
    return {"score": math.exp(mean_nll), "metric": "perplexity", "mean_nll": mean_nll, "results": results,
            "usage": usage.as_dict(), "describe": policy.describe(), "kv_bytes": policy.kv_bytes()}


def build_parser():
    p = common.base_parser(__doc__)
    p.add_argument("--text", help=f"text file (default: the .txt files of {common.ESSAYS}, sorted, concatenated)")
    p.add_argument("--context-length", type=int, default=2048, help="prompt tokens prefilled (default: %(default)s)")
    p.add_argument("--eval-tokens", type=int, default=256, help="tokens teacher-forced by decode steps "
                                                                "(default: %(default)s)")
    p.add_argument("--samples", type=int, default=1, help="non-overlapping windows averaged (default: %(default)s)")
    return p


def run(args) -> int:
    if args.context_length < 1 or args.eval_tokens < 1 or args.samples < 1:
        raise UsageError("--context-length, --eval-tokens and --samples must be at least 1")
    common.new_policy(args)
    text = common.read_text_file(args.text) if args.text else common.read_text_folder(common.ESSAYS)
    loaded = common.load(args)
    window = args.context_length + args.eval_tokens
    common.check_fits(loaded, window, f"--context-length {args.context_length} + --eval-tokens {args.eval_tokens}")
    windows = text_windows(loaded.tokenizer, text, window, args.samples)

    r = evaluate(loaded, lambda: common.new_policy(args), windows, args.context_length, common.Progress(len(windows)))
    results, mean_nll = r["results"], r["mean_nll"]
    print(f"{'sample':>6}  {'nll':>8}  {'ppl':>9}")
    for x in results:
        print(f"{x['sample']:>6}  {x['nll']:8.4f}  {x['perplexity']:9.3f}")
    print(f"{'mean':>6}  {mean_nll:8.4f}  {math.exp(mean_nll):9.3f}   ({args.samples} x {args.context_length} context"
          f" + {args.eval_tokens} decode tokens), policy {r['describe']}")
    if args.json:
        common.write_json(args.json, {**common.report_header(args), "text": args.text or str(common.ESSAYS),
                                      "context_length": args.context_length, "eval_tokens": args.eval_tokens,
                                      "samples": args.samples, "mean_nll": mean_nll,
                                      "perplexity": math.exp(mean_nll), "results": results,
                                      "describe": r["describe"], "kv_bytes": r["kv_bytes"]})
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.main_wrapper(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
