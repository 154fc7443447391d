"""bfloat16 on the CPU: the C++ kernels' bf16 paths (kernels/cpu_kernels.cpp, kernels/cpu_linear.cpp) against their
torch twins in bf16 (each rounding where the twin rounds: results within one bf16 step of it), the loader's bf16
model against model.py's own ops, and the default model in bf16 against HF transformers in bf16."""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import needs_cpp

pytestmark = needs_cpp
BF16_STEP = 2.0 ** -7          # the spacing of bf16 values relative to their size (8 significant bits)


def close_bf16(got, want, steps: float = 1.0, atol: float = 0.0):
    """got equals want (both bf16 or the reference in a wider dtype) within `steps` bf16 steps of each value."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    torch.testing.assert_close(got.double(), want.double(), rtol=steps * BF16_STEP, atol=atol)


def with_threads(n, f):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return f()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("B,Hq,Hkv,S,D,Hvis", [(1, 9, 3, 2048, 64, 1), (2, 8, 2, 700, 128, 2), (8, 9, 3, 515, 64, 0),
                                               (2, 3, 3, 15, 64, 1)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lanes", [8, 16], ids=["avx2", "avx512"])
def test_decode_attention_bf16_equals_fp32_attention_rounded(B, Hq, Hkv, S, D, Hvis, threads, lanes, monkeypatch):
    """kernels.cpu.decode_attention on bf16 q, k, v (a bf16 model's dense cache): the C++ kernel (it used to fall
    back to SDPA) in fp32 over the bf16 rows, the output rounded once: model.grouped_attention over fp32 copies,
    within one bf16 step; a row with nothing visible gets 0."""
    from kernels.cpu import decode_attention
    from model import grouped_attention
    monkeypatch.setattr("kernels.cpu._attn_lanes", lanes)
    g = torch.Generator().manual_seed(S)
    q = (torch.randn(B, Hq, 1, D, generator=g) * 3).bfloat16()
    k, v = torch.randn(2, B, Hkv, S + 7, D, generator=g).bfloat16()[:, :, :, :S]
    vis = None if not Hvis else torch.rand(B, Hvis, S + 5, generator=g) > 0.3
    if vis is not None and B > 1:
        vis[1, 0] = False
    out = with_threads(threads, lambda: decode_attention(q, k, v, vis))
    mask = None if vis is None else vis[..., None, :S].expand(B, Hvis, Hq // Hkv, S)
    ref = torch.nan_to_num(grouped_attention(q.float(), k.float(), v.float(), mask))
    close_bf16(out, ref, atol=1e-6)
    if vis is not None and B > 1:
        assert out[1, :Hq // Hkv if Hvis > 1 else Hq].abs().max() == 0


@pytest.mark.parametrize("shape", [(8, 9, 3, 300, 200, 64), (5, 8, 2, 700, 650, 128), (6, 12, 2, 130, 1, 64)])
@pytest.mark.parametrize("lanes", [8, 16], ids=["avx2", "avx512"])
def test_prefix_attention_bf16_equals_rows_holding_copies(shape, lanes, monkeypatch):
    """kvc::prefix_attention over a bf16 prefix and bf16 rows (the one-doc case of a bf16 model: the prefix read
    in place, once for all rows, instead of model.prefix_attention's copies per row and step): the rows holding
    copies in fp32, rounded, within one bf16 step."""
    from kernels.cpu import prefix_attention_cpu
    from tests.test_shared_prefix import case
    monkeypatch.setattr("kernels.cpu._attn_lanes", lanes)
    (q, k, v, visible, pk, pv, own_from), _, free = case(*shape)
    q, k, v, pk, pv = (t.bfloat16() for t in (q, k, v, pk, pv))
    ref = ref_rows_holding_copies(q.float(), k.float(), v.float(), visible, pk.float(), pv.float(), own_from)
    out = prefix_attention_cpu(q, k, v, visible, pk, pv, own_from)
    close_bf16(out[~free], ref[~free], atol=1e-6)


@pytest.mark.parametrize("shape", [(8, 9, 3, 900, 700, 64), (2, 9, 3, 640, 600, 64), (6, 16, 2, 600, 520, 128)])
@pytest.mark.parametrize("lanes", [8, 16], ids=["avx2", "avx512"])
def test_bf16_rows_are_read_as_their_fp32_values(shape, lanes):
    """kvc::prefix_attention / decode_attention over bf16 K/V give exactly (bitwise) what they give over the same
    values widened to fp32, whether the bf16 rows are widened in registers (few query rows: a row's own slots, a
    prefix read by one or two rows) or copied to fp32 once (>= 8 query rows: a prefix read by many rows)."""
    from tests.test_shared_prefix import case
    (q, k, v, visible, pk, pv, own_from), _, _ = case(*shape)
    q = q[:, :, 0].contiguous()
    kb, vb, pkb, pvb = (t.bfloat16() for t in (k, v, pk, pv))
    scale = q.shape[-1] ** -0.5
    got = torch.ops.kvc.prefix_attention(q, kb, vb, visible, pkb, pvb, own_from, scale, lanes)
    want = torch.ops.kvc.prefix_attention(q, kb.float(), vb.float(), visible, pkb.float(), pvb.float(), own_from,
                                          scale, lanes)
    assert torch.equal(got, want)
    got = torch.ops.kvc.decode_attention(q, kb, vb, visible, scale, lanes)
    assert torch.equal(got, torch.ops.kvc.decode_attention(q, kb.float(), vb.float(), visible, scale, lanes))


def ref_rows_holding_copies(q, k, v, visible, pk, pv, own_from):
    """tests.test_shared_prefix.case's oracle for given tensors: each sharing row's slots [0, P) overwritten by
    the prefix, grouped_attention over those copies (fp32)."""
    from model import grouped_attention
    B, Hq, _, _ = q.shape
    Hkv, S, P = k.shape[1], k.shape[2], pk.shape[2]
    kc, vc, vis = k.clone(), v.clone(), visible.clone()
    sharing = own_from > 0
    kc[sharing, :, :P], vc[sharing, :, :P] = pk[0], pv[0]
    vis[sharing, :, :P] = True
    mask = vis[:, :, None, :].expand(B, 1, Hq // Hkv, S).reshape(B, Hq // Hkv, S)
    return torch.nan_to_num(grouped_attention(q, kc, vc, mask))


@pytest.mark.parametrize("B,Hq,Hkv,C,start,D,vis", [(1, 9, 3, 600, 512, 64, "mask"), (2, 8, 2, 40, 17, 128, "mask"),
                                                     (2, 9, 3, 1200, 1100, 64, "none")])
@pytest.mark.parametrize("lanes", [8, 16], ids=["avx2", "avx512"])
def test_dense_decode_bf16_equals_twin(B, Hq, Hkv, C, start, D, vis, lanes):
    """kvc::dense_decode on bf16 qkv and bf16 caches: the slot writes equal dense_decode_torch's in bf16 (RoPE'd k
    rounded as apply_rope rounds it, v copied), the output the fp32 attention of the bf16 q over the written bf16
    rows, rounded: within one bf16 step."""
    from kernels.cpu import dense_decode_torch
    from model import apply_rope, grouped_attention
    from tests.test_cpu_kernels import dense_decode_case
    qkv, c, s, k, v, visible = dense_decode_case(B, Hq, Hkv, C, start, D, vis, torch.bfloat16)
    k_ref, v_ref = k.clone(), v.clone()
    dense_decode_torch(qkv, c, s, k_ref, v_ref, visible, start, Hq, Hkv)
    got = torch.ops.kvc.dense_decode(qkv, c, s, k, v, visible, start, Hq, Hkv, 1.0 / math.sqrt(D), lanes)
    close_bf16(k, k_ref)
    assert torch.equal(v, v_ref)
    q = apply_rope(qkv.view(B, 1, -1, D).transpose(1, 2)[:, :Hq], c, s)          # bf16, as the twin rounds it
    n = start + 1
    mask = None if vis == "none" else visible[:, :1, :n].expand(B, Hq // Hkv, n)
    want = grouped_attention(q.float(), k_ref[:, :, :n].float(), v_ref[:, :, :n].float(), mask)
    close_bf16(got, want.transpose(1, 2).reshape(B, 1, Hq * D), atol=1e-6)


def test_small_ops_bf16_equal_their_twins():
    """kvc::rms_norm, add_rms_norm, rope_split and silu_mul on bf16 tensors (the loader's eager ops now take a bf16
    model's steps) against model.py's functions in bf16: computed in fp32, rounded where the twin rounds, so within
    one bf16 step (the residual sum exactly); all bf16, shapes as the twin's."""
    from kernels.cpu import add_rms_norm_cpu, rms_norm_cpu, rope_split_cpu, silu_mul_cpu
    from model import ModelArgs, add_rms_norm, rms_norm, rope_split, rope_tables, silu_mul
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(2, 3, 7, 576, generator=g) * 4).bfloat16()
    w = (torch.randn(576, generator=g) + 1).bfloat16()
    close_bf16(rms_norm_cpu(x, w, 1e-5), rms_norm(x, w, 1e-5))
    (h, normed), (h_ref, normed_ref) = add_rms_norm_cpu(x, y, w, 1e-5), add_rms_norm(x, y, w, 1e-5)
    assert torch.equal(h, h_ref)
    close_bf16(normed, normed_ref)
    gu = (torch.randn(2, 3, 200, generator=g) * 6).bfloat16()              # 6 x 16 lanes + a tail of 4 per row
    close_bf16(silu_mul_cpu(gu), silu_mul(gu), steps=2)                    # silu rounded, then the product
    cos, sin = rope_tables(ModelArgs(dim=576, n_layers=1, n_heads=9, n_kv_heads=3, intermediate_size=64,
                                     vocab_size=32), 64)
    pos = torch.randint(0, 64, (2, 5), generator=g)
    qkv = torch.randn(2, 5, 15 * 64, generator=g).bfloat16()
    for got, want in zip(rope_split_cpu(qkv, cos[pos][:, None], sin[pos][:, None], 9, 3),
                         rope_split(qkv, cos[pos][:, None], sin[pos][:, None], 9, 3)):
        assert got.is_contiguous()
        close_bf16(got, want)


