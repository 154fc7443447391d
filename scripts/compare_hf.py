"""Decode speed of this engine next to HuggingFace transformers, side by side in one process.

    OMP_WAIT_POLICY=ACTIVE python scripts/compare_hf.py --checkpoint checkpoints/SmolLM2-135M-Instruct

Batch 1, greedy, the same prompt tokens (essay text) for every side.  Rows:
  hf eager          transformers LlamaForCausalLM (DynamicCache, default SDPA attention)
  engine eager      decode_step, dense static cache sized to the prompt + steps
  engine compiled   the same step under torch.compile (Inductor on CPU)
  engine 512/1024 vs 512/8192   eager decode at a 512-token context with --max-seq-length
                    1024 and 8192: the cost must follow the live length, not the allocation
The bandwidth bound is (bytes of weights + live KV read per step) / measured read bandwidth.
OMP_WAIT_POLICY is whatever the environment says (printed); both sides share it.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import atomic_io  # noqa: E402
import engine  # noqa: E402
from runtime.steps import compiled_steps, decode_step, prefill_step  # noqa: E402

ESSAYS = ROOT / "data" / "paul_graham_essays"


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> dict:
    """Streaming read rate: median of `repeats` full reads of a `gib` GiB float32 tensor, by two
    methods (aten sum, and an Inductor-compiled row reduction, the kernel shape of a GEMV).
    The median, not the best: on a shared VM single reads occasionally report 1.7x the rest."""
    x = torch.rand(int(gib * (1 << 30)) // 4)
    rows = x.view(-1, 1024)
    reduce_rows = torch.compile(lambda t: t.sum(-1))
    out = {}
    for name, fn in (("aten_sum", lambda: x.sum()), ("compiled_row_sum", lambda: reduce_rows(rows))):
        fn()
        out[name] = x.numel() * 4 / statistics.median(timed(fn) for _ in range(repeats)) / 1e9
    del x, rows
    return out


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = "\n\n".join(p.read_text() for p in sorted(ESSAYS.glob("*.txt")))
    ids = tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"essays give only {len(ids)} tokens, need {n}")
    return ids[:n]


def engine_decode_tps(model, ids, steps, max_seq_length, compiled=False, warmup=3) -> float:
    """Decode tokens/s of decode_step after a prefill of `ids` (batch 1)."""
    decode = compiled_steps(torch.device("cpu"))[1] if compiled else decode_step
    with torch.inference_mode():
        model.setup_caches(1, max_seq_length)
        tokens, n = torch.tensor([ids]), len(ids)
        for s in range(0, n, 1024):
            logits = prefill_step(model, tokens[:, s:s + 1024], torch.arange(s, min(s + 1024, n))[None], s)
        tok = logits.argmax(-1, keepdim=True)
        times = []
        for i in range(warmup + steps):
            t = time.perf_counter()
            logits = decode(model, tok, torch.tensor([[n + i]]), model.cache.n_filled)
            tok = logits.argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t)
    return 1.0 / statistics.median(times[warmup:])


def hf_decode_tps(hf, ids, steps, warmup=3) -> float:
    with torch.inference_mode():
        out = hf(torch.tensor([ids]), use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for i in range(warmup + steps):
            t = time.perf_counter()
            out = hf(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t)
    return 1.0 / statistics.median(times[warmup:])


def load_hf(checkpoint: Path):
    from transformers import LlamaForCausalLM
    if checkpoint.is_dir():
        return LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return LlamaForCausalLM.from_pretrained(checkpoint.parent, gguf_file=checkpoint.name, dtype=torch.float32).eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "SmolLM2-135M-Instruct")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per row and round")
    p.add_argument("--rounds", type=int, default=3, help="rows run interleaved this many times; medians reported")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)

    model, tokenizer = engine.load_model(a.checkpoint, "cpu", "float32")
    hf = load_hf(a.checkpoint)
    ids = prompt_ids(tokenizer, a.context)
    args = model.args
    weight_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in model.parameters()}.values())
    kv_bytes = 2 * args.n_layers * args.n_kv_heads * args.head_dim * 4 * a.context
    capacity = a.context + a.steps + 8  # prompt + warm-up + timed steps
    measure = {
        "hf eager": lambda: hf_decode_tps(hf, ids, a.steps),
        "engine eager": lambda: engine_decode_tps(model, ids, a.steps, capacity),
        "engine compiled": lambda: engine_decode_tps(model, ids, a.steps, capacity, compiled=True),
        "engine eager ctx512 max_seq 1024": lambda: engine_decode_tps(model, ids[:512], a.steps, 1024),
        "engine eager ctx512 max_seq 8192": lambda: engine_decode_tps(model, ids[:512], a.steps, 8192),
    }
    if a.skip_compile:
        del measure["engine compiled"]
    samples = {name: [] for name in measure}
    bandwidths = []
    for r in range(a.rounds):  # interleaved, so drift on a shared machine hits every row alike
        bandwidths.append(read_bandwidth_gbs())
        for name, fn in measure.items():
            samples[name].append(fn())
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items()), file=sys.stderr)
    rows = {name: statistics.median(v) for name, v in samples.items()}
    bw = {k: statistics.median(b[k] for b in bandwidths) for k in bandwidths[0]}
    best_bw = max(bw.values())
    bound = best_bw * 1e9 / (weight_bytes + kv_bytes)

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, float32, batch 1, context {a.context}")
    print("read bandwidth: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bw.items()) +
          f"; bytes/step {(weight_bytes + kv_bytes) / 1e6:.0f} MB (weights {weight_bytes / 1e6:.0f} + KV {kv_bytes / 1e6:.0f})"
          f" -> bound {bound:.1f} tok/s at {best_bw:.1f} GB/s")
    print(f"{'row':36s} {'tok/s':>8s} {'vs hf':>7s} {'of bound':>9s}")
    for name, tps in rows.items():
        print(f"{name:36s} {tps:8.2f} {tps / rows['hf eager']:6.2f}x {tps / bound:8.0%}")
    r = rows["engine eager ctx512 max_seq 8192"] / rows["engine eager ctx512 max_seq 1024"]
    print(f"max_seq 8192 / 1024 decode speed at ctx 512: {r:.2f}")
    if a.json:
        atomic_io.write_text(a.json, json.dumps({"rows": rows, "bandwidth_gbs": bw, "bound_tok_s": bound,
                                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
