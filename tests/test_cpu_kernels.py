"""kernels/cpu.py: the C++ CPU kernels against their torch twins (sparse attention) and torch.topk
(the radix select), on random cases and the edge cases the policies produce."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import needs_cpp  # noqa: E402

from cache.sparse_read import select_slots  # noqa: E402
from kernels import sparse_decode_attention, sparse_decode_attention_torch  # noqa: E402
from kernels.cpu import cpu_kernels_available, select_top_cpu, sparse_decode_attention_cpu  # noqa: E402
from model import grouped_attention  # noqa: E402

INF = float("inf")
pytestmark = needs_cpp


def test_the_kernels_build_here():
    assert cpu_kernels_available(), "the C++ CPU kernels failed to build (see the warning)"


@pytest.mark.parametrize("B,Hq,Hkv,S,N,D", [(1, 9, 3, 300, 37, 64), (3, 8, 2, 513, 130, 128), (2, 4, 4, 70, 70, 64),
                                            (2, 12, 3, 1000, 512, 64)])
@pytest.mark.parametrize("shared", [True, False], ids=["Hidx=Hkv", "Hidx=Hq"])
def test_sparse_attention_equals_twin(B, Hq, Hkv, S, N, D, shared):
    """GQA 3:1 and 4:1, MHA, N not a power of two, N not a multiple of 16 (the exp tail), D 64/128."""
    g = torch.Generator().manual_seed(B * 100 + N)
    q = torch.randn(B, Hq, D, generator=g) * 3          # large logits: the exp must hold up
    k, v = torch.randn(2, B, Hkv, S, D, generator=g)
    Hidx = Hkv if shared else Hq
    idx = torch.stack([torch.randperm(S, generator=g)[:N] for _ in range(B * Hidx)]).view(B, Hidx, N)
    valid = torch.rand(B, Hidx, N, generator=g) > 0.25
    idx = idx.masked_fill(~valid, -7)                  # invalid entries are never read
    out = sparse_decode_attention_cpu(q, k, v, idx, valid)
    torch.testing.assert_close(out, sparse_decode_attention_torch(q, k, v, idx, valid), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sparse_decode_attention_cpu(q, k, v, idx.clamp(min=0)),
                               sparse_decode_attention_torch(q, k, v, idx.clamp(min=0)), atol=1e-5, rtol=1e-5)


def test_sparse_attention_dispatch():
    """auto takes the kernel for fp32 CPU tensors, the twin for the dtypes it lacks; cpp insists."""
    q, k, v = torch.randn(1, 3, 64), torch.randn(1, 3, 20, 64), torch.randn(1, 3, 20, 64)
    idx = torch.arange(5).view(1, 1, 5).expand(1, 3, 5)
    ref = sparse_decode_attention_torch(q, k, v, idx)
    torch.testing.assert_close(sparse_decode_attention(q, k, v, idx), ref)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    assert sparse_decode_attention(qb, kb, vb, idx).dtype == torch.bfloat16     # twin
    with pytest.raises(ValueError, match="fp32"):
        sparse_decode_attention(qb, kb, vb, idx, backend="cpp")


def reference_select(scores, bias, n):
    vals, idx = torch.topk(F.pad(scores, (0, n)) + bias, n, dim=-1)
    return idx, vals > -INF


def as_sets(idx, ok):
    return [[sorted(i[o].tolist()) for i, o in zip(ib, ob)] for ib, ob in zip(idx, ok)]


@pytest.mark.parametrize("S,n", [(4096 + 37, 512), (300, 128), (129, 128), (40, 64)])
@pytest.mark.parametrize("per_head_bias", [False, True])
def test_select_top_equals_topk(S, n, per_head_bias):
    """Random scores, forced (+inf) sinks/recent, hidden (-inf) slots, fewer readable slots than n."""
    g = torch.Generator().manual_seed(S + n)
    B, H = 2, 3
    scores = torch.randn(B, H, S, generator=g)
    bias = torch.zeros(B, H if per_head_bias else 1, S)
    bias[..., :4] = INF
    bias[..., -8:] = INF
    bias[1, ..., S // 2:S // 2 + 20] = -INF
    bias[..., 10:12] = -INF
    bias = F.pad(bias, (0, n), value=-INF)
    idx, ok = select_top_cpu(scores, bias, n)
    ref_idx, ref_ok = reference_select(scores, bias, n)
    assert idx.shape == ok.shape == (B, H, n) and idx.dtype == torch.long
    assert as_sets(idx, ok) == as_sets(ref_idx, ref_ok)
    assert (idx[ok] < S).all() and (ok.sum(-1) == ref_ok.sum(-1)).all()
    assert (idx.diff(dim=-1) > 0).all()                                     # ascending slots


def test_select_top_ties_and_signs():
    """Equal scores (ties go to the lower slots, as many as fit), negative and zero values, -0.0."""
    S, n = 50, 10
    scores = torch.zeros(1, 2, S)
    scores[0, 0, 30:] = -1.0                            # 30 zeros above 20 negatives: 10 of the zeros
    scores[0, 1] = torch.tensor([-0.0, 0.0] * 25)
    scores[0, 1, 45] = -3.0
    scores[0, 1, 7] = 2.5
    bias = torch.full((1, 1, S + n), -INF)
    bias[..., :S] = 0
    idx, ok = select_top_cpu(scores, bias, n)
    assert ok.all()
    assert idx[0, 0].tolist() == list(range(10))
    assert 7 in idx[0, 1].tolist() and 45 not in idx[0, 1].tolist()
    # the same set as torch.topk whenever the n-th value is not tied
    scores = torch.randn(1, 2, S).round(decimals=1)
    ref_idx, ref_ok = reference_select(scores, bias, n)
    idx, ok = select_top_cpu(scores, bias, n)
    kth = (F.pad(scores, (0, n)) + bias).topk(n, -1).values[..., -1:]
    above = lambda i, o, s: sorted(int(x) for x in i[o] if s[int(x)] > kth[0, h, 0])   # noqa: E731
    for h in range(2):
        assert above(idx[0, h], ok[0, h], scores[0, h]) == above(ref_idx[0, h], ref_ok[0, h], scores[0, h])


def test_select_slots_dispatch():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 200, generator=g)
    bias = F.pad(torch.zeros(2, 1, 200), (0, 64), value=-INF)
    a = select_slots(scores, bias, 64)                                      # C++ (auto)
    b = select_slots(scores, bias, 64, backend="torch")
    assert as_sets(*a) == as_sets(*b)


@pytest.mark.parametrize("B,Hq,Hkv,S,D,Hvis", [(1, 9, 3, 2048, 64, 1), (2, 9, 3, 700, 64, 3), (1, 4, 4, 37, 128, 1),
                                               (3, 8, 2, 1100, 128, 2), (1, 9, 3, 300, 64, 0), (2, 12, 2, 17, 64, 2),
                                               (1, 10, 2, 1, 128, 1), (8, 9, 3, 515, 64, 1), (2, 3, 3, 15, 64, 0)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lanes", [8, 16], ids=["avx2", "avx512"])
def test_decode_attention_equals_grouped_attention(B, Hq, Hkv, S, D, Hvis, threads, lanes, monkeypatch):
    """The dense decode kernel (split over chunks of slots, merged by log-sum-exp) against model.grouped_attention:
    GQA (groups of 3, 4, 5 and 6 query rows: every register block), MHA, D 64/128, strided caches, lengths
    below, at and past the 8- or 16-slot blocks, visibility per batch row or per KV head or none, a row with
    nothing visible (-> 0), large logits; in the AVX2 (8 lanes) and AVX-512 (16 lanes) vector widths."""
    from kernels.cpu import decode_attention
    monkeypatch.setattr("kernels.cpu._attn_lanes", lanes)
    g = torch.Generator().manual_seed(S)
    q = torch.randn(B, Hq, 1, D, generator=g) * 3
    k, v = torch.randn(2, B, Hkv, S + 7, D, generator=g)[:, :, :, :S]          # live prefix of a larger buffer
    vis = None if not Hvis else torch.rand(B, Hvis, S + 5, generator=g) > 0.3
    if vis is not None and B > 1:
        vis[1, 0] = False
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = decode_attention(q, k, v, vis)
    finally:
        torch.set_num_threads(before)
    mask = None if vis is None else vis[..., None, :S].expand(B, Hvis, Hq // Hkv, S)
    ref = torch.nan_to_num(grouped_attention(q, k, v, mask))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    if vis is not None and B > 1:
        assert out[1, :Hq // Hkv if Hvis > 1 else Hq].abs().max() == 0


def test_attention_lanes_reads_kvc_attn_lanes(monkeypatch):
    """KVC_ATTN_LANES: auto -> 0 (the build's ISA's), 8 or 16 forced, anything else an error; the default on
    this CPU is the width of its ISA (dense_lanes in kernels/cpu_kernels.cpp)."""
    from kernels import cpu
    for value, lanes in (("auto", 0), ("8", 8), ("16", 16)):
        monkeypatch.setattr(cpu, "_attn_lanes", None)
        monkeypatch.setenv("KVC_ATTN_LANES", value)
        assert cpu.attention_lanes() == lanes
    monkeypatch.setattr(cpu, "_attn_lanes", None)
    monkeypatch.setenv("KVC_ATTN_LANES", "4")
    with pytest.raises(ValueError, match="KVC_ATTN_LANES"):
        cpu.attention_lanes()
    q, k = torch.randn(1, 2, 64), torch.randn(1, 1, 5, 64)
    with pytest.raises(RuntimeError, match="lanes"):
        torch.ops.kvc.decode_attention(q, k, k, torch.empty(0, dtype=torch.bool), 0.125, 4)


def test_rms_norm_cpu_equals_model_rms_norm():
    from kernels.cpu import rms_norm_cpu
    from model import rms_norm
    w = torch.randn(576)
    x = torch.randn(3, 5, 576) * 4
    torch.testing.assert_close(rms_norm_cpu(x, w, 1e-5), rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    xb = x.bfloat16()
    torch.testing.assert_close(rms_norm_cpu(xb, w, 1e-5), rms_norm(xb, w, 1e-5), atol=0, rtol=0)   # the model's own
    torch.testing.assert_close(rms_norm_cpu(x[:, :1], w, 1e-5), rms_norm(x[:, :1], w, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("B,T", [(1, 1), (2, 3)])
def test_rope_split_cpu_equals_model_rope_split(B, T):
    """kvc::rope_split against model.rope_split: the heads, RoPE on q and k, v untouched."""
    from kernels.cpu import rope_split_cpu
    from model import ModelArgs, rope_split, rope_tables
    cos, sin = rope_tables(ModelArgs(dim=576, n_layers=1, n_heads=9, n_kv_heads=3, intermediate_size=64,
                                     vocab_size=32), 64)
    pos = torch.randint(0, 64, (B, T))
    c, s = cos[pos][:, None], sin[pos][:, None]
    qkv = torch.randn(B, T, (9 + 6) * 64)
    for got, want in zip(rope_split_cpu(qkv, c, s, 9, 3), rope_split(qkv, c, s, 9, 3)):
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    qb = qkv.bfloat16()                       # bf16: the op too, within one bf16 step (tests/test_bf16.py)
    for got, want in zip(rope_split_cpu(qb, c, s, 9, 3), rope_split(qb, c, s, 9, 3)):
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)


def dense_decode_case(B, Hq, Hkv, C, start, D, vis, dtype=torch.float32):
    """Random inputs of kvc::dense_decode: qkv [B, 1, (Hq + 2 Hkv) D] and caches k, v [B, Hkv, C, D] in dtype, fp32
    cos, sin [B, 1, 1, D] at random positions, visible: the DenseCache's [B, G, start + 1] rows hiding some slots
    (vis "mask") or empty ("none")."""
    from model import ModelArgs, rope_tables
    g = torch.Generator().manual_seed(C + start)
    qkv = (torch.randn(B, 1, (Hq + 2 * Hkv) * D, generator=g) * 2).to(dtype)
    cos, sin = rope_tables(ModelArgs(dim=Hq * D, n_layers=1, n_heads=Hq, n_kv_heads=Hkv, intermediate_size=64,
                                     vocab_size=32), 2 * C)
    pos = torch.randint(0, 2 * C, (B, 1), generator=g)
    k, v = torch.randn(2, B, Hkv, C, D, generator=g).to(dtype)
    visible = torch.empty(0, 0, 0, dtype=torch.bool)
    if vis == "mask":
        row = torch.rand(B, 1, start + 1, generator=g) > 0.3
        row[..., start] = True
        visible = row.expand(B, Hq // Hkv, start + 1).contiguous()
    return qkv, cos[pos][:, None], sin[pos][:, None], k, v, visible


@pytest.mark.parametrize("B,Hq,Hkv,C,start,D,vis", [(1, 9, 3, 600, 512, 64, "mask"), (2, 8, 2, 40, 17, 128, "mask"),
                                                     (1, 4, 4, 10, 0, 64, "none"), (2, 9, 3, 1200, 1100, 64, "none")])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lanes", [8, 16], ids=["avx2", "avx512"])
def test_dense_decode_equals_twin(B, Hq, Hkv, C, start, D, vis, threads, lanes):
    """kvc::dense_decode (heads split, RoPE, slot writes, decode attention over [0, start]) against
    dense_decode_torch: the output, the written slot, and every other slot untouched; a visibility mask
    with the DenseCache's [B, G, n] rows (row 0 read) hiding some slots of each row, or none; both vector
    widths."""
    import math
    from kernels.cpu import dense_decode_torch
    qkv, c, s, k, v, visible = dense_decode_case(B, Hq, Hkv, C, start, D, vis)
    k_ref, v_ref = k.clone(), v.clone()
    want = dense_decode_torch(qkv, c, s, k_ref, v_ref, visible, start, Hq, Hkv)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.ops.kvc.dense_decode(qkv, c, s, k, v, visible, start, Hq, Hkv, 1.0 / math.sqrt(D), lanes)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (B, 1, Hq * D)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v, v_ref, atol=0, rtol=0)


def test_add_rms_norm_equals_model_add_rms_norm():
    from model import add_rms_norm
    x, y = torch.randn(2, 3, 3, 576) * 4
    w = torch.randn(576)
    for got, want in zip(torch.ops.kvc.add_rms_norm(x, y, w, 1e-5), add_rms_norm(x, y, w, 1e-5)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_eager_ops_are_the_registered_ops():
    """kernels/cpu_bindings.cpp: the direct bindings run the same functions as torch.ops.kvc."""
    from kernels.cpu import eager_ops
    ops = eager_ops()
    x, y = torch.randn(2, 1, 1, 576)
    w = torch.randn(576)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), torch.ops.kvc.rms_norm(x, w, 1e-5))
    for a, b in zip(ops.add_rms_norm(x, y, w, 1e-5), torch.ops.kvc.add_rms_norm(x, y, w, 1e-5)):
        assert torch.equal(a, b)
    gu = torch.randn(1, 1, 200)
    assert torch.equal(ops.silu_mul(gu), torch.ops.kvc.silu_mul(gu))
    for name in ("rope_split", "dense_decode", "qlinear", "qembed"):
        assert callable(getattr(ops, name))


def _tiny_model(**kw):
    from model import ModelArgs, Transformer
    torch.manual_seed(0)
    args = ModelArgs(dim=9 * 64, n_layers=2, n_heads=9, n_kv_heads=3, intermediate_size=96, vocab_size=64, **kw)
    m = Transformer(args)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return m.eval()


class _CountingBindings:
    """kernels.cpu's direct bindings, counting the calls of each op by name."""

    def __init__(self, bindings):
        self.bindings, self.calls = bindings, {}

    def __getattr__(self, name):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return getattr(self.bindings, name)(*args)
        return call


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_cpu_eager_ops_equal_the_model_over_a_dense_cache(sliding_window, monkeypatch):
    """cpu_eager_ops (kvc::dense_decode, kvc::add_rms_norm, ...) against the model's own ops, both with the
    C++ decode attention: logits and cache contents over a prompt with left padding and decode steps (a
    sliding window: masked slots); every C++ op ran, dense_decode once per layer and decode step."""
    import kernels.cpu
    from kernels.cpu import cpu_eager_ops, decode_attention
    ref, fused = _tiny_model(sliding_window=sliding_window), _tiny_model(sliding_window=sliding_window)
    fused.use_ops(cpu_eager_ops())
    bindings = _CountingBindings(kernels.cpu.eager_ops())
    monkeypatch.setattr(kernels.cpu, "_eager", bindings)
    for m in (ref, fused):
        m.decode_kernel = decode_attention
        m.setup_caches(2, 32)
    tokens = torch.randint(0, 64, (2, 9))
    pos = torch.arange(9).expand(2, 9) - torch.tensor([[0], [3]])          # row 1 left-padded by 3
    with torch.inference_mode():
        torch.testing.assert_close(fused(tokens, pos), ref(tokens, pos), atol=1e-5, rtol=1e-5)
        for i in range(4):
            tok, p = torch.randint(0, 64, (2, 1)), pos[:, -1:] + 1 + i
            torch.testing.assert_close(fused(tok, p, decode=True), ref(tok, p, decode=True), atol=1e-5, rtol=1e-5)
    for a, b in zip(fused.cache.k + fused.cache.v, ref.cache.k + ref.cache.v):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert bindings.calls["dense_decode"] == 2 * 4
    assert bindings.calls["rope_split"] == 2                               # the prompt's step
    assert {"rms_norm", "add_rms_norm", "silu_mul"} <= set(bindings.calls)


