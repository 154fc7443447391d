"""Per-checkpoint side data that some policies calibrate offline, made on first use and cached.

Two calibrations exist, both run on the bundled calibration text `data/calibration/` (essays
disjoint from the evaluation text in `data/paul_graham_essays/`):

- heavy channels (Double Sparsity's offline step, used by ds and hshare): for every calibration
  token, layer, KV head h and channel d, |q_d * k_d| with q the post-RoPE query of each query head
  of h's group and k the post-RoPE key of the same token, averaged; channels ranked by it.
  File: `heavy_channels.json` next to the checkpoint (`channels_path`).
- POD's layer similarity (paper sec. 2.1): mean 1 - JSD (base 2) between the attention rows of
  every pair of layers for the last `queries` tokens of each sample, per KV head.
  File: `pod_calibration.json` next to the checkpoint (`pod_path`); POD's greedy grouping of
  consecutive layers into blocks (Algorithm 1, `group_heads`) regroups it for any threshold.

`ensure_channels` / `ensure_pod` return the file, calibrating first (one line on stderr) when it is
missing.  Policies call them from their `prepare` hook; `scripts/calibrate_channels.py` and
`scripts/calibrate_pod.py` run the same functions with other settings.

Tensor parallelism (tp.py): both statistics are per KV head, so every process computes its own
heads' part on its shard of the model, the parts are all-gathered into the whole model's, and rank 0
writes the file (the others wait); reading a file, each process takes its own heads (`Shard.own`).
Without a shared filesystem across machines, make the files first (the scripts above, one process).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

import atomic_io
from cache.scoring import attention_probs, last_rows
from cache.shard import SINGLE, Shard, shard_of
from cache.full import FullCache
from model import ModelArgs

CALIBRATION_TEXT = Path(__file__).resolve().parent.parent / "data" / "calibration"
CHANNELS_FILE = "heavy_channels.json"
CHANNELS_FORMAT = "heavy-channels/1"
POD_FILE = "pod_calibration.json"
POD_FORMAT = "pod-blocks/1"
SIMILARITY = ("1 - Jensen-Shannon divergence (log base 2) of attention rows of the same query head in two "
              "layers, averaged over the last q queries, the samples and the query heads of each KV head")


# --------------------------------------------------------------------------- heavy-channel files

def side_file(checkpoint, name: str) -> Path:
    """Where a checkpoint's calibration file `name` lives: `<dir>/<name>` for a checkpoint directory,
    `<file stem>.<name>` beside a .gguf file."""
    p = Path(checkpoint)
    return p.with_name(p.stem + "." + name) if p.suffix == ".gguf" else p / name


def channels_path(checkpoint) -> Path:
    """The heavy-channel calibration of a checkpoint: heavy_channels.json (`side_file`)."""
    return side_file(checkpoint, CHANNELS_FILE)


def channel_importance(q: Tensor, k: Tensor, q_pos: Tensor) -> Tensor:
    """Sum over the real tokens and the group's query heads of |q_d * k_d| (same token, post-RoPE):
    q [B, H_q, T, D], k [B, H_kv, T, D], q_pos [B, T] (negative = padding) -> [H_kv, D] fp32.
    (Divide by the number of (token, query head) terms for the mean; the ranking does not need it.)"""
    B, Hq, T, D = q.shape
    H = k.shape[1]
    prod = (q.float().view(B, H, Hq // H, T, D) * k.float()[:, :, None]).abs()
    return torch.einsum("bhgtd,bt->hd", prod, (q_pos >= 0).float())


def rank_channels(importance: Tensor) -> Tensor:
    """[..., D] importance -> channel ids [..., D], most important first (ties: lower id first)."""
    return torch.sort(importance, dim=-1, descending=True, stable=True).indices


def write_channels_file(path, ranking: Tensor, importance: Tensor, meta: dict) -> Path:
    """ranking, importance [L, H_kv, D] -> JSON (see scripts/calibrate_channels.py)."""
    path = Path(path)
    L, H, D = ranking.shape
    data = {"format": CHANNELS_FORMAT, "n_layers": L, "n_kv_heads": H, "head_dim": D,
            "metric": "mean |q_d * k_d| over calibration tokens and the query heads of each KV head "
                      "(post-RoPE, same token)",
            **meta, "channels": ranking.tolist(),
            "importance": [[[round(float(x), 6) for x in h] for h in layer] for layer in importance]}
    return atomic_io.write_json(path, data)


def read_channels_file(path, args: ModelArgs) -> Tensor:
    """Channel ranking [L, H_kv, D] (long) from a calibration file, checked against the model (under
    tensor parallelism: the whole model's, and the ranking of this process's KV heads is returned)."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != CHANNELS_FORMAT:
        raise ValueError(f"{path}: not a heavy-channel file (format {data.get('format')!r})")
    shape = (data.get("n_layers"), data.get("n_kv_heads"), data.get("head_dim"))
    shard = shard_of(args)
    model = (args.n_layers, shard.whole(args.n_kv_heads), args.head_dim)
    if shape != model:
        raise ValueError(f"{path} was calibrated for (layers, kv heads, head_dim) = {shape}, the model has "
                         f"{model}: re-run scripts/calibrate_channels.py")
    ranking = torch.tensor(data["channels"], dtype=torch.long)
    if ranking.shape != shape or not all((r.sort().values == torch.arange(shape[2])).all() for r in ranking.flatten(0, 1)):
        raise ValueError(f"{path}: every (layer, head) entry must rank all {shape[2]} channels")
    return shard.own(ranking, dim=1)