def test_small_ops_refuse_mixed_dtypes():
    """A bf16 activation with an fp32 weight is no case of the kernels: the op says so (the Python wrappers take
    model.py's path for it)."""
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(64)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.kvc.rms_norm(x, w, 1e-5)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.kvc.silu_mul(torch.randn(2, 8).half())
    from kernels.cpu import rms_norm_cpu
    from model import rms_norm
    assert torch.equal(rms_norm_cpu(x, w, 1e-5), rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("N,K", [(37, 576), (961, 64), (131, 1536), (29, 67), (300, 15)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_small_m_bf16_equals_f_linear(N, K, bias, threads):
    """kvc::linear_small_m on bf16 x, W (and bias): every M in 1..16, N off the 16-row tile, K off the 16-column
    vector (the masked bf16 tail) against F.linear in float64 over the same values, rounded once: within one
    bf16 step (plus fp32 summation's error)."""
    from kernels.cpu import linear_small_m
    g = torch.Generator().manual_seed(N * 1000 + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None

    def check():
        for M in range(1, 17):
            x = torch.randn(M, K, generator=g).bfloat16()
            ref = F.linear(x.double(), w.double(), None if b is None else b.double())
            close_bf16(linear_small_m(x, w, b), ref, atol=1e-5 * ref.abs().max().item())
    with_threads(threads, check)


def test_linear_takes_the_kernel_for_bf16_decode_rows():
    """model.Linear in bf16 with the kernel plugged in: decode-sized inputs through kvc::linear_small_m, a prefill's
    rows through F.linear (oneDNN's bf16 matmul); both equal F.linear within one bf16 step."""
    from kernels.cpu import linear_small_m
    from model import Linear
    layer = Linear(576, 960, bias=True).bfloat16()
    calls = []
    layer.small_m_kernel = lambda *a: calls.append(1) or linear_small_m(*a)
    x = torch.randn(8, 5, 576).bfloat16()
    for inp, used in [(x[:, -1:], 1), (x[0], 1), (x, 0)]:
        calls.clear()
        ref = F.linear(inp.double(), layer.weight.double(), layer.bias.double())
        close_bf16(layer(inp), ref, steps=2, atol=1e-3)
        assert len(calls) == used


def tiny_model(dtype):
    from model import ModelArgs, Transformer
    torch.manual_seed(0)
    m = Transformer(ModelArgs(dim=9 * 64, n_layers=2, n_heads=9, n_kv_heads=3, intermediate_size=96, vocab_size=64))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return m.to(dtype).eval()


def test_bf16_model_with_the_loaders_kernels_equals_model_ops():
    """A bf16 model with everything the loader plugs in (cpu_eager_ops, the decode and prefix kernels,
    linear_small_m) against the same model on model.py's own torch ops: prefill (left padding) and decode logits
    within a few bf16 steps of the logits' size (two layers of one-step differences), the same greedy tokens;
    the fused ops ran (kvc::dense_decode once per layer and decode step)."""
    import kernels.cpu
    from kernels.cpu import cpu_eager_ops, decode_attention, linear_small_m, prefix_attention_cpu
    from model import Linear
    from tests.test_cpu_kernels import _CountingBindings
    ref, fast = tiny_model(torch.bfloat16), tiny_model(torch.bfloat16)
    fast.use_ops(cpu_eager_ops())
    fast.decode_kernel, fast.prefix_kernel = decode_attention, prefix_attention_cpu
    for m in fast.modules():
        if isinstance(m, Linear):
            m.small_m_kernel = linear_small_m
    bindings = _CountingBindings(kernels.cpu.eager_ops())
    for m in (ref, fast):
        m.setup_caches(2, 32)
    tokens = torch.randint(0, 64, (2, 9))
    pos = torch.arange(9).expand(2, 9) - torch.tensor([[0], [3]])
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels.cpu, "_eager", bindings)
        outs = [(fast(tokens, pos), ref(tokens, pos))]
        for i in range(4):
            tok, p = outs[-1][1][:, -1:].argmax(-1), pos[:, -1:] + 1 + i
            outs.append((fast(tok, p, decode=True), ref(tok, p, decode=True)))
    for got, want in outs:
        assert got.dtype == torch.bfloat16
        scale = want.abs().max().item()
        assert (got.float() - want.float()).abs().max().item() <= 8 * BF16_STEP * scale
    assert bindings.calls["dense_decode"] == 2 * 4
    assert {"rms_norm", "add_rms_norm", "silu_mul", "rope_split"} <= set(bindings.calls)


@pytest.mark.model
def test_default_model_bf16_matches_hf_bf16(default_dir, essay_text):
    """The default model loaded in bf16 (engine.load_model: the bf16 decode attention, small ops and linear kernel)
    against HF transformers: a 500-token essay prompt, then 12 decode steps.  At each of those 13 positions our
    logits are no further from HF's fp32 logits than HF's own bf16 logits are (1.5x, + 0.1), their top token
    agrees with fp32's about as often; and the bf16 model answers a chat question sensibly."""
    transformers = pytest.importorskip("transformers")
    import engine
    model, tok = engine.load_model(default_dir, dtype="bfloat16")
    ids = torch.tensor([tok.encode(essay_text)[:512]])
    with torch.inference_mode():
        model.setup_caches(1, 512)
        ours = [model(ids[:, :500], torch.arange(500), last_only=True)[0, -1]]
        ours += [model(ids[:, t:t + 1], torch.tensor([t]), decode=True)[0, -1] for t in range(500, 512)]
        ours = torch.stack(ours).float()
        hf = {dtype: transformers.LlamaForCausalLM.from_pretrained(default_dir, dtype=dtype).eval()(ids).logits[
            0, 499:512].float() for dtype in (torch.bfloat16, torch.float32)}
    ref, theirs = hf[torch.float32], hf[torch.bfloat16]
    err, their_err = (ours - ref).abs().max().item(), (theirs - ref).abs().max().item()
    assert err <= 1.5 * their_err + 0.1, (err, their_err)
    top = ref.argmax(-1)
    assert (ours.argmax(-1) == top).sum() >= (theirs.argmax(-1) == top).sum() - 1
    answer = engine.generate(model, tok, ["What is the capital of France?"], max_new_tokens=24, chat=True).texts[0]
    assert "Paris" in answer, answer


def test_bf16_rows_sharing_a_kept_prefix_equal_rows_holding_copies():
    """A bf16 model's running batch whose rows read a kept 150-token document in place (kvc::prefix_attention
    over bf16 rows, the served one-doc case) against the batch whose rows copy it (kvc::decode_attention): the
    same greedy tokens, logits within a few bf16 steps of their size."""
    from tests.test_rowbatch import prompts_of
    from tests.test_shared_prefix import head64_model, run_batch
    m = head64_model().to(torch.bfloat16)
    prompts = prompts_of({"q1": 12, "q2": 20, "q3": 7, "q4": 16}, shared=150)
    got, _, most = run_batch(m, prompts, share=True)
    ref, _, none = run_batch(m, prompts, share=False)
    assert most == 3 and none == 0
    for n in prompts:
        assert got[n].dtype == torch.bfloat16
        assert torch.equal(got[n].argmax(-1), ref[n].argmax(-1)), n
        scale = ref[n].abs().max().item()
        assert (got[n].float() - ref[n].float()).abs().max().item() <= 4 * BF16_STEP * scale
