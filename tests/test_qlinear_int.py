"""The quantized layers' prefill in integer arithmetic (kvc::qlinear_int, kernels/cpu_qlinear.cpp; twin
kernels/qlinear.py `qlinear_int_reference`): int8 activations per row and block of 32 x the stored int4 /
int8 codes, AVX-512 VNNI and AVX2 (both built on an AVX-512 machine: each is tested wherever built).

- each built ISA against the twin (every scheme, row counts around the 4-row block and the 64-row chunk,
  odd tile counts, an odd block count, zero blocks) and the two ISAs bit for bit against each other;
- the twin against the fp32-activation product within the int8 rounding bound;
- QuantizedLinear's prefill switch (prefill_arith, KVC_QLINEAR_ARITH) and errors;
- the real model: Q4_1 prompt logits with integer prefill against the fp32-activation path.
"""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import engine  # noqa: E402
import kernels.cpu  # noqa: E402
from kernels.cpu import ARITH, qlinear_arith_default, qlinear_int_arith  # noqa: E402
from kernels.qlinear import (MAX_GEMV_ROWS, MIN_INT_ROWS, QuantizedLinear, dequantize,  # noqa: E402
                             qlinear_int_reference, qlinear_torch, to_tiles)
from quantize import quantize_int4, quantize_weight  # noqa: E402
from tests.helpers import needs_cpp, prompt_logits  # noqa: E402
from tests.test_qlinear import IDS, SCHEMES, TEXT, act_bound, int8_rounded, summed, weight  # noqa: E402


def built_ariths() -> list[str]:
    """The integer arithmetics this build has (an AVX-512 VNNI build has AVX2 too)."""
    best = qlinear_int_arith()
    return {"vnni": ["avx2", "vnni"], "avx2": ["avx2"]}.get(best, [])


@needs_cpp
@pytest.mark.parametrize("mode,group,sym", SCHEMES, ids=IDS)
@pytest.mark.parametrize("M", [1, 3, 4, 5, 17, 64, 67])
@pytest.mark.parametrize("N,K", [(40, 256), (96, 288)])        # padded rows / odd tiles; 9 blocks of 32
def test_int_kernel_equals_twin(mode, group, sym, M, N, K):
    if K % (group or 32):
        pytest.skip("group does not divide K")
    qw = quantize_weight(weight(N=N, K=K), mode, group, sym)
    w, s, m = to_tiles(qw)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 2
    x[0, :32] = 0                                                             # an all-zero activation block
    x[-1, 40] = 50.0                                                          # an outlier channel
    ref = qlinear_int_reference(x, qw)
    outs = {}
    for arith in built_ariths():
        out = torch.ops.kvc.qlinear_int(x, w, s, m, qw.bits, qw.group, ARITH[arith])
        assert out.shape == (M, w.shape[0] * 16) and (out[:, N:] == 0).all()  # zero padding rows
        assert ((out[:, :N] - ref).abs() <= 1e-6 * summed(x, qw) + 1e-7).all(), arith
        outs[arith] = out
    if len(outs) == 2:                                                        # the same integers, the same fp32 steps
        assert torch.equal(outs["avx2"], outs["vnni"])


@pytest.mark.parametrize("mode,group,sym", SCHEMES, ids=IDS)
def test_twin_within_int8_rounding_of_fp32_activations(mode, group, sym):
    """x~ W~^T vs x W~^T: within |x - x~| |W~|^T (+ fp32), and that bound is <= 1/254 of each block's
    largest |x| times |W~|."""
    qw = quantize_weight(weight(), mode, group, sym)
    x = torch.randn(50, 256, generator=torch.Generator().manual_seed(3))
    x[:, 7] *= 30                                                             # outlier channel
    err = (qlinear_int_reference(x, qw) - qlinear_torch(x, qw)).abs()
    b = act_bound(x, qw, int8_rounded(x))
    assert (err <= b + 1e-5 * summed(x, qw)).all()
    blockmax = x.abs().view(50, 8, 32).amax(-1).repeat_interleave(32, dim=1)
    assert (b <= (blockmax / 254 * (1 + 1e-5)) @ dequantize(qw).abs().T).all()
    assert err.max() > 0


