"""A compact Llama/Mistral decoder with a static, pluggable KV cache.

Single file, no imports from the rest of the project: copy it into your own code.

    model = Transformer(ModelArgs.from_hf_config(json.load(open("config.json"))))
    model.load_state_dict(...)            # names as in `Transformer.state_dict()`
    model.setup_caches(max_batch_size=1, max_seq_length=4096)   # DenseCache by default
    logits = model(tokens, input_pos)     # the prompt: tokens [B, T], input_pos [T] or [B, T]
    logits = model(token, pos, decode=True)   # then one token per row and step: token [B, 1]

Each call appends its T tokens to the cache (call `model.reset_caches()` to start new
sequences); the caller says which forwards are decode steps.  `input_pos` gives every token's
absolute position (RoPE is applied at it and the cache records it); a negative position marks left padding, which is never attended.

The cache is a *policy* object (duck-typed; see `DenseCache` for the contract, and the
project's `cache/` package for compressing policies).  It owns preallocated per-layer
buffers `k, v: [B, H_kv, C, D]` and computes attention over what it keeps, so decode cost
follows the live length, never `max_seq_length`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


# --------------------------------------------------------------------------- config

@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0                      # 0 -> dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None    # {"rope_type": "llama3"|"linear", ...}
    max_position_embeddings: int = 4096    # the model's context length
    tie_word_embeddings: bool = False
    sliding_window: Optional[int] = None   # Mistral: keys older than this are not attended
    attention_bias: bool = False
    checkpoint: Optional[str] = None       # where it was loaded from (not architecture): policies look
                                           # for per-checkpoint calibration files beside it
    shard: Optional[object] = None         # tensor parallelism (not architecture either): this process's
                                           # share of the heads, set by the project's tp.py; None = all
    model_type: Optional[str] = None       # the HF config's model_type or GGUF general.architecture ("llama",
                                           # "mistral", ...; None: not recorded): per-family policy defaults

    def __post_init__(self):
        """ValueError for a field no model can have (a size that is not a positive integer, ...)."""
        def number(name: str, kind: tuple) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive {'integer' if kind == (int,) else 'number'}, got {value!r}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size",
                     "max_position_embeddings"):
            number(name, (int,))
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
        number("head_dim", (int,))
        number("norm_eps", (int, float))
        number("rope_theta", (int, float))
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.sliding_window is not None:
            number("sliding_window", (int,))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    REQUIRED_HF_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "intermediate_size")
    SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        """From a HuggingFace `config.json` dict (transformers 4.x or 5.x layout)."""
        missing = [k for k in cls.REQUIRED_HF_FIELDS if k not in cfg]
        if missing:
            raise ValueError(f"config is missing required field(s): {', '.join(missing)}")
        archs = cfg.get("architectures") or []
        if archs and not any(a in cls.SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(f"unsupported architecture {archs}; supported: {', '.join(cls.SUPPORTED_ARCHITECTURES)}")
        rope = dict(cfg.get("rope_parameters") or {})          # transformers 5
        if cfg.get("rope_scaling"):                             # transformers 4
            rope.update(cfg["rope_scaling"])
        rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            head_dim=cfg.get("head_dim") or 0,
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            attention_bias=bool(cfg.get("attention_bias", False)),
            model_type=cfg.get("model_type"),
        )

    def to_hf_config(self) -> dict:
        """The HuggingFace `config.json` dict describing this model (Llama architecture)."""
        cfg = {
            "architectures": ["MistralForCausalLM" if self.sliding_window else "LlamaForCausalLM"],
            "model_type": self.model_type or ("mistral" if self.sliding_window else "llama"),
            "vocab_size": self.vocab_size, "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads, "intermediate_size": self.intermediate_size,
            "head_dim": self.head_dim, "rms_norm_eps": self.norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "hidden_act": "silu",
        }
        if self.sliding_window:
            cfg["sliding_window"] = self.sliding_window
        return cfg


# --------------------------------------------------------------------------- RoPE

def rope_inv_freq(args: ModelArgs) -> Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with Llama 3.1 / linear scaling."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = args.rope_scaling
    if not s:
        return inv_freq
    kind = s["rope_type"]
    if kind == "linear":
        return inv_freq / s["factor"]
    if kind == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        return torch.where(medium, smoothed, scaled)
    if kind == "freq_factors":            # GGUF `rope_freqs.weight`: per-frequency divisors
        return inv_freq / torch.tensor(s["factors"], dtype=torch.float32)
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: linear, llama3")


def rope_tables(args: ModelArgs, n_positions: int, device=None) -> tuple[Tensor, Tensor]:
    """cos, sin tables [n_positions, head_dim] in float32 (rotate-half layout)."""
    inv_freq = rope_inv_freq(args).to(device)
    t = torch.arange(n_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D] rotated by cos/sin [B, 1, T, D] (float32), returned in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.addcmul(xf * cos, rotated, sin).to(x.dtype)


# --------------------------------------------------------------------------- attention

def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    """GQA attention with an explicit mask, without repeating the cache.

    q [B, H_q, T, D]; k, v [B, H_kv, L, D]; mask bool (True = attend), an additive bias in q's dtype
    (0 / -inf: the same mask, cheaper when many calls share it) or None, already expanded
    over the G = H_q / H_kv query heads of a group: [B, G*T, L] (same for every KV head) or
    [B, H_kv, G*T, L] (per KV head).  Returns [B, H_q, T, D].
    Query head h reads KV head h // G (HuggingFace's `repeat_kv` order).
    """
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, (Hq // Hkv) * T, D)
    if mask is not None and mask.dim() == 3:
        mask = mask[:, None]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return out.reshape(B, Hq, T, D)


def prefix_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, pk: Tensor, pv: Tensor,
                     own_from: Tensor) -> Tensor:
    """Decode attention where rows share a prefix: q [B, H_q, 1, D]; k, v [B, H_kv, n, D]; visible [B, 1, n]
    bool; pk, pv [1, H_kv, P, D], the shared prefix; own_from [B] long.  Row b attends over its visible slots
    [own_from[b], n) and, where own_from[b] > 0, over the P prefix rows too -> [B, H_q, 1, D].  (The
    prefix is expanded here; a kernel reads it once for every row, DenseCache.decode_kernel.)"""
    B, n, P = q.shape[0], k.shape[2], pk.shape[2]
    own = visible[:, 0, :n] & (torch.arange(n, device=k.device) >= own_from[:, None])
    mask = torch.cat([(own_from > 0)[:, None].expand(B, P), own], 1)                   # [B, P + n]
    mask = mask | ~mask.any(-1, keepdim=True)            # a row with nothing visible: finite (unused) output
    keys, values = (torch.cat([p.expand(B, -1, -1, -1), x], 2) for p, x in ((pk, k), (pv, v)))
    return grouped_attention(q, keys, values, mask[:, None].expand(B, q.shape[1] // k.shape[1], P + n))


def attention_mask(q_pos: Tensor, k_pos: Tensor, group: int, sliding_window: Optional[int]) -> Tensor:
    """Visibility [B, group*T, L] of keys at positions k_pos [B, L] from queries q_pos [B, T].

    A key is visible when it holds a token (pos >= 0) at or before the query's position (and
    within the sliding window).  Padding queries (pos < 0) see every slot so softmax stays
    finite; their outputs are never used.
    """
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    visible = (kp >= 0) & (kp <= qp)
    if sliding_window:
        visible &= qp - kp < sliding_window
    visible |= qp < 0
    B, T, L = visible.shape
    return visible[:, None].expand(B, group, T, L).reshape(B, group * T, L)


class DenseCache:
    """The plain static cache: every token kept, in preallocated per-layer buffers k, v [B, H_kv, S, D].

    The members `Transformer` calls: setup, reset, begin (once per forward), prefill / decode (each layer);
    the project's `cache/` package has compressing policies with the same members (cache/contract.py) and
    `full`, this cache with rows that join and leave a running batch (cache/full.py).
    Slots fill left to right: a forward's T tokens go to slots [n_filled, n_filled + T) of every row (a
    static batch, left padding included); attention reads slots [0, n_filled).  n_filled is a host int
    (never a tensor: the live length is a shape); a compiled decode step passes it to `begin` (through
    `Transformer.forward`), so the compiler sees a dynamic int instead of a constant.
    """

    n_filled = 0                    # tokens held (prompt + generated), a host int
    n_read = 0                      # slots this forward's attention reads: n_filled, or a static step's bound
    static_decode = False           # a decode step with device-side lengths (cache/full.py's FullCache: begin_static)
    aligned = True                  # every row's next slot is n_filled (cache/full.py's rows: each its own)
    prefill_in_one_pass = False     # a prompt may come in chunks (forwards of T >= 1 tokens before decode)
    # decode() is this class's own: write k, v at slot `start` of k[layer], v[layer], attend over slots
    # [0, n_filled) with row 0 of `mask` through decode_kernel.  Then EagerOps.dense_decode may do that
    # whole step as one op (head split included) instead of calling decode(); a subclass or an instance
    # that replaces decode (or stores K/V otherwise) sets this False, and its decode is called.
    fused_dense_decode = True
    # decode_kernel(q [B, H_q, 1, D], k, v [B, H_kv, n, D], visible [B, 1, n] bool) -> [B, H_q, 1, D]:
    # a faster kernel for one-token steps (Transformer.setup_caches passes its own in); None =
    # grouped_attention with the step's mask.  A row with nothing visible (a free row) gets any finite output.
    decode_kernel = None
    prefix_kernel = None            # the same for rows reading a shared prefix (cache/full.py; unused here)
    k = v = pos = None              # per-layer K/V buffers, slot positions [B, S] (setup)

    def setup(self, args: ModelArgs, max_batch_size: int, max_seq_length: int,
              dtype: torch.dtype, device) -> None:
        self.k, self.v = self.allocate_kv(args, max_batch_size, max_seq_length, dtype, device)
        self.pos = torch.full((max_batch_size, max_seq_length), -1, dtype=torch.long, device=device)
        self.group = args.n_heads // args.n_kv_heads
        self.sliding_window = args.sliding_window
        self.reset()

    def allocate_kv(self, args: ModelArgs, max_batch_size: int, max_seq_length: int, dtype: torch.dtype, device):
        """Per-layer K and V buffers [B, H_kv, max_seq_length, D] (a storage subclass allocates its own)."""
        shape = (max_batch_size, args.n_kv_heads, max_seq_length, args.head_dim)
        return ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)],
                [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)])

    @property
    def capacity(self) -> int:
        """Slots per layer; read from a tensor shape so compiled code treats it as dynamic."""
        return self.pos.shape[1]

    def reset(self) -> None:
        self.pos.fill_(-1)
        self.n_filled = self.n_read = 0
        self.start = 0          # the first slot this forward writes
        self.mask = self.bias = None

    def begin(self, input_pos: Tensor, n_filled: Optional[int] = None) -> None:
        """Once per forward, input_pos [B, T]: claim the T tokens' slots and build the forward's mask.
        n_filled: the tokens held before this forward, as the caller counts them (None: this cache's count)."""
        if n_filled is not None:
            self.n_filled = n_filled
        B, T = input_pos.shape
        end = self.n_filled + T
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} tokens > capacity {self.capacity} "
                             f"(raise max_seq_length in setup_caches)")
        if B != self.pos.shape[0]:
            raise ValueError(f"batch {B} does not match the cache's batch {self.pos.shape[0]}")
        self.claim(input_pos, end)
        self.n_filled = end
        self.read_slots(input_pos, end)

    def read_slots(self, input_pos: Tensor, n: int) -> None:
        """This forward's attention reads slots [0, n): its mask, one per forward, shared by all layers."""
        self.n_read = n
        self.mask = attention_mask(input_pos, self.pos[:, :n], self.group, self.sliding_window)
        # the decode kernels' [B, 1, n]: a free row (position -1) reads nothing (the mask lets it see every slot,
        # for a finite softmax in grouped_attention; a kernel reading nothing gives that row anything finite)
        self.decode_visible = self.mask[:, :1] & (input_pos[:, :1, None] >= 0)
        self.bias = None                # prefill's (below)

    def claim(self, input_pos: Tensor, end: int) -> None:
        """Record the forward's positions in slots [n_filled, end) of every row."""
        self.start = self.n_filled
        self.pos[:, self.start:end] = input_pos

    def store(self, layer: int, k: Tensor, v: Tensor):
        """Write this forward's k, v [B, H_kv, T, D] into slots [start, n_filled); returns the first slot."""
        self.k[layer][:, :, self.start:self.n_filled] = k
        self.v[layer][:, :, self.start:self.n_filled] = v
        return self.start

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, H_q, T, D], k/v [B, H_kv, T, D] (RoPE applied) -> attention output [B, H_q, T, D]."""
        self.store(layer, k, v)
        n = self.n_read
        if self.bias is None:           # the mask as an additive bias, once per forward (SDPA converts a bool
            self.bias = torch.zeros(self.mask.shape, dtype=q.dtype, device=q.device)  # mask at every call)
            self.bias.masked_fill_(~self.mask, float("-inf"))
        return grouped_attention(q, self.k[layer][:, :, :n], self.v[layer][:, :, :n], self.bias)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One token: q [B, H_q, 1, D], k/v [B, H_kv, 1, D] -> [B, H_q, 1, D]."""
        if self.decode_kernel is None:
            return self.prefill(layer, q, k, v)
        self.store(layer, k, v)
        n = self.n_read
        return self.decode_kernel(q, self.k[layer][:, :, :n], self.v[layer][:, :, :n], self.decode_visible)

    def storage(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """(k, v [B, H_kv, n, D], visible [B, 1, n]) over the slots this forward reads, for sparse readers."""
        n = self.n_read
        return self.k[layer][:, :, :n], self.v[layer][:, :, :n], (self.pos[:, None, :n] >= 0)

    def before_prefill(self, input_pos: Tensor) -> None:
        pass

    def end_prefill(self) -> None:
        pass

    def before_decode_step(self, step: int) -> None:
        pass

    def kept_positions(self, layer: int) -> Tensor:
        pos = self.pos[:, :self.n_filled]
        return pos[:, None, :].expand(-1, self.k[layer].shape[1], -1)   # [B, H_kv, n] (padding slots hold -1)

    def kv_bytes(self) -> dict:
        per_slot = sum(t[:, :, 0].numel() * t.element_size() for t in self.k + self.v)
        return {"allocated": per_slot * self.capacity, "live": per_slot * self.n_filled,
                "read_per_step": per_slot * self.n_filled}

    def describe(self) -> dict:
        return {"policy": "full", "capacity": self.capacity if self.k is not None else None}   # None: not set up


# --------------------------------------------------------------------------- eager ops

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., dim] normalized in float32 (as HF does), scaled by weight [dim] in x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """A residual add and the next norm: (x + y, rms_norm(x + y))."""
    h = x + y
    return h, rms_norm(h, weight, eps)


