"""Rank each layer's and KV head's key channels by their share of the attention logits (Double
Sparsity's offline calibration) and write `heavy_channels.json` next to the checkpoint.

    python scripts/calibrate_channels.py --checkpoint checkpoints/SmolLM2-135M-Instruct

ds and hshare (channels=auto) make this file themselves the first time they run on a checkpoint,
with the defaults below; this script re-makes it with other settings.  Statistic: for every
calibration token, layer, KV head h and channel d, |q_d * k_d| with q the post-RoPE query of each
query head of h's group and k the post-RoPE key of the same token, averaged over tokens and group
members (DS's "every token attends to itself" method).  Calibration text: data/calibration/ (or
--data DIR of .txt files), cut into --block-token blocks, --tokens in total, each block a fresh
sequence.  Output: `<checkpoint dir>/heavy_channels.json`, or `<name>.heavy_channels.json` beside a
.gguf file, holding the full ranking [layer][kv head][channel ids, best first] and the importances.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402
from cache.calibration import CALIBRATION_TEXT, channels_path, read_channels_file, write_channels  # noqa: E402
from checkpoint import CheckpointError  # noqa: E402
from runtime.steps import UsageError  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="HF/converted model directory or .gguf file")
    p.add_argument("--data", type=Path, default=CALIBRATION_TEXT, help="directory of .txt calibration files")
    p.add_argument("--tokens", type=int, default=16384, help="calibration tokens in total")
    p.add_argument("--block", type=int, default=512, help="tokens per calibration sequence")
    p.add_argument("--out", type=Path, help="output JSON (default: next to the checkpoint)")
    p.add_argument("--device", help="cpu or cuda")
    a = p.parse_args(argv)
    if a.block < 2 or a.tokens < a.block:
        print("error: need --block >= 2 and --tokens >= --block", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        model, tokenizer = engine.load_model(a.checkpoint, a.device)
        out = write_channels(model, tokenizer, a.out or channels_path(a.checkpoint), a.data, a.tokens, a.block)
    except (UsageError, CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mean = json.loads(out.read_text())["importance"]
    read_channels_file(out, model.args)     # checks what was written
    D = len(mean[0][0])
    for c in (D // 8, D // 4):
        shares = [sum(sorted(h, reverse=True)[:c]) / sum(h) for layer in mean for h in layer]
        print(f"top {c}/{D} channels hold {100 * sum(shares) / len(shares):.1f}% of mean |q*k| "
              f"(average over layers and heads)")
    print(f"wrote {out} ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