# --------------------------------------------------------------------------- POD's layer similarity and its files

def attention_rows(q: Tensor, k: Tensor, q_pos: Tensor, n_queries: int, sliding_window=None) -> Tensor:
    """Causal attention rows of the last `n_queries` queries: q [B, H_q, T, D], k [B, H_kv, T, D],
    q_pos [B, T] -> [B, H_kv, G, n_queries, T] fp32 (rows of padding queries are zero)."""
    q_last, pos_last = last_rows(q, q_pos, n_queries)
    return attention_probs(q_last, k, pos_last, q_pos, sliding_window)


def js_similarity(p: Tensor, q: Tensor) -> Tensor:
    """1 - JSD(p, q) with log base 2, in [0, 1] (1 = identical) for rows p, q [..., T] -> [...]."""
    m = 0.5 * (p + q)
    kl = lambda a: (torch.xlogy(a, a) - torch.xlogy(a, m)).sum(-1)      # noqa: E731
    return (1 - 0.5 * (kl(p) + kl(q)) / math.log(2)).clamp(0, 1)


def similarity_sums(rows: list[Tensor], valid: Tensor) -> tuple[Tensor, int]:
    """Per KV head, the sum over rows of the layer-pair similarity and the number of rows.

    rows[l] [B, H_kv, G, q, T] (attention_rows of layer l); valid [B, q] bool (real query rows).
    Returns (sums [H_kv, L, L] float64, symmetric, diagonal = count; count) so that several
    samples add up and sums / count is the paper's eq. 2 averaged over each KV head's query heads."""
    L = len(rows)
    B, H, G, n, T = rows[0].shape
    w = valid[:, None, None, :].expand(B, H, G, n).double()
    count = int(valid.sum()) * G
    sums = torch.zeros(H, L, L, dtype=torch.float64)
    for a in range(L):
        sums[:, a, a] = count
        for b in range(a):
            s = (js_similarity(rows[a], rows[b]).double() * w).sum((0, 2, 3))       # [H]
            sums[:, a, b] = sums[:, b, a] = s
    return sums, count


def greedy_blocks(sim, delta: float) -> list[list[int]]:
    """Algorithm 1 for one head: sim [L, L] -> consecutive blocks; layer l joins the current block
    when sim[l, j] >= delta for every layer j already in it, else it starts a new block."""
    sim = torch.as_tensor(sim, dtype=torch.float64)
    blocks = [[0]]
    for layer in range(1, sim.shape[0]):
        if all(float(sim[layer, j]) >= delta for j in blocks[-1]):
            blocks[-1].append(layer)
        else:
            blocks.append([layer])
    return blocks


def group_heads(sim: Tensor, delta: float) -> list[list[list[int]]]:
    """Algorithm 1 per KV head: sim [H_kv, L, L] -> blocks[h] (lists of consecutive layers)."""
    return [greedy_blocks(s, delta) for s in sim]


def key_saving(blocks: list[list[list[int]]], n_layers: int, capacity: Optional[int] = None,
               proximal: int = 0) -> float:
    """Fraction of K+V bytes saved against the full cache: (L H - #blocks) / (2 L H), times the
    distant share (capacity - proximal) / capacity when a capacity (slots per layer) is given."""
    H = len(blocks)
    n_blocks = sum(len(b) for b in blocks)
    share = 1.0 if capacity is None else max(0, capacity - proximal) / capacity
    return (n_layers * H - n_blocks) / (2 * n_layers * H) * share


def pod_path(checkpoint) -> Path:
    """POD's layer-similarity calibration of a checkpoint: pod_calibration.json (`side_file`)."""
    return side_file(checkpoint, POD_FILE)


