"""Compiled against eager decode in one process over one cache: the closest A/B of `--compile`.  Separate
runs (scripts/benchmark.py --compile both) each prefill a cache of their own and differ by the machine's
drift between them; here both steps continue the same cache, block after block.

    OMP_WAIT_POLICY=ACTIVE python scripts/compile_ab.py --checkpoint checkpoints/SmolLM2-135M-Instruct \\
        --kv-bits 4 --batch-size 8 --context-length 4096 --rounds 8 --steps 24

A random prompt of --context-length tokens per row is prefilled once (eager).  The compiled decode step
(compiled_steps) is compiled on the first 4 steps; then each round runs --steps greedy decode steps
with the eager step (decode_step) and --steps with the compiled one, their order swapped every
round.  Prints the compile time, each round's step times and compiled / eager speed, and the median,
min and max of that ratio.  --kv-bits 32 or 16 (the compute dtype's storage), 4 or 2 (KIVI; 16 with
--kv-dtype for other dtypes is scripts/benchmark.py's).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402
from cache import make_policy  # noqa: E402
from cache.kv_dtype import kv_storage  # noqa: E402
from runtime.steps import compiled_steps, decode_step, run_decode, run_prefill  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--policy", default="full", help="one policy spec (cache/spec.py), default full")
    p.add_argument("--kv-bits", type=int, default=32, choices=(32, 16, 4, 2))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=24, help="decode steps per block")
    a = p.parse_args(argv)
    for name in ("batch_size", "context_length", "rounds", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not a.checkpoint.exists():
        p.error(f"--checkpoint {a.checkpoint}: not found")
    try:
        kv_storage(make_policy(a.policy), a.kv_bits, 32, 128, None, torch.float32)
    except ValueError as e:                     # an unknown policy or argument, or storage it does not take
        p.error(f"--policy {a.policy!r} --kv-bits {a.kv_bits}: {e}")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    model = engine.load_model(a.checkpoint, "cpu", "float32")[0]
    B, T = a.batch_size, a.context_length
    need = T + 8 + 2 * a.rounds * a.steps
    if need > model.args.max_position_embeddings:
        print(f"error: {T} prompt tokens + {need - T} decode steps exceed the model's context "
              f"({model.args.max_position_embeddings})", file=sys.stderr)
        return 2
    policy = kv_storage(make_policy(a.policy), a.kv_bits, 32, 128, None, torch.float32)
    tokens = torch.randint(100, model.args.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    _, compiled = compiled_steps(torch.device("cpu"))
    print(f"{a.policy} kv{a.kv_bits}, B {B}, {T} tokens, {torch.get_num_threads()} threads", flush=True)
    with torch.inference_mode():
        model.setup_caches(B, need, policy)
        logits = run_prefill(model, tokens, torch.arange(T).repeat(B, 1))
        token, pos, i = logits.argmax(-1, keepdim=True), torch.full((B, 1), T), 0

        def block(step, n):
            nonlocal token, pos, i
            t0 = time.perf_counter()
            for _ in range(n):
                token = run_decode(model, token, pos, i, step).argmax(-1, keepdim=True)
                pos, i = pos + 1, i + 1
            return (time.perf_counter() - t0) / n * 1e3

        print(f"compile + 4 steps: {block(compiled, 4) * 4 / 1e3:.1f} s", flush=True)
        block(decode_step, 4)
        ratios = []
        for r in range(a.rounds):
            order = ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")
            ms = {name: block(decode_step if name == "eager" else compiled, a.steps) for name in order}
            ratios.append(ms["eager"] / ms["compiled"])
            print(f"round {r}: eager {ms['eager']:.2f} ms/step, compiled {ms['compiled']:.2f} ms/step, "
                  f"compiled / eager speed {ratios[-1]:.3f}x", flush=True)
    print(f"compiled / eager speed: median {statistics.median(ratios):.3f}x, min {min(ratios):.3f}x, "
          f"max {max(ratios):.3f}x ({a.rounds} rounds of {a.steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