def rope_split(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """qkv [B, T, (H_q + 2 H_kv) D], cos/sin [B, 1, T, D] -> q [B, H_q, T, D] and k, v [B, H_kv, T, D],
    q and k rotated."""
    B, T, HD = qkv.shape
    H = n_heads + 2 * n_kv_heads
    heads = qkv.view(B, T, H, HD // H).transpose(1, 2)
    qk = apply_rope(heads[:, :n_heads + n_kv_heads], cos, sin)        # q and k rotated together
    return qk[:, :n_heads], qk[:, n_heads:], heads[:, n_heads + n_kv_heads:]


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU's gate: [..., 2 F] (gate, up) -> silu(gate) * up [..., F]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def attend(hook, layer: int, qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv_heads: int,
           split=rope_split) -> Tensor:
    """qkv [B, T, (H_q + 2 H_kv) D] split into heads by `split` (rope_split's contract) and attended by a
    cache hook (its prefill or decode) -> [B, T, H_q D], the heads joined in wo's layout."""
    B, T, _ = qkv.shape
    q, k, v = split(qkv, cos, sin, n_heads, n_kv_heads)
    return hook(layer, q, k, v).transpose(1, 2).reshape(B, T, -1)


def dense_decode(qkv: Tensor, cos: Tensor, sin: Tensor, cache: DenseCache, layer: int, n_heads: int,
                 n_kv_heads: int) -> Tensor:
    """A decode step's attention over a DenseCache whose `fused_dense_decode` is True: qkv [B, 1,
    (H_q + 2 H_kv) D] -> [B, 1, H_q D].  Here the head split and the cache's decode hook; a faster op
    may do it all at once (the split, RoPE, the writes to slot cache.start, the attention)."""
    return attend(cache.decode, layer, qkv, cos, sin, n_heads, n_kv_heads)


@dataclass(frozen=True)
class EagerOps:
    """The small ops every layer calls, in one visible place: model.py's torch functions above by
    default.  A loader may choose faster versions once (`Transformer.use_ops`; the project's
    kernels.cpu.cpu_eager_ops runs C++ ops in eager fp32 CPU steps).  A replacement keeps each
    contract and calls the default itself wherever its op does not apply (other dtypes or devices,
    and under torch.compile, which fuses the torch code by itself)."""
    rms_norm: Callable = rms_norm            # (x, weight, eps) -> rms_norm(x)
    add_rms_norm: Callable = add_rms_norm    # (x, y, weight, eps) -> (x + y, rms_norm(x + y))
    rope_split: Callable = rope_split        # (qkv, cos, sin, H_q, H_kv) -> q, k, v
    silu_mul: Callable = silu_mul            # gate_up [..., 2 F] -> [..., F]
    dense_decode: Callable = dense_decode    # (qkv, cos, sin, cache, layer, H_q, H_kv) -> [B, 1, H_q D]


TORCH_OPS = EagerOps()


# --------------------------------------------------------------------------- layers

def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _define_onednn_linear() -> None:
    """torch.ops.kvc.onednn_linear(x [..., K], w [N, K], bias [N] or None) -> [..., N]: oneDNN's inner
    product as an op a compiled graph calls as it is (Inductor's own lowering of mkldnn._linear_pointwise
    wants prepacked weights, and its `mm` calls BLAS, 1.8x slower than oneDNN at 8 rows on our EPYC)."""
    if hasattr(torch.ops.kvc, "onednn_linear"):      # (model.py imported twice)
        return
    lib = torch.library.Library("kvc", "FRAGMENT")
    lib.define("onednn_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor")
    lib.impl("onednn_linear", lambda x, w, b: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""), "CPU")
    torch.library.register_fake("kvc::onednn_linear", lambda x, w, b: x.new_empty((*x.shape[:-1], w.shape[0])),
                                lib=lib)
    _libraries.append(lib)


