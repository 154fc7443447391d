"""POD's offline layer grouping (paper sec. 2.1, Algorithm 1): which consecutive layers may share
the attention scores of distant tokens, per KV head.  Writes `pod_calibration.json` next to the
checkpoint (the pod policy reads it with blocks=auto and regroups it with its own delta).

    python scripts/calibrate_pod.py --checkpoint checkpoints/SmolLM2-135M-Instruct

pod (blocks=auto) makes this file itself the first time it runs on a checkpoint, with the defaults
below; this script re-makes it with other settings and prints the groupings.  Calibration text:
data/calibration/ (or --data DIR of .txt files), concatenated in sorted order and cut into
--samples sequences of --length tokens.  Each sequence goes through the model with the full cache;
for the last --queries tokens, every layer and query head's causal attention row (post-RoPE, fp32
softmax) is kept.

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
from cache.calibration import CALIBRATION_TEXT, key_saving, pod_path, write_pod  # noqa: E402
from checkpoint import CheckpointError  # noqa: E402
from runtime.steps import UsageError  # noqa: E402


def print_groupings(data: dict, max_context: int, context: int) -> None:
    sim = torch.tensor(data["similarity"])
    H, L = sim.shape[0], sim.shape[1]
    n_sink = 16
    proximal = n_sink + max(1, max_context // 8 - n_sink)
    adjacent = [float(sim[h, i + 1, i]) for h in range(H) for i in range(L - 1)]
    print(f"{L} layers x {H} KV heads; neighbouring-layer similarity mean {sum(adjacent) / len(adjacent):.3f} "
          f"(min {min(adjacent):.3f}, max {max(adjacent):.3f})")
    print(f"{'delta':>6}  {'blocks per KV head':>20}  {'saving (limit)':>14}  {f'saving at {context}':>16}")
    for delta, g in data["groupings"].items():
        at = key_saving(g["blocks"], L, context, proximal)
        print(f"{delta:>6}  {str(g['blocks_per_head']):>20}  {100 * g['theoretical_kv_saving']:13.1f}%  {100 * at:15.1f}%")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="HF/converted model directory or .gguf file")
    p.add_argument("--data", type=Path, default=CALIBRATION_TEXT, help="directory of .txt calibration files")
    p.add_argument("--samples", type=int, default=8, help="calibration sequences N")
    p.add_argument("--length", type=int, default=2048, help="tokens per sequence n")
    p.add_argument("--queries", type=int, default=16, help="last tokens q whose attention rows are compared")
    p.add_argument("--deltas", default="0.3,0.5,0.7", help="thresholds to group with and report")
    p.add_argument("--context", type=int, default=2304, help="context (slots) for the saving at a finite length")
    p.add_argument("--out", type=Path, help="output JSON (default: next to the checkpoint)")
    p.add_argument("--device", help="cpu or cuda")
    a = p.parse_args(argv)
    try:
        deltas = [float(x) for x in a.deltas.split(",") if x.strip()]
        if a.samples < 1 or a.length < 2 or not 1 <= a.queries <= a.length:
            raise ValueError("need --samples >= 1, --length >= 2 and 1 <= --queries <= --length")
        t0 = time.perf_counter()
        model, tokenizer = engine.load_model(a.checkpoint, a.device)
        if a.length > model.args.max_position_embeddings:
            raise ValueError(f"--length {a.length} exceeds the model's context {model.args.max_position_embeddings}")
        out = a.out or pod_path(a.checkpoint)
        data = write_pod(model, tokenizer, out, a.data, a.samples, a.length, a.queries, deltas)
    except (UsageError, CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_groupings(data, model.args.max_position_embeddings, a.context)
    print(f"wrote {out} ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