def test_dense_decode_cpu_leaves_other_caches_to_their_decode():
    """A DenseCache subclass that declares fused_dense_decode False, an instance whose decode is replaced
    (flag set False on it), and a plain DenseCache with another decode kernel: each cache's decode hook is
    called in every decode step, as with the model's own ops."""
    from kernels.cpu import cpu_eager_ops, decode_attention
    from model import DenseCache

    calls = []

    class Recording(DenseCache):
        fused_dense_decode = False

        def decode(self, layer, q, k, v):
            calls.append(layer)
            return super().decode(layer, q, k, v)

    hooked = DenseCache()
    hooked.decode = lambda *a: calls.append(a[0]) or DenseCache.decode(hooked, *a)
    hooked.fused_dense_decode = False
    other_kernel = DenseCache()
    other_kernel.decode_kernel = lambda *a: calls.append(0) or decode_attention(*a)
    m = _tiny_model()
    m.use_ops(cpu_eager_ops())
    m.decode_kernel = decode_attention
    with torch.inference_mode():
        for policy in (Recording(), hooked, other_kernel):
            calls.clear()
            m.setup_caches(1, 16, policy)
            m(torch.randint(0, 64, (1, 4)), torch.arange(4))
            m(torch.randint(0, 64, (1, 1)), torch.tensor([4]), decode=True)
            assert len(calls) == 2, policy