def write_pod_file(path, sim: Tensor, meta: dict, deltas=(0.3, 0.5, 0.7)) -> dict:
    """Similarities [H_kv, L, L] + the blocks and savings for each delta -> JSON at `path`."""
    H, L, _ = sim.shape
    data = {"format": POD_FORMAT, "n_layers": L, "n_kv_heads": H, "similarity_metric": SIMILARITY,
            **meta, "similarity": [[[round(float(x), 6) for x in row] for row in s] for s in sim],
            "groupings": {}}
    for delta in deltas:
        blocks = group_heads(sim, delta)
        data["groupings"][str(delta)] = {
            "blocks": blocks, "blocks_per_head": [len(b) for b in blocks],
            "theoretical_kv_saving": round(key_saving(blocks, L), 6)}
    atomic_io.write_json(path, data)
    return data


def read_pod_file(path, args: ModelArgs, delta: float) -> tuple[list, Optional[Tensor]]:
    """(blocks per KV head, similarity [H_kv, L, L] or None) from a calibration file: regrouped
    with `delta` when the file holds similarities, else its `blocks` entry as written.  Checked
    against the whole model; under tensor parallelism the part of this process's KV heads."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read POD blocks file {path}: {e}") from None
    if data.get("format") != POD_FORMAT:
        raise ValueError(f"{path}: not a POD blocks file (format {data.get('format')!r})")
    shard = shard_of(args)
    shape, model = (data.get("n_layers"), data.get("n_kv_heads")), (args.n_layers, shard.whole(args.n_kv_heads))
    if shape != model:
        raise ValueError(f"{path} was calibrated for (layers, kv heads) = {shape}, the model has "
                         f"{model}: re-run scripts/calibrate_pod.py")
    if "similarity" in data:
        sim = shard.own(torch.tensor(data["similarity"], dtype=torch.float64))
        return group_heads(sim, delta), sim
    blocks = data.get("blocks")
    flat = [sum(b, []) for b in blocks or []]
    if len(flat) != model[1] or any(f != list(range(args.n_layers)) for f in flat):
        raise ValueError(f"{path}: 'blocks' must list, per KV head, consecutive blocks covering layers "
                         f"0..{args.n_layers - 1} in order")
    return shard.own(blocks), None


# --------------------------------------------------------------------------- running the model on calibration text


def calibration_blocks(tokenizer, data: Path, tokens: int, block: int) -> list[list[int]]:
    """The .txt files of `data` (sorted, concatenated) cut into blocks of `block` token ids, `tokens`
    in all (fewer if the text is shorter).  ValueError when the folder has no text or too little."""
    files = sorted(Path(data).glob("*.txt"))
    if not files:
        raise ValueError(f"no .txt files in {data}")
    ids: list[int] = []
    for f in files:
        ids += tokenizer.encode(f.read_text(encoding="utf-8"))
        if len(ids) >= tokens:
            break
    ids = ids[:tokens]
    blocks = [ids[i:i + block] for i in range(0, len(ids) - block + 1, block)]
    if not blocks:
        raise ValueError(f"{data} holds fewer than {block} tokens")
    return blocks


class ChannelStats(FullCache):
    """The full cache, plus the per-layer sum of |q_d k_d| over every prefilled token."""

    name = "channel-stats"

    def setup(self, args, max_batch_size, max_seq_length, dtype, device) -> None:
        super().setup(args, max_batch_size, max_seq_length, dtype, device)
        self.total = torch.zeros(args.n_layers, args.n_kv_heads, args.head_dim, dtype=torch.float64)
        self.terms = 0

    def begin(self, input_pos, n_filled=None):
        super().begin(input_pos, n_filled)
        self.q_pos = input_pos
        self.terms += int((input_pos >= 0).sum()) * self.group

    def prefill(self, layer, q, k, v):
        self.total[layer] += channel_importance(q, k, self.q_pos).double().cpu()
        return super().prefill(layer, q, k, v)


class RowRecorder(FullCache):
    """The full cache, keeping each layer's attention rows of the last `queries` tokens."""

    name = "pod-rows"

    def __init__(self, queries: int):
        self.queries = queries

    def reset(self) -> None:
        super().reset()
        self.rows: dict = {}

    def begin(self, input_pos, n_filled=None):
        super().begin(input_pos, n_filled)
        self.q_pos = input_pos

    def prefill(self, layer, q, k, v):
        self.rows[layer] = attention_rows(q, k, self.q_pos, self.queries, self.sliding_window)
        return super().prefill(layer, q, k, v)


