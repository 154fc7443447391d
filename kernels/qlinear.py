"""Weight-only int8/int4 linear layers: the row-major format, its per-backend layouts, the kernels and
their torch twins, and the modules the checkpoint loader swaps into `model.Transformer`.

Row-major format (what `python quantize.py` writes and the GGUF repack produces), W [N, K], groups of
G consecutive input channels per output row (K % G == 0, G % 32 == 0):
    int8  qweight int8 [N, K]                 W~ = scale * q                 (q in [-127, 127])
    int4  qweight uint8 [N, K // 2]           W~ = scale * q + min           (q in [0, 16))
          byte i of a row holds k = 2i in its low nibble and k = 2i + 1 in its high nibble
    scales fp16 [N, K // G]; mins fp16 [N, K // G] (int4 only; a symmetric int4 scheme has
    min = -8 * scale, exactly representable, so one kernel serves both)
A `QWeight` holds one such tensor; `dequantize(qw)` -> W~ fp32.

Backends of `QuantizedLinear` (chosen when the module is built, by its device):
    cpp     CPU: kvc::qlinear (kernels/cpu_qlinear.cpp) on 16-row tiles (`to_tiles`), ONE arithmetic for every
            row count, batch-invariant: each row of x is rounded alone to int8 codes per block of 32
            (d = max|x| / 127: llama.cpp's Q8 activations), each block's products with the stored codes are
            summed exactly in int32, and the blocks are added in order in fp32 with the same fused multiply-adds
            whatever the number of rows, the other rows, the register blocking or the threads: a request's
            logits do not depend on prefill chunk size, batch size or its neighbours (tests/test_batch_invariance.py).
            Twin: `qlinear_reference`.  The instructions (`isa`, from KVC_QLINEAR_ARITH: kernels/cpu.py
            qlinear_isa_default) are AVX-512 VNNI vpdpbusd, AVX2 vpmaddubsw or portable loops, bitwise equal.
    triton  CUDA: a GEMV that dequantizes the row-major codes in registers (y = x W~^T) for up to
            MAX_GEMV_ROWS rows; more rows dequantize W~ once and use the dense matmul.
    torch   anywhere (no compiler for the C++ kernels, or backend="torch"): dequantize + F.linear.
`qlinear_torch` (y = x W~^T) is the twin of the Triton GEMV and the oracle of the others.
Why int8 activations for every row count: the arithmetic used to change with the row count (16-bit activations
in 16-row GEMVs below 128 rows, int8 from 128), so chunking and batching flipped greedy tokens on the Q4_1 GGUF
(issue 49).  One arithmetic it is, and int8 (llama.cpp's own; vpdpbusd takes 4 products where the 16-bit
vpdpwssd takes 2) was the faster of the two, side by side on the default model's five layer shapes (4 Q4_1 +
the Q8_0 head), min of N calls, 16-bit / int8 time: 1 thread, M = 1 (decode) 1695 / 1485 us (1.14x; per shape
0.86-1.41x), M = 256 (a prefill chunk) 1.31x (1.16-1.61x); 2 threads, M = 1, the linear layers of one decode
token (30 layers + head, direct bindings): 2.33-2.84 ms before, 1.90-1.96 ms now (a decode step at 2048 tokens
took ~21 ms: attention and per-op overhead dominate).  2-core Intel Xeon with AVX-512 VNNI, shared with other
jobs (2026-11-29, load average ~2-5; under load 14-38 the 1-thread ratios were 1.18x and 1.21x).
Exact activations (fp32 FMA) need ~2x the instructions of the 16-bit kernel; dequantize + oneDNN's matmul rounds
by row count; torch's packed CPU ops (aten._weight_int8pack_mm, _weight_int4pack_mm_for_cpu,
_dyn_quant_matmul_4bit) are slower here at batch 1 or need bf16 activations.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .backend import resolve_backend
from .cpu import QLINEAR_ISA, qlinear_isa_default

TILE = 16            # rows per CPU tile
MIN_GROUP = 32       # group sizes are multiples of this
MAX_GEMV_ROWS = 16   # rows of x the Triton GEMV takes (more rows dequantize + dense matmul)

triton = tl = None   # imported lazily by _kernels(): importing this module never imports Triton
_eager_ops = None    # kernels.cpu.eager_ops() once a layer takes the cpp backend (eager calls skip the dispatcher)


@dataclass
class QWeight:
    """A quantized weight in the row-major format (module docstring); shape = (N, K)."""
    qweight: Tensor
    scales: Tensor
    mins: Optional[Tensor]
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * (8 // self.bits)

    def map(self, fn) -> "QWeight":
        """The same weight with `fn` applied to each tensor (row selections, device moves)."""
        return QWeight(fn(self.qweight), fn(self.scales), None if self.mins is None else fn(self.mins),
                       self.bits, self.group)


def check_qweight(qw: QWeight) -> None:
    """ValueError unless the tensors of `qw` are consistent (dtypes, shapes, group)."""
    N, K = qw.shape
    if qw.bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {qw.bits}")
    want = torch.int8 if qw.bits == 8 else torch.uint8
    if qw.qweight.dtype != want or qw.qweight.dim() != 2:
        raise ValueError(f"int{qw.bits} qweight must be a 2-D {want} tensor, "
                         f"got {qw.qweight.dtype} {tuple(qw.qweight.shape)}")
    if qw.group % MIN_GROUP or K % qw.group:
        raise ValueError(f"group size {qw.group} must be a multiple of {MIN_GROUP} dividing K={K}")
    for name, t in (("scales", qw.scales), ("mins", qw.mins)):
        if t is None and (name == "scales" or qw.bits == 4):
            raise ValueError(f"int{qw.bits} weight without {name}")
        if t is not None and (t.dtype != torch.float16 or tuple(t.shape) != (N, K // qw.group)):
            raise ValueError(f"{name} must be fp16 [{N}, {K // qw.group}], got {t.dtype} {tuple(t.shape)}")


# ------------------------------------------------------------------------------ row-major format
def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [..., K // 2] -> codes uint8 [..., K] (low nibble first)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def pack_int4(codes: Tensor) -> Tensor:
    """codes [..., K] in [0, 16) -> uint8 [..., K // 2] (inverse of unpack_int4)."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def codes_of(qw: QWeight) -> Tensor:
    """Integer codes [N, K] (int8 or uint8)."""
    return qw.qweight if qw.bits == 8 else unpack_int4(qw.qweight)


def dequantize(qw: QWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """W~ [N, K] in fp32 (then `dtype`): scale * q (+ min), group-wise."""
    q = codes_of(qw).float()
    N, K = q.shape
    q = q.view(N, K // qw.group, qw.group) * qw.scales.float()[..., None]
    if qw.mins is not None:
        q = q + qw.mins.float()[..., None]
    return q.view(N, K).to(dtype)


# ------------------------------------------------------------------------------ CPU tiles
_INT8_ORDER = [0, 2, 1, 3]              # channel order of a tile dword's bytes (int8), its own inverse
_INT4_LOW, _INT4_HIGH = [0, 4, 1, 5], [2, 6, 3, 7]   # channels in the low / high nibbles of its 4 bytes


def to_tiles(qw: QWeight, chunk: int = 2048) -> tuple[Tensor, Tensor, Tensor]:
    """Row-major -> the C++ kernel's tiles (layouts: kernels/cpu_qlinear.cpp): (w [N'/16, K/4 or K/8,
    16, 4] int8 / uint8, scales, mins fp16 [N'/16, K/G, 16]; mins empty for int8), rows padded with
    zeros to N' = a multiple of 16.  Converted `chunk` rows at a time (small temporaries: a large
    head would otherwise raise the loader's peak memory by a few copies of itself)."""
    if qw.shape[0] <= chunk:
        return _tiles(qw)
    assert chunk % TILE == 0
    first = _tiles(qw.map(lambda t: t[:chunk]))
    NT = -(-qw.shape[0] // TILE)
    out = tuple(t.new_empty((NT, *t.shape[1:])) if t.numel() else t for t in first)
    for i in range(0, qw.shape[0], chunk):          # written in place: no list of parts to concatenate
        part = first if i == 0 else _tiles(qw.map(lambda t: t[i:i + chunk]))
        for o, p in zip(out, part):
            if o.numel():
                o[i // TILE:i // TILE + p.shape[0]] = p
    return out


def _tiles(qw: QWeight) -> tuple[Tensor, Tensor, Tensor]:
    pad = -qw.shape[0] % TILE

    def per_tile(t: Tensor) -> Tensor:                   # [N, X] -> [N'/16, X, 16]
        t = F.pad(t, (0, 0, 0, pad))
        return t.view(t.shape[0] // TILE, TILE, -1).transpose(1, 2).contiguous()
    q = F.pad(codes_of(qw), (0, 0, 0, pad))
    NT = q.shape[0] // TILE
    if qw.bits == 8:
        dwords = q.view(NT, TILE, -1, 4)[..., _INT8_ORDER]
    else:
        c = q.view(NT, TILE, -1, 8)
        dwords = c[..., _INT4_LOW] | (c[..., _INT4_HIGH] << 4)
    mins = per_tile(qw.mins) if qw.mins is not None else qw.scales.new_empty(0)
    return dwords.transpose(1, 2).contiguous(), per_tile(qw.scales), mins


def tile_rows(w: Tensor, scales: Tensor, mins: Tensor, bits: int, group: int, rows: Tensor) -> QWeight:
    """The row-major QWeight of `rows` (long [L]) of tiled tensors (embedding lookups of a tied head)."""
    t, r = rows // TILE, rows % TILE
    dwords = w[t, :, r]                                  # [L, K/4 or K/8, 4]
    if bits == 8:
        q = dwords[..., _INT8_ORDER].flatten(1)
    else:
        c = torch.cat((dwords & 15, dwords >> 4), dim=-1)[..., [0, 2, 4, 6, 1, 3, 5, 7]]
        q = pack_int4(c.flatten(1))
    return QWeight(q, scales[t, :, r], mins[t, :, r] if bits == 4 else None, bits, group)


# ------------------------------------------------------------------------------ twins
def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (codes int8 [M, K], d fp32 [M, K/32]): per row and block of 32, d = max|x| / 127,
    q = round(x / d) (computed as x * (1 / d), round half to even): kvc::qlinear's codes and scales."""
    M, K = x.shape
    xb = x.float().view(M, K // MIN_GROUP, MIN_GROUP)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(xb * inv).to(torch.int8).view(M, K), d.view(M, -1)


def qlinear_reference(x: Tensor, qw: QWeight) -> Tensor:
    """kvc::qlinear's twin (the same integer arithmetic): x [M, K] -> [M, N] fp32.  Per block b of 32
    channels (group g(b)), the exact int32 sum S[m, n, b] of q_w q_x, then in fp32, block after block:
    y += S * (scale[n, g] * d[m, b]), and for int4 y += min[n, g] * (d[m, b] * sum q_x[m, b])."""
    q, d = quantize_activations(x)
    M, K = x.shape
    N, KB = qw.shape[0], K // MIN_GROUP
    qb = q.view(M, KB, MIN_GROUP)
    S = torch.einsum("mbk,nbk->mnb", qb.double(), codes_of(qw).double().view(N, KB, MIN_GROUP)).float()
    g = torch.arange(KB, device=x.device) * MIN_GROUP // qw.group
    sc = qw.scales.float()[:, g]                                      # [N, KB]
    mn = None if qw.mins is None else qw.mins.float()[:, g]
    xs = d * qb.sum(-1, dtype=torch.int32).float()                    # [M, KB]
    y = x.new_zeros((M, N), dtype=torch.float32)
    for b in range(KB):
        y = y + S[:, :, b] * (sc[None, :, b] * d[:, b, None])
        if mn is not None:
            y = y + mn[None, :, b] * xs[:, b, None]
    return y


def qlinear_torch(x: Tensor, qw: QWeight) -> Tensor:
    """x [..., K] -> x W~^T [..., N] in x's dtype (the kernels' twin)."""
    return F.linear(x, dequantize(qw, x.dtype))


# ------------------------------------------------------------------------------ Triton (CUDA)
@lru_cache(maxsize=None)
def _kernels():
    global triton, tl
    import triton as _triton
    import triton.language as _tl
    triton, tl = _triton, _tl

    @triton.jit
    def gemv(x_ptr, w_ptr, s_ptr, m_ptr, out_ptr, N, K, NG, BITS: tl.constexpr, GROUP: tl.constexpr,
             HAS_MIN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[m, n-block] = sum over k of x[m, k] * W~[n, k]; one program per (row m, BLOCK_N rows of W).
        int4 codes are read as bytes: the even k from the low nibbles, the odd k from the high ones."""
        m, pid_n = tl.program_id(0), tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        HALF: tl.constexpr = BLOCK_K // 2
        for k0 in range(0, K, BLOCK_K):
            if BITS == 8:
                k = k0 + tl.arange(0, BLOCK_K)
                ok = n_ok[:, None] & (k[None, :] < K)
                q = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=ok, other=0).to(tl.float32)
                g = k // GROUP
                w = q * tl.load(s_ptr + n[:, None] * NG + g[None, :], mask=ok, other=0).to(tl.float32)
                x = tl.load(x_ptr + m * K + k, mask=k < K, other=0).to(tl.float32)
                acc += tl.sum(w * x[None, :], axis=1)
            else:
                i = k0 // 2 + tl.arange(0, HALF)                      # byte index: k = 2i, 2i + 1
                ok = n_ok[:, None] & (i[None, :] < K // 2)
                byte = tl.load(w_ptr + n[:, None] * (K // 2) + i[None, :], mask=ok, other=0).to(tl.int32)
                g = (2 * i) // GROUP
                s = tl.load(s_ptr + n[:, None] * NG + g[None, :], mask=ok, other=0).to(tl.float32)
                mn = tl.load(m_ptr + n[:, None] * NG + g[None, :], mask=ok, other=0).to(tl.float32)
                x_even = tl.load(x_ptr + m * K + 2 * i, mask=i < K // 2, other=0).to(tl.float32)
                x_odd = tl.load(x_ptr + m * K + 2 * i + 1, mask=i < K // 2, other=0).to(tl.float32)
                lo = (byte & 15).to(tl.float32) * s + mn
                hi = (byte >> 4).to(tl.float32) * s + mn
                acc += tl.sum(lo * x_even[None, :] + hi * x_odd[None, :], axis=1)
        tl.store(out_ptr + m * N + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)

    return gemv


def qlinear_triton(x: Tensor, qw: QWeight, block_n: int = 32, block_k: int = 128) -> Tensor:
    """The Triton GEMV: x [M, K] (contiguous) -> x W~^T [M, N] in x's dtype."""
    gemv = _kernels()
    M, K = x.shape
    N = qw.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    mins = qw.mins if qw.mins is not None else qw.scales
    gemv[(M, triton.cdiv(N, block_n))](x, qw.qweight, qw.scales, mins, out, N, K, K // qw.group, BITS=qw.bits,
                                        GROUP=qw.group, HAS_MIN=qw.mins is not None, BLOCK_N=block_n,
                                        BLOCK_K=block_k)
    return out


# ------------------------------------------------------------------------------ dispatch
def _kvc():
    """The C++ ops' direct bindings in eager code once a layer took the cpp backend, else torch.ops.kvc
    (which torch.compile traces)."""
    return torch.ops.kvc if _eager_ops is None or torch.compiler.is_compiling() else _eager_ops


def resolve_qbackend(backend: str, device: torch.device) -> str:
    """"cpp" | "triton" | "torch" for a layer on `device` ("auto": cpp on CPU when the C++ kernels
    build, triton on CUDA, torch otherwise)."""
    global _eager_ops
    from .cpu import cpu_kernels_available, eager_ops
    if backend == "cpp" or (backend == "auto" and device.type == "cpu"):
        if cpu_kernels_available() and device.type == "cpu":
            _eager_ops = eager_ops()
            return "cpp"
        if backend == "cpp":
            raise RuntimeError("backend='cpp' needs CPU tensors and the C++ CPU kernels (see kernels/cpu.py)")
        return "torch"
    probe = torch.empty(0, device=device)
    return resolve_backend(backend, probe)


# ------------------------------------------------------------------------------ modules
class QuantizedLinear(nn.Module):
    """y = x W~^T (+ bias) for a `QWeight` W~ [N, K]; x [..., K] fp32/bf16/fp16 -> [..., N] in x's dtype.

    The weight is kept only in the backend's layout (tiles for cpp, row-major otherwise), as
    non-trainable Parameters `weight`, `scales`, `mins` (empty for int8), so `model.parameters()`
    counts its bytes and `.to()` moves it.  `backend`: see the module docstring."""

    def __init__(self, qw: QWeight, bias: Optional[Tensor] = None, backend: str = "auto"):
        super().__init__()
        check_qweight(qw)
        self.out_features, self.in_features = qw.shape
        self.bits, self.group = qw.bits, qw.group
        self.backend = resolve_qbackend(backend, qw.qweight.device)
        if self.backend == "cpp":
            w, s, m = to_tiles(qw)
        else:
            w, s, m = qw.qweight, qw.scales, qw.mins if qw.mins is not None else qw.scales.new_empty(0)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.scales = nn.Parameter(s, requires_grad=False)
        self.mins = nn.Parameter(m, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # fp32 inputs go straight to the kernel (no reshapes, no padded rows to cut, no bias)
        self._direct = self.backend == "cpp" and bias is None and self.out_features % TILE == 0
        self.isa = qlinear_isa_default() if self.backend == "cpp" else None

    def _cpp(self, x: Tensor) -> Tensor:
        """x [M, K] -> [M, N] in x's dtype: kvc::qlinear in `isa` (the one arithmetic, any M)."""
        out = _kvc().qlinear(x.float().contiguous(), self.weight, self.scales, self.mins, self.bits, self.group,
                             QLINEAR_ISA[self.isa])
        out = out[:, :self.out_features] if out.shape[1] != self.out_features else out   # padded rows
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _row_major(self) -> QWeight:
        return QWeight(self.weight, self.scales, self.mins if self.bits == 4 else None, self.bits, self.group)

    def rows(self, idx: Tensor) -> QWeight:
        """Output rows `idx` (long [L]) as a row-major QWeight [L, K]."""
        if self.backend == "cpp":
            return tile_rows(self.weight, self.scales, self.mins, self.bits, self.group, idx)
        return self._row_major().map(lambda t: t[idx])

    def qweight(self) -> QWeight:
        """The whole weight, row-major (a copy for the cpp backend)."""
        return self.rows(torch.arange(self.out_features, device=self.weight.device))

    def forward(self, x: Tensor) -> Tensor:
        if self._direct and x.dtype == torch.float32 and x.is_contiguous():
            return _kvc().qlinear(x, self.weight, self.scales, self.mins, self.bits, self.group, QLINEAR_ISA[self.isa])
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.backend == "cpp":
            out = self._cpp(x2)
        elif self.backend == "triton" and x2.shape[0] <= MAX_GEMV_ROWS:
            out = qlinear_triton(x2.contiguous(), self._row_major())
        else:
            out = qlinear_torch(x2, self._row_major())
        if self.bias is not None:
            out = out + self.bias
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, "
                f"group={self.group}, backend={self.backend}")


class QuantizedEmbedding(nn.Module):
    """Embedding lookups from a tied output head's QuantizedLinear: tokens [...] -> [..., K] in `dtype`.
    The table is shared, not a submodule (it belongs to `model.output`)."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self._table = (table,)
        self.dtype = dtype

    def forward(self, tokens: Tensor) -> Tensor:
        table = self._table[0]
        if table.backend == "cpp" and tokens.dtype == torch.long:      # one op instead of tile_rows' two dozen
            rows = _kvc().qembed(table.weight, table.scales, table.mins, table.bits, table.group, table.in_features,
                              tokens.reshape(-1).contiguous())
            rows = rows if self.dtype == torch.float32 else rows.to(self.dtype)
        else:
            rows = dequantize(table.rows(tokens.reshape(-1)), self.dtype)
        return rows.view(*tokens.shape, rows.shape[-1])
