"""float32 against bfloat16 on the CPU, side by side in one process: prefill, decode and rows sharing a document.

    python scripts/bench_dtype.py --checkpoint checkpoints/SmolLM2-135M-Instruct --dtypes float32,bfloat16

Per dtype (the HF directory loaded with engine.load_model(dtype=...), a `full` cache): prefill tok/s of one
prompt of each --prefill-lengths (run_prefill, chunks of 1024); decode tok/s at each --batch-sizes after a
--decode-context-token prompt (eager decode_step); and a one-doc run: --rows requests through a RowBatch that
share a --doc-tokens prefix (read in place, DenseCache.adopt(prefix=)), each its own --question-tokens, then
--new-tokens decode steps of all rows (tok/s of those steps, and the wall time of the whole run).  Token ids are
random (speed does not depend on them).  Every case runs --repeats times, the best time is kept; prints one
markdown table (and --json writes the numbers).  The dtype `bfloat16-torch` is bfloat16 with the C++ kernels
kept to fp32 (model.py's torch ops, SDPA and oneDNN for every bf16 step: the bf16 path before the kernels took
bf16), for an A/B in one process.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import engine  # noqa: E402
import kernels.cpu  # noqa: E402
import model as model_module  # noqa: E402
from cache import make_policy  # noqa: E402
from runtime.rows import RowBatch  # noqa: E402
from runtime.steps import decode_step, run_prefill  # noqa: E402


def best_of(repeats: int, f) -> float:
    """The least wall time of `repeats` calls of f()."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def ids(n: int, vocab: int, seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, n), generator=torch.Generator().manual_seed(seed))


def prefill_rate(model, n: int, repeats: int) -> float:
    """Prompt tokens per second of one n-token prompt."""
    tokens, pos = ids(n, model.args.vocab_size, 1), torch.arange(n)[None]
    model.setup_caches(1, n + 8, make_policy("full"))

    def run():
        model.reset_caches()
        run_prefill(model, tokens, pos)
    return n / best_of(repeats, run)


def decode_rate(model, batch: int, context: int, steps: int, repeats: int) -> float:
    """Tokens per second of `steps` eager decode steps at `batch` rows after a `context`-token prompt."""
    tokens, pos = ids(context, model.args.vocab_size, 2, batch), torch.arange(context)[None].expand(batch, -1)
    model.setup_caches(batch, context + steps + 8, make_policy("full"))
    token = torch.zeros(batch, 1, dtype=torch.long)

    def run():
        model.reset_caches()
        run_prefill(model, tokens, pos)
        t0 = time.perf_counter()
        for i in range(steps):
            decode_step(model, token, torch.full((batch, 1), context + i), context + i)
        return time.perf_counter() - t0
    return batch * steps / min(run() for _ in range(repeats))


def one_doc(model, rows: int, doc: int, question: int, new_tokens: int) -> tuple[float, float]:
    """`rows` requests sharing a `doc`-token prefix through a RowBatch (prefix read in place) -> (decode tok/s of
    the steps with every row active, wall seconds of the whole run: prefills and steps)."""
    vocab = model.args.vocab_size
    head = ids(doc, vocab, 3)[0].tolist()
    prompts = [head + ids(question, vocab, 10 + r)[0].tolist() for r in range(rows)]
    t0 = time.perf_counter()
    batch = RowBatch(model, lambda: make_policy("full"), rows, doc + question + new_tokens + 8, new_tokens,
                     prefix_bytes=1 << 34, min_prefix=16, share_prefix=True)
    for p in prompts:
        batch.start(p, prefix_len=doc)
    while batch.pending:
        batch.advance()
    shared = int((batch.policy.own_from > 0).sum())
    if shared < rows - 1:
        raise RuntimeError(f"only {shared} of {rows} rows read the prefix in place")
    t1 = time.perf_counter()
    for _ in range(new_tokens):
        batch.step({r: 0 for r in batch.active})
    t2 = time.perf_counter()
    return rows * new_tokens / (t2 - t1), t2 - t0


def kernel_dtypes(dtypes: tuple) -> None:
    """The dtypes the C++ decode attention, eager small ops (kernels.cpu) and model.Linear's small-M kernel take."""
    kernels.cpu.DENSE_DTYPES = model_module.SMALL_M_DTYPES = dtypes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="checkpoints/SmolLM2-135M-Instruct")
    p.add_argument("--dtypes", default="float32,bfloat16", help="float32, bfloat16, bfloat16-torch (see above)")
    p.add_argument("--prefill-lengths", default="1536,3072")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--decode-context", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=3072)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", help="write the numbers here")
    a = p.parse_args()
    results = {}
    with torch.inference_mode():
        for dtype in a.dtypes.split(","):
            torch_only = dtype.endswith("-torch")
            kernel_dtypes((torch.float32,) if torch_only else (torch.float32, torch.bfloat16))
            model, _ = engine.load_model(a.checkpoint, dtype=dtype.removesuffix("-torch"))
            r = results[dtype] = {}
            for n in map(int, a.prefill_lengths.split(",")):
                r[f"prefill {n} tok/s"] = prefill_rate(model, n, a.repeats)
            for b in map(int, a.batch_sizes.split(",")):
                r[f"decode B{b} tok/s"] = decode_rate(model, b, a.decode_context, a.decode_steps, a.repeats)
            if a.rows:
                rate, wall = one_doc(model, a.rows, a.doc_tokens, a.question_tokens, a.new_tokens)
                r[f"one-doc {a.rows}x{a.new_tokens} decode tok/s"], r["one-doc wall s"] = rate, wall
            print(dtype, {k: round(v, 2) for k, v in r.items()}, file=sys.stderr, flush=True)
    names = list(next(iter(results.values())))
    print("| case | " + " | ".join(results) + " |\n|---|" + "---:|" * len(results))
    for k in names:
        print(f"| {k} | " + " | ".join(f"{results[d][k]:.1f}" for d in results) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
