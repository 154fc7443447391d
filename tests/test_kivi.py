"""KIVI storage under every policy (cache/quantized.py): slot writes and evictions of packed tokens
against a naive dequantize-modify-requantize reference, appending groups against one block
quantization, every read path against attention over the dequantized cache, D2O's merge into a
packed token, exact kv_bytes and the memory claim at 4000 tokens, the command lines and the real
model.  Compiled decode at 4 bits: tests/test_policies.py and tests/test_model.py (the -kv4 cases)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine
from cache import POLICIES, make_policy, policy_params
from cache.base import EvictionPolicy
from cache.h2o import H2OPolicy
from cache.quantized import KIVIDenseCache, KIVISlots, SlotStore, check_format, with_kv_bits
from cache.snapkv import SnapKVPolicy
from kernels.kivi_attention import ring_flags
from model import ModelArgs
from kernels.kivi_codec import QuantizedTensor, dequantize_keys, quantize_keys, quantize_values
from runtime.steps import run_decode, run_prefill
from tests.helpers import greedy_logits, kept, left_padded, tiny_hf_model

ROOT = Path(__file__).resolve().parent.parent
BUFFERS = ("k_packed", "k_scale", "k_min", "v_packed", "v_scale", "v_min", "k_ring", "v_ring")
def small_args(name: str) -> str:
    """Arguments under which a registered eviction policy evicts on the short prompts of these tests."""
    declared = policy_params(POLICIES[name])
    sizes = {"budget": 12, "n_sink": 2, "obs_window": 4, "n_recent": 4 if "budget" in declared else 6}
    return ",".join(f"{k}={v}" for k, v in sizes.items() if k in declared)


EVICTION = {**{n: small_args(n) for n in POLICIES if issubclass(POLICIES[n], EvictionPolicy)},
            "simlayerkv@prefill": small_args("simlayerkv") + ",strategy=prefill"}


def kivi(name, args, bits=4, group=8, residual=16):
    return with_kv_bits(make_policy(name.split("@")[0], args), bits, group, residual)


def snapshot(store):
    return {name: getattr(store, name).clone() for name in BUFFERS}


# ------------------------------------------------------------------------------- the reference
def reference_write(store, before, slot, k, v, pos, now):
    """Naive per (row, head): the slot's key group is dequantized from `before`, young members
    (pos > now - R) take their ring rows, the slot takes the new key, and the group is requantized
    with min/max over the members holding a token; the value is quantized alone; a young slot's
    ring row gets the new K/V.  Returns the expected buffers."""
    exp = {name: t.clone() for name, t in before.items()}
    B, H = slot.shape
    G, R, bits, S = store.group, store.residual, store.bits, pos.shape[-1]
    for b in range(B):
        for h in range(H):
            s = int(slot[b, h])
            g = s // G
            group = QuantizedTensor(before["k_packed"][b, h, g * G:(g + 1) * G][None, None],
                                    before["k_scale"][b, h, g:g + 1][None, None], before["k_min"][b, h, g:g + 1][None, None],
                                    bits, G)
            deq = dequantize_keys(group, torch.float32)[0, 0]
            rows, include = [], []
            for t in range(g * G, (g + 1) * G):
                p = int(pos[b, min(h, pos.shape[1] - 1), t]) if t < S else -1
                if t == s:
                    rows.append(k[b, h, 0].float())
                elif p >= 0 and p > int(now[b]) - R:
                    rows.append(before["k_ring"][b, h, p % R].float())
                else:
                    rows.append(deq[t - g * G])
                include.append(p >= 0 or t == s)
            qk = quantize_keys(torch.stack(rows)[None, None], bits, G, include=torch.tensor(include)[None, None],
                               dtype=store.dtype)
            exp["k_packed"][b, h, g * G:(g + 1) * G] = qk.packed[0, 0]
            exp["k_scale"][b, h, g] = qk.scale[0, 0, 0]
            exp["k_min"][b, h, g] = qk.minimum[0, 0, 0]
            qv = quantize_values(v[b, h][None, None], bits, G, dtype=store.dtype)
            exp["v_packed"][b, h, s] = qv.packed[0, 0, 0]
            exp["v_scale"][b, h, s] = qv.scale[0, 0, 0]
            exp["v_min"][b, h, s] = qv.minimum[0, 0, 0]
            p = int(pos[b, min(h, pos.shape[1] - 1), s])
            if p > int(now[b]) - R:
                exp["k_ring"][b, h, p % R] = k[b, h, 0]
                exp["v_ring"][b, h, p % R] = v[b, h, 0]
    return exp


def assert_buffers(store, expected):
    for name in BUFFERS:
        assert torch.equal(getattr(store, name), expected[name]), name


def filled_store(bits=4, dtype=torch.float32, slots=44, seed=0, G=8, R=16):
    """A SlotStore whose first 40 slots hold a shuffled prompt (positions 0..39, a few empty)."""
    g = torch.Generator().manual_seed(seed)
    B, H, D = 2, 3, 16
    store = SlotStore(B, H, D, slots, bits, G, R, dtype)
    pos = torch.full((B, H, slots), -1)
    perm = torch.stack([torch.stack([torch.randperm(40, generator=g) for _ in range(H)]) for _ in range(B)])
    pos[..., :40] = perm
    pos[0, 1, 5] = pos[1, 2, 17] = -1                             # empty slots inside groups
    k = (torch.randn(B, H, 40, D, generator=g) * 2 + 0.5).to(dtype)
    v = torch.randn(B, H, 40, D, generator=g).to(dtype)
    now = torch.tensor([39, 39])
    store.write_range(0, k, v, pos, now)
    return store, pos, now, g


@pytest.mark.parametrize("bits,dtype", [(4, torch.float32), (2, torch.bfloat16), (8, torch.float16)])
def test_slot_writes_equal_dequantize_modify_requantize(bits, dtype):
    """Evictions into packed slots (old and young tokens, empty slots, the padded tail past S),
    step after step, bit for bit against the naive reference; where=False writes change nothing."""
    store, pos, now, g = filled_store(bits, dtype)
    B, H, S = pos.shape
    for step in range(40):
        now = now + 1
        slot = torch.randint(0, S, (B, H), generator=g)
        if step % 5 == 0:
            slot[0, 0] = 43                                      # the last slot: its group runs past S
        k = (torch.randn(B, H, 1, 16, generator=g) * 3).to(dtype)
        v = torch.randn(B, H, 1, 16, generator=g).to(dtype)
        pos.scatter_(2, slot[..., None], now[:, None, None].expand(B, H, 1))
        before = snapshot(store)
        expected = reference_write(store, before, slot, k, v, pos, now)
        store.write(slot, k, v, pos, now)
        assert_buffers(store, expected)
    before = snapshot(store)
    store.write(slot, k * 5, v * 5, pos, now, where=torch.zeros(B, H, dtype=torch.bool))
    assert_buffers(store, before)
    where = torch.tensor([[True, False, True], [False, False, True]])
    expected = reference_write(store, before, slot, k * 5, v * 5, pos, now)
    store.write(slot, k * 5, v * 5, pos, now, where=where)
    for name in BUFFERS:                         # rows/heads with where=False keep every buffer as it was
        ref = torch.where(where.view(B, H, *[1] * (before[name].dim() - 2)), expected[name], before[name])
        assert torch.equal(getattr(store, name), ref), name


def test_appending_slots_end_as_one_block_quantization():
    """Slots filled one per step (an appending layer): every completed group holds exactly the codes
    of quantizing its exact keys in one block (KIVI's flush), never re-rounded ones."""
    g = torch.Generator().manual_seed(1)
    B, H, D, G, R, n = 2, 2, 16, 8, 16, 70
    store = SlotStore(B, H, D, 80, 4, G, R, torch.float32)
    k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
    pos = torch.full((B, H, 80), -1)
    pos[..., :5] = torch.arange(5)
    store.write_range(0, k[:, :, :5], v[:, :, :5], pos, torch.tensor([4, 4]))
    for t in range(5, n):
        pos[..., t] = t
        store.write(torch.full((B, H), t), k[:, :, t:t + 1], v[:, :, t:t + 1], pos, torch.tensor([t, t]))
    done = n // G * G
    block = quantize_keys(k[:, :, :done], 4, G)
    assert torch.equal(store.k_packed[:, :, :done], block.packed)
    assert torch.equal(store.k_scale[:, :, :done // G], block.scale)
    values = quantize_values(v, 4, G)
    assert torch.equal(store.v_packed[:, :, :n], values.packed)
    kd, vd = store.dequantized(pos, torch.tensor([n - 1, n - 1]), n)
    nk = n % R                                          # keys: the R-block still filling is exact
    assert torch.equal(kd[:, :, n - nk:], k[:, :, n - nk:]) and torch.equal(kd[:, :, :n - nk], block_keys(block, n - nk))
    assert torch.equal(vd[:, :, n - R:], v[:, :, n - R:])                     # values: a FIFO of the newest R


def block_keys(block, n):
    return dequantize_keys(block, torch.float32)[:, :, :n]


def naive_attention(q, k, v, visible):
    B, Hq, _, D = q.shape
    H = k.shape[1]
    s = q.float().view(B, H, Hq // H, D) @ k.transpose(-1, -2) / math.sqrt(D)
    s = s.masked_fill(~visible[:, :, None], float("-inf"))
    return (s.softmax(-1) @ v).view(B, Hq, 1, D)


@pytest.mark.parametrize("bits", [4, 2])
def test_reads_equal_attention_over_the_dequantized_cache(bits):
    """attend (kernel + ring), attend_and_probs (H2O/D2O), scores, cosine and gather against plain
    computations on store.dequantized(): young slots come from the ring, old ones from the words."""
    store, pos, now, g = filled_store(bits)
    B, H, S = pos.shape
    q = torch.randn(B, 3 * H, 1, 16, generator=g)
    visible = (pos >= 0) & (torch.rand(B, H, S, generator=g) > 0.2)
    kd, vd = store.dequantized(pos, now, S)
    key_exact, value_exact = ring_flags(pos, now, 16)
    assert torch.equal(value_exact, pos > 39 - 16) and torch.equal(key_exact, pos >= 32)
    assert not ring_flags(pos, now + 100, 16)[1].any()
    torch.testing.assert_close(store.attend(q, visible, pos, now, S), naive_attention(q, kd, vd, visible))
    shared = visible[:, :1]                                            # one visibility row for all heads
    torch.testing.assert_close(store.attend(q, shared, pos, now, S), naive_attention(q, kd, vd, shared.expand(B, H, S)))
    k_new, v_new = torch.randn(B, H, 1, 16, generator=g), torch.randn(B, H, 1, 16, generator=g)
    out, p_old, p_new = store.attend_and_probs(q, visible, pos, now, k_new, v_new, S)
    from cache.scoring import attend_with_new
    ref_out, ref_old, ref_new = attend_with_new(q, kd, vd, visible, k_new, v_new)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(p_old, ref_old)
    torch.testing.assert_close(p_new, ref_new)
    qg = q.view(B, H, 3, 16)
    torch.testing.assert_close(store.scores(qg, pos, now, S), qg @ kd.transpose(-1, -2))
    from cache.scoring import cosine
    torch.testing.assert_close(store.cosine(k_new, pos, now, S), cosine(k_new, kd)[:, :, 0])
    idx = torch.randint(0, S, (B, H, 7), generator=g)
    gk, gv = store.gather(idx, pos, now)
    torch.testing.assert_close(gk, kd.gather(2, idx[..., None].expand(-1, -1, -1, 16)), atol=0, rtol=0)
    torch.testing.assert_close(gv, vd.gather(2, idx[..., None].expand(-1, -1, -1, 16)), atol=0, rtol=0)


def test_store_attend_triton_interpreter_equals_torch():
    """SlotStore.attend (packed words and residual) through the Triton kernel (interpreter) == the torch twin."""
    pytest.importorskip("triton")
    code = ("import torch, sys; sys.path.insert(0, '.'); from tests.test_kivi import filled_store\n"
            "store, pos, now, g = filled_store(4, G=16)\n"
            "q = torch.randn(2, 6, 1, 16, generator=g); vis = pos >= 0\n"
            "outs = []\n"
            "for b in ('triton', 'torch'):\n"
            "    store.backend = b; outs.append(store.attend(q, vis, pos, now, pos.shape[2]))\n"
            "print((outs[0] - outs[1]).abs().max().item())\n")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert float(p.stdout.strip().splitlines()[-1]) <= 2e-5


# ------------------------------------------------------------------------------- policies
def bare(name, args, T=20, head_dim=16, batch=1, n_kv_heads=1, n_heads=2, max_seq=64, **kv):
    a = ModelArgs(vocab_size=16, dim=n_heads * head_dim, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads,
                  intermediate_size=8, head_dim=head_dim)
    policy = kivi(name, args, **kv)
    policy.setup(a, batch, max_seq, torch.float32, "cpu")
    policy.begin(torch.arange(T)[None].repeat(batch, 1))
    return policy


def test_d2o_merge_into_a_packed_token_equals_the_reference():
    """on_evict over packed slots: similarity and the merged K/V as full-precision D2O computes them on
    the dequantized cache; the target's group requantized as dequantize-modify-requantize."""
    torch.manual_seed(0)
    T = 40
    policy = bare("d2o", "budget=24,n_sink=1,recent_share=0.2,ema_beta=0.5", T=T, residual=8)
    q, k, v = torch.randn(1, 2, T, 16), torch.randn(1, 1, T, 16), torch.randn(1, 1, T, 16)
    policy.prefill(0, q, k, v)
    policy.end_prefill()
    store, pos = policy.k[0], policy.pos[0]
    policy.q_pos = torch.tensor([[T]])                                  # the next token's step
    fp = make_policy("d2o", "budget=24,n_sink=1,recent_share=0.2,ema_beta=0.5")
    fp.__dict__.update({k_: v_ for k_, v_ in policy.__dict__.items() if k_ != "slots"})
    now = policy.q_pos.amax(-1)
    kd, vd = store.dequantized(pos, now, pos.shape[2])
    fp.slots.k, fp.slots.v, fp.tau = [kd.clone()], [vd.clone()], [policy.tau[0].clone()]
    merged = 0
    for s in range(4, 24, 3):                                            # victims: old and packed
        slot = torch.tensor([[s]])
        kd, vd = store.dequantized(pos, now, pos.shape[2])
        fp.k[0], fp.v[0], fp.tau[0] = kd.clone(), vd.clone(), policy.tau[0].clone()
        fp.on_evict(0, slot)
        changed = (fp.k[0] != kd).any(-1)[0, 0]
        before = snapshot(store)
        policy.on_evict(0, slot)
        torch.testing.assert_close(policy.tau[0], fp.tau[0])
        if changed.any():
            merged += 1
            target = int(changed.nonzero()[0])
            expect = reference_write(store, before, torch.tensor([[target]]), fp.k[0][:, :, target:target + 1],
                                     fp.v[0][:, :, target:target + 1], pos, now)
            ref = SlotStore(1, 1, 16, pos.shape[2], 4, 8, 8)            # the reference's buffers, read back
            for name in BUFFERS:
                getattr(ref, name).copy_(expect[name])
            got, want = store.dequantized(pos, now, 24), ref.dequantized(pos, now, 24)
            for a, b in zip(got, want):      # the merge weights differ from fp D2O's by float rounding only
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            others = [g for g in range(3) if g != target // 8]
            for name in ("k_packed", "k_scale", "k_min"):
                t = getattr(store, name)
                sel = (slice(None), slice(None), [x for g in others for x in range(g * 8, g * 8 + 8)] if
                       name == "k_packed" else others)
                assert torch.equal(t[sel], before[name][sel]), name                # other groups untouched
        else:
            assert_buffers(store, before)                                # no merge: nothing requantized
        pos[0, 0, s] = -1                                                # the slot leaves
    assert merged >= 2


def test_d2o_prefill_merges_in_full_precision_before_packing():
    torch.manual_seed(3)
    T = 40
    q, k, v = torch.randn(1, 2, T, 16), torch.randn(1, 1, T, 16), torch.randn(1, 1, T, 16)
    outs = []
    for bits in (16, 4):
        policy = bare("d2o", "budget=16,n_sink=1,recent_share=0.2", T=T, bits=bits)
        policy.prefill(0, q, k, v)
        policy.end_prefill()
        outs.append((policy.pos[0].clone(), policy.dense_kv(0), policy.tau[0]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][2], outs[1][2])
    block = quantize_keys(outs[0][1][0][:, :, :16], 4, 8)               # the merged fp keys, packed once
    store = kivi("d2o", "budget=16")                                      # (class check only)
    assert store.kv_bits == 4
    kd = dequantize_keys(block)
    young = outs[0][0][0, 0] > T - 1 - 16
    torch.testing.assert_close(outs[1][1][0][0, 0][~young], kd[0, 0][~young])
    torch.testing.assert_close(outs[1][1][0][0, 0][young], outs[0][1][0][0, 0][young])


@pytest.mark.parametrize("name", list(EVICTION) + ["full"])
def test_every_policy_reads_what_its_packed_store_holds(name, tmp_path):
    """A tiny model, left-padded batch, eviction mid-decode: per step and layer, the decode output
    equals attention over the store's own dequantized slots (SlotStore.dequantized), kept positions
    match the 16-bit policy after prefill, and 8-bit logits stay close to 16-bit ones."""
    _, model = tiny_hf_model("tied_gqa3", tmp_path)
    tokens, pos = left_padded([30, 21])
    follow = torch.randint(0, 128, (2, 10))
    args = EVICTION.get(name, "")
    logits, kept_after_prefill = {}, {}
    for bits in (16, 8, 4):
        policy = kivi(name, args, bits=bits) if name != "full" else with_kv_bits(None or make_policy("full"), bits, 8, 16)
        checks = []
        if bits == 4:
            real = policy.decode

            def decode(layer, q, k, v, real=real, policy=policy):
                out = real(layer, q, k, v)
                store, spos, now = policy.kv_store(layer)
                kd, vd = store.dequantized(spos, now, spos.shape[2])
                if hasattr(policy, "visible"):
                    vis = policy.visible(layer)
                    if policy.decode_attention and not policy.layer_appends[layer]:
                        checks.append(out.shape == q.shape)      # joint softmax: compared in the store test
                        return out
                else:
                    vis = policy.mask[:, :1]
                checks.append(torch.allclose(out, naive_attention(q, kd, vd, vis), atol=1e-5))
                return out
            policy.decode = decode
        with torch.no_grad():
            model.setup_caches(2, 48, policy)
            out = [run_prefill(model, tokens, pos)]
            kept_after_prefill[bits] = [kept(policy, layer) for layer in range(2)]
            out += [run_decode(model, follow[:, s:s + 1], pos[:, -1:] + 1 + s, s) for s in range(10)]
        logits[bits] = torch.stack(out)
        if bits == 4:
            assert checks and all(checks)
    assert kept_after_prefill[4] == kept_after_prefill[16]
    assert torch.equal(logits[4][0].argmax(-1), logits[16][0].argmax(-1))       # prefill attention is exact
    assert (logits[8] - logits[16]).abs().max() < 0.05


READERS = [("full", "ds", "n_critical=64,n_sink=2,n_recent=4"),
           ("full", "quest", "n_critical=64,n_sink=2,n_recent=4,page_size=4"),
           ("full", "hshare", "n_critical=64,n_sink=2,n_recent=4,ratios=1/2-1/2-1/2,label_bits=4"),
           ("snapkv", "hshare", "budget=20,obs_window=4|n_critical=64,n_sink=2,n_recent=4,ratios=1-1-1/2"),
           ("streaming", "quest", "budget=16|n_critical=64,quest.n_sink=2,n_recent=4")]


@pytest.mark.parametrize("storage,reader,args", READERS)
def test_sparse_readers_over_packed_storage(storage, reader, args, tmp_path):
    """A reader over packed storage gathers and dequantizes only the selected rows: reading every
    token it equals the packed storage's own attention (left-padded batch; streaming evicts packed
    tokens mid-decode); with a small N_c it reads exactly N_c tokens, stays close to the 16-bit
    reader, and its kv_bytes count packed rows."""
    _, model = tiny_hf_model("tied_gqa3", tmp_path)
    tokens, pos = left_padded([30, 19], seed=3)
    storage_args, reader_args = args.split("|") if "|" in args else ("", args)
    both = ",".join(a for a in (storage_args, reader_args) if a)
    name = f"{storage}+{reader}" if storage != "full" else reader
    ref = greedy_logits(model, with_kv_bits(make_policy(storage, storage_args), 4, 8, 16), tokens, pos)
    got = greedy_logits(model, with_kv_bits(make_policy(name, both), 4, 8, 16), tokens, pos)
    assert (got - ref).abs().max() < 1e-4

    sparse = both.replace("n_critical=64", "n_critical=12")
    policy = with_kv_bits(make_policy(name, sparse), 4, 8, 16)
    policy.record_reads = True
    got = greedy_logits(model, policy, tokens, pos)
    assert policy.storage_.packed and policy.describe()["inner"]["kv_bits"] == 4
    stores = [policy.inner.kv_store(layer)[0] for layer in range(model.args.n_layers)]
    assert all(s.slot_words is not None for s in stores)        # on the CPU the reads take slot-major words
    tail = getattr(policy, "a", 1) - 1               # hshare's reuse steps add the tokens since the select step
    assert all(12 <= len(head) <= 12 + tail for row in policy.read_positions(1) for head in row)
    wide = make_policy(name, sparse)
    assert (got - greedy_logits(model, wide, tokens, pos)).abs().max() < 0.3
    got_bytes, inner_bytes = policy.kv_bytes(), policy.inner.kv_bytes()
    assert got_bytes["allocated"] == inner_bytes["allocated"] + policy.index_bytes(live=False)
    D, G = model.args.head_dim, 8               # per token: packed K and V, value scales/minimums, 1/G of the key's
    per_token = 2 * D // 2 + 2 * (D // G) * 4 + 2 * D * 4 // G
    assert policy.kv_row_bytes() == 2 * model.args.n_kv_heads * per_token < wide.kv_row_bytes() / 2


def test_full_in_prompt_chunks_then_decode_close_to_one_forward(tmp_path):
    """`full` at 8 bits fed in two prompt chunks (the second attends the packed first) and single
    decode tokens, against one full-precision forward pass."""
    _, model = tiny_hf_model("tied_gqa3", tmp_path)
    ids = torch.randint(0, 128, (1, 60))
    with torch.no_grad():
        model.setup_caches(1, 64, with_kv_bits(make_policy("full"), 8, 8, 16))
        got = [model(ids[:, :25], torch.arange(25)), model(ids[:, 25:50], torch.arange(25, 50))]
        got += [model(ids[:, t:t + 1], torch.tensor([t]), decode=True) for t in range(50, 60)]
        model.setup_caches(1, 64)
        ref = model(ids, torch.arange(60))
    torch.testing.assert_close(torch.cat(got, 1), ref, atol=5e-3, rtol=0)


def test_with_kv_bits_composition_and_errors():
    assert with_kv_bits(make_policy("snapkv"), 16) is not None
    h2o = make_policy("h2o", "budget=64,n_recent=8")
    p = with_kv_bits(h2o, 4, 8, 16)
    assert p is h2o and type(p) is H2OPolicy and isinstance(p.slots, KIVISlots)           # no class made at run time
    assert (p.budget, p.n_recent, p.name, p.kv_bits, p.kv_group, p.kv_residual) == (64, 8, "h2o", 4, 8, 16)
    with pytest.raises(ValueError, match="already stores K/V at 4 bits"):
        with_kv_bits(p, 2)
    assert isinstance(with_kv_bits(make_policy("full"), 2), KIVIDenseCache)
    with pytest.raises(ValueError, match="has no KIVI storage"):
        with_kv_bits(make_policy("pod"), 4)
    reader = with_kv_bits(make_policy("snapkv+ds", "budget=64"), 4)
    assert type(reader.inner) is SnapKVPolicy and isinstance(reader.inner.slots, KIVISlots) and reader.storage_.packed
    with pytest.raises(ValueError, match="--kv-residual 48 must be a positive multiple of --kv-group-size 32"):
        with_kv_bits(make_policy("full"), 4, 32, 48)
    with pytest.raises(ValueError, match="head_dim 48 is not a multiple of --kv-group-size 32"):
        check_format(48, 4, 32, 32)
    with pytest.raises(ValueError, match="--kv-bits 3"):
        with_kv_bits(make_policy("full"), 3)
    with pytest.raises(NotImplementedError, match="kv_store"):
        bare("snapkv", "budget=8,obs_window=2").storage(0)


# ------------------------------------------------------------------------------- memory
SMOL = dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536)


def allocated(name, args, bits, dtype, T=4000, new=64, residual=32):
    policy = make_policy(name, args)
    policy = with_kv_bits(policy, bits, residual=residual) if bits != 16 else policy
    policy.setup(ModelArgs(**SMOL), 1, T + new, dtype, "cpu")
    pos = torch.arange(T)[None]
    policy.before_prefill(pos)
    if name == "simlayerkv":                                          # half the layers lazy
        policy.prompt_length = T
        policy.decide(torch.tensor([[1.0] if i % 2 else [0.0] for i in range(30)]))
    if getattr(policy, "defer_compression", False):
        for layer in range(30):
            policy.allocate(layer)
    return policy.kv_bytes()["allocated"]


@pytest.mark.parametrize("name,args", [("full", None), ("snapkv", "budget=2048"), ("pyramidkv", "budget=2048"),
                                       ("h2o", "budget=2048"), ("streaming", "budget=2048"),
                                       ("simlayerkv", None)])
def test_4bit_allocates_at_most_a_third_of_16bit_at_4000_tokens(name, args):
    """The default model's shapes (30 layers, 3 KV heads, head_dim 64), G = R = 32."""
    for dtype, bound in ((torch.bfloat16, 1 / 3), (torch.float32, 1 / 4)):
        ratio = allocated(name, args, 4, dtype) / allocated(name, args, 16, dtype)
        assert ratio <= bound, (dtype, ratio)       # bf16 0.320 (full) .. 0.330; fp32 (fp32 scales) 0.195 .. 0.204


def test_kv_bytes_exact():
    """Packed words + scales + minimums + the ring, from the buffers, against the formula."""
    B, H, D, G, R, e = 2, 3, 64, 32, 32, 2
    for bits in (4, 2):
        P = 32 // bits
        store = SlotStore(B, H, D, 100, bits, G, R, torch.bfloat16)                  # 100 slots -> 128
        C = 128
        words, k_meta, v_meta, ring = C * D // P * 4, 2 * (C // G) * D * e, 2 * C * (D // G) * e, 2 * R * D * e
        assert store.nbytes() == B * H * (2 * words + k_meta + v_meta + ring)
        n = 45                                                                        # 2 key groups live
        live = (64 + n) * D // P * 4 + 2 * 2 * D * e + 2 * n * (D // G) * e + 2 * R * D * e
        assert store.nbytes(n) == B * H * live
    policy = with_kv_bits(make_policy("full"), 4)
    policy.setup(ModelArgs(**SMOL), 1, 100, torch.float32, "cpu")
    assert policy.kv_bytes()["allocated"] == 30 * SlotStore(1, 3, 64, 100 + 32, 4, 32, 128).nbytes()   # + a spare group


# ------------------------------------------------------------------------------- command lines, real model
def test_first_token_equals_full_under_every_policy_at_4_bits(engine_dir, essay_text):
    model, tok = engine_dir
    ids = tok.encode(essay_text)[:700]
    full = engine.generate(model, tok, [ids, ids[:500]], max_new_tokens=1)
    for name in ["full", *[n for n in EVICTION if "@" not in n]]:
        args = "n_recent=128" if name == "simlayerkv" else "budget=128" if name != "full" else None
        out = engine.generate(model, tok, [ids, ids[:500]], max_new_tokens=1,
                              policy=with_kv_bits(make_policy(name, args), 4))
        assert [t[0] for t in out.tokens] == [t[0] for t in full.tokens], name
        assert out.stats["policy"]["kv_bits"] == 4


def test_cli_and_eval_run_at_4_bits(default_dir, tmp_path, capsys):
    code = engine.main(["--checkpoint", str(default_dir), "--chat", "--prompt", "What is the capital of France?",
                        "--max-new-tokens", "12", "--kv-bits", "4", "--policy", "snapkv",
                        "--policy-args", "budget=64,obs_window=16"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Paris" in out and "KV cache" in err
    from eval import perplexity
    path = tmp_path / "p.json"
    code = perplexity.main(["--checkpoint", str(default_dir), "--kv-bits", "2", "--kv-group-size", "16",
                            "--kv-residual", "16", "--context-length", "96", "--eval-tokens", "8", "--json", str(path)])
    assert code == 0, capsys.readouterr().err
    r = json.loads(path.read_text())
    assert (r["kv_bits"], r["kv_group_size"], r["kv_residual"]) == (2, 16, 16)
    assert r["describe"]["kv_bits"] == 2 and r["perplexity"] < 1e4