_libraries: list = []          # kept alive: an op lives as long as its Library object
SMALL_M_DTYPES = (torch.float32, torch.bfloat16)      # the dtypes a Linear's small_m_kernel takes


class Linear(nn.Linear):
    """nn.Linear with faster CPU paths; weights stay ordinary tensors.

    - Eager on CPU: oneDNN's inner product (`mkldnn._linear_pointwise`, the kernel Inductor
      itself uses), about 3x the BLAS GEMV rate for decode-sized inputs on our 2-core EPYC.
    - Under torch.compile on CPU for a single row (batch-1 decode): `(x * W).sum(-1)`, which Inductor
      turns into one vectorized reduction streaming W at memory bandwidth.  With more rows that
      reduction reads W once per row (2.8x oneDNN's time at 8 rows), so fp32 goes to oneDNN through
      `kvc::onednn_linear`, opaque to Inductor, or to `small_m_kernel` as below.
    - fp32 or bf16 on CPU with at most 12 rows (decode; compiled: 2 to 12), if a loader plugged one in:
      `small_m_kernel` (kernels.cpu.linear_small_m on AVX-512 CPUs: 1.3-1.6x oneDNN's rate at 1 row,
      1.1-1.3x at 8, even at 12-16, where oneDNN stays; a custom op with a fake, so compiled steps call
      it too: with oneDNN there, compiled batch-8 decode ran at 0.89-1.04x eager).
    - Anything else (bf16 prefill, CUDA, no oneDNN): F.linear.  On CPU a bf16 F.linear is oneDNN's bf16 matmul,
      AMX or AVX-512 BF16 where the CPU has them (docs/design.md, "bf16 on the CPU").
    """

    use_onednn = _onednn_linear_available()
    if use_onednn:
        _define_onednn_linear()
    # small_m_kernel(x [..., K] fp32 or bf16 with <= 12 rows, weight, bias) -> F.linear's result; None: oneDNN
    small_m_kernel = None

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "cpu":
            fp32 = x.dtype == self.weight.dtype == torch.float32
            small = self.small_m_kernel is not None and x.dtype == self.weight.dtype and x.dtype in SMALL_M_DTYPES
            if torch.compiler.is_compiling():
                if x.numel() == x.shape[-1]:
                    out = (x.unsqueeze(-2) * self.weight).sum(-1)
                    return out if self.bias is None else out + self.bias
                # decode-shaped steps only ([B, 1, K], B static): a prefill's row count is its dynamic prompt
                # length, and a guard on it would recompile the prefill graph when a prompt crosses 12 tokens
                if small and x.shape[-2] == 1 and x.numel() <= 12 * x.shape[-1]:
                    return self.small_m_kernel(x, self.weight, self.bias)
                if fp32 and self.use_onednn:
                    return torch.ops.kvc.onednn_linear(x, self.weight, self.bias)
            else:
                if small and x.numel() <= 12 * x.shape[-1]:
                    return self.small_m_kernel(x, self.weight, self.bias)
                if fp32 and self.use_onednn:
                    return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, ops: EagerOps = TORCH_OPS) -> Tensor:
        """Normalized in float32 (as HF does), scaled in the input dtype."""
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wqkv = Linear(args.dim, q_dim + 2 * kv_dim, bias=args.attention_bias)
        self.wo = Linear(q_dim, args.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache, decoding: bool,
                ops: EagerOps = TORCH_OPS) -> Tensor:
        """x [B, T, dim] -> [B, T, dim]: the cache's prefill or decode hook between wqkv and wo, or a
        decode step over a DenseCache that allows it as ops.dense_decode (see fused_dense_decode)."""
        qkv = self.wqkv(x)
        if decoding and isinstance(cache, DenseCache) and cache.fused_dense_decode:
            out = ops.dense_decode(qkv, cos, sin, cache, self.layer_idx, self.n_heads, self.n_kv_heads)
        else:
            hook = cache.decode if decoding else cache.prefill
            out = attend(hook, self.layer_idx, qkv, cos, sin, self.n_heads, self.n_kv_heads, ops.rope_split)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU with the gate and up projections fused into one matmul."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w2 = Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor, ops: EagerOps = TORCH_OPS) -> Tensor:
        return self.w2(ops.silu_mul(self.w13(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.attention = Attention(args, layer_idx)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, cache, decoding, ops: EagerOps = TORCH_OPS):
        a = self.attention(self.attention_norm(x, ops), cos, sin, cache, decoding, ops)
        h, normed = ops.add_rms_norm(x, a, self.ffn_norm.weight, self.ffn_norm.eps)   # h = x + a, ffn_norm(h)
        return h + self.feed_forward(normed, ops)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.cache = None
        self.rope_cos = self.rope_sin = None
        # the full cache's decode attention (see DenseCache.decode_kernel); a loader may plug in a kernel
        self.decode_kernel = None
        self.prefix_kernel = None       # the same for rows reading a shared prefix (cache/full.py's prefix_kernel)
        self.ops = TORCH_OPS            # every layer's small ops (see EagerOps); a loader may choose others

    def use_ops(self, ops: EagerOps) -> None:
        """Run every layer's small ops (norms, head split, SwiGLU gate, the dense decode step) through
        `ops` from now on: chosen once, by the loader."""
        if not isinstance(ops, EagerOps):
            raise TypeError(f"use_ops takes an EagerOps, got {type(ops).__name__}")
        self.ops = ops

    def setup_caches(self, max_batch_size: int, max_seq_length: int, policy=None, beyond_context: bool = False):
        """Allocate the KV storage (DenseCache unless a policy object is given) and RoPE tables.

        max_seq_length bounds the absolute positions (prompt + generated tokens).  beyond_context=True
        lets them run past the model's context length (RoPE extrapolates; text quality degrades
        there): long runs of bounded-memory policies use it."""
        if max_seq_length > self.args.max_position_embeddings and not beyond_context:
            raise ValueError(f"max_seq_length {max_seq_length} exceeds the model's context "
                             f"length {self.args.max_position_embeddings}")
        weight = self.norm.weight          # the compute dtype (linear layers may be swapped for quantized ones)
        policy = policy if policy is not None else DenseCache()
        if isinstance(policy, DenseCache) and policy.decode_kernel is None:
            policy.decode_kernel = self.decode_kernel
        if isinstance(policy, DenseCache) and policy.prefix_kernel is None:
            policy.prefix_kernel = self.prefix_kernel
        policy.setup(self.args, max_batch_size, max_seq_length, weight.dtype, weight.device)
        self.use_cache(policy)
        self.max_seq_length = max_seq_length
        self.rope_cos, self.rope_sin = rope_tables(self.args, max_seq_length, weight.device)
        return policy

    def use_cache(self, cache) -> None:
        """Run the next forwards over `cache` (set up for this model): the one place the model's cache
        changes (setup_caches; a batch of rows switching between its scratch and its rows)."""
        self.cache = cache

    def reset_caches(self) -> None:
        self.cache.reset()

    def forward(self, tokens: Tensor, input_pos: Tensor, last_only: bool = False, decode: bool = False,
                n_filled: Optional[int] = None, n_read: Optional[int] = None) -> Tensor:
        """tokens [B, T], input_pos [T] or [B, T] -> logits [B, T, V] (or [B, 1, V] if last_only).

        decode=True: a decode step (T = 1, after the prompt): the cache's decode hook, else its prefill hook (a
        prompt or a chunk of it).  n_filled: the tokens the cache holds before this forward, passed by a compiled
        step so that the compiler sees a dynamic int (None: the cache's own count).  n_read: a static decode
        step (a cache with static_decode, its host count already advanced): the slots it reads, its only int."""
        if self.cache is None:
            raise RuntimeError("call model.setup_caches(...) before the forward pass")
        B, T = tokens.shape
        if decode and T != 1:
            raise ValueError(f"a decode step takes one token per row, got {T}")
        if input_pos.dim() == 1:
            input_pos = input_pos[None].expand(B, T)
        if n_read is None:
            self.cache.begin(input_pos, n_filled)
        elif decode and self.cache.static_decode:
            self.cache.begin_static(input_pos, n_read)
        else:
            raise ValueError("n_read is for a decode step over a cache with static_decode")
        rope_idx = input_pos.clamp(min=0)
        cos, sin = self.rope_cos[rope_idx][:, None], self.rope_sin[rope_idx][:, None]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, self.cache, decode, self.ops)
        if last_only:
            x = x[:, -1:]
        return self.output(self.norm(x, self.ops))
