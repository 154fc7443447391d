"""SimLayerKV (Zhang et al., 2024): trim the KV cache of "lazy" layers only.

A layer is lazy when its attention mass on the first `n_sink` tokens plus the `n_recent` most
recent (relative to each query), averaged over heads and queries, exceeds `lazy_threshold` (the
paper's delta).  Strategy `decode` (the default: the paper's experiments identify lazy layers "during
the decoding stage") measures it on the first generated token's query; `prefill` on the last
`obs_window` prompt queries.  A layer is trimmed only when every sequence of the batch finds it lazy
(its capacity is a shape shared by the batch).  As in the paper, a lazy layer's cache is cut to the
initial tokens plus a ring of recent ones as soon as it is identified (decode: before the second
decode step, the first one attended over the whole prompt; prefill: before the first) and then
evicts StreamingLLM-style (the eviction base's defaults: sinks and recent window kept, the oldest other
token leaves); the other layers keep everything.

lazy_threshold defaults per model family as in the paper: Llama-3 0.9, Llama-2 0.65, Mistral 0.8,
Qwen 0.85, otherwise 0.9 (see model_family).
"""
from dataclasses import dataclass

import torch
from torch import Tensor

from cache.base import EvictionPolicy
from cache.params import param, recent_param, sink_param
from cache.scoring import attention_probs, last_rows
from cache.shard import shard_of

DELTA_BY_FAMILY = {"llama3": 0.9, "llama2": 0.65, "mistral": 0.8, "qwen": 0.85, "other": 0.9}


def model_family(args) -> str:
    """The paper's model family from the checkpoint's model type (HF `model_type` or GGUF
    `general.architecture`; None counts as llama): qwen* -> qwen, mistral -> mistral, any other type
    but llama (gemma, ...) -> other; a llama by its sliding window (mistral) or vocabulary: >= 128000
    Llama-3, 32768 Mistral, 32000 Llama-2 with MHA or Mistral with GQA, any other -> other."""
    kind = (args.model_type or "llama").lower()
    if kind.startswith("qwen"):
        return "qwen"
    if kind != "llama":
        return "mistral" if kind == "mistral" else "other"
    if args.sliding_window or args.vocab_size == 32768:
        return "mistral"
    if args.vocab_size >= 128000:
        return "llama3"
    if args.vocab_size == 32000:
        return "llama2" if args.n_kv_heads == args.n_heads else "mistral"
    return "other"


def lazy_mass(probs: Tensor, q_pos: Tensor, k_pos: Tensor, n_sink: int, n_recent: int) -> Tensor:
    """Attention mass on initial + recent keys, mean over heads and valid queries -> [B].

    probs [B, H_kv, G, T, L] for queries at q_pos [B, T] over keys at k_pos [B, L] (or
    [B, H_kv, L] when each head holds its own slots)."""
    if k_pos.dim() == 2:
        k_pos = k_pos[:, None]
    kp, qp = k_pos[:, :, None, None, :], q_pos[:, None, None, :, None]
    near = (kp >= 0) & ((kp < n_sink) | (kp > qp - n_recent))
    mass = (probs * near).sum(-1).mean((1, 2))                                   # [B, T]
    valid = (q_pos >= 0).float()
    return (mass * valid).sum(-1) / valid.sum(-1).clamp(min=1)


