"""kernels/: torch twins against dense oracles (in process), and every Triton kernel against its twin
under the Triton interpreter on CPU.

The Triton comparisons run in ONE subprocess (this file executed as a script with TRITON_INTERPRET=1
in its environment), because Triton reads TRITON_INTERPRET when a kernel is decorated and something
else in the pytest process may already have imported Triton without it.  The subprocess prints one
JSON record per case; each case is then its own test here.
"""
import json
import math
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:     # also run as a script (the Triton subprocess below)
    sys.path.insert(0, str(ROOT))

from tests.helpers import needs_cpp  # noqa: E402

from kernels import (approx_scores, approx_scores_torch, dequantize_labels_4bit,  # noqa: E402
                     mask_sink_recent, pack_4bit, quantize_labels_4bit, resolve_backend,
                     select_critical, sparse_decode_attention, sparse_decode_attention_torch,
                     unpack_4bit)
from model import grouped_attention  # noqa: E402

# (atol, rtol) of a low-precision result against an fp32 reference / of two backends
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------------- inputs
def make_attn(B=2, Hq=9, Hkv=3, S=80, D=64, N=37, Hidx=3, dtype=torch.float32, p_invalid=0.2,
              dup=False, seed=0, idx_dtype=torch.int64, strided=False, device="cpu"):
    """Random q/k/v, unique indices (or with duplicates), a valid mask with ~p_invalid False
    entries whose idx is -1 (never read); drawn on the CPU (the same values on every device), on `device`."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(device, dtype)
    S_buf = S + 16 if strided else S   # strided: the live prefix of a larger buffer (non-contiguous)
    k = torch.randn(B, Hkv, S_buf, D, generator=g).to(device, dtype)[:, :, :S]
    v = torch.randn(B, Hkv, S_buf, D, generator=g).to(device, dtype)[:, :, :S]
    if dup:
        idx = torch.randint(0, S // 4, (B, Hidx, N), generator=g)       # many repeats
    else:
        idx = torch.stack([torch.randperm(S, generator=g)[:N] for _ in range(B * Hidx)]).view(B, Hidx, N)
    valid = None
    if p_invalid:
        valid = torch.rand(B, Hidx, N, generator=g) >= p_invalid
        idx = idx.masked_fill(~valid, -1)
        valid = valid.to(device)
    return q, k, v, idx.to(device, idx_dtype), valid


def dense_oracle(q, k, v, idx, valid, additive_counts=False):
    """model.grouped_attention over the whole cache with a mask = the index set (per KV head or per
    query head).  additive_counts: a float mask log(multiplicity) instead (duplicates count k times)."""
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G, Hidx = Hq // Hkv, idx.shape[1]
    ok = torch.ones_like(idx, dtype=torch.bool) if valid is None else valid
    counts = torch.zeros(B, Hidx, S).scatter_add_(2, torch.where(ok, idx, 0).long(), ok.float())
    if Hidx == Hkv:
        counts = counts[:, :, None].expand(B, Hkv, G, S)
    counts = counts.reshape(B, Hkv, G, S)
    mask = counts.log() if additive_counts else counts > 0
    out = grouped_attention(q.float()[:, :, None], k.float(), v.float(), mask)
    return out.squeeze(2)


def make_labels(B=2, Hq=9, Hkv=3, S=70, C=16, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ql = torch.randn(B, Hq, C, generator=g).to(device, dtype)
    lab = (torch.randn(B, Hkv, S, C, generator=g) * 2 + 0.5).to(device, dtype)
    lab[0, 0, 3] = 1.25                 # a constant token (4-bit: scale 0)
    return ql, lab


# ----------------------------------------------------------------------------------- twins
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("shared", [True, False], ids=["Hidx=Hkv", "Hidx=Hq"])
def test_sparse_twin_equals_masked_dense(dtype, D, shared):
    q, k, v, idx, valid = make_attn(D=D, Hidx=3 if shared else 9, dtype=dtype)
    out = sparse_decode_attention_torch(q, k, v, idx, valid)
    assert out.dtype == dtype and out.shape == q.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), dense_oracle(q, k, v, idx, valid), atol=atol, rtol=rtol)


CPP = pytest.param("cpp", marks=needs_cpp)


@pytest.mark.parametrize("backend", ["torch", CPP])
@pytest.mark.parametrize("shared", [True, False], ids=["Hidx=Hkv", "Hidx=Hq"])
def test_sparse_attention_layouts(shared, backend):
    """int32 indices, a strided cache view, q as [B, H_q, 1, D], no valid mask, MHA (G = 1); the torch
    twin and the C++ CPU kernel."""
    q, k, v, idx, valid = make_attn(Hidx=3 if shared else 9, idx_dtype=torch.int32, strided=True)
    assert not k.is_contiguous()
    ref = dense_oracle(q, k, v, idx, valid)
    attend = partial(sparse_decode_attention, backend=backend)
    torch.testing.assert_close(attend(q, k, v, idx, valid), ref, atol=2e-5, rtol=1e-5)
    out4 = attend(q[:, :, None], k, v, idx, valid)
    assert out4.shape == (2, 9, 1, 64)
    torch.testing.assert_close(out4[:, :, 0], ref, atol=2e-5, rtol=1e-5)
    ws = {}                                               # caller-owned gather buffers, reused by the twin
    for seed in (1, 2):
        q2, k2, v2, idx2, valid2 = make_attn(Hidx=3 if shared else 9, seed=seed)
        torch.testing.assert_close(attend(q2, k2, v2, idx2, valid2, workspace=ws),
                                   dense_oracle(q2, k2, v2, idx2, valid2), atol=2e-5, rtol=1e-5)
    assert len(ws) == (2 if backend == "torch" else 0)
    q, k, v, idx, _ = make_attn(Hq=4, Hkv=4, Hidx=4, p_invalid=0)
    torch.testing.assert_close(attend(q, k, v, idx), dense_oracle(q, k, v, idx, None), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", CPP])
def test_sparse_attention_empty_rows_and_duplicates(backend):
    q, k, v, idx, valid = make_attn(dup=True, p_invalid=0.3)
    valid[1, 2] = False                                   # a row with nothing to attend to -> 0
    out = sparse_decode_attention(q, k, v, idx, valid, backend=backend)
    assert torch.isfinite(out).all()
    assert out[1, 6:9].abs().max() == 0
    # documented semantics: a duplicated index counts once per occurrence
    ref = dense_oracle(q, k, v, idx, valid, additive_counts=True)
    torch.testing.assert_close(out[:, :6], ref[:, :6], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], ref[0], atol=2e-5, rtol=1e-5)


def test_pack_unpack_exact():
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_4bit(unpack_4bit(every_byte)), every_byte)
    codes = torch.randint(0, 16, (3, 5, 16), dtype=torch.uint8)
    packed = pack_4bit(codes)
    assert packed.shape == (3, 5, 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_4bit(packed), codes)
    assert torch.equal(packed[..., 0] & 15, codes[..., 0]) and torch.equal(packed[..., 0] >> 4, codes[..., 1])
    with pytest.raises(ValueError):
        pack_4bit(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_quantize_labels_4bit(param_dtype):
    _, lab = make_labels(S=300)
    lab[1, 2, 7] = -3.0                                   # another constant token
    lab[1, 1, 9] = lab[1, 1, 9] * 1e-6                    # a tiny range
    packed, scale, mn = quantize_labels_4bit(lab, param_dtype)
    assert packed.shape == (2, 3, 300, 8) and scale.dtype == mn.dtype == param_dtype
    deq = dequantize_labels_4bit(packed, scale, mn)
    assert torch.isfinite(deq).all()
    assert torch.equal(deq[0, 0, 3], lab[0, 0, 3]) and torch.equal(deq[1, 2, 7], lab[1, 2, 7])
    assert scale[0, 0, 3] == 0 and scale[1, 2, 7] == 0
    err = (deq - lab).abs()
    bound = scale.float()[..., None] / 2 * (1 + 1e-5) + 1e-6 * lab.abs()   # fp32 rounding slack
    assert (err <= bound).all(), (err - bound).max()
    # the rounded parameters cover the range: the extremes use codes 0 and 15 without clipping
    codes = unpack_4bit(packed)
    assert codes.max() == 15 and codes.min() == 0


@pytest.mark.parametrize("group", ["kv", "query"])
def test_approx_scores_twin(group):
    ql, lab = make_labels()
    per_head = torch.einsum("bhgc,bhsc->bhgs", ql.view(2, 3, 3, 16).double(), lab.double())
    ref = per_head.sum(2) if group == "kv" else per_head.reshape(2, 9, 70)
    s = approx_scores(ql, lab, group=group)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s.double(), ref, atol=1e-4, rtol=1e-5)
    # 4-bit labels: within the quantization error bound sum_c |q_c| * scale / 2
    packed, scale, mn = quantize_labels_4bit(lab)
    s4 = approx_scores(ql, packed, scale, mn, group=group)
    qabs = ql.abs().view(2, 3, 3, 16).sum(-1)                                   # [B, Hkv, G]
    qabs = qabs.sum(2, keepdim=True) if group == "kv" else qabs
    bound = (qabs[..., None] * scale.float()[:, :, None] / 2).reshape(s.shape)
    assert ((s4 - s).abs() <= bound * (1 + 1e-4) + 1e-4).all()
    deq_s = approx_scores(ql, dequantize_labels_4bit(packed, scale, mn), group=group)
    torch.testing.assert_close(s4, deq_s, atol=1e-4, rtol=1e-5)


def test_mask_sink_recent_and_select():
    S = 20
    scores = torch.arange(S, dtype=torch.float32).flip(0).repeat(2, 3, 1)      # [2, 3, 20], high first
    length = torch.tensor([20, 9])
    m = mask_sink_recent(scores, 2, 3, length)
    inf = float("inf")
    assert (m[0, :, :2] == inf).all() and (m[0, :, 17:] == inf).all() and torch.isfinite(m[0, :, 2:17]).all()
    assert (m[1, :, :2] == inf).all() and (m[1, :, 6:9] == inf).all() and (m[1, :, 9:] == -inf).all()
    m0 = mask_sink_recent(scores, 0, 0, 7)                 # the current token is always forced
    assert (m0[..., 6] == inf).all() and (m0[..., 7:] == -inf).all() and torch.isfinite(m0[..., :6]).all()
    idx, valid = select_critical(m, 8, return_valid=True)
    assert idx.shape == (2, 3, 8) and idx.dtype == torch.int64
    assert sorted(idx[0, 0].tolist()) == [0, 1, 2, 3, 4, 17, 18, 19]          # sinks, recent + top-3
    assert sorted(idx[1, 0].tolist()) == [0, 1, 2, 3, 4, 6, 7, 8] and valid.all()
    idx, valid = select_critical(mask_sink_recent(scores, 2, 3, torch.tensor([20, 5])), 8, return_valid=True)
    assert valid[1].sum(-1).eq(5).all() and (idx[1][valid[1]] < 5).all()
    # fused masking inside approx_scores equals scoring then masking
    ql, lab = make_labels()
    L = torch.tensor([70, 31])
    torch.testing.assert_close(approx_scores(ql, lab, length=L, n_sink=4, n_recent=8),
                               mask_sink_recent(approx_scores(ql, lab), 4, 8, L))


def test_dispatch():
    q, k, v, idx, valid = make_attn()
    assert resolve_backend("auto", q, k) == "torch"
    with pytest.raises(ValueError):
        resolve_backend("cuda", q)
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            sparse_decode_attention(q, k, v, idx, valid, backend="triton")
    # importing the package never imports Triton (kernels are built on first Triton use)
    code = "import sys; import kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


# ----------------------------------------------------------------------------------- Triton
def _attn_cases():
    cases = []
    for dt in DTYPES:
        for shared in (True, False):
            for splits in (1, 3):
                cases.append(dict(dtype=dt, D=64, Hidx=3 if shared else 9, n_splits=splits, block_n=16))
    for dt in ("fp32", "bf16"):
        for shared in (True, False):
            cases.append(dict(dtype=dt, D=128, Hidx=3 if shared else 9, n_splits=2, block_n=16))
    cases += [
        dict(dtype="fp32", D=64, Hidx=3, n_splits=2, block_n=16, dup=True),
        dict(dtype="fp32", D=64, Hidx=9, n_splits=2, block_n=16, dup=True),
        dict(dtype="fp16", D=64, Hidx=3, n_splits=2, block_n=16, empty_row=True, idx_dtype="int32",
             strided=True),
        dict(dtype="fp32", D=64, Hidx=9, n_splits=3, block_n=16, empty_row=True, p_invalid=0),
        dict(dtype="fp32", D=64, Hq=4, Hkv=4, Hidx=4, n_splits=2, block_n=16),        # MHA
        dict(dtype="fp32", D=64, Hidx=3, n_splits=None, block_n=None, N=80),          # defaults, N = S
    ]
    return cases


def _label_cases():
    cases = []
    for dt in DTYPES:
        for group in ("kv", "query"):
            cases.append(dict(kind="scores", dtype=dt, group=group, C=16, length="tensor"))
    cases += [
        dict(kind="scores", dtype="fp32", group="kv", C=8, length=None),
        dict(kind="scores", dtype="fp32", group="query", C=12, length=40),
        dict(kind="scores4", group="kv", C=16, length="tensor", param="fp16"),
        dict(kind="scores4", group="query", C=16, length="tensor", param="fp16"),
        dict(kind="scores4", group="kv", C=8, length=None, param="fp32"),
        dict(kind="mask", dtype="fp32", shape=(2, 3, 70), length="tensor"),
        dict(kind="mask", dtype="fp16", shape=(2, 9, 70), length=33),
        dict(kind="mask", dtype="fp32", shape=(2, 300), length="tensor"),
    ]
    return cases


def _case_id(case):
    return ",".join(f"{k}={v}" for k, v in case.items())


def _run_attn_case(case, device="cpu"):
    """(ok, max error) of the Triton kernel against the twin on `device` (CPU: the interpreter)."""
    from kernels import sparse_decode_attention_triton
    c = dict(case)
    dtype = DTYPES[c.pop("dtype")]
    n_splits, block_n, empty_row = c.pop("n_splits"), c.pop("block_n"), c.pop("empty_row", False)
    c["idx_dtype"] = getattr(torch, c.pop("idx_dtype", "int64"))
    if "p_invalid" not in c:
        c["p_invalid"] = 0.2
    q, k, v, idx, valid = make_attn(dtype=dtype, device=device, **c)
    if empty_row:
        valid = torch.ones_like(idx, dtype=torch.bool) if valid is None else valid
        valid[1, 2] = False
    twin = sparse_decode_attention_torch(q, k, v, idx, valid)
    out = sparse_decode_attention_triton(q, k, v, idx, valid, n_splits=n_splits, block_n=block_n)
    atol, rtol = TOL[dtype]
    err = (out.float() - twin.float()).abs()
    ok = bool(torch.isfinite(out).all() and (err <= atol + rtol * twin.float().abs()).all()
              and out.dtype == q.dtype and out.shape == q.shape)
    if empty_row:
        G = q.shape[1] // k.shape[1] if idx.shape[1] == k.shape[1] else 1   # query heads of row 2
        ok = ok and bool(out[1, 2 * G:3 * G].abs().max() == 0)
    return ok, float(err.max())


def _run_label_case(case, device="cpu"):
    """(ok, max error) of the Triton kernel against the twin on `device` (CPU: the interpreter)."""
    from kernels import approx_scores_triton, mask_sink_recent_triton
    c = dict(case)
    L = c.get("length")
    length = torch.tensor([70, 31], device=device) if L == "tensor" else L
    if c["kind"] == "mask":
        g = torch.Generator().manual_seed(1)
        shape = c["shape"]
        scores = torch.randn(*shape, generator=g).to(device, DTYPES[c["dtype"]])
        length = torch.tensor([shape[-1], 31], device=device) if L == "tensor" else L
        a = mask_sink_recent(scores, 4, 8, length)
        b = mask_sink_recent_triton(scores, 4, 8, length)
        return bool(torch.equal(a, b)), 0.0
    if c["kind"] == "scores":
        ql, lab = make_labels(C=c["C"], dtype=DTYPES[c["dtype"]], device=device)
        args = (ql, lab)
    else:
        ql, lab = make_labels(C=c["C"], device=device)
        args = (ql, *quantize_labels_4bit(lab, DTYPES[c["param"]]))
    kw = dict(group=c["group"], length=length, n_sink=4, n_recent=8)
    a = approx_scores_torch(*args, **kw)
    b = approx_scores_triton(*args, **kw)
    fin = torch.isfinite(a)
    same_inf = torch.equal(a == math.inf, b == math.inf) and torch.equal(a == -math.inf, b == -math.inf)
    err = (a[fin] - b[fin]).abs()
    ok = bool(same_inf and b.dtype == torch.float32 and a.shape == b.shape
              and (err <= 1e-4 + 1e-5 * a[fin].abs()).all())
    return ok, float(err.max())


def _main_triton_cases():
    """Subprocess entry point (TRITON_INTERPRET=1): one JSON line per case."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for kind, cases, run in (("attn", _attn_cases(), _run_attn_case),
                             ("label", _label_cases(), _run_label_case)):
        for case in cases:
            try:
                ok, err = run(case)
                rec = dict(ok=ok, err=err)
            except Exception as e:  # reported by the matching test
                rec = dict(ok=False, err=None, error=f"{type(e).__name__}: {e}")
            print(json.dumps(dict(key=f"{kind}:{_case_id(case)}", **rec)), flush=True)


@pytest.fixture(scope="module")
def triton_results():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--triton-cases"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["key"]: r for r in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.parametrize("case", _attn_cases(), ids=_case_id)
def test_triton_sparse_attention(triton_results, case):
    rec = triton_results[f"attn:{_case_id(case)}"]
    assert rec["ok"], rec


@pytest.mark.parametrize("case", _label_cases(), ids=_case_id)
def test_triton_label_scores(triton_results, case):
    rec = triton_results[f"label:{_case_id(case)}"]
    assert rec["ok"], rec


if __name__ == "__main__" and "--triton-cases" in sys.argv:
    _main_triton_cases()