def _run_blocks(model, recorder: FullCache, blocks: list[list[int]], on_block) -> None:
    """Prefill every block as a fresh sequence through `recorder`; on_block(i) after each."""
    model.setup_caches(1, len(blocks[0]), recorder)
    device = model.output.weight.device
    with torch.inference_mode():
        for i, ids in enumerate(blocks):
            recorder.reset()
            model(torch.tensor([ids], device=device), torch.arange(len(ids), device=device), last_only=True)
            on_block(i)
            if shard_of(model.args).writes_files:
                print(f"\r  block {i + 1}/{len(blocks)}", end="", file=sys.stderr, flush=True)
    if shard_of(model.args).writes_files:
        print(file=sys.stderr)


def calibrate_channels(model, blocks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Heavy-channel ranking over token blocks -> (ranking [L, H_kv, D] long, mean importance [L, H_kv, D]),
    of the whole model's KV heads under tensor parallelism."""
    stats = ChannelStats()
    _run_blocks(model, stats, blocks, lambda i: None)
    mean = shard_of(model.args).all_gather((stats.total / max(stats.terms, 1)).float(), 1)
    return rank_channels(mean), mean


def calibrate_pod(model, blocks: list[list[int]], queries: int) -> torch.Tensor:
    """POD's mean layer similarity [H_kv, L, L] over token blocks (see the module docstring), of the
    whole model's KV heads under tensor parallelism."""
    recorder = RowRecorder(queries)
    acc = {"total": 0, "count": 0}

    def add(i: int) -> None:
        n = len(blocks[i])
        valid = torch.nn.functional.pad(torch.ones(1, min(queries, n), dtype=torch.bool),
                                        (queries - min(queries, n), 0))
        sums, c = similarity_sums([recorder.rows[layer].cpu() for layer in range(len(recorder.rows))], valid)
        acc["total"], acc["count"] = acc["total"] + sums, acc["count"] + c

    _run_blocks(model, recorder, blocks, add)
    return shard_of(model.args).all_gather((acc["total"] / acc["count"]).float(), 0)


def write_channels(model, tokenizer, out: Path, data: Path = CALIBRATION_TEXT, tokens: int = 16384,
                   block: int = 512) -> Path:
    """Calibrate heavy channels on `data` and write them to `out` (blocks no longer than the model's context)."""
    block = min(block, model.args.max_position_embeddings)
    blocks = calibration_blocks(tokenizer, data, tokens, block)
    ranking, mean = calibrate_channels(model, blocks)
    meta = {"data": data.name, "tokens": len(blocks) * block, "block": block}
    if shard_of(model.args).writes_files:
        write_channels_file(out, ranking, mean, meta)
    return Path(out)


def write_pod(model, tokenizer, out: Path, data: Path = CALIBRATION_TEXT, samples: int = 8, length: int = 2048,
              queries: int = 16, deltas=(0.3, 0.5, 0.7)) -> dict | None:
    """Calibrate POD's layer similarity on `data` and write it (with groupings for `deltas`) to `out`:
    the file's data (None on the processes that do not write, under tensor parallelism)."""
    length = min(length, model.args.max_position_embeddings)
    blocks = calibration_blocks(tokenizer, data, samples * length, length)
    sim = calibrate_pod(model, blocks, queries)
    meta = {"data": data.name, "samples": len(blocks), "length": length, "queries": queries}
    return write_pod_file(out, sim, meta, deltas) if shard_of(model.args).writes_files else None


def ensure(path: Path, what: str, make, shard: Shard = SINGLE) -> Path:
    """`path` if it exists, else make(path) first with a one-line note on stderr (under tensor
    parallelism every process calibrates when one misses the file, and all wait for the write)."""
    path = Path(path)
    if shard.any(not path.exists()):
        t0 = time.perf_counter()
        if shard.writes_files:
            print(f"calibrating {what} on {CALIBRATION_TEXT.name}/ (first use of this checkpoint) -> {path}",
                  file=sys.stderr, flush=True)
        make(path)
        shard.barrier()
        if shard.writes_files:
            print(f"  done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return path


def ensure_channels(model, tokenizer, checkpoint) -> Path:
    return ensure(channels_path(checkpoint), "heavy channels",
                  lambda out: write_channels(model, tokenizer, out), shard_of(model.args))


def ensure_pod(model, tokenizer, checkpoint) -> Path:
    return ensure(pod_path(checkpoint), "POD layer similarity",
                  lambda out: write_pod(model, tokenizer, out), shard_of(model.args))