def test_dense_cache_subclasses_that_replace_decode_declare_it():
    """Every DenseCache subclass in the product with its own decode (or K/V storage) sets fused_dense_decode
    False: EagerOps.dense_decode would otherwise skip it."""
    import importlib
    from model import DenseCache
    for name in ("cache", "cache.kv_dtype", "cache.quantized", "cache.calibration", "eval.agreement",
                 "eval.similarity"):
        importlib.import_module(name)
    todo, seen = [DenseCache], []
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo += cls.__subclasses__()
        if cls.__module__.startswith("tests"):
            continue
        own = {"decode", "store", "storage"} & set(vars(cls))
        # FullCache's decode and store differ from DenseCache's only off the aligned path (rows at their own
        # lengths, a shared prefix), where kernels.cpu.dense_decode_cpu calls the cache's decode itself
        if own and cls is not DenseCache and cls.__qualname__ != "FullCache":
            assert cls.fused_dense_decode is False, f"{cls.__qualname__} defines {own}"
    assert len(seen) >= 6


def test_silu_mul_cpu_equals_model_silu_mul():
    from kernels.cpu import silu_mul_cpu
    from model import silu_mul
    gu = torch.randn(2, 3, 200) * 6                                     # 6 rows of 6 x 16 lanes + a tail of 4
    torch.testing.assert_close(silu_mul_cpu(gu), silu_mul(gu), atol=1e-6, rtol=1e-6)
    assert silu_mul_cpu(gu).shape == (2, 3, 100)


