"""KIVI's fused kernels against their torch twins: kvc::kivi_attention (C++) and the Triton kernel
(interpreter) against kernels.kivi_attention.kivi_attention_torch on random packed caches (odd
lengths, every group boundary, every key-residual size, eviction-shuffled slots, sparse reads), the C++
writes against SlotStore's torch writes bit for bit, the residual rule after n tokens, the 16-bit
dense kernel, and compiled == eager decode over packed storage."""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import needs_cpp  # noqa: E402

from cache.quantized import KIVIDenseCache, SlotStore  # noqa: E402
from kernels.cpu import (dense_attention_cpu, kivi_arith_default, kivi_attention_cpu,  # noqa: E402
                         kivi_write_cpu, kivi_write_range_cpu)
from kernels.kivi_attention import kivi_attention, kivi_attention_torch, ring_flags  # noqa: E402
from kernels.kivi_int import kivi_attention_int_torch  # noqa: E402
from model import ModelArgs, grouped_attention  # noqa: E402

cpp = needs_cpp


def random_store(B, H, D, n, bits, G, R, seed, evict=False, extra=0, dtype=torch.float32):
    """A SlotStore (storage dtype `dtype`) holding n tokens (positions 0..n-1, shuffled over the slots per
    head when evict, a few empty slots then) written one block at a time; now = n - 1 + extra."""
    g = torch.Generator().manual_seed(seed)
    C = n + 2 * G
    store = SlotStore(B, H, D, C, bits, G, R, dtype)
    pos = torch.full((B, H, C), -1)
    order = torch.stack([torch.randperm(n, generator=g) if evict else torch.arange(n) for _ in range(B * H)])
    pos[..., :n] = order.view(B, H, n)
    if evict and n > 3:
        pos[0, 0, 1] = pos[-1, -1, n - 2] = -1
    k = torch.randn(B, H, n, D, generator=g) * 2 + 0.3
    v = torch.randn(B, H, n, D, generator=g)
    now = torch.full((B,), n - 1 + extra)
    store.write_range_torch(0, k, v, pos, now)
    return store, pos, now, g


CASES = [(bits, D, G, R) for bits in (4, 2, 8) for D, G, R in ((64, 32, 128), (64, 16, 32), (128, 32, 64), (64, 64, 64))]
LENGTHS = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 200, 257]


def dense_cases(bits, D, G, R):
    """(q, store, pos, visible, now, n) of dense reads: every length of LENGTHS (odd ones, every group
    boundary), GQA 3:1 / 4:1 / MHA, per-head or shared visibility, slots shuffled as an evicting policy
    leaves them."""
    for i, n in enumerate(LENGTHS):
        B, H, Hq = (2, 3, 9) if i % 3 == 0 else (1, 2, 8) if i % 3 == 1 else (2, 2, 2)
        store, pos, now, g = random_store(B, H, D, n, bits, G, R, seed=i, evict=i % 2 == 1)
        q = torch.randn(B, Hq, 1, D, generator=g) * 2
        vis = (pos >= 0) & (torch.rand(B, H if i % 2 else 1, pos.shape[2], generator=g) > 0.15)
        for visible, shared in ((vis, pos[:, :1]), (None, pos)):
            yield q, store, shared, visible, now, n


@cpp
@pytest.mark.parametrize("bits,D,G,R", CASES)
def test_cpp_attention_equals_twin(bits, D, G, R):
    """Dense reads (dense_cases), fp32 arithmetic: within 1e-4 of the twin."""
    for q, store, pos, visible, now, n in dense_cases(bits, D, G, R):
        ref = kivi_attention_torch(q, store.buffers, pos, visible, now, n)
        out = kivi_attention_cpu(q, store.buffers, pos, visible, now, n, arith="fp32")
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@cpp
def test_cpp_attention_every_residual_size():
    """n through a whole R-block: the key residual takes every size 0 .. R-1 (the value FIFO is R)."""
    R = 32
    sizes = set()
    for n in range(4 * R, 5 * R):
        store, pos, now, g = random_store(2, 3, 64, n, 4, 16, R, seed=n, evict=True)
        q = torch.randn(2, 9, 1, 64, generator=g)
        key_exact, value_exact = ring_flags(pos, now, R)
        sizes.add(int(key_exact[1, 0].sum()))
        assert int(value_exact[1, 0].sum()) == R
        ref = kivi_attention_torch(q, store.buffers, pos, pos >= 0, now, n)
        torch.testing.assert_close(kivi_attention_cpu(q, store.buffers, pos, pos >= 0, now, n, arith="fp32"), ref,
                                   atol=1e-4, rtol=1e-4)
    assert sizes == set(range(R))


