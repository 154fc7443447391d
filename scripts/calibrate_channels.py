"""Rank each layer's and KV head's key channels by their share of the attention logits (Double
Sparsity's offline calibration) and write `heavy_channels.json` next to the checkpoint.

    python scripts/calibrate_channels.py --checkpoint checkpoints/SmolLM2-135M-Instruct

Statistic: for every calibration token, layer, KV head h and channel d, |q_d * k_d| with q the
post-RoPE query of each query head of h's group and k the post-RoPE key of the same token; averaged
over tokens and group members (DS's "every token attends to itself" method).  Calibration text: the
Paul Graham essays in ../shared/data/paul_graham_essays (or --data DIR of .txt files), cut into
--block-token blocks, --tokens in total, each block a fresh sequence.

Output: `<checkpoint dir>/heavy_channels.json`, or `<name>.heavy_channels.json` beside a .gguf file
(cache.sparse_read.channels_path), holding the full ranking [layer][kv head][channel ids, best first]
and the mean importances.  ds and hshare load it by default (policy argument channels=auto) and
otherwise rank channels on the prompt itself; their describe() says which source was used.
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
from cache.sparse_read import channel_importance, channels_path, rank_channels, write_channels_file  # noqa: E402
from model import DenseCache  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "paul_graham_essays"


class ChannelStats(DenseCache):
    """The full cache, plus the per-layer sum of |q_d k_d| over every prefilled token."""

    name = "channel-stats"

    def setup(self, args, max_batch_size, max_seq_length, dtype, device) -> None:
        super().setup(args, max_batch_size, max_seq_length, dtype, device)
        self.total = torch.zeros(args.n_layers, args.n_kv_heads, args.head_dim, dtype=torch.float64)
        self.terms = 0
        self.group = args.n_heads // args.n_kv_heads

    def begin(self, input_pos):
        super().begin(input_pos)
        self.q_pos = input_pos
        self.terms += int((input_pos >= 0).sum()) * self.group

    def prefill(self, layer, q, k, v):
        self.total[layer] += channel_importance(q, k, self.q_pos).double().cpu()
        return super().prefill(layer, q, k, v)


def calibration_blocks(tokenizer, data: Path, tokens: int, block: int) -> list[list[int]]:
    files = sorted(data.glob("*.txt"))
    if not files:
        raise SystemExit(f"error: no .txt files in {data}")
    ids: list[int] = []
    for f in files:
        ids += tokenizer.encode(f.read_text())
        if len(ids) >= tokens:
            break
    ids = ids[:tokens]
    blocks = [ids[i:i + block] for i in range(0, len(ids) - block + 1, block)]
    if not blocks:
        raise SystemExit(f"error: {data} holds fewer than --block {block} tokens")
    return blocks


def calibrate(model, blocks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ranking [L, H_kv, D] long, mean importance [L, H_kv, D])."""
    stats = ChannelStats()
    model.setup_caches(1, len(blocks[0]), stats)
    device = model.output.weight.device
    with torch.inference_mode():
        for i, b in enumerate(blocks):
            stats.reset()
            tokens = torch.tensor([b], device=device)
            model(tokens, torch.arange(len(b), device=device), last_only=True)
            print(f"\r  block {i + 1}/{len(blocks)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    mean = (stats.total / max(stats.terms, 1)).float()
    return rank_channels(mean), mean


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="HF/converted model directory or .gguf file")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory of .txt calibration files")
    p.add_argument("--tokens", type=int, default=16384, help="calibration tokens in total")
    p.add_argument("--block", type=int, default=512, help="tokens per calibration sequence")
    p.add_argument("--out", type=Path, help="output JSON (default: next to the checkpoint)")
    p.add_argument("--device", help="cpu or cuda")
    a = p.parse_args(argv)
    if a.block < 2 or a.tokens < a.block:
        raise SystemExit("error: need --block >= 2 and --tokens >= --block")
    t0 = time.perf_counter()
    model, tokenizer = engine.load_model(a.checkpoint, a.device)
    blocks = calibration_blocks(tokenizer, a.data, a.tokens, a.block)
    print(f"calibrating on {len(blocks)} blocks of {a.block} tokens from {a.data}", file=sys.stderr)
    ranking, mean = calibrate(model, blocks)
    out = a.out or channels_path(a.checkpoint)
    meta = {"checkpoint": str(a.checkpoint), "data": str(a.data), "tokens": len(blocks) * a.block,
            "block": a.block}
    write_channels_file(out, ranking, mean, meta)
    D = mean.shape[-1]
    for c in (D // 8, D // 4):
        share = (mean.sort(-1, descending=True).values[..., :c].sum(-1) / mean.sum(-1)).mean()
        print(f"top {c}/{D} channels hold {100 * float(share):.1f}% of mean |q*k| (average over layers and heads)")
    print(f"wrote {out} ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