@pytest.mark.parametrize("N,K", [(1, 16), (37, 576), (961, 64), (131, 1536), (29, 67), (7, 5), (300, 15)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_small_m_equals_f_linear(N, K, bias, threads):
    """Every M in 1..16 (each its own code path), N odd / not a multiple of the 16-row tile, K a multiple
    of 16 and not (the masked tail), against F.linear in float64."""
    from kernels.cpu import linear_small_m
    g = torch.Generator().manual_seed(N * 1000 + K)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for M in range(1, 17):
            x = torch.randn(M, K, generator=g)
            ref = F.linear(x.double(), w.double(), None if b is None else b.double())
            torch.testing.assert_close(linear_small_m(x, w, b).double(), ref, atol=1e-5 * ref.abs().max().item(),
                                       rtol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_linear_dispatch_takes_the_kernel_for_decode_rows_only():
    """model.Linear with the kernel plugged in: decode-sized fp32 inputs (any leading shape, strided
    rows) through kvc::linear_small_m, prefill through oneDNN, same results; bf16 decode rows through the kernel
    too (within one bf16 step of oneDNN's bf16 result), fp16 through F.linear."""
    from kernels.cpu import linear_small_m
    from model import Linear
    layer = Linear(576, 960, bias=True)
    plain = Linear(576, 960, bias=True)
    plain.load_state_dict(layer.state_dict())
    calls = []
    layer.small_m_kernel = lambda *a: calls.append(1) or linear_small_m(*a)
    x = torch.randn(8, 5, 576)
    for inp, used in [(x[:, -1:], 1), (x[:2, :3], 1), (x, 0), (x[0], 1), (x[:4], 0), (x[:3, :4], 1), (x[:, :2], 0)]:
        calls.clear()
        torch.testing.assert_close(layer(inp), plain(inp), atol=1e-5, rtol=1e-5)
        assert len(calls) == used
    layer, plain = layer.bfloat16(), plain.bfloat16()
    calls.clear()
    got, want = layer(x[:, -1:].bfloat16()), plain(x[:, -1:].bfloat16())
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)
    assert len(calls) == 1
    layer, plain = layer.half(), plain.half()
    calls.clear()
    torch.testing.assert_close(layer(x[:, -1:].half()), plain(x[:, -1:].half()), atol=0, rtol=0)
    assert not calls


def test_the_linear_kernel_is_plugged_in_on_avx512_only(monkeypatch):
    """Built for AVX2, kvc::linear_small_m spills its accumulators (1.9x oneDNN's step time at batch 8):
    the loader plugs it in where the CPU has AVX-512 only."""
    from kernels import cpu
    from model import Linear
    model = torch.nn.Sequential(Linear(16, 16))
    for capability, plugged in [("AVX512", True), ("AVX512_BF16", True), ("AVX2", False), ("DEFAULT", False)]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        model[0].small_m_kernel = None
        cpu.use_linear_kernel(model)
        assert (model[0].small_m_kernel is not None) == (plugged and cpu.cpu_kernels_available()), capability


@pytest.mark.skipif(not __import__("model").Linear.use_onednn, reason="needs oneDNN")
def test_compiled_linear_reads_the_weight_once_per_step():
    """Under torch.compile a single row is the (x * W).sum(-1) reduction Inductor streams W through;
    more rows go to oneDNN (kvc::onednn_linear), since the reduction would read W once per row
    (2.8x oneDNN's time at 8 rows); both equal F.linear."""
    from model import Linear
    layer = Linear(64, 96, bias=True)
    for shape, used, unused in [((1, 1, 64), ".sum(", "onednn_linear"), ((4, 1, 64), "onednn_linear", ".sum("),
                                ((2, 5, 64), "onednn_linear", ".sum(")]:
        codes = compiled_linear_code(layer, torch.randn(shape))
        assert len(codes) == 1 and used in codes[0] and unused not in codes[0], (shape, codes)


def compiled_linear_code(layer, x) -> list[str]:
    """The code of the graphs torch.compile(layer, dynamic=True) traces for x, after checking its output
    against F.linear."""
    codes = []

    def backend(gm, example_inputs):
        codes.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(layer, backend=backend, dynamic=True, fullgraph=True)(x)
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    return codes


@needs_cpp
def test_compiled_linear_takes_the_plugged_kernel_for_2_to_12_rows():
    """With the loader's kvc::linear_small_m plugged in, compiled decode steps of 2 to 12 rows ([B, 1, K])
    call it (a custom op with a fake: Inductor calls it as it is) as eager steps do; one row stays the
    reduction; more than 12 rows, and prefill shapes [B, T, K] of any size (T is the dynamic prompt length:
    no guard on it), go to oneDNN (or F.linear); all equal F.linear."""
    from kernels.cpu import linear_small_m
    from model import Linear
    layer = Linear(64, 96, bias=True)
    layer.small_m_kernel = linear_small_m
    for shape, used in [((1, 1, 64), ".sum("), ((8, 1, 64), "linear_small_m"), ((2, 6, 64), "onednn_linear" if Linear.use_onednn else "linear("),
                        ((4, 5, 64), "onednn_linear" if Linear.use_onednn else "linear(")]:
        codes = compiled_linear_code(layer, torch.randn(shape))
        assert len(codes) == 1 and used in codes[0], (shape, codes)


@pytest.mark.model
def test_model_logits_with_the_linear_kernel_equal_onednn(engine_dir):
    """The default model's prefill + decode logits (B 1 and 8) with the loader's kvc::linear_small_m
    against the same model on oneDNN's inner product."""
    from model import Linear
    from kernels.cpu import linear_kernel_pays, linear_small_m
    model, _ = engine_dir
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all((m.small_m_kernel is not None) == linear_kernel_pays() for m in layers)
    if not linear_kernel_pays():            # not plugged in on this CPU: compare the kernel all the same
        for m in layers:
            m.small_m_kernel = linear_small_m

    def run(B):
        g = torch.Generator().manual_seed(B)
        tokens = torch.randint(0, model.args.vocab_size, (B, 12), generator=g)
        model.setup_caches(B, 16)
        with torch.no_grad():
            out = [model(tokens[:, :8], torch.arange(8))]
            out += [model(tokens[:, t:t + 1], torch.tensor([t]), decode=True) for t in range(8, 12)]
        return torch.cat(out, dim=1)

    kernel = layers[0].small_m_kernel
    try:
        for B in (1, 8):
            new = run(B)
            for m in layers:
                m.small_m_kernel = None
            old = run(B)
            for m in layers:
                m.small_m_kernel = kernel
            scale = old.abs().max().item()          # float rounding differs over 30 layers: 1e-4 of the logits' size
            assert (new - old).abs().max().item() <= 1e-4 * scale, ((new - old).abs().max().item(), scale)
            assert torch.equal(new.argmax(-1), old.argmax(-1))
    finally:
        for m in layers:
            m.small_m_kernel = kernel if linear_kernel_pays() else None


@pytest.mark.parametrize("extensions_dir", [True, False])
def test_a_stale_build_lock_is_removed_a_fresh_one_kept(tmp_path, monkeypatch, extensions_dir):
    """A build killed midway leaves torch's lock behind, and every later load would wait on it forever; the lock
    is where torch puts it: $TORCH_EXTENSIONS_DIR/NAME, else BUILD_ROOT/pyXY_cpu/NAME."""
    import os
    import time
    import torch.utils.cpp_extension as ext
    import kernels.cpu as cpu
    if extensions_dir:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
        lock = tmp_path / "kvc_x" / "lock"
    else:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setattr(ext, "get_default_build_root", lambda: str(tmp_path))
        lock = cpu.build_dir("kvc_x") / "lock"
        assert lock.parent.parent.parent == tmp_path
    lock.parent.mkdir(parents=True)
    lock.touch()
    cpu._clear_stale_lock("kvc_x")
    assert lock.exists()
    os.utime(lock, (time.time() - cpu.STALE_LOCK_SECONDS - 1,) * 2)
    with pytest.warns(RuntimeWarning, match="stale build lock"):
        cpu._clear_stale_lock("kvc_x")
    assert not lock.exists()


def test_an_old_lock_of_a_live_build_is_kept(tmp_path, monkeypatch):
    """A build that outlives STALE_LOCK_SECONDS on a loaded machine (a process works in its folder) keeps its lock."""
    import os
    import subprocess
    import time
    import kernels.cpu as cpu
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "kvc_x" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - cpu.STALE_LOCK_SECONDS - 1,) * 2)
    builder = subprocess.Popen(["sleep", "30"], cwd=lock.parent)
    try:
        time.sleep(0.2)
        cpu._clear_stale_lock("kvc_x")
        assert lock.exists()
    finally:
        builder.kill()
        builder.wait()
