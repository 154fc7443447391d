"""Rows that read a kept prefix in place (DenseCache.adopt(prefix=), RowBatch's share_prefix): the
attention op (kvc::prefix_attention and its twin model.prefix_attention) against the same rows holding copies
of the prefix, and a running batch whose rows share a document against one whose rows copy it."""
from __future__ import annotations

import pytest
import torch

from cache import make_policy
from kernels.cpu import cpu_kernels_available, decode_attention, prefix_attention_cpu
from model import ModelArgs, Transformer, grouped_attention, prefix_attention
from runtime.rows import RowBatch
from tests.test_policy_matrix import model  # noqa: F401  (the tiny Llama fixture: head_dim 16, the twin's path)
from tests.test_rowbatch import NEW, drive, prompts_of

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels are not built")


def case(B, Hq, Hkv, S, P, D, seed=0):
    """q [B, Hq, 1, D], own k, v [B, Hkv, S, D] (a larger buffer's first S slots), a prefix pk, pv [1, Hkv, P, D],
    own_from (rows 0, 2, 3, ...: P, row 1: 0, a row past 2 of B > 3: free), visible [B, 1, S] with holes (a free
    row: none) -> the tensors and the oracle: each sharing row's slots [0, P) overwritten by the prefix,
    grouped_attention over those copies."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=g) * 2
    k, v = torch.randn(2, B, Hkv, S + 3, D, generator=g)[:, :, :, :S]
    pk, pv = torch.randn(2, 1, Hkv, P, D, generator=g)
    own_from = torch.tensor([0 if b == 1 else P for b in range(B)])
    visible = torch.rand(B, 1, S, generator=g) > 0.2
    visible[:, :, -1] = True                                   # the step's own token
    if B > 3:
        own_from[2], visible[2] = 0, False                     # a free row of a running batch
    kc, vc = k.clone(), v.clone()
    sharing = own_from > 0
    kc[sharing, :, :P], vc[sharing, :, :P] = pk[0], pv[0]
    vis = visible.clone()
    vis[sharing, :, :P] = True
    mask = vis[:, :, None, :].expand(B, 1, Hq // Hkv, S).reshape(B, Hq // Hkv, S)
    ref = torch.nan_to_num(grouped_attention(q, kc, vc, mask))
    return (q, k, v, visible, pk, pv, own_from), ref, ~visible.any(-1)[:, 0]


SHAPES = [(8, 9, 3, 300, 200, 64), (5, 8, 2, 700, 650, 128), (4, 4, 4, 40, 17, 64), (3, 9, 3, 16, 16, 64),
          (6, 12, 2, 130, 1, 64)]


@needs_kernels
@pytest.mark.parametrize("B,Hq,Hkv,S,P,D", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lanes", [8, 16], ids=["avx2", "avx512"])
def test_prefix_kernel_equals_rows_holding_copies(B, Hq, Hkv, S, P, D, threads, lanes, monkeypatch):
    """kvc::prefix_attention: the sharing rows' query heads read the prefix together (register blocks of up to
    R * G rows), the rest of their slots and the other rows' slots in place, merged by log-sum-exp; equal to
    the same rows holding copies; a free row (nothing visible) gets 0.  GQA groups of 3/4/6, MHA, D 64/128, a
    one-slot prefix, a prefix that fills the row; both vector widths and thread counts."""
    monkeypatch.setattr("kernels.cpu._attn_lanes", lanes)
    args, ref, free = case(B, Hq, Hkv, S, P, D)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = prefix_attention_cpu(*args)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out[~free], ref[~free], atol=2e-5, rtol=1e-5)
    assert not free.any() or out[free].abs().max() == 0


@pytest.mark.parametrize("B,Hq,Hkv,S,P,D", SHAPES[:3])
def test_prefix_twin_equals_rows_holding_copies(B, Hq, Hkv, S, P, D):
    args, ref, free = case(B, Hq, Hkv, S, P, D)
    out = prefix_attention(*args)
    torch.testing.assert_close(out[~free], ref[~free], atol=2e-5, rtol=1e-5)
    assert torch.isfinite(out).all()                            # a free row: finite, unused


@needs_kernels
def test_decode_kernel_reads_nothing_of_a_free_row():
    """A free row of a running batch (position -1: DenseCache.decode_visible hides every slot) gets 0 from the
    C++ kernel, a finite output from its torch fallback (model.grouped_attention would give NaN)."""
    q, k, v = torch.randn(1, 2, 9, 1, 64), torch.randn(2, 3, 50, 64), torch.randn(2, 3, 50, 64)
    visible = torch.ones(2, 1, 50, dtype=torch.bool)
    visible[1] = False
    assert decode_attention(q[0], k, v, visible)[1].abs().max() == 0
    assert torch.isfinite(decode_attention(q[0].double(), k.double(), v.double(), visible)).all()


def head64_model() -> Transformer:
    """A small random Llama with head_dim 64 and the loader's kernels plugged in (the C++ path on CPU)."""
    torch.manual_seed(0)
    m = Transformer(ModelArgs(vocab_size=256, dim=256, n_layers=2, n_heads=6, n_kv_heads=2, intermediate_size=256,
                              max_position_embeddings=1024)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    m.decode_kernel, m.prefix_kernel = decode_attention, prefix_attention_cpu
    return m


def run_batch(m, prompts, share: bool, max_batch: int = 3):
    """prompts through a `full` RowBatch keeping prefixes; arrivals staggered so that rows join a running batch and
    leave it; -> (logits per request, the batch, the largest number of rows that read the prefix at one step)."""
    batch = RowBatch(m, lambda: make_policy("full"), max_batch, 400 + NEW, NEW, prefill_chunk=32,
                     prefix_bytes=1 << 30, min_prefix=16, share_prefix=share)
    most = 0
    step = batch.step

    def counted(tokens):
        nonlocal most
        most = max(most, int((batch.policy.own_from > 0).sum()))
        return step(tokens)
    batch.step = counted
    got, _ = drive(batch, prompts, {n: i for i, n in enumerate(prompts)}, staged=True)
    return got, batch, most


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_kernels), False], ids=["cpp", "twin"])
def test_rows_sharing_a_kept_prefix_equal_rows_holding_copies(model, kernels):  # noqa: F811
    """Five questions on one 150-token document, three rows: each row after the first reads the kept document in
    place (own_from = 150) and holds only its question and answer; tokens equal and logits within 1e-5 of the
    batch whose rows copy it; the prefix is dropped when the last row reading it leaves."""
    m = head64_model() if kernels else model
    prompts = prompts_of({"q1": 12, "q2": 20, "q3": 7, "q4": 16, "q5": 3}, shared=150)
    got, batch, most = run_batch(m, prompts, share=True)
    ref, plain, none = run_batch(m, prompts, share=False)
    assert most == 3 and none == 0
    for n in prompts:
        assert torch.equal(got[n].argmax(-1), ref[n].argmax(-1)), f"{n}'s tokens differ when rows share the prefix"
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-5)
    assert not batch.policy.groups and not batch.policy.own_from.any() and not batch.prefixes.refs


