"""The C++ CPU kernels (kernels/cpu_kernels.cpp, kernels/kivi_kernels.cpp, kernels/cpu_qlinear.cpp): the
sparse readers', KIVI's, the dense caches' and the weight-quantized linear layers' fast path on CPU
(kernels/qlinear.py), beside the Triton kernels on CUDA and the torch twins everywhere.


    cpu_kernels_available()            builds the extension on first call (torch.utils.cpp_extension,
                                       -O3 -march=native, minutes once, saying so on stderr; cached under
                                       ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR), then True;
                                       False with one warning if it cannot be built (no compiler)
    sparse_decode_attention_cpu(...)   == kernels.sparse_decode_attention_torch (fp32, D 64 or 128)
    select_top_cpu(scores, bias, n)    == torch.topk of F.pad(scores, (0, n)) + bias, as a set per row
    label_scores_cpu / label_write_cpu == kernels.approx_scores_torch (no masking) / LabelCache.write_torch
                                       (cpu_labels.cpp: the label cache of ds and hshare)
    kivi_attention_cpu(...)            == kernels.kivi_attention.kivi_attention_torch (packed K/V + residual);
                                       dense reads of 2/4-bit storage in integer arithmetic where the CPU has
                                       AVX-512 VNNI (== kernels.kivi_int.kivi_attention_int_torch;
                                       KVC_KIVI_ARITH chooses, see kivi_arith_default)
    kivi_write_cpu / kivi_write_range_cpu  == SlotStore.write_torch / write_range_torch, bit for bit
    dense_attention_cpu(q, k, v, n)    decode attention over fp32 or bf16 rows [0, n), all visible
                                       (vector width: attention_lanes(), KVC_ATTN_LANES)
    decode_attention(q, k, v, visible) == model.grouped_attention of one decode query over a dense cache
                                       (the C++ kernel on fp32/bf16 CPU tensors, grouped_attention otherwise)
    prefix_attention_cpu(...)          == model.prefix_attention: decode attention where rows share a kept
                                       prefix (kvc::prefix_attention reads it once for all of them)
    kvc::dense_decode                  == dense_decode_torch: a decode step's attention over a DenseCache
    cpu_eager_ops()                    model.EagerOps with kvc::rms_norm, add_rms_norm, rope_split, silu_mul
                                       and dense_decode in eager fp32 or bf16 CPU steps (the loader's choice)
    qlinear_isa_default()              the instructions of the quantized layers' one arithmetic (kvc::qlinear: int8
                                       activations x int4/int8 codes; KVC_QLINEAR_ARITH: VNNI, AVX2, bitwise equal)
    eager_ops()                        the ops an eager decode step calls per layer as direct Python bindings
                                       (kernels/cpu_bindings.cpp): ~2 us less per call than torch.ops.kvc

Why: on CPU the torch twin of sparse attention copies the N selected K and V rows (index_select)
and runs two batched matmuls over the copies, so every selected byte crosses memory three times;
the kernel reads each selected row once, in place, with the scores, an exact softmax and the
weighted sum in registers.  torch.topk runs a generic partial sort per row; the radix select touches
each score three times.  `scripts/bench_sparse_attention.py` times both next to their twins.

Set KVC_CPU_KERNELS=0 to never build or use them (the twins then run; results are the same within
float rounding, and the selected sets are the same up to ties).
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from model import EagerOps, Linear, add_rms_norm, attend, rms_norm, rope_split, silu_mul
from .backend import arith_request

SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_kernels.cpp", "kivi_kernels.cpp", "cpu_qlinear.cpp", "cpu_linear.cpp", "cpu_labels.cpp",
                        "cpu_bindings.cpp")]
HEADERS = [Path(__file__).with_name("cpu_vec.h")]      # what the sources #include (part of the build tag)


def _build_tag() -> str:
    """A short hash of the CPU's feature flags (-march=native code must not be reused on another CPU),
    of the sources (an edited source must not load a stale build; checkouts with different kernels
    never share one build), of the Python environment (two venvs compile against different torch
    headers: sharing a build directory would make each rebuild the other's extension) and of the sources'
    folder (torch's build file names the sources by absolute path: two checkouts of the same kernels
    sharing a venv would otherwise rebuild the whole extension, minutes, each time the other one loaded it).
    OSError if a source is missing (an install without them: _build then warns and the twins run)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    folder = str(SOURCES[0].parent.resolve())
    text = flags.encode() + sys.prefix.encode() + folder.encode() + b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    return hashlib.sha1(text).hexdigest()[:10]


_available: Optional[bool] = None       # a plain global, not lru_cache: torch.compile reads it as a constant
_eager = None                           # the extension's Python module (kernels/cpu_bindings.cpp), once built


def cpu_kernels_available() -> bool:
    global _available
    if _available is None:
        _available = os.environ.get("KVC_CPU_KERNELS", "1") != "0" and _build()
    return _available


def eager_ops():
    """The extension's direct Python bindings (kernels/cpu_bindings.cpp: rms_norm, add_rms_norm, rope_split,
    dense_decode, silu_mul, qlinear, qembed, each with its torch.ops.kvc signature and ~2 us cheaper a call),
    or None when the kernels are not built.  Eager code only: torch.compile traces torch.ops.kvc."""
    return _eager if cpu_kernels_available() else None


def use_cpu_kernel(backend: str, supported: bool) -> bool:
    """Whether a dispatcher runs the C++ kernel: backend "cpp" demands it (error if it cannot), "auto"
    takes it on CPU tensors it supports when it is built."""
    if backend == "cpp":
        if not supported:
            raise ValueError("backend='cpp' needs fp32 CPU tensors (and head_dim 64 or 128 for attention)")
        if not cpu_kernels_available():
            raise RuntimeError("backend='cpp' but the C++ CPU kernels are not available (KVC_CPU_KERNELS=0 "
                               "or the build failed, see the warning)")
        return True
    return backend == "auto" and supported and cpu_kernels_available()


STALE_LOCK_SECONDS = 900


def _building_in(folder: Path) -> bool:
    """Whether a live process (the compiler or ninja of a running build) works in `folder` (Linux: /proc/*/cwd;
    False where /proc cannot tell)."""
    folder = str(folder.resolve())
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if os.readlink(cwd) == folder:
                return True
        except OSError:                                                 # gone, or not ours to read
            continue
    return False


def _clear_stale_lock(name: str) -> None:
    """torch's build lock stays behind when a build is killed, and every later load then waits on it
    forever: a lock older than STALE_LOCK_SECONDS with no live process building in its folder (a build on a
    loaded machine can take longer) is removed, with a warning."""
    lock = build_dir(name) / "lock"
    try:
        stale = time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS
    except FileNotFoundError:                                           # none, or released meanwhile
        return
    if stale and not _building_in(lock.parent):
        warnings.warn(f"removing the stale build lock {lock} (left by an interrupted build)", RuntimeWarning)
        lock.unlink(missing_ok=True)


def _watch_lock(name: str, done: threading.Event) -> None:
    """Clear a stale lock now, then every 30 s until the load is done."""
    _clear_stale_lock(name)
    while not done.wait(30):
        _clear_stale_lock(name)


BUILD_MINUTES = 3        # a cold build: 336 s of CPU time (user + sys) on a 2-core AMD EPYC VM, 2026-11-29


def build_dir(name: str) -> Path:
    """The folder torch.utils.cpp_extension builds extension `name` in (its _get_build_directory, without
    creating it): $TORCH_EXTENSIONS_DIR/name, else ~/.cache/torch_extensions/py311_cpu/name."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root
        accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
                 f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{py}_{accel}")
    return Path(root) / name


def needs_build(library: Path, sources: list[Path]) -> bool:
    """Whether loading compiles: the built library is missing or older than a source (ninja's test; the
    name's build tag already covers the CPU, the venv and the sources' contents)."""
    try:
        built = library.stat().st_mtime
    except FileNotFoundError:
        return True
    return any(p.stat().st_mtime > built for p in sources)


def extension_name() -> str:
    return f"kvc_cpu_kernels_{_build_tag()}"


def build_needed(name: str) -> bool:
    """Whether loading extension `name` compiles it (needs_build of its library in build_dir)."""
    from torch.utils.cpp_extension import LIB_EXT
    return needs_build(build_dir(name) / f"{name}{LIB_EXT}", SOURCES + HEADERS)


def build_message(folder: Path) -> str:
    """The one line printed on stderr before a build that is not cached."""
    return (f"kvc: building the C++ kernels for this machine (first use; about {BUILD_MINUTES} minutes on 2 cores, "
            f"cached in {folder}; KVC_CPU_KERNELS=0 skips them) ...")


def _build() -> bool:
    """Build (or load the cached build of) the C++ ops, saying so on stderr when it compiles; while torch
    waits on another process's build lock, a watchdog clears the lock once it is stale (its owner was killed)."""
    global _eager
    done = threading.Event()
    try:
        name = extension_name()
        from torch.utils.cpp_extension import load
        if build_needed(name):
            print(build_message(build_dir(name)), file=sys.stderr, flush=True)
        threading.Thread(target=_watch_lock, args=(name, done), daemon=True).start()
        _eager = load(name=name, sources=[str(p) for p in SOURCES],
                      extra_cflags=["-O3", "-march=native", "-fopenmp"], is_python_module=True, verbose=False)
    except Exception as e:                                  # no compiler, no headers, a source missing, ...
        warnings.warn(f"the C++ CPU kernels could not be built ({type(e).__name__}: {str(e)[:200]}); "
                      f"using the torch twins (slower on CPU)", RuntimeWarning, stacklevel=2)
        return False
    finally:
        done.set()
    _register_fakes()
    return True


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing (the ops run as extern calls in the compiled graph)."""
    @torch.library.register_fake("kvc::sparse_attention")
    def _(q, k, v, idx, valid, scale):
        return torch.empty_like(q)

    @torch.library.register_fake("kvc::kivi_attention")
    def _(q, *args):
        return torch.empty_like(q)

    @torch.library.register_fake("kvc::kivi_write")
    def _(*args):
        return None

    @torch.library.register_fake("kvc::kivi_write_range")
    def _(*args):
        return None

    @torch.library.register_fake("kvc::dense_attention")
    def _(q, k, v, n, scale, lanes=0):
        return torch.empty_like(q)

    @torch.library.register_fake("kvc::select_top")
    def _(scores, bias, n):
        B, H = scores.shape[:2]
        return (scores.new_empty((B, H, n), dtype=torch.long), scores.new_empty((B, H, n), dtype=torch.bool))

    @torch.library.register_fake("kvc::label_scores")
    def _(q_label, labels, scale, minimum, group_sum):
        heads = labels.shape[1] if group_sum else q_label.shape[1]
        return q_label.new_empty((q_label.shape[0], heads, labels.shape[2]))

    @torch.library.register_fake("kvc::label_write")
    def _(*args):
        return None

    @torch.library.register_fake("kvc::decode_attention")
    def _(q, k, v, visible, scale, lanes=0):
        return torch.empty_like(q)

    @torch.library.register_fake("kvc::prefix_attention")
    def _(q, k, v, visible, pk, pv, own_from, scale, lanes=0):
        return torch.empty_like(q)

    @torch.library.register_fake("kvc::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("kvc::rope_split")
    def _(qkv, cos, sin, Hq, Hkv):
        B, T, HD = qkv.shape
        D = HD // (Hq + 2 * Hkv)
        return qkv.new_empty((B, Hq, T, D)), qkv.new_empty((B, Hkv, T, D)), qkv.new_empty((B, Hkv, T, D))

    @torch.library.register_fake("kvc::dense_decode")
    def _(qkv, cos, sin, k_cache, v_cache, visible, start, Hq, Hkv, scale, lanes=0):
        return qkv.new_empty((qkv.shape[0], 1, Hq * (qkv.shape[2] // (Hq + 2 * Hkv))))

    @torch.library.register_fake("kvc::add_rms_norm")
    def _(x, y, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("kvc::silu_mul")
    def _(gu):
        return gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))

    @torch.library.register_fake("kvc::qlinear")
    def _(x, w, scales, mins, bits, group, isa):
        return x.new_empty((*x.shape[:-1], w.shape[0] * 16))

    @torch.library.register_fake("kvc::linear_small_m")
    def _(x, w, bias):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("kvc::qembed")
    def _(w, scales, mins, bits, group, K, rows):
        return scales.new_empty((rows.shape[0], K), dtype=torch.float32)

    @torch.library.register_fake("kvc::qdequant")
    def _(w, scales, mins, bits, group, K):
        return scales.new_empty((w.shape[0] * 16, K), dtype=torch.float32)


def sparse_attention_supported(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether the kernel takes these tensors (fp32 CPU, head_dim 64 or 128, contiguous rows)."""
    return (q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and q.shape[-1] in (64, 128) and k_cache.stride(3) == 1 and v_cache.stride(3) == 1)


def sparse_decode_attention_cpu(q: Tensor, k_cache: Tensor, v_cache: Tensor, idx: Tensor,
                                valid: Optional[Tensor] = None, scale: Optional[float] = None) -> Tensor:
    """The C++ kernel; contract of kernels.sparse_decode_attention (q [B, H_q, D] or [B, H_q, 1, D])."""
    squeeze = q.dim() == 4
    if squeeze:
        q = q.squeeze(2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    no_valid = torch.empty(0, dtype=torch.bool, device=q.device)
    out = torch.ops.kvc.sparse_attention(q.contiguous(), k_cache, v_cache, idx.long().contiguous(),
                                         no_valid if valid is None else valid.contiguous(), scale)
    return out.unsqueeze(2) if squeeze else out


def select_top_cpu(scores: Tensor, bias: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Top-n slots of scores [B, h, S] + bias [B, 1 or h, S + n] (fp32) -> (idx, valid) [B, h, n],
    idx in ascending slot order (see cache.sparse_read.select_slots for the contract)."""
    return torch.ops.kvc.select_top(_unit_stride_rows(scores), _unit_stride_rows(bias), n)


def label_scores_supported(q_label: Tensor, labels: Tensor) -> bool:
    """Whether kvc::label_scores / label_write take these tensors (fp32 queries or keys on the CPU; fp32 or
    4-bit packed labels with contiguous channels)."""
    return (q_label.device.type == "cpu" and q_label.dtype == torch.float32
            and labels.dtype in (torch.float32, torch.uint8) and labels.stride(-1) == 1)


def _label_params(labels: Tensor, scale: Optional[Tensor], minimum: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """The 4-bit labels' scale and minimum, empty tensors for fp32 labels (which have none)."""
    none = labels.new_empty(0, dtype=torch.float16)
    return none if scale is None else scale, none if minimum is None else minimum


def label_scores_cpu(q_label: Tensor, labels: Tensor, scale: Optional[Tensor], minimum: Optional[Tensor],
                     group_sum: bool) -> Tensor:
    """kvc::label_scores: kernels.approx_scores without masking ([B, H_kv, S] summed over each group, or
    [B, H_q, S])."""
    return torch.ops.kvc.label_scores(q_label, labels, *_label_params(labels, scale, minimum), group_sum)


def label_write_cpu(k: Tensor, channels: Tensor, labels: Tensor, scale: Optional[Tensor], minimum: Optional[Tensor],
                    slot) -> None:
    """kvc::label_write: the label of k [B, H, 1, D] at slot (an int for every row, or [B, H] long), in place."""
    per_row = isinstance(slot, Tensor)
    slots = slot if per_row else labels.new_empty(0, dtype=torch.long)
    torch.ops.kvc.label_write(k, channels, labels, *_label_params(labels, scale, minimum), slots,
                              0 if per_row else slot)


def _unit_stride_rows(t: Tensor) -> Tensor:
    """t itself when its last dim is contiguous (the kernels take the other strides as they are)."""
    return t if t.stride(-1) == 1 else t.contiguous()


ARITH = {"fp32": 0, "avx2": 1, "vnni": 2}    # kvc::kivi_attention's `arith` codes
_kivi_arith: Optional[str] = None            # KVC_KIVI_ARITH, resolved once (kivi_arith_default)


def kivi_int_arith() -> str:
    """The integer arithmetic this build has for KIVI's dense reads: "vnni" (AVX-512 VNNI), "avx2", or
    "fp32" when it has neither (or the kernels are not built)."""
    if not cpu_kernels_available():
        return "fp32"
    return {v: k for k, v in ARITH.items()}[_eager.kivi_arith()]


def kivi_arith_default() -> str:
    """The arithmetic of kivi_attention_cpu's dense reads of 2/4-bit storage, from KVC_KIVI_ARITH (read
    once per process): "auto" (the default: the integer scheme of kernels/kivi_int.py where the CPU has
    AVX-512 VNNI, else fp32: the AVX2 integer path measured slower than the fp32 op on an AVX-512 EPYC and
    has not been timed on an AVX2-only CPU), "int" (kivi_int_arith(): VNNI or AVX2), "fp32" (the
    fp32-arithmetic op), or "avx2" / "vnni" to force one."""
    global _kivi_arith
    if _kivi_arith is None:
        best = kivi_int_arith()
        _kivi_arith = _arith_from_env("KVC_KIVI_ARITH", best, best if best == "vnni" else "fp32")
    return _kivi_arith


def _arith_from_env(var: str, best: str, auto: str) -> str:
    """The arithmetic environment variable `var` names: "auto" (or unset) -> `auto`, "int" -> `best`
    (the integer arithmetic built), else one of ARITH (ValueError for anything else)."""
    want = arith_request(var)
    return auto if want == "auto" else best if want == "int" else want


QLINEAR_ISA = {"portable": 0, "avx2": 1, "vnni": 2}     # kvc::qlinear's `isa` codes (one arithmetic)
_qlinear_isa: Optional[str] = None            # KVC_QLINEAR_ARITH, resolved once (qlinear_isa_default)


def qlinear_isa() -> str:
    """The fastest instructions this build has for kvc::qlinear: "vnni", "avx2" or "portable" (plain loops;
    also when the kernels are not built)."""
    if not cpu_kernels_available():
        return "portable"
    return {v: k for k, v in QLINEAR_ISA.items()}[_eager.qlinear_isa()]


def qlinear_isa_default() -> str:
    """The instructions of the quantized layers' kvc::qlinear from KVC_QLINEAR_ARITH (read once per process):
    "auto" (the default) and "int": qlinear_isa(); "avx2" / "vnni" to force one (ValueError where not built).
    Every choice gives bitwise the same results (one arithmetic: int8 activations x the stored codes, for every
    row count); "fp32" (dequantize + a dense matmul, whose rounding depended on the row count) was retired."""
    global _qlinear_isa
    if _qlinear_isa is None:
        want, best = arith_request("KVC_QLINEAR_ARITH"), qlinear_isa()
        if want == "fp32":
            raise ValueError("KVC_QLINEAR_ARITH=fp32 was retired: the quantized layers have one arithmetic "
                             "(int8 activations, batch-invariant); choose auto, int, avx2 or vnni")
        want = best if want in ("auto", "int") else want
        if want == "vnni" and best != "vnni" or want == "avx2" and best == "portable":
            raise ValueError(f"KVC_QLINEAR_ARITH={want} is not built here (this build's best: {best})")
        _qlinear_isa = want
    return _qlinear_isa


def kivi_attention_cpu(q: Tensor, buf, pos: Tensor, visible: Optional[Tensor], now: Tensor, n: int,
                       scale: Optional[float] = None, idx: Optional[Tensor] = None,
                       valid: Optional[Tensor] = None, arith: Optional[str] = None) -> Tensor:
    """The C++ op; contract of kernels.kivi_attention.kivi_attention (buf: its KIVIBuffers).  arith: of
    the dense reads of 2- and 4-bit storage, "fp32", "int" (kivi_int_arith()), "avx2" or "vnni" (an error
    where not built); None: kivi_arith_default().  Sparse reads and 8-bit storage are always fp32."""
    arith = kivi_arith_default() if arith is None else kivi_int_arith() if arith == "int" else arith
    if arith not in ARITH:
        raise ValueError(f"arith must be int, {', '.join(ARITH)}; got {arith!r}")
    code = ARITH[arith] if idx is None and buf.bits in (2, 4) else 0
    squeeze = q.dim() == 4
    q3 = q.squeeze(2) if squeeze else q
    scale = 1.0 / math.sqrt(q3.shape[-1]) if scale is None else scale
    out = torch.ops.kvc.kivi_attention(
        q3, buf.k_packed, buf.k_scale, buf.k_min, buf.v_packed, buf.v_scale, buf.v_min, buf.k_ring, buf.v_ring,
        _unit_stride_rows(pos), _NO_VISIBLE if visible is None else _unit_stride_rows(visible), now.contiguous(),
        _NO_INDEX if idx is None else idx.long().contiguous(), _NO_VISIBLE if valid is None else valid.contiguous(),
        n, buf.bits, buf.group, scale, code)
    return out.unsqueeze(2) if squeeze else out


def kivi_write_cpu(buf, slot: Tensor, k: Tensor, v: Tensor, pos: Tensor, now: Tensor,
                   where: Optional[Tensor] = None, copies: Optional[tuple[Tensor, Tensor]] = None) -> None:
    """The C++ twin of cache.quantized.SlotStore.write (bit for bit): k, v [B, H, 1, D] into slot [B, H];
    copies: the store's slot-major words (SlotStore.keep_slot_major), written alongside."""
    B, H, _, D = k.shape
    k_copy, v_copy = copies if copies is not None else (_NO_WORDS, _NO_WORDS)
    torch.ops.kvc.kivi_write(buf.k_packed, buf.k_scale, buf.k_min, buf.v_packed, buf.v_scale, buf.v_min,
                             buf.k_ring, buf.v_ring, slot.long().contiguous(), k.reshape(B, H, D).float().contiguous(),
                             v.reshape(B, H, D).float().contiguous(), _unit_stride_rows(pos), now.contiguous(),
                             _NO_WHERE if where is None else where.contiguous(), buf.bits, buf.group, k_copy, v_copy)


def kivi_write_range_cpu(buf, start: int, k: Tensor, v: Tensor, pos: Tensor, now: Tensor) -> None:
    """The C++ twin of cache.quantized.SlotStore.write_range (bit for bit): k, v [B, H, T, D] into slots
    [start, start + T)."""
    torch.ops.kvc.kivi_write_range(buf.k_packed, buf.k_scale, buf.k_min, buf.v_packed, buf.v_scale, buf.v_min,
                                   buf.k_ring, buf.v_ring, start, k.float().contiguous(), v.float().contiguous(),
                                   _unit_stride_rows(pos), now.contiguous(), buf.bits, buf.group)


_attn_lanes: Optional[int] = None           # KVC_ATTN_LANES, resolved once (attention_lanes)


def attention_lanes() -> int:
    """The vector width of the dense decode attention ops (kvc::decode_attention, dense_attention,
    dense_decode) from KVC_ATTN_LANES (read once per process): "auto" (the default, 0: the build's ISA's,
    16 lanes with AVX-512, 8 with AVX2), "16" or "8" to force one (8 runs the AVX2 path on an AVX-512 CPU)."""
    global _attn_lanes
    if _attn_lanes is None:
        want = os.environ.get("KVC_ATTN_LANES", "auto")
        if want not in ("auto", "8", "16"):
            raise ValueError(f"KVC_ATTN_LANES must be auto, 8 or 16; got {want!r}")
        _attn_lanes = 0 if want == "auto" else int(want)
    return _attn_lanes


def dense_attention_cpu(q: Tensor, k: Tensor, v: Tensor, n: int, scale: Optional[float] = None) -> Tensor:
    """kvc::dense_attention: q [B, H_q, 1, D] fp32 over slots [0, n) of k, v [B, H_kv, S, D] (fp32 or bf16,
    rows contiguous), every slot visible -> [B, H_q, 1, D]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.kvc.dense_attention(q.squeeze(2).contiguous(), k, v, n, scale, attention_lanes()).unsqueeze(2)


DENSE_DTYPES = (torch.float32, torch.bfloat16)     # the dense decode kernels' K/V (and q: taken as fp32)


def _dense_rows(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether k, v [.., D] are CPU rows the dense decode kernels read: fp32 or bf16 in q's dtype, rows
    contiguous, head_dim 64 or 128."""
    return (k.device.type == "cpu" and q.dtype == k.dtype == v.dtype and k.dtype in DENSE_DTYPES
            and q.shape[-1] in (64, 128) and k.stride(3) == 1 and v.stride(3) == 1)


def _dense_decode_kernel_takes(q: Tensor, k: Tensor, v: Tensor, pk: Optional[Tensor] = None,
                               pv: Optional[Tensor] = None) -> bool:
    """Whether the C++ dense decode kernels take one query q [B, H_q, 1, D] over k, v (and a shared prefix
    pk, pv): fp32 or bf16 CPU tensors of one dtype (_dense_rows), the kernels built.  (bf16: q goes in as fp32,
    the attention runs in fp32 over the bf16 rows, the output is rounded to bf16.)"""
    return (q.shape[2] == 1 and _dense_rows(q, k, v) and (pk is None or _dense_rows(q, pk, pv))
            and cpu_kernels_available())


def decode_attention(q: Tensor, k: Tensor, v: Tensor, visible: Optional[Tensor]) -> Tensor:
    """Decode attention over a dense cache: q [B, H_q, 1, D], k, v [B, H_kv, S, D], visible bool
    [B, 1 or H_kv, >= S] (True = attend) or None -> [B, H_q, 1, D]; query head h reads KV head
    h // (H_q / H_kv).  The C++ kernel (each K/V row read once, in place; ~2.5x the rate of
    F.scaled_dot_product_attention's CPU kernel for one query) on fp32 or bf16 CPU tensors with head_dim 64 or
    128, else model.grouped_attention with the equivalent mask."""
    B, Hq, T, D = q.shape
    S = k.shape[2]
    if _dense_decode_kernel_takes(q, k, v):
        vis = torch.empty(0, dtype=torch.bool) if visible is None else _unit_stride_rows(visible)
        out = torch.ops.kvc.decode_attention(q.reshape(B, Hq, D).float().contiguous(), k, v, vis,
                                             1.0 / math.sqrt(D), attention_lanes())
        return out.to(q.dtype).view(B, Hq, 1, D)
    from model import grouped_attention
    if visible is not None:                     # a row with nothing visible (a free row): any finite output
        visible = visible[..., :S] | ~visible[..., :S].any(-1, keepdim=True)
    mask = None if visible is None else visible[..., None, :].expand(B, visible.shape[1], (Hq // k.shape[1]) * T, S)
    return grouped_attention(q, k, v, mask)


def prefix_attention_cpu(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, pk: Tensor, pv: Tensor,
                         own_from: Tensor) -> Tensor:
    """model.prefix_attention (rows reading a shared prefix) as kvc::prefix_attention where decode_attention
    takes the C++ kernel (the prefix's K/V read once for all its rows), else model.prefix_attention."""
    B, Hq, T, D = q.shape
    if _dense_decode_kernel_takes(q, k, v, pk, pv):
        out = torch.ops.kvc.prefix_attention(q.reshape(B, Hq, D).float().contiguous(), k, v, _unit_stride_rows(visible),
                                             pk, pv, own_from.contiguous(), 1.0 / math.sqrt(D), attention_lanes())
        return out.to(q.dtype).view(B, Hq, 1, D)
    from model import prefix_attention
    return prefix_attention(q, k, v, visible, pk, pv, own_from)


def dense_decode_torch(qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, visible: Tensor,
                       start: int, Hq: int, Hkv: int) -> Tensor:
    """kvc::dense_decode's twin: qkv [B, 1, (Hq + 2 Hkv) D], cos, sin [B, 1, 1, D] -> [B, 1, Hq D], k and v
    written into slot `start` of k_cache, v_cache [B, Hkv, C, D] (model.rope_split, DenseCache's
    slot writes and grouped_attention over slots [0, start] with row 0 of visible [B, R, >= start + 1] or,
    empty, all)."""
    from model import apply_rope, grouped_attention
    B, _, HD = qkv.shape
    D, n = HD // (Hq + 2 * Hkv), start + 1
    heads = qkv.view(B, 1, Hq + 2 * Hkv, D).transpose(1, 2)
    qk = apply_rope(heads[:, :Hq + Hkv], cos, sin)
    k_cache[:, :, start] = qk[:, Hq:, 0]
    v_cache[:, :, start] = heads[:, Hq + Hkv:, 0]
    mask = None if visible.numel() == 0 else visible[:, :1, :n].expand(B, Hq // Hkv, n)
    out = grouped_attention(qk[:, :Hq], k_cache[:, :, :n], v_cache[:, :, :n], mask)
    return out.transpose(1, 2).reshape(B, 1, Hq * D)


def linear_small_m(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """kvc::linear_small_m: F.linear(x, weight, bias) for fp32 or bf16 CPU x [..., K] with at most 16 rows and a
    contiguous weight [N, K] in x's dtype (model.Linear's decode kernel: W streamed once; see
    kernels/cpu_linear.cpp)."""
    y = torch.ops.kvc.linear_small_m(x.reshape(-1, x.shape[-1]), weight,
                                     _NO_BIAS if bias is None else bias)
    return y.view(*x.shape[:-1], weight.shape[0])


_NO_BIAS = torch.empty(0)


def linear_kernel_pays() -> bool:
    """Whether linear_small_m beats oneDNN here: on AVX-512 CPUs (1.3-1.6x oneDNN's rate at 1 row); built
    for AVX2 its 16-float vectors take two registers each, its accumulators spill, and on a 2-core AVX2
    EPYC the default model's eager decode step took 1.9x oneDNN's time at batch 8 (equal at batch 1)."""
    return cpu_kernels_available() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def use_linear_kernel(model: torch.nn.Module) -> None:
    """Plug linear_small_m into every model.Linear of `model` (its decode-sized fp32 and bf16 CPU steps) where
    it pays (linear_kernel_pays)."""
    if linear_kernel_pays():
        for mod in model.modules():
            if isinstance(mod, Linear):
                mod.small_m_kernel = linear_small_m


def _eager_cpu(*tensors: Tensor, rope: tuple = ()) -> bool:
    """Whether the fused eager ops below take these tensors (eager, contiguous CPU tensors of one dtype, fp32 or
    bf16, and RoPE tables `rope` in fp32; kernels built); they then call the direct bindings (`_eager`, see
    eager_ops).  (A plain loop over cheap properties: it runs a few times per layer and step.)"""
    if torch.compiler.is_compiling() or not cpu_kernels_available():
        return False
    dtype = tensors[0].dtype
    if dtype not in DENSE_DTYPES:
        return False
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
            return False
    for t in rope:
        if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
            return False
    return True


def rms_norm_cpu(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """model.rms_norm as one C++ op (kvc::rms_norm; F.rms_norm is six ATen ops) in eager fp32 or bf16 CPU steps;
    under torch.compile (Inductor fuses it anyway) and elsewhere model.rms_norm."""
    if _eager_cpu(x, weight):
        return _eager.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


def add_rms_norm_cpu(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """model.add_rms_norm (the attention's residual add and ffn_norm) as one C++ op (kvc::add_rms_norm)
    in eager fp32 or bf16 CPU steps."""
    if _eager_cpu(x, y, weight):
        return _eager.add_rms_norm(x, y, weight, eps)
    return add_rms_norm(x, y, weight, eps)


def rope_split_cpu(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv_heads: int):
    """model.rope_split (view, slices and RoPE's seven ops) as one C++ op (kvc::rope_split) in eager fp32 or
    bf16 CPU steps."""
    if _eager_cpu(qkv, rope=(cos, sin)) and cos.shape[1] == 1:      # cos/sin [B, 1, T, D]: [B, T, D] in memory
        return _eager.rope_split(qkv, cos, sin, n_heads, n_kv_heads)
    return rope_split(qkv, cos, sin, n_heads, n_kv_heads)


def silu_mul_cpu(gate_up: Tensor) -> Tensor:
    """model.silu_mul (SwiGLU's chunk, silu and product) as one C++ op (kvc::silu_mul) in eager fp32 or bf16
    CPU steps."""
    if _eager_cpu(gate_up):
        return _eager.silu_mul(gate_up)
    return silu_mul(gate_up)


def dense_decode_cpu(qkv: Tensor, cos: Tensor, sin: Tensor, cache, layer: int, n_heads: int,
                     n_kv_heads: int) -> Tensor:
    """model.dense_decode as one C++ op (kvc::dense_decode: the head split, RoPE, both slot writes, the
    masked decode attention, heads already in wo's layout) when the cache's decode kernel is
    decode_attention (the op's attention), every row writes the same slot (cache.aligned)
    and the step is eager fp32 or bf16 CPU (the cache in qkv's dtype) with head_dim 64 or 128; else
    the cache's decode hook after rope_split_cpu."""
    D = qkv.shape[-1] // (n_heads + 2 * n_kv_heads)
    if (cache.decode_kernel is decode_attention and cache.aligned and D in (64, 128) and cos.shape[1] == 1
            and _eager_cpu(qkv, cache.k[layer], cache.v[layer], rope=(cos, sin))):
        visible = _NO_VISIBLE if cache.mask is None else cache.mask
        return _eager.dense_decode(qkv, cos, sin, cache.k[layer], cache.v[layer], visible, cache.start,
                                   n_heads, n_kv_heads, 1.0 / math.sqrt(D), attention_lanes())
    return attend(cache.decode, layer, qkv, cos, sin, n_heads, n_kv_heads, rope_split_cpu)


# the C++ ops' "none given" arguments (empty CPU tensors), made once instead of per call
_NO_VISIBLE = torch.empty(0, 0, 0, dtype=torch.bool)
_NO_INDEX = torch.empty(0, dtype=torch.long)
_NO_WHERE = torch.empty(0, dtype=torch.bool)
_NO_WORDS = torch.empty(0, dtype=torch.int32)


def cpu_eager_ops() -> EagerOps:
    """model.EagerOps with the C++ ops above: the loader's choice (Transformer.use_ops) on every device,
    each op stepping aside to model.py's function outside eager fp32 or bf16 CPU steps."""
    return EagerOps(rms_norm=rms_norm_cpu, add_rms_norm=add_rms_norm_cpu, rope_split=rope_split_cpu,
                    silu_mul=silu_mul_cpu, dense_decode=dense_decode_cpu)