@cpp
@pytest.mark.parametrize("bits,D,G", [(4, 64, 32), (2, 128, 16), (8, 64, 64)])
def test_cpp_attention_value_chunk_boundaries(bits, D, G):
    """Dense reads over several of the kernel's value chunks (512 slots) and score blocks (32): lengths
    around the chunk boundaries, the last block a single vector of 16 or a partial one."""
    for i, n in enumerate((255, 257, 511, 512, 528, 1041)):
        store, pos, now, g = random_store(2, 3, D, n, bits, G, 64, seed=40 + i, evict=i % 2 == 1)
        q = torch.randn(2, 9, 1, D, generator=g) * 2
        vis = (pos >= 0) & (torch.rand(2, 3, pos.shape[2], generator=g) > 0.1)
        ref = kivi_attention_torch(q, store.buffers, pos, vis, now, n)
        out = kivi_attention_cpu(q, store.buffers, pos, vis, now, n, arith="fp32")
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@cpp
@pytest.mark.parametrize("bits,D,G,R", [(4, 64, 32, 128), (2, 64, 16, 32), (8, 128, 32, 64), (4, 128, 8, 16)])
def test_cpp_sparse_reads_equal_twin(bits, D, G, R):
    """Selected slots (sorted or not, lists per KV head or per query head, invalid entries holding
    garbage indices, with or without a visibility mask; list lengths around the kernel's blocks of 16)
    read from packed storage: no gathered copy, same result as gather + attention."""
    for i, n in enumerate((33, 150, 300)):
        store, pos, now, g = random_store(2, 3, D, n, bits, G, R, seed=10 + i, evict=True)
        q = torch.randn(2, 9, 1, D, generator=g)
        vis = (pos >= 0) & (torch.rand(2, 3, pos.shape[2], generator=g) > 0.2)
        for Hidx, N, visible in ((3, min(n, 70), None), (9, min(n, 70), vis), (3, 16, vis), (9, 5, None)):
            idx = torch.stack([torch.randperm(n, generator=g)[:N] for _ in range(2 * Hidx)]).view(2, Hidx, N)
            if i % 2:
                idx = idx.sort(-1).values
            valid = torch.rand(2, Hidx, N, generator=g) > 0.2
            idx = torch.where(valid, idx, n + 1000)                      # never read
            ref = kivi_attention_torch(q, store.buffers, pos, visible, now, n, idx=idx, valid=valid)
            out = kivi_attention_cpu(q, store.buffers, pos, visible, now, n, idx=idx, valid=valid)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@cpp
@pytest.mark.parametrize("bits,D,G", [(4, 64, 32), (2, 128, 8)])
def test_cpp_sparse_reads_of_whole_groups(bits, D, G):
    """Ascending lists that take whole key groups and every slot of some 16-slot lines (as the readers'
    selections near the sinks and the newest tokens), with and without valid, over a long cache."""
    n = 700
    store, pos, now, g = random_store(2, 3, D, n, bits, G, 64, seed=bits)
    q = torch.randn(2, 9, 1, D, generator=g) * 2
    picks = torch.cat([torch.arange(0, 3 * G), torch.arange(n - 100, n),
                       torch.randperm(n - 3 * G - 100, generator=g)[:150] + 3 * G]).sort().values
    idx = picks.expand(2, 3, -1).contiguous()
    for valid in (None, torch.rand(idx.shape, generator=g) > 0.1):
        ref = kivi_attention_torch(q, store.buffers, pos, None, now, n, idx=idx, valid=valid)
        out = kivi_attention_cpu(q, store.buffers, pos, None, now, n, idx=idx, valid=valid)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@cpp
