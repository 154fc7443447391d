"""Triton kernels of kernels/sparse_attention.py (imported on first use, so importing the package never
imports Triton): the split-N partial pass over an index list and the log-sum-exp combination."""
import triton
import triton.language as tl


@triton.jit
def _online_query(q, k, v, nmask, m_i, l_i, acc, scale):
    """One block of an online softmax for one query q [BLOCK_D] over rows k, v [BLOCK_N, BLOCK_D]."""
    s = tl.sum(q[None, :] * k.to(tl.float32), 1) * scale
    s = tl.where(nmask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe)
    return m_new, l_i * alpha + tl.sum(p, 0), acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)

@triton.jit
def _online_group(q, k, v, nmask, m_i, l_i, acc, scale, DOT_F32: tl.constexpr):
    """The same for the G query rows q [BLOCK_G, BLOCK_D] of a KV head, with tl.dot."""
    if DOT_F32:   # the interpreter's tl.dot multiplies bf16 bit patterns (triton 3.9)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N]
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i * alpha + tl.sum(p, 1), acc

@triton.jit
def _store_query(OUT, M_PART, L_PART, ACC_PART, m_i, l_i, acc, b, qh, sp, n_splits, so_b, so_h, so_d,
                 offs_d, dmask, BLOCK_D: tl.constexpr, SINGLE: tl.constexpr):
    """The output row of query head qh (SINGLE), or this split's partial (m, l, acc)."""
    if SINGLE:
        out = acc / tl.maximum(l_i, 1e-20)
        tl.store(OUT + b * so_b + qh * so_h + offs_d * so_d, out.to(OUT.dtype.element_ty), mask=dmask)
    else:
        row = (b * tl.num_programs(1) + qh) * n_splits + sp
        tl.store(M_PART + row, m_i)
        tl.store(L_PART + row, l_i)
        tl.store(ACC_PART + row * BLOCK_D + offs_d, acc)

@triton.jit
def _store_group(OUT, M_PART, L_PART, ACC_PART, m_i, l_i, acc, b, qh, gmask, sp, n_splits, G,
                 so_b, so_h, so_d, offs_d, dmask, BLOCK_D: tl.constexpr, SINGLE: tl.constexpr):
    """The same for the G query heads qh [BLOCK_G] of a KV head."""
    if SINGLE:
        out = acc / tl.maximum(l_i, 1e-20)[:, None]
        tl.store(OUT + b * so_b + qh[:, None] * so_h + offs_d[None, :] * so_d,
                 out.to(OUT.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    else:
        row = (b * tl.num_programs(1) * G + qh) * n_splits + sp                 # [BLOCK_G]
        tl.store(M_PART + row, m_i, mask=gmask)
        tl.store(L_PART + row, l_i, mask=gmask)
        tl.store(ACC_PART + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=gmask[:, None])

@triton.jit
def sparse_attn_partial(
        Q, K, V, IDX, VALID, OUT, M_PART, L_PART, ACC_PART,
        scale, N, G, n_per_split, n_splits,
        sq_b, sq_h, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
        si_b, si_h, si_n, sm_b, sm_h, sm_n, so_b, so_h, so_d,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
        PER_QUERY: tl.constexpr, HAS_VALID: tl.constexpr, SINGLE: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (b, hi, split): index list hi of batch b, entries [split*n_per_split, ...).
    PER_QUERY: hi is a query head (one query vector, reads KV head hi // G); otherwise hi is a
    KV head and its G query heads (padded to BLOCK_G >= 16 rows for tl.dot) share the gather."""
    b = tl.program_id(0).to(tl.int64)
    hi = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < G
    qh = hi * G + offs_g
    if PER_QUERY:
        kvh = hi // G
        q = tl.load(Q + b * sq_b + hi * sq_h + offs_d * sq_d, mask=dmask, other=0.0).to(tl.float32)
        m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)   # fp32 scalars
        l_i = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), 0)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    else:
        kvh = hi
        q = tl.load(Q + b * sq_b + qh[:, None] * sq_h + offs_d[None, :] * sq_d,
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_base = K + b * sk_b + kvh * sk_h
    v_base = V + b * sv_b + kvh * sv_h
    start = sp * n_per_split
    end = tl.minimum(start + n_per_split, N)
    for off in range(start, end, BLOCK_N):
        offs_n = off + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        ids = tl.load(IDX + b * si_b + hi * si_h + offs_n * si_n, mask=nmask, other=0).to(tl.int64)
        if HAS_VALID:
            ok = tl.load(VALID + b * sm_b + hi * sm_h + offs_n * sm_n, mask=nmask, other=0)
            nmask = nmask & (ok != 0)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_base + ids[:, None] * sk_s + offs_d[None, :] * sk_d, mask=kv_mask, other=0.0)
        v = tl.load(v_base + ids[:, None] * sv_s + offs_d[None, :] * sv_d, mask=kv_mask, other=0.0)
        if PER_QUERY:
            m_i, l_i, acc = _online_query(q, k, v, nmask, m_i, l_i, acc, scale)
        else:
            m_i, l_i, acc = _online_group(q, k, v, nmask, m_i, l_i, acc, scale, DOT_F32)
    if PER_QUERY:
        _store_query(OUT, M_PART, L_PART, ACC_PART, m_i, l_i, acc, b, hi, sp, n_splits, so_b, so_h, so_d,
                     offs_d, dmask, BLOCK_D, SINGLE)
    else:
        _store_group(OUT, M_PART, L_PART, ACC_PART, m_i, l_i, acc, b, qh, gmask, sp, n_splits, G,
                     so_b, so_h, so_d, offs_d, dmask, BLOCK_D, SINGLE)

@triton.jit
def sparse_attn_combine(OUT, M_PART, L_PART, ACC_PART, n_splits, so_b, so_h, so_d,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLIT: tl.constexpr):
    """Program (b, h): log-sum-exp combination of the n_splits partials of query head h."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_SPLIT)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < n_splits
    row = (b * tl.num_programs(1) + h) * n_splits + offs_s
    m = tl.load(M_PART + row, mask=smask, other=float("-inf"))
    l = tl.load(L_PART + row, mask=smask, other=0.0)
    acc = tl.load(ACC_PART + row[:, None] * BLOCK_D + offs_d[None, :], mask=smask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max)
    out = tl.sum(w[:, None] * acc, 0) / tl.maximum(tl.sum(w * l, 0), 1e-20)
    tl.store(OUT + b * so_b + h * so_h + offs_d * so_d, out.to(OUT.dtype.element_ty), mask=offs_d < D)
