"""HShare's Figure 1 analysis on any checkpoint: how much the critical tokens of one attention
overlap those of another layer, of another head of the same layer, and of the next query.

    python -m eval.similarity --checkpoint C --length 2048 --queries 16 --decode-steps 16 --out DIR

A text of `--length` tokens (the essays by default) is prefilled with the full cache, then
`--decode-steps` tokens are generated greedily.  For the last `--queries` prompt queries
("prefill") and every generated token's query ("decode"), per layer and query head, the critical
tokens are the `--n-critical` keys with the highest exact attention logits (causal; with
`--middle-only` the first `--n-sink` and the last `--n-recent` positions are left out, as HShare
compares them).  Similarity of two sets is the paper's eq. 3, |A n B| / max(|A|, |B|):
    layer  [L, L]      layers i, j: same query head, same query, averaged over heads and queries
    head   [L, H, H]   heads g, h of one layer: same query, averaged over queries (and its mean [H, H])
    adjacent [L, H]    query t and t + 1 of the same phase, same layer and head, averaged over t
Writes DIR/similarity.json and, with matplotlib, DIR/similarity.png (the heatmaps).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import argparse  # noqa: E402
import math  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

import atomic_io  # noqa: E402
import engine  # noqa: E402
from eval import common  # noqa: E402
from eval.common import UsageError  # noqa: E402
from cache.full import FullCache  # noqa: E402
from runtime.steps import run_decode, run_prefill  # noqa: E402


class QueryRecorder(FullCache):
    """The full cache, remembering the queries the analysis needs: the last `tail` prompt queries
    and every decode query, per layer ([B, H_q, n, D] lists) with their positions."""

    name = "query-recorder"
    prefill_in_one_pass = True     # the prompt's last queries come from one forward
    fused_dense_decode = False     # every decode step goes through decode() below

    def __init__(self, tail: int):
        self.tail = tail

    def reset(self) -> None:
        super().reset()
        self.queries: dict = {"prefill": {}, "decode": {}}
        self.positions: dict = {"prefill": None, "decode": []}

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.queries["prefill"][layer] = q[:, :, -self.tail:].clone()
        if layer == 0:
            self.positions["prefill"] = self.pos[:, self.start:self.n_filled][:, -self.tail:].clone()
        return super().prefill(layer, q, k, v)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.queries["decode"].setdefault(layer, []).append(q.clone())
        if layer == 0:
            self.positions["decode"].append(self.pos[:, self.start:self.n_filled].clone())
        return super().decode(layer, q, k, v)

    def phase(self, name: str) -> tuple[list[Tensor], Tensor]:
        """(queries per layer [B, H_q, n, D], positions [B, n]) of a phase."""
        q, pos = self.queries[name], self.positions[name]
        if name == "decode":
            return [torch.cat(q[i], dim=2) for i in range(len(q))], torch.cat(pos, dim=1)
        return [q[i] for i in range(len(q))], pos


def critical_sets(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, n_critical: int,
                  exclude_first: int = 0, exclude_last: int = 0) -> Tensor:
    """Membership [H_q, n, S] (bool) of the n_critical keys with the highest logits per query head
    and query: q [H_q, n, D] at q_pos [n], k [H_kv, S, D] at k_pos [S] (causal; optionally without
    the first `exclude_first` positions and the last `exclude_last` before each query)."""
    Hq, Hkv = q.shape[0], k.shape[0]
    logits = (q.float().reshape(Hkv, Hq // Hkv * q.shape[1], -1) @ k.float().transpose(-1, -2)).view(Hq, q.shape[1], -1)
    qp, kp = q_pos[:, None], k_pos[None, :]
    allowed = (kp >= 0) & (kp <= qp) & (kp >= exclude_first) & (kp <= qp - exclude_last)
    logits = logits.masked_fill(~allowed, -math.inf)
    n = min(n_critical, int(allowed.sum(-1).min()))
    if n < 1:
        raise UsageError("no key is eligible as a critical token: lengthen the text or lower --n-sink/--n-recent")
    members = torch.zeros_like(logits, dtype=torch.bool)
    return members.scatter_(-1, logits.topk(n, dim=-1).indices, True)


def overlap(a: Tensor, b: Tensor) -> Tensor:
    """Eq. 3 elementwise over the leading dims: |A n B| / max(|A|, |B|) of membership rows [..., S]."""
    return (a & b).sum(-1) / torch.maximum(a.sum(-1), b.sum(-1)).clamp(min=1)


def similarity_matrices(sets: Tensor) -> dict:
    """sets [L, H, n, S] membership -> {"layer" [L, L], "head" [L, H, H], "head_mean" [H, H],
    "adjacent" [L, H]} (adjacent: queries t and t + 1, needs n >= 2)."""
    L, H, n, S = sets.shape
    f = sets.float()
    sizes = f.sum(-1)                                                         # [L, H, n]
    inter = torch.einsum("ahqs,bhqs->abhq", f, f)
    layer = (inter / torch.maximum(sizes[:, None], sizes[None]).clamp(min=1)).mean((2, 3))
    inter = torch.einsum("lgqs,lhqs->lghq", f, f)
    head = (inter / torch.maximum(sizes[:, :, None], sizes[:, None]).clamp(min=1)).mean(-1)
    adjacent = overlap(sets[:, :, 1:], sets[:, :, :-1]).mean(-1) if n > 1 else torch.full((L, H), math.nan)
    return {"layer": layer, "head": head, "head_mean": head.mean(0), "adjacent": adjacent}


def summary(m: dict) -> dict:
    """The figure's headline numbers: neighbouring layers, distinct head pairs, adjacent queries."""
    L, H = m["layer"].shape[0], m["head_mean"].shape[0]
    neighbours = torch.diagonal(m["layer"], offset=-1) if L > 1 else torch.tensor([math.nan])
    off = ~torch.eye(H, dtype=torch.bool)
    return {"adjacent_layers": round(float(neighbours.mean()), 4),
            "all_layer_pairs": round(float(m["layer"][~torch.eye(L, dtype=torch.bool)].mean()), 4) if L > 1 else None,
            "head_pairs": round(float(m["head"][:, off].mean()), 4) if H > 1 else None,
            "adjacent_queries": round(float(m["adjacent"].mean()), 4)}


