"""The integer KIVI Triton kernel (kernels/kivi_int_triton.py) under TRITON_INTERPRET=1 against its twin
(kernels.kivi_int.kivi_attention_int_triton_torch): every group boundary, odd lengths, every key-residual
size, packed and ring values, 2 and 4 bits, several splits; the KVC_KIVI_ARITH switch of the Triton
backend.  As in tests/test_kernels.py, the cases run in ONE subprocess (this file as a script with
TRITON_INTERPRET=1: Triton reads it when it is imported) printing one JSON record each, and each case is
then its own test.  Small caches: the interpreter runs each program's ops one numpy call at a time."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.test_kivi_kernels import buffers_on, random_store  # noqa: E402

import kernels.kivi_int_triton as kit  # noqa: E402
from kernels.kivi_attention import kivi_attention, kivi_attention_torch, ring_flags  # noqa: E402
from kernels.kivi_int import kivi_attention_int_triton_torch  # noqa: E402

TOL = 1e-4
SHAPES = [(64, 16, 16), (64, 32, 32), (128, 32, 64), (64, 64, 64)]
CASES = ([("twin", bits, D, G, R) for bits in (4, 2) for D, G, R in SHAPES]
         + [("residual", bits) for bits in (4, 2)] + [("switch",)])


def case_id(case) -> str:
    return "-".join(map(str, case))


def error(q, store, pos, visible, now, n, splits, device="cpu") -> float:
    """|kernel - twin|: the twin on the CPU, the kernel on `device` (CPU: the interpreter)."""
    ref = kivi_attention_int_triton_torch(q, store.buffers, pos, visible, now, n)
    to = (lambda t: None if t is None else t.to(device))
    out = kit.kivi_attention_int_triton(to(q), buffers_on(store.buffers, device), to(pos), to(visible), to(now), n,
                                        n_splits=splits)
    return (out.cpu() - ref).abs().max().item()


def twin_case(bits, D, G, R, device="cpu") -> float:
    """Lengths on both sides of the group boundaries (odd ones too), past the residual (packed values):
    GQA 3:1 and MHA, positions and visibility per head or shared, no visibility, slots shuffled as an
    evicting policy leaves them, 1-3 splits."""
    worst = 0.0
    for i, n in enumerate((1, G - 1, G, G + 1, 2 * G + 1, R + 2 * G + 3)):
        B, H, Hq = (1, 2, 6) if i % 2 == 0 else (2, 1, 1)
        store, pos, now, g = random_store(B, H, D, n, bits, G, R, seed=i, evict=i % 3 == 1)
        q = torch.randn(B, Hq, 1, D, generator=g) * 2
        if i % 3 == 0:
            pos = pos[:, :1]
        visible = (pos >= 0) & (torch.rand(pos.shape, generator=g) > 0.15) if i % 3 < 2 else None
        worst = max(worst, error(q, store, pos, visible, now, n, 1 + i % 3, device))
    return worst


def residual_case(bits, device="cpu") -> float:
    """n through a whole R-block: the key residual takes every size 0 .. R-1."""
    R, sizes, worst = 16, set(), 0.0
    for n in range(4 * R, 5 * R):
        store, pos, now, g = random_store(1, 1, 64, n, bits, 16, R, seed=n)
        q = torch.randn(1, 2, 1, 64, generator=g)
        sizes.add(int(ring_flags(pos, now, R)[0][0, 0].sum()))
        worst = max(worst, error(q, store, pos, pos >= 0, now, n, 1 + n % 2, device))
    assert sizes == set(range(R))
    return worst


def switch_case() -> float:
    """kivi_attention(backend="triton"): KVC_KIVI_ARITH=int and auto run the integer kernel on dense reads of
    2/4-bit storage, fp32 the fp32 kernel, sparse reads stay fp32; a bad value is a ValueError."""
    store, pos, now, g = random_store(1, 1, 64, 70, 4, 16, 16, seed=3)
    q = torch.randn(1, 2, 1, 64, generator=g)
    idx = torch.arange(0, 70, 3).expand(1, 1, -1)
    dense = (q, store.buffers, pos, None, now, 70)
    fp32 = kivi_attention_torch(*dense)
    worst = 0.0
    int_ref = kivi_attention_int_triton_torch(*dense)
    for env, ref in (("int", int_ref), ("fp32", fp32), ("auto", int_ref)):
        os.environ["KVC_KIVI_ARITH"], kit._use_int = env, None
        worst = max(worst, (kivi_attention(*dense, backend="triton") - ref).abs().max().item())
        sparse = kivi_attention(*dense, idx=idx, backend="triton") - kivi_attention_torch(*dense, idx=idx)
        worst = max(worst, sparse.abs().max().item())
    os.environ["KVC_KIVI_ARITH"], kit._use_int = "int8", None
    try:
        kivi_attention(*dense, backend="triton")
    except ValueError as e:
        assert "KVC_KIVI_ARITH" in str(e)
    else:
        raise AssertionError("KVC_KIVI_ARITH=int8 was accepted")
    return worst


def _main_triton_cases():
    """Subprocess entry point (TRITON_INTERPRET=1): one JSON line per case."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    run = {"twin": twin_case, "residual": residual_case, "switch": switch_case}
    for case in CASES:
        try:
            err = run[case[0]](*case[1:])
            rec = dict(ok=err <= TOL, err=err)
        except Exception as e:  # reported by the matching test
            rec = dict(ok=False, err=None, error=f"{type(e).__name__}: {e}")
        print(json.dumps(dict(key=case_id(case), **rec)), flush=True)


@pytest.fixture(scope="module")
def triton_results():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", KVC_CPU_KERNELS="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--triton-cases"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["key"]: r for r in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_int_triton_equals_twin(triton_results, case):
    """Each case's largest |kernel - twin| within TOL (printed with -s)."""
    rec = triton_results[case_id(case)]
    print(f"{rec['key']}: max |triton - twin| = {rec['err']}")
    assert rec["ok"], rec


def test_rejects_what_it_cannot_read():
    """8-bit storage (and shapes the GPU's int8 dots cannot take) are a ValueError, before any Triton call."""
    store, pos, now, g = random_store(1, 1, 64, 40, 8, 16, 16, seed=4)
    with pytest.raises(ValueError, match="2/4-bit"):
        kit.kivi_attention_int_triton(torch.randn(1, 1, 64), store.buffers, pos, None, now, 40)
    store, pos, now, g = random_store(1, 1, 16, 40, 4, 16, 16, seed=4)
    with pytest.raises(ValueError, match="head_dim >= 32"):
        kit.kivi_attention_int_triton(torch.randn(1, 1, 16), store.buffers, pos, None, now, 40)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the script itself")
def test_the_gpu_timing_script_refuses_without_cuda(capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_kivi_triton
    assert bench_kivi_triton.main([]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


if __name__ == "__main__" and "--triton-cases" in sys.argv:
    _main_triton_cases()