def test_prefixes_past_max_prefixes_are_copied(model):  # noqa: F811
    """Up to FullCache.max_prefixes kept prefixes are read in place at once (tests/test_memory.py: two); with
    max_prefixes 1, requests on another document, while rows read the first, copy theirs (own_from 0) and still
    decode what they decode alone."""
    a = prompts_of({"a1": 10, "a2": 12}, seed=1, shared=120)
    b = prompts_of({"b1": 9, "b2": 14}, seed=2, shared=100)
    prompts = {"a1": a["a1"], "b1": b["b1"], "a2": a["a2"], "b2": b["b2"]}
    seen = set()

    def one_prefix():
        policy = make_policy("full")
        policy.max_prefixes = 1
        return policy
    batch = RowBatch(model, one_prefix, 4, 400 + NEW, NEW, prefill_chunk=32, prefix_bytes=1 << 30, min_prefix=16)
    step = batch.step

    def watched(tokens):
        assert len(batch.policy.groups) <= 1
        for prefix, _, _ in batch.policy.groups:
            seen.add((prefix.n_filled, tuple(sorted(set(batch.policy.own_from.tolist())))))
        return step(tokens)
    batch.step = watched
    got, _ = drive(batch, prompts, dict.fromkeys(prompts, 0), staged=True)
    ref, _ = drive(RowBatch(model, lambda: make_policy("full"), 4, 400 + NEW, NEW, prefill_chunk=32), prompts,
                   dict.fromkeys(prompts, 0), staged=True)
    assert any(0 in rows and len(rows) == 2 for _, rows in seen), seen       # sharing rows beside copying ones
    for n in prompts:
        assert torch.equal(got[n].argmax(-1), ref[n].argmax(-1))
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-5)


def test_kv_bytes_count_a_shared_prefix_once(model):  # noqa: F811
    """kv_bytes' live and read bytes: the prefix once, each sharing row's own slots after it."""
    prompts = prompts_of({"q1": 12, "q2": 20}, shared=150)
    live = {}
    for share in (True, False):
        batch = RowBatch(model, lambda: make_policy("full"), 2, 400 + NEW, NEW, prefill_chunk=64,
                         prefix_bytes=1 << 30, min_prefix=16, share_prefix=share)
        with torch.inference_mode():
            batch.start(prompts["q1"], prefix_len=150)
            batch.start(prompts["q2"], prefix_len=150)
            while batch.pending:
                batch.advance()
        live[share] = batch.policy.kv_bytes()
    per_token = live[False]["allocated"] // (400 + NEW) // 2          # one row's slot, every layer
    assert live[False]["live"] - live[True]["live"] == per_token * 150      # two copies -> one prefix
    assert live[False]["read_per_step"] - live[True]["read_per_step"] == per_token * 150