@pytest.mark.parametrize("bits", [4, 2, 8])
@pytest.mark.parametrize("D,G,R", [(64, 32, 64), (128, 16, 32), (16, 8, 16)])
def test_cpp_writes_equal_torch_bit_for_bit(bits, D, G, R):
    """kvc::kivi_write / kivi_write_range against SlotStore.write_torch / write_range_torch: random slot
    overwrites (old, residual and empty slots, `where` masks) and prompt chunks with padding."""
    store, pos, now, g = random_store(2, 3, D, 60, bits, G, R, seed=bits, evict=True)
    twin = copy.deepcopy(store)
    B, H, S = pos.shape
    for step in range(30):
        now = now + 1
        slot = torch.randint(0, S, (B, H), generator=g)
        pos.scatter_(2, slot[..., None], now[:, None, None].expand(B, H, 1))
        k, v = torch.randn(2, B, H, 1, D, generator=g) * 3
        where = torch.rand(B, H, generator=g) > 0.3 if step % 2 else None
        twin.write_torch(slot, k, v, pos, now, where)
        kivi_write_cpu(store.buffers, slot, k, v, pos, now, where)
    assert all(torch.equal(a, b) for a, b in zip(store.buffers[:8], twin.buffers[:8]))
    start, T = 7, 45
    pos[..., start:start + T] = torch.arange(start, start + T)
    pos[0, 1, start + 3] = -1                                           # a padding slot
    now = torch.full((B,), start + T - 1)
    k, v = torch.randn(2, B, H, T, D, generator=g)
    twin.write_range_torch(start, k, v, pos, now)
    kivi_write_range_cpu(store.buffers, start, k, v, pos, now)
    assert all(torch.equal(a, b) for a, b in zip(store.buffers[:8], twin.buffers[:8]))


def triton_write_mismatches(device: str) -> list[str]:
    """kivi_write_triton on `device` (CPU: under the interpreter) against SlotStore.write_torch on the CPU,
    bit for bit: 12 random slot overwrites (old, residual and empty slots, slots past the policy's S,
    `where` masks) per format and storage dtype.  -> the buffers that differ, named."""
    from kernels.kivi_write_triton import kivi_write_triton
    bad = []
    for bits, D, G, R, dtype in [(4, 64, 32, 64, torch.float32), (2, 128, 16, 32, torch.bfloat16),
                                 (8, 64, 32, 32, torch.float16), (4, 64, 16, 32, torch.bfloat16)]:
        store, pos, now, g = random_store(2, 3, D, 60, bits, G, R, seed=bits, evict=True, dtype=dtype)
        twin, dev = copy.deepcopy(store), buffers_on(store.buffers, device)
        B, H, S = pos.shape
        pos = pos[..., :S - 5]                                         # the store's last slots lie past S
        for step in range(12):
            now = now + 1
            slot = torch.randint(0, S, (B, H), generator=g)
            pos.scatter_(2, slot.clamp(max=S - 6)[..., None], now[:, None, None].expand(B, H, 1))
            k, v = (torch.randn(2, B, H, 1, D, generator=g) * 3).to(torch.float32 if step % 3 else dtype)
            where = torch.rand(B, H, generator=g) > 0.3 if step % 2 else None
            twin.write_torch(slot, k, v, pos, now, where)
            kivi_write_triton(dev, *(t if t is None else t.to(device) for t in (slot, k, v, pos, now, where)))
        names = ("k_packed", "k_scale", "k_min", "v_packed", "v_scale", "v_min", "k_ring", "v_ring")
        bad += [f"{bits}-bit D {D} G {G} {dtype}: {name}" for name, a, b in zip(names, dev, twin.buffers)
                if not torch.equal(a.cpu(), b)]
    return bad


def test_triton_write_interpreter_equals_torch_bit_for_bit():
    """kivi_write_triton under TRITON_INTERPRET=1 against write_torch (triton_write_mismatches)."""
    assert interpreted("triton_write_mismatches") == "[]"


