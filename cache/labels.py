"""Double Sparsity's label machinery, shared by ds and hshare: heavy channels, the label cache and the
reader that selects by approximate scores over it (`LabelReader`, on cache/sparse_read.py's SparseReader).

Label cache (per layer): `[B, H_kv, S, C]` = the C heavy channels of every cached (post-RoPE) key,
in the key dtype, or 4-bit packed (`[B, H_kv, S, C/2]` uint8 + per-token fp16 scale/minimum,
`kernels.quantize_labels_4bit`).  Its slots mirror the inner storage's slots.  Heavy channels per
(layer, KV head) come from `scripts/calibrate_channels.py` (`heavy_channels.json` next to the
checkpoint: channels ranked by mean |q_d k_d| on calibration text, post-RoPE, over the tokens and
the query heads of the group, as Double Sparsity's offline calibration), or, when that file is
absent, from the prompt itself: the same statistic accumulated over the prompt's tokens during
prefill ("prompt" source; describe() says which was used).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from cache.calibration import channel_importance, channels_path, ensure_channels, rank_channels, read_channels_file
from cache.sparse_read import SparseReader, param, select_slots
from kernels import approx_scores, dequantize_labels_4bit, quantize_labels_4bit, resolve_backend
from kernels.cpu import label_scores_supported, label_write_cpu, use_cpu_kernel


def gather_channels(x: Tensor, channels: Tensor) -> Tensor:
    """x [B, H, T, D] or [B, H, G, T, D]-like with heads on dim 1; channels [H, C] -> [..., C]."""
    idx = channels.view(1, channels.shape[0], *([1] * (x.dim() - 3)), channels.shape[1])
    return x.gather(-1, idx.expand(*x.shape[:-1], channels.shape[1]))


class LabelCache:
    """Per-layer heavy-channel labels mirroring the inner storage's slots (see module docstring)."""

    def __init__(self, bits: int):
        if bits not in (4, 16):
            raise ValueError(f"label_bits must be 16 (key dtype) or 4, got {bits}")
        self.bits = bits
        self.labels: list = []
        self.scale: list = []
        self.minimum: list = []

    def build(self, n_layers: int) -> None:
        self.labels, self.scale, self.minimum = [None] * n_layers, [None] * n_layers, [None] * n_layers

    def fill(self, layer: int, keys: Tensor, channels: Tensor, capacity: int) -> None:
        """Allocate the layer's labels for `capacity` slots and fill the first S from keys [B, H, S, D]."""
        B, H, S, _ = keys.shape
        C = channels.shape[1]
        lab = gather_channels(keys, channels)
        if self.bits == 4:
            packed, sc, mn = quantize_labels_4bit(lab)
            self.labels[layer] = torch.zeros(B, H, capacity, C // 2, dtype=torch.uint8, device=keys.device)
            self.scale[layer] = torch.zeros(B, H, capacity, dtype=sc.dtype, device=keys.device)
            self.minimum[layer] = torch.zeros(B, H, capacity, dtype=mn.dtype, device=keys.device)
            self.labels[layer][:, :, :S] = packed
            self.scale[layer][:, :, :S] = sc
            self.minimum[layer][:, :, :S] = mn
        else:
            self.labels[layer] = torch.zeros(B, H, capacity, C, dtype=keys.dtype, device=keys.device)
            self.labels[layer][:, :, :S] = lab

    def permute(self, layer: int, perm: Tensor) -> None:
        """Reorder the layer's KV heads (HShare puts the selecting heads first)."""
        for store in (self.labels, self.scale, self.minimum):
            if store[layer] is not None:
                store[layer] = store[layer].index_select(1, perm).contiguous()

    def write(self, layer: int, k: Tensor, channels: Tensor, slot, backend: str = "auto") -> None:
        """Label of the new key k [B, H, 1, D] (heads in the label cache's order) at `slot` (an int, or
        [B, H] long): kvc::label_write on CPU where it is built, else write_torch."""
        if use_cpu_kernel(backend, label_scores_supported(k, self.labels[layer])):
            label_write_cpu(k, channels, self.labels[layer], self.scale[layer], self.minimum[layer], slot)
        else:
            self.write_torch(layer, k, channels, slot)

    def write_torch(self, layer: int, k: Tensor, channels: Tensor, slot) -> None:
        """write's twin in torch ops."""
        lab = gather_channels(k, channels)                                    # [B, H, 1, C]
        parts = [lab]
        if self.bits == 4:
            packed, sc, mn = quantize_labels_4bit(lab)
            parts = [packed, sc, mn]
        for store, x in zip((self.labels, self.scale, self.minimum), parts):
            t = store[layer]
            if isinstance(slot, Tensor):                                      # [B, H]
                if x.dim() == 4:
                    t.scatter_(2, slot[:, :, None, None].expand(-1, -1, 1, x.shape[-1]), x)
                else:
                    t.scatter_(2, slot[:, :, None], x)
            else:
                t[:, :, slot:slot + 1] = x

    def view(self, layer: int, length: Optional[int] = None, heads: Optional[int] = None):
        """(labels, scale, minimum) of the first `length` slots and `heads` heads (None = all)."""
        out = []
        for store in (self.labels, self.scale, self.minimum):
            t = store[layer]
            if t is not None:
                if heads is not None:
                    t = t[:, :heads]
                if length is not None:
                    t = t[:, :, :length]
            out.append(t)
        return tuple(out)

    def dense(self, layer: int, length: Optional[int] = None) -> Tensor:
        """Labels as floats [B, H, S, C] (dequantized when 4-bit)."""
        lab, sc, mn = self.view(layer, length)
        return dequantize_labels_4bit(lab, sc, mn) if self.bits == 4 else lab.float()

    def nbytes(self, layer: int, length: Optional[int] = None) -> int:
        total = 0
        for t in self.view(layer, length):
            if t is not None:
                total += t.numel() * t.element_size()
        return total


@dataclass(eq=False)
class LabelReader(SparseReader):
    """Double Sparsity's selection: label cache + approximate scores (see module docstring)."""

    heavy_channels: int = param(0, "C, heavy channels per KV head in the label cache (0 = head_dim / 8)")
    label_bits: int = param(4, "label precision: 4 (packed, per-token scale/min: the HShare and Double Sparsity "
                               "papers' setting) or 16 (the key dtype)")
    channels: str = param("auto", "heavy-channel source: auto (the checkpoint's heavy_channels.json, calibrated on "
                                  "first use), prompt, or a path to a calibration JSON")

    def validate(self) -> None:
        super().validate()
        if self.heavy_channels < 0:
            raise ValueError(f"heavy_channels must be >= 0, got {self.heavy_channels}")
        if self.label_bits not in (4, 16):
            raise ValueError(f"label_bits must be 16 or 4, got {self.label_bits}")

    def setup(self, args, max_batch_size, max_seq_length, dtype, device) -> None:
        D = args.head_dim
        self.C = self.heavy_channels or max(1, D // 8)
        if self.C > D:
            raise ValueError(f"heavy_channels ({self.C}) exceeds head_dim ({D})")
        if self.label_bits == 4 and self.C % 2:
            raise ValueError(f"4-bit labels need an even heavy_channels, got {self.C}")
        self.labels = LabelCache(self.label_bits)
        self.calibrated = self.load_calibration(args)
        super().setup(args, max_batch_size, max_seq_length, dtype, device)

    def prepare(self, model, tokenizer) -> None:
        """channels=auto: make the checkpoint's heavy_channels.json (on data/calibration/) if it is missing."""
        super().prepare(model, tokenizer)
        if self.channels == "auto" and model.args.checkpoint is not None:
            ensure_channels(model, tokenizer, model.args.checkpoint)

    def load_calibration(self, args) -> Optional[Tensor]:
        """Channel ranking [L, H_kv, D] from the calibration file, or None (prompt statistics: channels=prompt,
        or channels=auto without a calibration file beside the checkpoint)."""
        self.channels_source = "prompt"
        if self.channels == "prompt":
            return None
        if self.channels == "auto":
            if args.checkpoint is None or not channels_path(args.checkpoint).exists():
                return None
            path = channels_path(args.checkpoint)
        else:
            path = Path(self.channels)
            if not path.exists():
                raise ValueError(f"channels={self.channels}: no such file")
        self.channels_source = str(path)
        return read_channels_file(path, args)

    def reset(self) -> None:
        super().reset()
        L = self.args.n_layers
        # prompt statistics for the "prompt" channel source (no Python branch per chunk: compiled
        # prefill graphs stay the same for the first and later chunks)
        self.importance = (torch.zeros(L, self.args.n_kv_heads, self.args.head_dim, device=self.device)
                           if self.calibrated is None else None)
        self.labels.build(L)
        self.channel_ids = None             # [L, H_kv, C] once known

    def observe_prefill(self, layer: int, q: Tensor, k: Tensor) -> None:
        if self.calibrated is None:
            self.importance[layer] += channel_importance(q, k, self.q_pos)

    def end_prefill(self) -> None:
        if self.inner.n_filled and not self.built:
            if self.calibrated is not None:
                ranking = self.calibrated
            else:
                ranking = rank_channels(self.importance.cpu())
            self.channel_ids = ranking[:, :, :self.C].contiguous().to(self.device)
            self.label_channels = list(self.channel_ids)      # per layer, in the label cache's head order
        super().end_prefill()

    @property
    def admission(self) -> str:
        """Heavy channels ranked on the prompt are a decision for the whole batch; calibrated ones are not
        (known once set up)."""
        return self.inner.admission if getattr(self, "calibrated", None) is not None else "batch"

    def adopt_decisions(self, other: "LabelReader") -> None:
        self.channel_ids, self.label_channels = other.channel_ids, other.label_channels

    def build(self, layer: int) -> None:
        k = self.storage_.filled_keys(layer)
        self.labels.fill(layer, k, self.channel_ids[layer], self.storage_.capacity(layer))

    def index_tensors(self, layer: int, row: int) -> list[Tensor]:
        return [t[layer][row] for t in (self.labels.labels, self.labels.scale, self.labels.minimum)
                if t[layer] is not None]

    def index_static_tensors(self) -> list[Tensor]:
        return [t for store in (self.labels.labels, self.labels.scale, self.labels.minimum) for t in store
                if t is not None] + list(self.label_channels)

    def update(self, layer: int, k: Tensor, slot) -> None:
        self.labels.write(layer, k, self.label_channels[layer], slot, self.backend)

    def query_labels(self, layer: int, q: Tensor, channels: Tensor) -> Tensor:
        """q [B, H_q, 1, D] restricted to each KV head's heavy channels -> [B, H_q, C]."""
        B, Hq, _, D = q.shape
        H = channels.shape[0]
        return gather_channels(q.view(B, H, Hq // H, D), channels).reshape(B, Hq, -1)

    def scores(self, layer: int, q: Tensor, heads: Optional[int] = None) -> Tensor:
        """Approximate scores [B, h, S] of the first `heads` KV heads (label cache order).

        The Triton and C++ kernels score the head slice of the label cache as it is.  The torch twin
        scores every head and returns the first `heads` rows: the slice is not one strided batch, so
        torch.matmul would first copy it (2 MB per layer at 4096 tokens), which costs more than the
        extra heads' dot products."""
        channels = self.label_channels[layer]
        kernel = (resolve_backend(self.backend, q) == "triton"
                  or use_cpu_kernel(self.backend, label_scores_supported(q, self.labels.labels[layer])))
        sliced = heads is not None and heads < channels.shape[0] and kernel
        if sliced:
            channels = channels[:heads]
            q = q[:, :heads * self.group]
        lab, sc, mn = self.labels.view(layer, self.step_length(layer), heads if sliced else None)
        q_label = self.query_labels(layer, q, channels)
        if self.head_agg == "mean":     # the group's summed query against each label: the same ranking
            s = approx_scores(q_label, lab, sc, mn, group="kv", backend=self.backend)
        else:
            s = self.reduce_query_scores(approx_scores(q_label, lab, sc, mn, group="query", backend=self.backend))
        if heads is None or sliced:
            return s
        return s[:, :heads * (self.group if self.head_agg == "query" else 1)]

    def select(self, layer: int, q: Tensor) -> tuple[Tensor, Tensor]:
        s = self.scores(layer, q)
        return select_slots(s, self.select_bias(layer, s.shape[1]), self.n_slots(), self.backend)

    def index_bytes(self, live: bool) -> int:
        if not self.built:
            return 0
        n = self.inner.n_filled if (live and self.storage_.uniform) else None
        return sum(self.labels.nbytes(layer, n) for layer in range(self.args.n_layers))

    def read_bytes_per_step(self) -> float:
        L = self.args.n_layers
        n = self.inner.n_filled if self.storage_.uniform else None
        labels = sum(self.labels.nbytes(layer, n) for layer in range(L))
        rows = sum(min(self.n_critical, self.readable_length(layer)) for layer in range(L))
        return labels + rows * self.kv_row_bytes()

    def describe(self) -> dict:
        d = super().describe()
        if self.args is None:                               # not set up yet
            return d
        d["heavy_channels"] = self.C
        d["heavy_channels_source"] = ("calibrated: " + self.channels_source if self.calibrated is not None else
                                      "prompt: top channels by mean |q*k| over the prompt tokens at prefill")
        return d