@dataclass(eq=False)
class SimLayerKVPolicy(EvictionPolicy):
    admission = "batch"     # lazy layers are decided once for the whole batch
    name = "simlayerkv"
    strategy: str = param("decode", "where lazy layers are found: decode (the first generated token's query, "
                                    "the paper's experiments) or prefill (the last prompt queries)")
    lazy_threshold: float = param(-1.0, "the paper's delta: laziness threshold (-1: the paper's value for the "
                                        "model family)")
    n_sink: int = sink_param(4)             # what a lazy layer keeps, and its laziness measure
    n_recent: int = recent_param(1024)
    obs_window: int = param(32, "last prompt queries measured by the prefill strategy")
    renamed = {"delta": "lazy_threshold", "n_initial": "n_sink", "window": "n_recent", "w_last": "obs_window"}
    appending = True
    defer_compression = True
    decided_masses = None

    @property
    def reader_composable(self) -> bool:
        """The decode strategy measures the first decode step's full attention: no reader over it."""
        return self.strategy == "prefill"

    @classmethod
    def full_cache_args(cls, n_tokens: int):
        return {"n_recent": n_tokens}

    def validate(self) -> None:
        if self.strategy not in ("prefill", "decode"):
            raise ValueError(f"strategy must be prefill or decode, got {self.strategy!r}")
        if self.n_sink < 0 or self.n_recent < 1 or self.obs_window < 1:
            raise ValueError("need n_sink >= 0, n_recent >= 1, obs_window >= 1")
        if self.lazy_threshold != -1.0 and not 0 < self.lazy_threshold <= 1:
            raise ValueError(f"lazy_threshold must be in (0, 1], got {self.lazy_threshold}")

    def setup(self, args, max_batch_size, max_seq_length, dtype, device) -> None:
        if self.lazy_threshold == -1.0:
            self.lazy_threshold = DELTA_BY_FAMILY[model_family(args)]
        super().setup(args, max_batch_size, max_seq_length, dtype, device)
        self.lazy = [False] * args.n_layers
        self.masses: list = [None] * args.n_layers

    def reset(self) -> None:
        super().reset()
        self.layer_appends = [True] * len(self.k)
        self.lazy = [False] * len(self.k)
        self.measuring = False
        self.decided_masses = None

    def layer_budget(self, layer: int) -> int:
        return self.n_sink + self.n_recent if self.lazy[layer] else self.prompt_length

    # ---------------------------------------------------------------- finding lazy layers
    def prefill_stats(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> dict:
        if self.strategy != "prefill":
            return {}
        q_last, pos_last = last_rows(q, q_pos, self.obs_window)
        probs = attention_probs(q_last, k, pos_last, k_pos, self.sliding_window)
        return {"mass": lazy_mass(probs, pos_last, k_pos, self.n_sink, self.n_recent)}

    def prefill_queries(self) -> int:
        return self.obs_window if self.strategy == "prefill" else 0

    def plan(self, stats: list[dict]) -> None:
        if self.strategy == "prefill":
            self.decide(torch.stack([s["mass"] for s in stats]))

    def decide(self, masses: Tensor) -> None:
        """masses [n_layers, B] -> lazy flags (one host sync per request; under --tp the masses are first
        averaged over every process's heads, so all decide alike and as one process would)."""
        self.decided_masses = shard_of(self.args).mean(masses).tolist()
        self.lazy = [all(m > self.lazy_threshold for m in row) for row in self.decided_masses]
        self.layer_appends = [not lazy for lazy in self.lazy]

    def before_decode_step(self, step: int) -> None:
        if self.strategy == "decode":
            self.measuring = step == 0
            if step == 1:
                self.decide(torch.stack(self.masses))
                for layer in range(len(self.k)):
                    if self.lazy[layer]:
                        self.trim(layer)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = super().decode(layer, q, k, v)
        if self.measuring:                      # the first generated token's attention
            pos = self.pos[layer]
            probs = attention_probs(q, self.dense_kv(layer)[0], self.q_pos, pos[:, 0], self.sliding_window)
            self.masses[layer] = lazy_mass(probs, self.q_pos, pos, self.n_sink, self.n_recent)
        return out

    def trim(self, layer: int) -> None:
        """Decode strategy: shrink a full layer to initial + recent ring (host, once)."""
        used = self.used_slots(layer)
        k, v = (x[:, :, :used] for x in self.dense_kv(layer))
        pos = self.pos[layer][:, 0, :used]
        q_pos, prompt_length = self.q_pos, self.prompt_length
        self.q_pos = pos                                   # the slots play the prompt's role
        self.prompt_length = self.n_filled
        self.allocate(layer)
        self.compress(layer, k, v, {})
        self.q_pos, self.prompt_length = q_pos, prompt_length
        self.kept[layer] -= self.n_filled - self.prompt_length   # used_slots counts from the prompt

    def describe(self) -> dict:
        d = super().describe()
        if self.decided_masses:
            d["lazy_layers"] = [i for i, lazy in enumerate(self.lazy) if lazy]
            d["lazy_mass"] = [round(sum(m) / len(m), 3) for m in self.decided_masses]
        return d
