"""POD's offline layer grouping (paper sec. 2.1, Algorithm 1): which consecutive layers may share
the attention scores of distant tokens, per KV head.  Writes `pod_calibration.json` next to the
checkpoint (the pod policy reads it with blocks=auto and regroups it with its own delta).

    python scripts/calibrate_pod.py --checkpoint checkpoints/SmolLM2-135M-Instruct

Calibration text: the Paul Graham essays in ../shared/data/paul_graham_essays (or --data DIR of
.txt files), concatenated in sorted order and cut into --samples sequences of --length tokens.
Each sequence goes through the model with the full cache; for the last --queries tokens, every
layer and query head's causal attention row (post-RoPE, fp32 softmax) is kept.

Similarity of layers a and b for query head j: the mean over those rows and the samples of
1 - JSD(row_a, row_b), the Jensen-Shannon divergence with log base 2, which lies in [0, 1], so the
similarity is 1 for identical rows and 0 for rows with disjoint support (the paper's eq. 2 writes
the mean JS divergence; the grouping threshold "similar when sim >= delta" needs 1 = identical).
Keys are stored per KV head (GQA), so the grouping is per KV head: the similarity of a KV head is
the mean over its query heads.  Grouping (Algorithm 1): per KV head, layer l joins the current
block when its similarity to every layer already in it is >= delta, else it starts a new block.

Output JSON: format, model shape, data, the similarities [kv head][layer][layer], and for each
--deltas value the blocks per KV head, their count and the theoretical KV saving in the long-context
limit, (L H - #blocks) / (2 L H): non-first layers of a block drop the keys of distant tokens (half of
their K+V).  The table printed also gives the saving at --context tokens with the proximal
tokens (n_sink + n_recent) of the policy's defaults.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import engine  # noqa: E402
from cache.pod import attention_rows, calibration_path, key_saving, similarity_sums, write_calibration  # noqa: E402
from model import DenseCache  # noqa: E402
from scripts.calibrate_channels import calibration_blocks  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "paul_graham_essays"


class RowRecorder(DenseCache):
    """The full cache, keeping each layer's attention rows of the last `queries` tokens."""

    name = "pod-rows"

    def __init__(self, queries: int):
        self.queries = queries

    def reset(self) -> None:
        super().reset()
        self.rows: dict = {}

    def begin(self, input_pos):
        super().begin(input_pos)
        self.q_pos = input_pos

    def prefill(self, layer, q, k, v):
        self.rows[layer] = attention_rows(q, k, self.q_pos, self.queries, self.sliding_window)
        return super().prefill(layer, q, k, v)


def calibrate(model, samples: list[list[int]], queries: int) -> torch.Tensor:
    """Mean similarity [H_kv, L, L] over the samples (see the module docstring)."""
    recorder = RowRecorder(queries)
    model.setup_caches(1, len(samples[0]), recorder)
    device = model.output.weight.device
    total, count = 0, 0
    with torch.inference_mode():
        for i, ids in enumerate(samples):
            recorder.reset()
            n = len(ids)
            pos = torch.arange(n, device=device)
            model(torch.tensor([ids], device=device), pos, last_only=True)
            valid = torch.ones(1, min(queries, n), dtype=torch.bool)
            valid = torch.nn.functional.pad(valid, (queries - valid.shape[1], 0))
            sums, c = similarity_sums([recorder.rows[layer].cpu() for layer in range(len(recorder.rows))], valid)
            total, count = total + sums, count + c
            print(f"\r  sample {i + 1}/{len(samples)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return (total / count).float()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="HF/converted model directory or .gguf file")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory of .txt calibration files")
    p.add_argument("--samples", type=int, default=8, help="calibration sequences N")
    p.add_argument("--length", type=int, default=2048, help="tokens per sequence n")
    p.add_argument("--queries", type=int, default=16, help="last tokens q whose attention rows are compared")
    p.add_argument("--deltas", default="0.3,0.5,0.7", help="thresholds to group with and report")
    p.add_argument("--context", type=int, default=2304, help="context (slots) for the saving at a finite length")
    p.add_argument("--out", type=Path, help="output JSON (default: next to the checkpoint)")
    p.add_argument("--device", help="cpu or cuda")
    a = p.parse_args(argv)
    if a.samples < 1 or a.length < 2 or not 1 <= a.queries <= a.length:
        raise SystemExit("error: need --samples >= 1, --length >= 2 and 1 <= --queries <= --length")
    try:
        deltas = [float(x) for x in a.deltas.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --deltas {a.deltas!r}: expected comma-separated numbers") from None
    t0 = time.perf_counter()
    model, tokenizer = engine.load_model(a.checkpoint, a.device)
    if a.length > model.args.max_position_embeddings:
        raise SystemExit(f"error: --length {a.length} exceeds the model's context {model.args.max_position_embeddings}")
    samples = calibration_blocks(tokenizer, a.data, a.samples * a.length, a.length)
    print(f"calibrating on {len(samples)} samples of {a.length} tokens from {a.data}, last {a.queries} rows",
          file=sys.stderr)
    sim = calibrate(model, samples, a.queries)
    out = a.out or calibration_path(a.checkpoint)
    meta = {"checkpoint": str(a.checkpoint), "data": str(a.data), "samples": len(samples), "length": a.length,
            "queries": a.queries}
    data = write_calibration(out, sim, meta, deltas)
    L, H = sim.shape[1], sim.shape[0]
    n_sink = 16
    proximal = n_sink + max(1, model.args.max_position_embeddings // 8 - n_sink)
    adjacent = [float(sim[h, i + 1, i]) for h in range(H) for i in range(L - 1)]
    print(f"{L} layers x {H} KV heads; neighbouring-layer similarity mean {sum(adjacent) / len(adjacent):.3f} "
          f"(min {min(adjacent):.3f}, max {max(adjacent):.3f})")
    print(f"{'delta':>6}  {'blocks per KV head':>20}  {'saving (limit)':>14}  {f'saving at {a.context}':>16}")
    for delta in deltas:
        g = data["groupings"][str(delta)]
        at = key_saving(g["blocks"], L, a.context, proximal)
        print(f"{delta:>6}  {str(g['blocks_per_head']):>20}  {100 * g['theoretical_kv_saving']:13.1f}%  {100 * at:15.1f}%")
    print(f"wrote {out} ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