@pytest.mark.parametrize("backend", [pytest.param("cpp", marks=cpp), "torch"])
@pytest.mark.parametrize("bits,D,G,R", [(4, 64, 32, 64), (2, 128, 16, 32), (8, 64, 32, 32)])
def test_slot_major_copy_follows_every_write_and_reads_the_same(backend, bits, D, G, R):
    """SlotStore.keep_slot_major: after slot writes (old, residual and empty slots, `where` masks) and a
    prompt chunk, through the C++ writes or the torch ones, the copy equals the words slot by slot, and a
    sparse read of reader_buffers equals one of buffers (the C++ op reads the copy in place); a row copied
    in whole is refreshed by refresh_slot_major."""
    store, pos, now, g = random_store(2, 3, D, 70, bits, G, R, seed=bits, evict=True)
    store.backend = backend
    store.keep_slot_major()
    B, H, S = pos.shape

    def same_words():
        return all(torch.equal(c, w.contiguous()) for c, w in zip(store.slot_words, (store.k_packed, store.v_packed)))
    for step in range(12):
        now = now + 1
        slot = torch.randint(0, S, (B, H), generator=g)
        pos.scatter_(2, slot[..., None], now[:, None, None].expand(B, H, 1))
        k, v = torch.randn(2, B, H, 1, D, generator=g) * 3
        store.write(slot, k, v, pos, now, torch.rand(B, H, generator=g) > 0.3 if step % 2 else None)
        assert same_words()
    start, T = 5, 40
    pos[..., start:start + T] = torch.arange(start, start + T)
    now = torch.full((B,), start + T - 1)
    k, v = torch.randn(2, B, H, T, D, generator=g)
    store.write_range(start, k, v, pos, now)
    assert same_words()
    assert store.reader_buffers.k_packed.is_contiguous() and store.buffers.k_packed.stride(2) == 1
    q = torch.randn(B, 9, 1, D, generator=g)
    idx = torch.stack([torch.randperm(S - 2 * G, generator=g)[:50].sort().values for _ in range(B * H)]).view(B, H, 50)
    valid = torch.rand(B, H, 50, generator=g) > 0.1
    ref = kivi_attention_torch(q, store.buffers, pos, None, now, S, idx=idx, valid=valid)
    out = kivi_attention(q, store.reader_buffers, pos, None, now, S, idx=idx, valid=valid, backend=backend)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    store.k_packed[1].copy_(torch.randint_like(store.k_packed[1], 0, 2 ** 31 - 1))
    store.refresh_slot_major(1)
    assert same_words()


def buffers_on(buf, device: str):
    """KIVIBuffers `buf` with its tensors moved to `device` (strides kept)."""
    from kernels.kivi_attention import KIVIBuffers
    return KIVIBuffers(*(t.to(device) for t in buf[:8]), buf.bits, buf.group)


def triton_worst_error(device: str) -> float:
    """The largest |Triton - twin| over dense and sparse reads (lists per KV head and per query head), each
    with and without visibility, several splits; the stores are written on the CPU, then moved to `device`
    (strides kept; CPU: the kernel runs under the interpreter)."""
    from kernels.kivi_triton import kivi_attention_triton
    worst = 0.0
    for i, (bits, D, G, R, n, splits) in enumerate([(4, 64, 32, 128, 200, 2), (2, 64, 16, 32, 77, 1),
                                                    (8, 32, 16, 16, 45, 3), (4, 64, 16, 32, 129, 4)]):
        store, pos, now, g = random_store(2, 3, D, n, bits, G, R, seed=i, evict=i % 2 == 1)
        q = torch.randn(2, 9, 1, D, generator=g)
        vis = (pos >= 0) & (torch.rand(2, 3, pos.shape[2], generator=g) > 0.2)
        lists = {}
        for Hidx in (3, 9):
            idx = torch.stack([torch.randperm(n, generator=g)[:37] for _ in range(2 * Hidx)]).view(2, Hidx, 37)
            lists[Hidx] = idx, torch.rand(2, Hidx, 37, generator=g) > 0.2
        buf = store.buffers
        dev = buffers_on(buf, device)
        to = (lambda t: None if t is None else t.to(device))
        for visible in (vis, None):
            for idx, valid in (None, None), *lists.values():
                ref = kivi_attention_torch(q, buf, pos, visible, now, n, idx=idx, valid=valid)
                out = kivi_attention_triton(to(q), dev, to(pos), to(visible), to(now), n, idx=to(idx),
                                            valid=to(valid), n_splits=splits)
                worst = max(worst, (out.cpu() - ref).abs().max().item())
    return worst


