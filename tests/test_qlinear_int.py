"""The quantized layers' one arithmetic (kvc::qlinear, kernels/cpu_qlinear.cpp; twin kernels/qlinear.py
`qlinear_reference`): int8 activations per row and block of 32 x the stored int4 / int8 codes, for every row
count, in AVX-512 VNNI, AVX2 or portable loops (all built on an AVX-512 machine: each is tested where built).

- every ISA bitwise equal to the others, each row bitwise the same however x is cut, batched or ordered
  (batch invariance: the end-to-end check on the real model is tests/test_batch_invariance.py);
- the twin against the fp32-activation product within the int8 rounding bound;
- QuantizedLinear's ISA choice (KVC_QLINEAR_ARITH, the retired fp32) and the op's errors;
- the real model: Q4_1 prompt logits against the same weights with exact fp32 activations.
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
from kernels.cpu import QLINEAR_ISA, qlinear_isa, qlinear_isa_default  # noqa: E402
from kernels.qlinear import QuantizedLinear, dequantize, qlinear_reference, qlinear_torch, to_tiles  # noqa: E402
from quantize import quantize_int4, quantize_weight  # noqa: E402
from tests.helpers import needs_cpp, prompt_logits  # noqa: E402
from tests.test_qlinear import IDS, SCHEMES, TEXT, act_bound, built_isas, summed, weight  # noqa: E402


@needs_cpp
@pytest.mark.parametrize("mode,group,sym", SCHEMES, ids=IDS)
def test_rows_are_batch_invariant(mode, group, sym):
    """A row's output is bitwise the same alone, in any chunk of rows, among other rows, in any order and in
    every ISA (x [150, 288]: 9 blocks, 3 tiles with padding)."""
    if 288 % (group or 32):
        pytest.skip("group does not divide K")
    qw = quantize_weight(weight(N=40, K=288), mode, group, sym)
    tiles = to_tiles(qw)
    x = torch.randn(150, 288, generator=torch.Generator().manual_seed(5)) * 3
    x[4, :64] = 0
    x[9, 100] = 80.0
    ref = torch.ops.kvc.qlinear(x, *tiles, qw.bits, qw.group, QLINEAR_ISA[qlinear_isa()])
    for isa in built_isas():
        def run(rows: torch.Tensor, isa=isa) -> torch.Tensor:
            return torch.ops.kvc.qlinear(rows.contiguous(), *tiles, qw.bits, qw.group, QLINEAR_ISA[isa])
        assert torch.equal(run(x), ref), isa
        for chunk in (1, 3, 16, 64, 129):
            assert torch.equal(torch.cat([run(x[i:i + chunk]) for i in range(0, 150, chunk)]), ref), (isa, chunk)
        perm = torch.randperm(150, generator=torch.Generator().manual_seed(1))
        assert torch.equal(run(x[perm]), ref[perm]), isa
        crowd = torch.cat((torch.randn(70, 288) * 100, x[7:8], torch.randn(5, 288)))
        assert torch.equal(run(crowd)[70], ref[7]), isa


@pytest.mark.parametrize("mode,group,sym", SCHEMES, ids=IDS)
def test_twin_within_int8_rounding_of_fp32_activations(mode, group, sym):
    """x~ W~^T vs x W~^T: within |x - x~| |W~|^T (+ fp32), and that bound is <= 1/254 of each block's
    largest |x| times |W~|."""
    qw = quantize_weight(weight(), mode, group, sym)
    x = torch.randn(50, 256, generator=torch.Generator().manual_seed(3))
    x[:, 7] *= 30                                                             # outlier channel
    err = (qlinear_reference(x, qw) - qlinear_torch(x, qw)).abs()
    b = act_bound(x, qw)
    assert (err <= b + 1e-5 * summed(x, qw)).all()
    blockmax = x.abs().view(50, 8, 32).amax(-1).repeat_interleave(32, dim=1)
    assert (b <= (blockmax / 254 * (1 + 1e-5)) @ dequantize(qw).abs().T).all()
    assert err.max() > 0


@needs_cpp
def test_quantized_linear_isa(monkeypatch):
    """QuantizedLinear runs kvc::qlinear in `isa` (default: the best built, KVC_QLINEAR_ARITH forces one; the
    retired fp32 and unbuilt ISAs are refused); every ISA gives the same bits; bf16 in, bf16 out."""
    qw = quantize_int4(weight(), 32)
    lin = QuantizedLinear(qw)
    assert lin.isa == qlinear_isa_default() == qlinear_isa()
    x = torch.randn(2, 70, 256, generator=torch.Generator().manual_seed(0))
    ref = lin(x)
    for isa in built_isas():
        lin.isa = isa
        assert torch.equal(lin(x), ref)
        assert lin(x.bfloat16()).dtype == torch.bfloat16
    for want, got in (("int", qlinear_isa()), ("avx2", "avx2")):
        if got in built_isas():
            monkeypatch.setattr(kernels.cpu, "_qlinear_isa", None)
            monkeypatch.setenv("KVC_QLINEAR_ARITH", want)
            assert QuantizedLinear(qw).isa == got
    for want, msg in (("fp32", "retired"), ("int8", "KVC_QLINEAR_ARITH must be auto, int, fp32")):
        monkeypatch.setattr(kernels.cpu, "_qlinear_isa", None)
        monkeypatch.setenv("KVC_QLINEAR_ARITH", want)
        with pytest.raises(ValueError, match=msg):
            QuantizedLinear(qw)
    monkeypatch.setattr(kernels.cpu, "_qlinear_isa", None)


@needs_cpp
def test_kernel_errors():
    qw = quantize_int4(weight(), 32)
    w, s, m = to_tiles(qw)
    with pytest.raises(RuntimeError, match="isa 7"):
        torch.ops.kvc.qlinear(torch.randn(20, 256), w, s, m, 4, 32, 7)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        torch.ops.kvc.qlinear(torch.randn(256, 20).T, w, s, m, 4, 32, 0)
    with pytest.raises(RuntimeError, match="tiles"):
        torch.ops.kvc.qlinear(torch.randn(20, 288), w, s, m, 4, 32, 0)
    with pytest.raises(RuntimeError, match="bits"):
        torch.ops.kvc.qlinear(torch.randn(20, 256), w, s, m, 3, 32, 0)


@pytest.mark.model
@needs_cpp
def test_real_model_close_to_fp32_activations(default_gguf):
    """The Q4_1 GGUF's prompt logits (185 positions, the head included) with int8 activations against the same
    weights dequantized (weights="float": fp32 activations).  Measured (AVX-512 VNNI, the prefill arithmetic
    before it was the only one): mean KL 0.0029 nats per position, the same argmax at 96.2% of the positions;
    bounds asserted: KL < 0.01, agreement >= 0.93."""
    native, tok = engine.load_model(default_gguf)
    flt, _ = engine.load_model(default_gguf, weights="float")
    assert all(lin.isa == qlinear_isa() for lin in native.modules() if isinstance(lin, QuantizedLinear))
    ids = torch.tensor([tok.encode(TEXT)])
    int_logits, fp_logits = prompt_logits((native, flt), ids)
    kl = F.kl_div(int_logits.log_softmax(-1), fp_logits.log_softmax(-1), log_target=True, reduction="none")
    kl = kl.sum(-1).mean().item()
    agree = (int_logits.argmax(-1) == fp_logits.argmax(-1)).float().mean().item()
    print(f"int8 activations vs fp32 activations: KL {kl:.5f}, argmax agreement {agree:.3f}")
    assert 0 < kl < 0.01 and agree >= 0.93