def analyse(recorder: QueryRecorder, n_critical: int, exclude_first: int, exclude_last: int) -> dict:
    """Similarity matrices and summary per phase (batch row 0)."""
    out = {}
    for phase in ("prefill", "decode"):
        if not recorder.queries[phase]:
            continue
        queries, q_pos = recorder.phase(phase)
        n = recorder.n_filled
        k_pos = recorder.pos[0, :n]
        sets = torch.stack([critical_sets(q[0], recorder.k[layer][0, :, :n], q_pos[0], k_pos, n_critical,
                                          exclude_first, exclude_last) for layer, q in enumerate(queries)])
        m = similarity_matrices(sets)
        out[phase] = {"summary": summary(m), **{key: value.tolist() for key, value in m.items()}}
    return out


def plot(result: dict, path: Path) -> Optional[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no heatmaps (pip install -e '.[bench]')", file=sys.stderr)
        return None
    phases = [p for p in ("prefill", "decode") if p in result]
    panels = [("layer", "layer x layer"), ("head_mean", "head x head (mean over layers)"),
              ("adjacent", "adjacent queries (layer x head)")]
    fig, axes = plt.subplots(len(phases), 3, figsize=(15, 4.6 * len(phases)), squeeze=False)
    for row, phase in enumerate(phases):
        for col, (key, title) in enumerate(panels):
            ax = axes[row][col]
            image = ax.imshow(result[phase][key], vmin=0, vmax=1, cmap="viridis", aspect="auto")
            ax.set_title(f"{phase}: {title}")
            fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle("critical-token similarity |A n B| / max(|A|, |B|)")
    fig.tight_layout()
    with atomic_io.atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return path


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(common.DEFAULT_CHECKPOINT), help="(default: %(default)s)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=list(engine.DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--text", help="text file (default: the essays)")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens (default: %(default)s)")
    p.add_argument("--queries", type=int, default=16, help="last prompt queries analysed (default: %(default)s)")
    p.add_argument("--decode-steps", type=int, default=16, help="generated tokens analysed (default: %(default)s)")
    p.add_argument("--n-critical", type=int, default=128, help="critical tokens per query (default: %(default)s)")
    p.add_argument("--middle-only", action="store_true", help="leave the first --n-sink and last --n-recent out")
    p.add_argument("--n-sink", type=int, default=16)
    p.add_argument("--n-recent", type=int, default=64)
    p.add_argument("--out", required=True, help="output folder (similarity.json, similarity.png)")
    return p


def run(args) -> int:
    if args.length < 2 or args.queries < 1 or args.decode_steps < 0 or args.n_critical < 1:
        raise UsageError("need --length >= 2, --queries >= 1, --decode-steps >= 0, --n-critical >= 1")
    if args.queries > args.length:
        raise UsageError(f"--queries {args.queries} exceeds --length {args.length}")
    device = engine.resolve_device(args.device)
    model, tokenizer = engine.load_model(args.checkpoint, device, args.dtype)
    common.check_fits(common.Loaded(model, tokenizer, device), args.length + args.decode_steps,
                      "--length + --decode-steps")
    text = common.read_text_file(args.text) if args.text else common.read_text_folder(common.ESSAYS)
    ids = tokenizer.encode(text)[:args.length]
    if len(ids) < args.length:
        raise UsageError(f"the text has only {len(ids)} tokens, fewer than --length {args.length}")
    recorder = QueryRecorder(args.queries)
    model.setup_caches(1, args.length + args.decode_steps + 1, recorder)
    tokens = torch.tensor([ids], device=device)
    pos = torch.arange(args.length, device=device)[None]
    with torch.inference_mode():
        logits = run_prefill(model, tokens, pos)
        for step in range(args.decode_steps):
            token = logits.argmax(-1, keepdim=True)
            logits = run_decode(model, token, pos[:, -1:] + 1 + step, step)
    exclude = (args.n_sink, args.n_recent) if args.middle_only else (0, 0)
    result = {"checkpoint": str(args.checkpoint), "length": args.length, "queries": args.queries,
              "decode_steps": args.decode_steps, "n_critical": args.n_critical, "middle_only": args.middle_only,
              "metric": "|A n B| / max(|A|, |B|) of the top-n_critical keys by exact attention logits",
              **analyse(recorder, args.n_critical, *exclude)}
    out = Path(args.out)
    common.write_json(out / "similarity.json", result)
    picture = plot(result, out / "similarity.png")
    for phase in ("prefill", "decode"):
        if phase in result:
            print(f"{phase:8s} " + "  ".join(f"{k} {v}" for k, v in result[phase]["summary"].items()))
    print(f"wrote {out / 'similarity.json'}" + (f" and {picture}" if picture else ""))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.main_wrapper(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