def triton_decode_error(device: str) -> float:
    """A tiny model's prefill + 8 greedy decode steps of two left-padded rows over KIVI 4-bit storage with
    backend "triton" (the CUDA decode path: kivi_write_triton, the Triton attention, kivi_merge) against
    backend "torch" -> the largest |logits difference|; "triton" both through the dynamic step and through the static
    one (runtime.steps.GraphDecode, eager: the CUDA-graph step, reading a bucket of slots whose last ones are
    empty).  Run with KVC_KIVI_ARITH=fp32 (the fp32-arithmetic kernel, whose twin the torch path is)."""
    from cache import make_policy
    from cache.quantized import with_kv_bits
    from model import Transformer
    from runtime.steps import GraphDecode, decode_step, run_decode, run_prefill, static_decode_step
    from tests.helpers import left_padded
    args = ModelArgs(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64, head_dim=32)
    torch.manual_seed(0)
    model = Transformer(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    model = model.to(device)
    tokens, pos = left_padded([70, 45], vocab=64, seed=1)
    runs = []
    for backend, step in (("torch", decode_step), ("triton", decode_step),
                          ("triton", GraphDecode(static_decode_step, decode_step))):
        model.setup_caches(2, 90, with_kv_bits(make_policy("full"), 4, 16, 32, backend=backend))
        with torch.inference_mode():
            logits = [run_prefill(model, tokens.to(device), pos.to(device))]
            token, p = logits[0].argmax(-1, keepdim=True), pos[:, -1:].to(device) + 1
            for i in range(8):
                logits.append(run_decode(model, token, p + i, i, step))
                token = logits[-1].argmax(-1, keepdim=True)
        runs.append(torch.stack(logits).float().cpu())
    return max((run - runs[0]).abs().max().item() for run in runs[1:])


def interpreted(check: str, **env: str) -> str:
    """This module's `check`('cpu') run in a fresh process under TRITON_INTERPRET=1 (and `env`) -> what it
    returned, printed (the interpreter must be set before triton is first imported)."""
    pytest.importorskip("triton")
    code = f"import sys; sys.path.insert(0, '.'); from tests.test_kivi_kernels import {check}; print({check}('cpu'))"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", **env)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip().splitlines()[-1]


def test_triton_decode_path_equals_torch_path():
    """The CUDA decode path over KIVI storage, wired end to end (triton_decode_error), under the interpreter."""
    assert float(interpreted("triton_decode_error", KVC_KIVI_ARITH="fp32")) <= 1e-4


def test_triton_interpreter_equals_twin():
    """The Triton kernel under TRITON_INTERPRET=1 against the twin (triton_worst_error)."""
    assert float(interpreted("triton_worst_error")) <= 1e-4


def merge_worst_error(device: str) -> float:
    """The largest |kivi_merge - _merge| over random partials (5 splits, some empty: m = -inf, l = 0, acc =
    ring = 0 as the kernels store them; one row empty in every split), rows 3 of BLOCK_G 16 and 1 of 16."""
    from kernels.kivi_triton import _merge, merged_output
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for rows, Hi in ((3, 3), (1, 9)):
        B, S, NCG, BG, G, D = 2, 5, 2, 16, 32, 64
        m = torch.randn(B, Hi, S, BG, generator=g) * 4
        empty = torch.rand(B, Hi, S, BG, generator=g) < 0.3
        empty[0, 1, :, 0] = True
        m[empty] = float("-inf")
        l = torch.rand(B, Hi, S, BG, generator=g).masked_fill(empty, 0.0) * 9
        acc = torch.randn(B, Hi, S, NCG, BG, G, generator=g).masked_fill(empty[:, :, :, None, :, None], 0.0)
        ring = torch.randn(B, Hi, S, BG, D, generator=g).masked_fill(empty[..., None], 0.0)
        q = torch.zeros(B, Hi * rows, 1, D)
        ref = _merge(m[..., :rows], l[..., :rows], acc[..., :rows, :], ring[..., :rows, :]).reshape(B, Hi * rows, D)
        out = merged_output(q.to(device), tuple(t.to(device) for t in (m, l, acc, ring)), rows)
        assert out.shape == q.shape and torch.isfinite(out).all()
        worst = max(worst, (out[:, :, 0].cpu() - ref).abs().max().item())
    return worst


def test_merge_kernel_interpreter_equals_twin():
    """kivi_merge (the splits' log-sum-exp, one launch) under TRITON_INTERPRET=1 against `_merge`."""
    assert float(interpreted("merge_worst_error")) <= 1e-5


def full_cache(D=64, G=32, R=128, bits=4, B=2, S=600):
    a = ModelArgs(vocab_size=16, dim=2 * D, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=8, head_dim=D)
    cache = KIVIDenseCache(bits, G, R)
    cache.setup(a, B, S, torch.float32, "cpu")
    return cache


@pytest.mark.parametrize("R", [32, 128])
def test_residual_size_after_n_tokens(R):
    """Issue 20 item 6, KIVI's rule: after n tokens (prompt + decode steps through the policy's own
    hooks) exactly the n mod R newest keys read back exact, the rest quantized; values keep the newest
    min(n, R) exact.  n around multiples of R."""
    G, D = 32, 64
    cache = full_cache(D, G, R)
    g = torch.Generator().manual_seed(R)
    T0 = R - 3
    k, v = torch.randn(2, 2, 1, 3 * R + 3, D, generator=g)
    q = torch.randn(2, 2, 1, D, generator=g)
    cache.begin(torch.arange(T0)[None].repeat(2, 1))
    cache.prefill(0, torch.randn(2, 2, T0, D, generator=g), k[:, :, :T0], v[:, :, :T0])
    checks = {R - 1, R, R + 1, 2 * R - 1, 2 * R, 2 * R + 1, 3 * R}
    for n in range(T0 + 1, 3 * R + 2):
        cache.begin(torch.full((2, 1), n - 1))
        cache.decode(0, q, k[:, :, n - 1:n], v[:, :, n - 1:n])
        if n not in checks:
            continue
        kd, vd = cache.stores[0].dequantized(cache.pos[:, None], cache.now, n)
        exact_k = (kd == k[:, :, :n]).all(-1)                                   # [B, H, n]
        exact_v = (vd == v[:, :, :n]).all(-1)
        assert int(exact_k[0, 0].sum()) == n % R and exact_k[..., n - n % R:].all(), n
        assert int(exact_v[0, 0].sum()) == min(n, R) and exact_v[..., n - min(n, R):].all(), n


@cpp
@pytest.mark.parametrize("lanes", [8, 16], ids=["avx2", "avx512"])
def test_dense_bf16_attention_equals_sdpa(lanes, monkeypatch):
    """kvc::dense_attention over bf16 rows (the --kv-dtype bfloat16 cache) == SDPA over their fp32 values,
    in both vector widths (kernels.cpu.attention_lanes)."""
    monkeypatch.setattr("kernels.cpu._attn_lanes", lanes)
    g = torch.Generator().manual_seed(3)
    for D, (B, Hq, H), n in ((64, (2, 9, 3), 77), (128, (1, 4, 4), 300), (64, (1, 6, 1), 9)):
        k, v = (torch.randn(2, B, H, n + 10, D, generator=g)).bfloat16()
        q = torch.randn(B, Hq, 1, D, generator=g)
        ref = grouped_attention(q, k[:, :, :n].float(), v[:, :, :n].float(), None)
        torch.testing.assert_close(dense_attention_cpu(q, k, v, n), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dense_attention_cpu(q, k.float(), v.float(), n), ref, atol=1e-5, rtol=1e-5)


@cpp
@pytest.mark.parametrize("arith,tol", [("fp32", 1e-4), ("int", 1e-3)])
def test_compiled_decode_over_packed_storage_equals_eager_without_recompiles(arith, tol, monkeypatch):
    """torch.compile over the fused ops (opaque to Inductor through their fake kernels): the compiled
    decode step equals eager within 1e-4 and compiles nothing after the first step, through a key flush.
    Integer arithmetic (kernels/kivi_int.py): within 1e-3, as Inductor's other ops round q differently
    in the last bit and one ulp can move a query's int8 code."""
    from runtime.steps import decode_step, run_prefill
    from torch._dynamo.utils import counters
    import kernels.cpu
    from model import Transformer
    monkeypatch.setattr(kernels.cpu, "_kivi_arith", kernels.cpu.kivi_int_arith() if arith == "int" else arith)
    torch.manual_seed(0)
    a = ModelArgs(vocab_size=64, dim=128, n_layers=2, n_heads=6, n_kv_heads=2, intermediate_size=64, head_dim=64)
    model = Transformer(a).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    tokens = torch.randint(0, 64, (2, 100))
    runs = {}
    torch._dynamo.reset()
    for compiled in (False, True):
        model.setup_caches(2, 120, KIVIDenseCache(4, 32, 32))
        step = torch.compile(decode_step, dynamic=True) if compiled else decode_step
        logits = []
        with torch.inference_mode():
            run_prefill(model, tokens[:, :65], torch.arange(65).repeat(2, 1))
            for i, t in enumerate(range(65, 100)):           # keys flush at 96
                logits.append(step(model, tokens[:, t:t + 1], torch.full((2, 1), t), model.cache.n_filled))
                if compiled and i == 0:
                    graphs = counters["stats"]["unique_graphs"]
        runs[compiled] = torch.stack(logits)
    assert counters["stats"]["unique_graphs"] == graphs, "decode recompiled"
    torch.testing.assert_close(runs[True], runs[False], atol=tol, rtol=tol)


@cpp
def test_dispatch_takes_cpp_on_fp32_cpu_and_the_twin_elsewhere():
    store, pos, now, g = random_store(1, 1, 64, 40, 4, 32, 32, seed=1)
    q = torch.randn(1, 3, 1, 64, generator=g)
    ref = kivi_attention_torch(q, store.buffers, pos, None, now, 40)
    twin = ref if kivi_arith_default() == "fp32" else kivi_attention_int_torch(q, store.buffers, pos, None, now, 40)
    torch.testing.assert_close(kivi_attention(q, store.buffers, pos, None, now, 40), twin, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kivi_attention(q, store.buffers, pos, None, now, 40, backend="torch"), ref, atol=0, rtol=0)
    small, pos8, now8, _ = random_store(1, 1, 64, 40, 4, 8, 32, seed=1)           # G 8: dense path is the twin's
    with pytest.raises(ValueError, match="fp32"):
        kivi_attention(q, small.buffers, pos8, None, now8, 40, backend="cpp")


@cpp
@pytest.mark.parametrize("n_critical", [0, 96])
def test_bench_kivi_attention_runs(n_critical, capsys):
    """scripts/bench_kivi_attention.py, dense and sparse, at toy sizes: one line per op, fp32 first."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_kivi_attention
    from kernels.cpu import kivi_int_arith
    bench_kivi_attention.main(["--batch", "1", "--seq", "256", "--n-critical", str(n_critical), "--bits", "4,2",
                               "--repeats", "1", "--inner", "1", "--layers", "1", "--threads", "1",
                               "--peak-size", "256", "--read-mib", "16"])
    lines = capsys.readouterr().out.splitlines()
    assert f"N={n_critical or 'all'}" in lines[0] and "FMA peak" in lines[0] and "read rate" in lines[0]
    arith = kivi_int_arith()
    names = ["fp32", "kivi4", "kivi4 slots", "kivi2", "kivi2 slots"] if n_critical else ["fp32", "kivi4", "kivi2"]
    if n_critical == 0 and arith != "fp32":
        names = ["fp32", "kivi4", f"kivi4 {arith}", "kivi2", f"kivi2 {arith}"]
    if n_critical == 0:
        names.insert(1, "fp32 lanes8")
    assert [ln.split(":")[0].strip() for ln in lines[1:]] == names
    assert all("G MAC/s" in ln and "% of peak" in ln and "% of read rate" in ln and "bound" in ln for ln in lines[1:])