@needs_cpp
def test_quantized_linear_prefill_switch(monkeypatch):
    """From MIN_INT_ROWS rows kvc::qlinear_int runs in prefill_arith (default: the best built), "fp32" takes the
    old path (dequantize + dense matmul: exact to the twin); fewer rows (more than MAX_GEMV_ROWS) take the GEMV
    per MAX_GEMV_ROWS rows; bf16 in, bf16 out."""
    qw = quantize_int4(weight(), 32)
    lin = QuantizedLinear(qw)
    assert lin.prefill_arith == qlinear_arith_default()
    short = torch.randn(MIN_INT_ROWS - 1, 256)
    blocks = [lin(short[i:i + MAX_GEMV_ROWS]) for i in range(0, len(short), MAX_GEMV_ROWS)]
    assert len(blocks) > 1 and torch.equal(lin(short), torch.cat(blocks))
    x = torch.randn(2, MIN_INT_ROWS // 2, 256, generator=torch.Generator().manual_seed(0))
    x2 = x.view(-1, 256)
    for arith in built_ariths():
        lin.prefill_arith = arith
        y = lin(x)
        assert y.shape == (2, MIN_INT_ROWS // 2, 96)
        assert torch.equal(y.view(-1, 96), torch.ops.kvc.qlinear_int(x2, *to_tiles(qw), 4, 32, ARITH[arith])[:, :96])
        assert lin(x.bfloat16()).dtype == torch.bfloat16
    lin.prefill_arith = "fp32"
    assert torch.equal(lin(x2), qlinear_torch(x2, qw))
    monkeypatch.setattr(kernels.cpu, "_qlinear_arith", None)
    monkeypatch.setenv("KVC_QLINEAR_ARITH", "fp32")
    assert QuantizedLinear(qw).prefill_arith == "fp32"
    monkeypatch.setattr(kernels.cpu, "_qlinear_arith", None)
    monkeypatch.setenv("KVC_QLINEAR_ARITH", "int8")
    with pytest.raises(ValueError, match="KVC_QLINEAR_ARITH must be auto, int, fp32"):
        QuantizedLinear(qw)
    monkeypatch.setattr(kernels.cpu, "_qlinear_arith", None)


@needs_cpp
def test_int_kernel_errors():
    qw = quantize_int4(weight(), 32)
    w, s, m = to_tiles(qw)
    with pytest.raises(RuntimeError, match="arith 0"):
        torch.ops.kvc.qlinear_int(torch.randn(20, 256), w, s, m, 4, 32, 0)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        torch.ops.kvc.qlinear_int(torch.randn(2, 20, 256), w, s, m, 4, 32, ARITH[qlinear_int_arith()])
    with pytest.raises(RuntimeError, match="tiles"):
        torch.ops.kvc.qlinear_int(torch.randn(20, 288), w, s, m, 4, 32, ARITH[qlinear_int_arith()])


@pytest.mark.model
@needs_cpp
def test_real_model_integer_prefill_close_to_fp32_activations(default_gguf):
    """The Q4_1 GGUF's prompt logits (185 positions >= MIN_INT_ROWS, the head included) with the integer prefill against
    the fp32-activation path (the same weights).  Measured (AVX-512 VNNI): mean KL 0.0029 nats per
    position, max |diff| 1.43 on logits up to 40, the same argmax at 96.2% of the positions; bounds
    asserted: KL < 0.01, agreement >= 0.93.  (Perplexity, 2048 + 256 tokens: 22.142 vs 22.110.)"""
    model, tok = engine.load_model(default_gguf)
    ids = torch.tensor([tok.encode(TEXT)])
    layers = [mod for mod in model.modules() if isinstance(mod, QuantizedLinear)]
    assert layers and all(lin.prefill_arith == qlinear_int_arith() for lin in layers)
    (int_logits,) = prompt_logits((model,), ids)
    for lin in layers:
        lin.prefill_arith = "fp32"
    (fp_logits,) = prompt_logits((model,), ids)
    kl = F.kl_div(int_logits.log_softmax(-1), fp_logits.log_softmax(-1), log_target=True, reduction="none")
    kl = kl.sum(-1).mean().item()
    agree = (int_logits.argmax(-1) == fp_logits.argmax(-1)).float().mean().item()
    print(f"integer prefill vs fp32 activations: KL {kl:.5f}, argmax agreement {agree:.3f}")
    assert 0 < kl < 0.01 and agree >= 0.93
