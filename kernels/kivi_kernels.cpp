// Decode attention straight from KIVI-packed storage (cache/quantized.py's SlotStore; layout in
// kernels/kivi_codec.py), built with cpu_kernels.cpp by kernels/cpu.py.  One op, fp32:
//
//   kvc::kivi_attention(q [B, Hq, D], k_packed [B, H, S, W] int32, k_scale, k_min [B, H, S/G, D],
//                       v_packed [B, H, S, W] int32, v_scale, v_min [B, H, S, D/G],
//                       k_ring, v_ring [B, H, R, D], pos [B, 1 or H, S'] long, visible [B, 1 or H, S'] bool
//                       (or empty), now [B] long, idx [B, Hidx, N] long (or empty), valid [B, Hidx, N]
//                       bool (or empty), n, bits, group, scale, arith = 0) -> out [B, Hq, D]
//   arith (dense reads of 2/4-bit storage): 0 fp32 (below), 1 integer with AVX2, 2 integer with AVX-512
//   VNNI ("integer dense path" below; kernels/kivi_int.py is its twin); kivi_arith() names the best built.
//
//   Softmax attention of each decode query over the slots [0, n) (idx empty: "dense") or over its
//   index list (idx given: the sparse readers' selected slots; Hidx = H: one list per KV head, shared
//   by its query heads, or Hidx = Hq: one per query head).  A slot holding position p is read
//     key:   from ring row p % R while p is in the key residual, p >= (now + 1) - (now + 1) % R (the
//            tokens of the R-block still filling), else from the packed words;
//     value: from ring row p % R while p > now - R (the FIFO of the newest R), else packed.
//   Words, scales and minimums: token-contiguous (stride 1 over slots), as SlotStore allocates them.
//
// Dense path, per (batch row, KV head) and register block of query rows, two passes.  Keys are
// quantized per channel over groups of G slots, so per group the key scale folds into the query
// (qs = q * s_k) and the minimum into one dot product (z = q . m_k): score_t = z + sum_d qs_d
// code_{t,d}.  Scores go 32 slots at a time through all the slots' words, the codes unpacked in
// registers (slot lanes: one shift and a table lookup per bit-plane), accumulators in registers;
// masking, ring keys and the running maximum are applied on the block while it is in L1.  Values are
// quantized per token, so their scale and minimum go into the softmax weights: out_d = sum_t (p_t
// s_{t,c(d)}) code_{t,d} + sum_t p_t m_{t,c(d)}; the weights p_t s_t of CH slots at a time are kept
// in L1 and each word row of the chunk is swept with bit-plane x query-row accumulators in registers.
// Ring slots are found from `pos` in the score pass and handled from their full-precision rows.
// Needs G % 16 == 0.  When the (batch row, KV head) lists do not divide evenly over the threads (batch
// 1: 3 KV heads on 2 threads), each list's slots are read in chunks of whole 256-slot spans, each chunk
// a dense read of its own, merged by their log-sum-exps (split_chunks; an even share reads unsplit).
// Sparse path (idx given), per (batch row, index list) and block of query rows, two passes over the
// list in its order: scores, then weighted values.  Each entry's W words come into one vector (one
// load from the readers' slot-major copy, else a gather) and are unpacked in channel lanes (a per-lane
// shift and the code table); the key group's scale and minimum are folded into the query once per
// group the list enters (ascending lists enter each group once), and the 16 channel-lane partial sums
// of 16 entries are reduced together; values are dequantized in registers with their own scale and
// minimum and accumulated with the softmax weights (vectorized exp).  Prefetches follow the list, 16
// entries ahead: a slot-major entry's own line, the lines of each new 16-slot window and the scales of
// each new key group.  D 64 or 128, bits 2, 4 or 8, G % 8 == 0, D / G <= 16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_vec.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int L = 16;                  // slot lanes per vector (dense path)
constexpr int64_t AHEAD = 16;          // list entries prefetched ahead (sparse path; 16 ran 1.15x faster than 8)
constexpr int64_t AHEAD_SLOTS = 256;   // dense path: slots ahead (1 KiB of one word row, 16 cache lines)

// one (batch row, KV head) of the storage: pointers and element strides of its eight buffers
struct Row {
  int32_t* kp; int64_t kp_t, kp_w;     // key word w of slot t: kp[t * kp_t + w * kp_w] (dense reads: kp_t == 1)
  float* ks; float* km; int64_t k_g;   // key scale/min of group g, channel d: ks[g * k_g + d]
  int32_t* vp; int64_t vp_t, vp_w;
  float* vs; float* vm; int64_t v_t, v_c;          // value scale/min of slot t, channel group c: vs[t * v_t + c * v_c]
  float* kr; float* vr; int64_t r_row; // ring row r: kr + r * r_row
  int32_t* kc = nullptr; int32_t* vc = nullptr;    // writes: slot-major copies of the words (word w of slot t: kc[t W + w])
  const int64_t* pos; const bool* vis;             // per slot (vis may be null)
  int64_t now, R, kfrom;                           // kfrom: first position of the key residual
  int bits, G, D;
  int arith = 0;                                   // dense reads: ARITH_FP32, _AVX2 or _VNNI
  bool ring_v(int64_t p) const { return p >= 0 && p > now - R; }
  bool ring_k(int64_t p) const { return p >= kfrom && ring_v(p); }
};

template <typename T>
static T* row_of(const torch::Tensor& t, int64_t b, int64_t h) {  // t [B, 1 or H, ...] at (b, h)
  return t.data_ptr<T>() + b * t.stride(0) + (t.size(1) == 1 ? 0 : h) * t.stride(1);
}

// buffers = {k_packed, k_scale, k_min, v_packed, v_scale, v_min, k_ring, v_ring}
static Row row_at(const std::vector<torch::Tensor>& t, const torch::Tensor& pos, int64_t b, int64_t h,
                  int64_t now, int bits, int G) {
  Row r;
  r.kp = row_of<int32_t>(t[0], b, h); r.kp_t = t[0].stride(2); r.kp_w = t[0].stride(3);
  r.ks = row_of<float>(t[1], b, h); r.km = row_of<float>(t[2], b, h); r.k_g = t[1].stride(2);
  r.vp = row_of<int32_t>(t[3], b, h); r.vp_t = t[3].stride(2); r.vp_w = t[3].stride(3);
  r.vs = row_of<float>(t[4], b, h); r.vm = row_of<float>(t[5], b, h); r.v_t = t[4].stride(2); r.v_c = t[4].stride(3);
  r.kr = row_of<float>(t[6], b, h); r.vr = row_of<float>(t[7], b, h); r.r_row = t[6].stride(2);
  r.pos = row_of<int64_t>(pos, b, h);
  r.vis = nullptr;
  r.now = now;
  r.R = t[6].size(2);
  r.kfrom = (now + 1) - (((now + 1) % r.R) + r.R) % r.R;      // floor: the R-block of now + 1
  r.bits = bits; r.G = G; r.D = (int)t[6].size(3);
  return r;
}

// layout checks shared by both ops
static void check_buffers(const std::vector<torch::Tensor>& t, const torch::Tensor& pos, const torch::Tensor& now) {
  for (int i : {1, 2, 4, 5, 6, 7})
    TORCH_CHECK(t[i].dtype() == torch::kFloat && t[i].dim() == 4, "kvc::kivi_*: fp32 scales, minimums and rings");
  TORCH_CHECK(t[0].dtype() == torch::kInt && t[3].dtype() == torch::kInt, "kvc::kivi_*: int32 words");
  TORCH_CHECK(t[0].strides() == t[3].strides() && t[1].strides() == t[2].strides() && t[4].strides() == t[5].strides()
              && t[6].strides() == t[7].strides() && t[1].stride(3) == 1 && t[6].stride(3) == 1,
              "kvc::kivi_*: unexpected strides");
  TORCH_CHECK(pos.dtype() == torch::kLong && pos.dim() == 3 && pos.stride(2) == 1 && now.dtype() == torch::kLong
              && now.is_contiguous(), "kvc::kivi_*: pos [B, 1 or H, S] and now [B] must be long");
}

struct RingHit { int64_t t; int64_t row; bool key; };

static inline v16 load16(const float* p) { v16 x; std::memcpy(&x, p, sizeof x); return x; }
static inline v16i load16i(const int32_t* p) { v16i x; std::memcpy(&x, p, sizeof x); return x; }
static inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }
static inline v16 bcast(float x) { return (v16){} + x; }
// the codes at bit offset `shift` (one for all lanes, or per lane) of 16 words as floats.  2 and 4
// bits on AVX-512: a 16-entry table lookup (__builtin_shuffle takes lane indices modulo 16, one
// vpermps) replaces the mask and the int->float convert: TABLE[i] = i & (2^BITS - 1) reads the low 4
// bits, which start with the code.  Without AVX-512 no instruction looks up 16 lanes, and GCC
// builds the shuffle lane by lane (the 4-bit decode step ran at 0.54x the fp32 cache's on an AVX2
// EPYC): the mask and the convert instead
template <int BITS, typename Shift>
static inline v16 codes(v16i words, Shift shift) {
#if defined(__AVX512F__)
  constexpr bool table_lookup = BITS != 8;
#else
  constexpr bool table_lookup = false;
#endif
  if constexpr (!table_lookup) {
    return __builtin_convertvector((words >> shift) & ((1 << BITS) - 1), v16);
  } else {
    constexpr int M = (1 << BITS) - 1;
    const v16 table = {0 & M, 1 & M, 2 & M, 3 & M, 4 & M, 5 & M, 6 & M, 7 & M,
                       8 & M, 9 & M, 10 & M, 11 & M, 12 & M, 13 & M, 14 & M, 15 & M};
    return __builtin_shuffle(table, words >> shift);
  }
}

static float dot(const float* a, const float* b, int D) {
  v16 acc = {};
  for (int c = 0; c < D; c += L) acc += load16(a + c) * load16(b + c);
  return hsum(acc);
}

// always_inline, here and in prefetch_ahead and DenseAhead: GCC's IPA takes a function whose only effects
// are prefetches for pure and deletes its calls (the sparse path ran without a single prefetch until
// 2026-11-26)
__attribute__((always_inline)) static inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char*)p + o);
}

// ------------------------------------------------------------------------------------ dense path
// Two passes per (batch row, KV head) and block of GB query rows, D a template parameter (channel
// offsets j * W become immediates).  Scores: 32 slots at a time, all W word rows of those slots,
// the GB x 2 accumulators in registers; a key group's scale and minimum are folded into qs / z when
// the sweep enters it; masking, ring keys and the running max on the block while it is in L1.
// Values: chunks of CH slots; the chunk's weights e = exp(s - m) times the value scales (pv) go to
// an L1 buffer, then each word row of the chunk is swept once per PB bit-planes with GB x PB
// accumulators in registers, added into per-channel vector sums (acc, L1) at the chunk's end.

constexpr int64_t CH = 512;            // value chunk: slots whose weights stay in L1

// qs = q * s_k (channel order) and z = q . m_k of one key group, for GB query rows.  Two cached:
// the 32 slots of a score block span at most two groups
struct Folded {
  int64_t grp[2] = {-1, -1};
  float qs[2][4 * 128];
  float z[2][4];
};

template <int GB, int D>
static int fold_group(const float* q, const Row& r, int64_t grp, Folded& f) {
  const int i = (int)(grp & 1);
  if (f.grp[i] == grp) return i;
  f.grp[i] = grp;
  const float* ks = r.ks + grp * r.k_g;
  const float* km = r.km + grp * r.k_g;
  for (int g = 0; g < GB; ++g) {
    v16 zv = {};
    for (int c = 0; c < D; c += L) {
      const v16 qv = load16(q + g * D + c);
      store16(f.qs[i] + g * D + c, qv * load16(ks + c));
      zv += qv * load16(km + c);
    }
    f.z[i][g] = hsum(zv);
  }
  return i;
}

// whether the 16 slots from t are all visible and out of the value ring (pos <= lo)
static inline bool plain16(const Row& r, int64_t t, int64_t lo) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i l = _mm512_set1_epi64(lo);
  if (_mm512_cmpgt_epi64_mask(_mm512_loadu_si512(r.pos + t), l) | _mm512_cmpgt_epi64_mask(_mm512_loadu_si512(r.pos + t + 8), l))
    return false;
  return !r.vis || !_mm_cmpeq_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.vis + t)), _mm_setzero_si128());
#else
  int any = 0;
  for (int l = 0; l < L; ++l) any |= r.pos[t + l] > lo;
  if (r.vis)
    for (int l = 0; l < L; ++l) any |= !r.vis[t + l];
  return !any;
#endif
}

// slots [t, t + 16) after their packed scores (s[g * npad + t]): -inf past n or invisible; ring
// slots go to hits, those in the key residual get their scores from the exact ring keys
template <int GB, int D>
__attribute__((noinline)) static void mask_ring(const float* q, const Row& r, int64_t n, int64_t t, float* s,
                                                int64_t npad, std::vector<RingHit>& hits) {
  for (int64_t u = t; u < t + L; ++u) {
    if (u >= n || (r.vis && !r.vis[u])) {
      for (int g = 0; g < GB; ++g) s[g * npad + u] = -INFINITY;
    } else if (r.ring_v(r.pos[u])) {
      const int64_t p = r.pos[u];
      hits.push_back({u, p % r.R, r.ring_k(p)});
      if (r.ring_k(p))
        for (int g = 0; g < GB; ++g) s[g * npad + u] = dot(q + g * D, r.kr + (p % r.R) * r.r_row, D);
    }
  }
}

// stores the packed scores x[g] of slots [t, t + 16) into s[g * npad + t], masked (mask_ring), and folds
// their maximum into mv.  x is reloaded only when mask_ring ran: a load right behind the 64-byte store
// (and a call) stalled the dense sweep
template <int GB, int D>
static inline void store_scores(const float* q, const Row& r, int64_t n, int64_t t, v16* x, float* s, int64_t npad,
                                v16* mv, std::vector<RingHit>& hits) {
  for (int g = 0; g < GB; ++g) store16(s + g * npad + t, x[g]);
  if (t + L > n || !plain16(r, t, std::max<int64_t>(r.now - r.R, -1))) {   // ring_v(p) <=> p > now - R
    mask_ring<GB, D>(q, r, n, t, s, npad, hits);
    for (int g = 0; g < GB; ++g) x[g] = load16(s + g * npad + t);
  }
  for (int g = 0; g < GB; ++g) mv[g] = x[g] > mv[g] ? x[g] : mv[g];
}

// Dense path: what the score sweep reads outside its word rows (those it prefetches itself), fetched a
// little each 32-slot block so that the misses overlap the sweep: the key scales and minimums of the
// groups AHEAD_SLOTS on (fold_group, IntFold::enter), and the ring rows of the newest R positions (the
// key residual's keys and every value row), which mask_ring and finish_rows read after the sweep
struct DenseAhead {
  static constexpr int RING_LINES = 8;                        // ring lines a block: 1024 by slot 4096
  const Row& r;
  int64_t p, line = 0;                                        // ring position being fetched, its next line
  explicit DenseAhead(const Row& row) : r(row), p(std::max<int64_t>(row.now - row.R + 1, 0)) {}
  __attribute__((always_inline)) inline void block(int64_t t0, int64_t n) {
    for (int64_t t = t0 + AHEAD_SLOTS; t < std::min(t0 + AHEAD_SLOTS + 2 * L, n); t += r.G) {
      prefetch_lines(r.ks + t / r.G * r.k_g, r.D * sizeof(float));
      prefetch_lines(r.km + t / r.G * r.k_g, r.D * sizeof(float));
    }
    const int64_t per_row = r.D * (int64_t)sizeof(float) / 64;  // lines: the value row, then the key row
    for (int i = 0; i < RING_LINES && p <= r.now; ++i) {
      __builtin_prefetch((line < per_row ? r.vr : r.kr) + (p % r.R) * r.r_row + line % per_row * 16);
      if (++line == (r.ring_k(p) ? 2 * per_row : per_row)) line = 0, ++p;
    }
  }
};

// scores of NV vectors of 16 slots from t0 into s, masked, their maximum folded into mv
template <int BITS, int GB, int D, int NV>
static void score_block(const float* q, const Row& r, int64_t n, int64_t t0, Folded& f, float* s, int64_t npad,
                        v16* mv, std::vector<RingHit>& hits) {
  constexpr int P = 32 / BITS, W = D / P;
  const float* qs[NV];
  v16 acc[NV][GB];
  for (int v = 0; v < NV; ++v) {
    const int i = fold_group<GB, D>(q, r, (t0 + v * L) / r.G, f);
    qs[v] = f.qs[i];
    for (int g = 0; g < GB; ++g) acc[v][g] = bcast(f.z[i][g]);
  }
  for (int w = 0; w < W; ++w) {
    const int32_t* kw = r.kp + w * r.kp_w + t0;
    v16i words[NV];
    for (int v = 0; v < NV; ++v) {
      __builtin_prefetch(kw + v * L + AHEAD_SLOTS);
      words[v] = load16i(kw + v * L);
    }
#pragma GCC unroll 16
    for (int j = 0; j < P; ++j)
      for (int v = 0; v < NV; ++v) {
        const v16 c = codes<BITS>(words[v], BITS * j);
        for (int g = 0; g < GB; ++g) acc[v][g] += qs[v][g * D + j * W + w] * c;
      }
  }
  for (int v = 0; v < NV; ++v) store_scores<GB, D>(q, r, n, t0 + v * L, acc[v], s, npad, mv, hits);
}

// all scores s[g * npad + t] for t < npad and each row's maximum m[g] (0 when nothing is visible)
template <int BITS, int GB, int D>
static void dense_scores(const float* q, const Row& r, int64_t n, int64_t npad, float* s, float* m,
                         std::vector<RingHit>& hits) {
  Folded f;
  v16 mv[GB];
  for (int g = 0; g < GB; ++g) mv[g] = bcast(-INFINITY);
  int64_t t = 0;
  DenseAhead ahead(r);
  for (; t + 2 * L <= npad; t += 2 * L) {
    ahead.block(t, n);
    score_block<BITS, GB, D, 2>(q, r, n, t, f, s, npad, mv, hits);
  }
  if (t < npad) score_block<BITS, GB, D, 1>(q, r, n, t, f, s, npad, mv, hits);
  for (int g = 0; g < GB; ++g) {
    float mg = -INFINITY;
    for (int l = 0; l < L; ++l) mg = std::max(mg, mv[g][l]);
    m[g] = std::isinf(mg) ? 0.f : mg;
  }
}

// weights of the chunk [t0, t0 + len): e = exp(s - m) summed into lsum, pv[(c * GB + g) * CH + t] =
// e * s_v (value channel group c), zc[g * NCG + c] += e * m_v
template <int GB>
static void chunk_weights(const Row& r, const float* s, int64_t npad, const float* m, int64_t t0, int64_t len,
                          int NCG, float* pv, v16* lsum, v16* zc) {
  for (int64_t t = 0; t < len; t += L) {
    v16 e[GB];
    for (int g = 0; g < GB; ++g) {
      e[g] = vexp(load16(s + g * npad + t0 + t) - m[g]);
      lsum[g] += e[g];
    }
    for (int c = 0; c < NCG; ++c) {
      const float* vs = r.vs + c * r.v_c + t0 + t;
      const float* vm = r.vm + c * r.v_c + t0 + t;
      __builtin_prefetch(vs + AHEAD_SLOTS);
      __builtin_prefetch(vm + AHEAD_SLOTS);
      const v16 sc = load16(vs), mn = load16(vm);
      for (int g = 0; g < GB; ++g) {
        store16(pv + (c * GB + g) * CH + t, e[g] * sc);
        zc[g * NCG + c] += e[g] * mn;
      }
    }
  }
}

// acc[g * D + d] += sum over the chunk [t0, t0 + len) of pv * code_{t,d}, word row by word row
template <int BITS, int GB, int D>
static void chunk_values(const Row& r, int64_t t0, int64_t len, const float* pv, v16* acc) {
  constexpr int P = 32 / BITS, W = D / P;
  constexpr int PB = std::min(P, GB <= 3 ? 8 : 4);            // bit-planes per register block
  for (int w = 0; w < W; ++w) {
    const int32_t* vw = r.vp + w * r.vp_w + t0;
    for (int jb = 0; jb < P; jb += PB) {
      const float* pc[PB];                                    // the planes' channel groups' weights
      for (int jj = 0; jj < PB; ++jj) pc[jj] = pv + ((jb + jj) * W + w) / r.G * GB * CH;
      v16 a[GB][PB] = {};
      for (int64_t t = 0; t < len; t += L) {
        if (jb == 0) __builtin_prefetch(vw + t + AHEAD_SLOTS);
        const v16i words = load16i(vw + t);
#pragma GCC unroll 16
        for (int jj = 0; jj < PB; ++jj) {
          const v16 c = codes<BITS>(words, BITS * (jb + jj));
          for (int g = 0; g < GB; ++g) a[g][jj] += load16(pc[jj] + g * CH + t) * c;
        }
      }
      for (int g = 0; g < GB; ++g)
        for (int jj = 0; jj < PB; ++jj) acc[g * D + (jb + jj) * W + w] += a[g][jj];
    }
  }
}

// the ring slots' weights taken out of the scores: ring_p[g * np + i] = exp(s - m) of hit i (np: the hits
// rounded up to 16), summed into lring, and their scores set to -inf (the packed values' pass then
// gives them weight 0)
template <int GB>
static void take_ring_weights(const std::vector<RingHit>& hits, float* s, int64_t npad, const float* m,
                              std::vector<float>& ring_p, float* lring) {
  const size_t nh = hits.size(), np = (nh + L - 1) / L * L;
  ring_p.assign(np * GB, -INFINITY);
  for (int g = 0; g < GB; ++g) {
    float* rp = ring_p.data() + g * np;
    for (size_t i = 0; i < nh; ++i) {
      float& x = s[g * npad + hits[i].t];
      rp[i] = x;
      x = -INFINITY;
    }
    v16 acc = {};
    for (size_t i = 0; i < np; i += L) {
      const v16 e = vexp(load16(rp + i) - m[g]);
      store16(rp + i, e);
      acc += e;
    }
    lring[g] = hsum(acc);
  }
}

// split dense reads: lse[g] = m[g] + log l[g], the log-sum-exp of row g's scores (-inf when it saw nothing)
template <int GB>
static inline void log_sum_exp(const float* m, const float* l, float* lse) {
  if (lse)
    for (int g = 0; g < GB; ++g) lse[g] = l[g] > 0.f ? m[g] + std::log(l[g]) : -INFINITY;
}

// out[g * D + d] (query row g's packed part) plus the ring rows' weighted values, divided by the weights'
// sums l[g]; hit by hit, so each ring row is read once for the GB query rows
template <int GB, int D>
static void finish_rows(const Row& r, const std::vector<RingHit>& hits, const std::vector<float>& ring_p,
                        const float* l, float* out) {
  const size_t np = ring_p.size() / GB;
  v16 acc[GB][D / L];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < D / L; ++c) acc[g][c] = load16(out + g * D + c * L);
  for (size_t i = 0; i < hits.size(); ++i) {
    const float* vrow = r.vr + hits[i].row * r.r_row;
    for (int c = 0; c < D / L; ++c) {
      const v16 x = load16(vrow + c * L);
      for (int g = 0; g < GB; ++g) acc[g][c] += ring_p[g * np + i] * x;
    }
  }
  for (int g = 0; g < GB; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int c = 0; c < D / L; ++c) store16(out + g * D + c * L, acc[g][c] * inv);
  }
}

template <int BITS, int GB, int D>
static void dense_rows(const float* q, const Row& r, int64_t n, std::vector<float>& work, float* out, float* lse) {
  const int64_t npad = (n + L - 1) / L * L;
  const int NCG = D / r.G;
  work.resize(GB * npad + NCG * GB * CH + (GB * D + GB * NCG) * L);
  float* s = work.data();
  float* pv = s + GB * npad;
  v16* acc = reinterpret_cast<v16*>(pv + NCG * GB * CH);
  v16* zc = acc + GB * D;
  std::fill(acc, zc + GB * NCG, v16{});
  std::vector<RingHit> hits;
  float m[GB], lring[GB];
  dense_scores<BITS, GB, D>(q, r, n, npad, s, m, hits);
  std::vector<float> ring_p;                                  // ring slots: weights moved to their rows
  take_ring_weights<GB>(hits, s, npad, m, ring_p, lring);
  v16 lsum[GB] = {};
  for (int64_t t0 = 0; t0 < npad; t0 += CH) {
    const int64_t len = std::min(CH, npad - t0);
    chunk_weights<GB>(r, s, npad, m, t0, len, NCG, pv, lsum, zc);
    chunk_values<BITS, GB, D>(r, t0, len, pv, acc);
  }
  float l[GB];
  for (int g = 0; g < GB; ++g) {
    float* og = out + g * D;
    for (int d = 0; d < D; ++d) og[d] = hsum(acc[g * D + d]) + hsum(zc[g * NCG + d / r.G]);
    l[g] = hsum(lsum[g]) + lring[g];
  }
  log_sum_exp<GB>(m, l, lse);
  finish_rows<GB, D>(r, hits, ring_p, l, out);
}

// ------------------------------------------------------------------------------------ integer dense path
// The dense read in integer arithmetic (its twin, which states the scheme with shapes, is
// kernels/kivi_int.py), `arith` ARITH_VNNI (vpdpbusd: 4 u8 x s8 products summed into each int32 lane)
// or ARITH_AVX2 (vpmaddubsw -> int16 pair sums, vpmaddwd by 1 -> int32: the same sums; pair sums stay
// below 2 * 255 * 15 and 2 * 15 * 127 < 2^15, so nothing saturates).  Slot lanes: word w of 16 slots
// in one vector; a byte k of (word >> BITS sh) & mask is the code of plane E k + sh (E = 8 / BITS
// codes a byte), i.e. of channel (E k + sh) W + w.
//   scores: when the sweep enters a key group, q s_k is quantized to int8 (a = max|q s_k| / 127) and
//           laid out as one dword per (word, shift) holding the 4 query bytes of those channels
//           (IntFold); per word and shift one u8 x s8 dot per query row; score = float(sum) a + z.
//   values: per slot group (G slots), value channel group c and lane block (4 of every 16 slots) the
//           weights e s_v are quantized to u8 (b = max / 255); a 4 x 4 byte transpose within each 16-byte block turns (4 slots x 4
//           planes) into (4 planes x 4 slots), so each int32 lane sums 4 slots of one channel; the
//           group's int32 sums are scaled by b into fp32 accumulators at the group's end.
// Needs G % 16 == 0 (whole groups of 16-slot vectors), bits 2 or 4.
enum Arith { ARITH_FP32 = 0, ARITH_AVX2 = 1, ARITH_VNNI = 2 };

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVC_KIVI_VNNI 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define KVC_KIVI_AVX2 1
#endif

static bool arith_built(int64_t arith) {
  switch (arith) {
    case ARITH_FP32: return true;
#ifdef KVC_KIVI_AVX2
    case ARITH_AVX2: return true;
#endif
#ifdef KVC_KIVI_VNNI
    case ARITH_VNNI: return true;
#endif
    default: return false;
  }
}

static inline v16 as_v16(const void* p) { v16 x; std::memcpy(&x, p, sizeof x); return x; }

typedef uint8_t v64b __attribute__((vector_size(64)));

// 16 int32 lanes in the registers of one ISA
template <int ISA> struct IV;

#ifdef KVC_KIVI_VNNI
template <> struct IV<ARITH_VNNI> {
  __m512i x;
  static IV load(const void* p) { return {_mm512_loadu_si512(p)}; }
  static IV set1(int32_t v) { return {_mm512_set1_epi32(v)}; }
  static IV zero() { return {_mm512_setzero_si512()}; }
  IV srl(int n) const { return {_mm512_srl_epi32(x, _mm_cvtsi32_si128(n))}; }
  IV operator&(IV o) const { return {_mm512_and_si512(x, o.x)}; }
  IV bytes(IV idx) const { return {_mm512_shuffle_epi8(x, idx.x)}; }   // within each 16-byte block
  IV dot(IV u8, IV s8) const { return {_mm512_dpbusd_epi32(x, u8.x, s8.x)}; }
  v16 to_float() const { const __m512 f = _mm512_cvtepi32_ps(x); return as_v16(&f); }
  static IV round(v16 f) { __m512 m; std::memcpy(&m, &f, 64); return {_mm512_cvtps_epi32(m)}; }
  // the lanes of r[0 .. 4) as 64 bytes (int8 with SIGNED, else uint8; values in range), lane l of r[k]
  // at byte 16 (l / 4) + 4 k + l % 4 (pack_pos): the packs work within 128-bit blocks
  template <bool SIGNED>
  static v64b pack4(const IV* r) {
    const __m512i a = SIGNED ? _mm512_packs_epi32(r[0].x, r[1].x) : _mm512_packus_epi32(r[0].x, r[1].x);
    const __m512i b = SIGNED ? _mm512_packs_epi32(r[2].x, r[3].x) : _mm512_packus_epi32(r[2].x, r[3].x);
    const __m512i c = SIGNED ? _mm512_packs_epi16(a, b) : _mm512_packus_epi16(a, b);
    v64b out;
    std::memcpy(&out, &c, 64);
    return out;
  }
};
#endif

#ifdef KVC_KIVI_AVX2
template <> struct IV<ARITH_AVX2> {
  __m256i lo, hi;
  static IV load(const void* p) {
    const __m256i* v = reinterpret_cast<const __m256i*>(p);
    return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
  }
  static IV set1(int32_t v) { const __m256i a = _mm256_set1_epi32(v); return {a, a}; }
  static IV zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  IV srl(int n) const {
    const __m128i c = _mm_cvtsi32_si128(n);
    return {_mm256_srl_epi32(lo, c), _mm256_srl_epi32(hi, c)};
  }
  IV operator&(IV o) const { return {_mm256_and_si256(lo, o.lo), _mm256_and_si256(hi, o.hi)}; }
  IV bytes(IV idx) const { return {_mm256_shuffle_epi8(lo, idx.lo), _mm256_shuffle_epi8(hi, idx.hi)}; }
  IV dot(IV u8, IV s8) const {
    const __m256i one = _mm256_set1_epi16(1);
    return {_mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_maddubs_epi16(u8.lo, s8.lo), one)),
            _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_maddubs_epi16(u8.hi, s8.hi), one))};
  }
  v16 to_float() const {
    const __m256 f[2] = {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
    return as_v16(f);
  }
  static IV round(v16 f) {
    __m256 m[2];
    std::memcpy(m, &f, 64);
    return {_mm256_cvtps_epi32(m[0]), _mm256_cvtps_epi32(m[1])};
  }
  template <bool SIGNED>                                   // as IV<ARITH_VNNI>::pack4, per 256-bit half
  static v64b pack4(const IV* r) {
    __m256i h[2];
    for (int k = 0; k < 2; ++k) {
      const __m256i x0 = k ? r[0].hi : r[0].lo, x1 = k ? r[1].hi : r[1].lo;
      const __m256i x2 = k ? r[2].hi : r[2].lo, x3 = k ? r[3].hi : r[3].lo;
      const __m256i a = SIGNED ? _mm256_packs_epi32(x0, x1) : _mm256_packus_epi32(x0, x1);
      const __m256i b = SIGNED ? _mm256_packs_epi32(x2, x3) : _mm256_packus_epi32(x2, x3);
      h[k] = SIGNED ? _mm256_packs_epi16(a, b) : _mm256_packus_epi16(a, b);
    }
    v64b out;
    std::memcpy(&out, h, 64);
    return out;
  }
};
#endif

template <int ISA>
static inline IV<ISA> from_bytes(v64b b) {                     // 64 bytes as 16 int32 lanes
  IV<ISA> x;
  std::memcpy(&x, &b, 64);
  return x;
}

// where IV::pack4 puts lane l of its source k
constexpr int pack_pos(int k, int l) { return 16 * (l / 4) + 4 * k + l % 4; }

template <int BITS> constexpr int32_t code_mask() { return BITS == 4 ? 0x0F0F0F0F : 0x03030303; }

// byte (4 i + m) of each 16-byte block <- byte (4 m + i): (4 slots x 4 planes) -> (4 planes x 4 slots)
template <int ISA>
static inline IV<ISA> transpose_pattern() {
  int32_t p[16];
  for (int l = 0; l < 16; ++l) p[l] = 0x0C080400 + 0x01010101 * (l % 4);
  return IV<ISA>::load(p);
}

// lane 4 b of the result: op over the 16 lanes of x[b] (b < GB <= 4), in cpu_vec.h hsum's tree order
// (lanes l and l + 8, then + 4, + 2, + 1), so a sum equals hsum(x[b]) bit for bit
template <int GB, typename Op>
static inline v16 reduce4(const v16* x, Op op) {
  const v16i lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, hi8 = lo8 + 8;
  const v16i lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}, hi4 = lo4 + 4;
  const v16 p0 = op(__builtin_shuffle(x[0], x[std::min(1, GB - 1)], lo8), __builtin_shuffle(x[0], x[std::min(1, GB - 1)], hi8));
  const v16 p1 = GB > 2 ? op(__builtin_shuffle(x[std::min(2, GB - 1)], x[GB - 1], lo8),
                             __builtin_shuffle(x[std::min(2, GB - 1)], x[GB - 1], hi8)) : p0;
  v16 y = op(__builtin_shuffle(p0, p1, lo4), __builtin_shuffle(p0, p1, hi4));   // lanes 4 b .. 4 b + 3: row b
  y = op(y, __builtin_shuffle(y, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  return op(y, __builtin_shuffle(y, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
}

// one key group folded into GB query rows: qw[g][w * E + sh] = the int8 bytes k = 0..3 of
// round(q s_k * 127 / max|q s_k|) for channels (E k + sh) W + w; a[g] = max|q s_k| / 127; z[g] = q . m_k
template <int BITS, int GB, int D>
struct IntFold {
  static constexpr int E = 8 / BITS, W = D * BITS / 32, NB = D / 64;
  int64_t grp = -1;
  alignas(64) int32_t qw[GB][D / 4];
  float a[GB], z[GB];
  v64b perm[NB];                       // byte i of qw <- byte perm[i] of the packed int8 query (IV::pack4)
  IntFold() {
    for (int i = 0; i < D; ++i) {      // i = (w E + sh) 4 + k
      const int k = i % 4, w = i / 4 / E, sh = i / 4 % E, ch = (E * k + sh) * W + w;
      perm[i / 64][i % 64] = (uint8_t)(64 * (ch / 64) + pack_pos(ch / 16 % 4, ch % 16));
    }
  }
  template <int ISA>
  void enter(const float* q, const Row& r, int64_t g) {
    if (g == grp) return;
    grp = g;
    const float* ks = r.ks + g * r.k_g;
    const float* km = r.km + g * r.k_g;
    v16 qs[GB][D / L], mx[GB], zs[GB];
    for (int b = 0; b < GB; ++b) {
      mx[b] = zs[b] = v16{};
      for (int c = 0; c < D / L; ++c) {
        const v16 qv = load16(q + b * D + c * L);
        qs[b][c] = qv * load16(ks + c * L);
        const v16 ab = qs[b][c] < 0.f ? -qs[b][c] : qs[b][c];
        mx[b] = ab > mx[b] ? ab : mx[b];
        zs[b] += qv * load16(km + c * L);
      }
    }
    const v16 zero = {}, one = zero + 1.f;
    const v16 amax = reduce4<GB>(mx, [](v16 x, v16 y) { return y > x ? y : x; });   // lane 4 b: row b
    const v16 zb = reduce4<GB>(zs, [](v16 x, v16 y) { return x + y; });
    const v16 inv = amax > zero ? 127.f / (amax > zero ? amax : one) : zero, ab = amax / 127.f;
    for (int b = 0; b < GB; ++b) {
      a[b] = ab[4 * b];
      z[b] = zb[4 * b];
      IV<ISA> qi[D / L];
      for (int c = 0; c < D / L; ++c) qi[c] = IV<ISA>::round(qs[b][c] * inv[4 * b]);
      v64b src[NB], dst[NB];
      for (int k = 0; k < NB; ++k) src[k] = IV<ISA>::template pack4<true>(qi + 4 * k);
      if constexpr (NB == 1) {
        dst[0] = __builtin_shuffle(src[0], perm[0]);
      } else {
        dst[0] = __builtin_shuffle(src[0], src[1], perm[0]);
        dst[1] = __builtin_shuffle(src[0], src[1], perm[1]);
      }
      std::memcpy(qw[b], dst, D);
    }
  }
};

// the int32 sums acc[v * GB + g] of NV vectors of 16 slots from kp (word w at kp + w * kp_w) with the query
// words qw[v][g * D / 4 + w * E + sh].  Not inlined: inside dense_rows_int GCC kept the accumulators on
// the stack (a load and a store per word row); on its own they stay in registers
template <int ISA, int BITS, int GB, int D, int NV>
__attribute__((noinline)) static void int_sweep(const int32_t* kp, int64_t kp_w, const int32_t* const* qw,
                                                IV<ISA>* out) {
  using V = IV<ISA>;
  constexpr int E = 8 / BITS, W = D * BITS / 32;
  const V mask = V::set1(code_mask<BITS>());
  V acc[NV][GB];
  for (int v = 0; v < NV; ++v)
    for (int g = 0; g < GB; ++g) acc[v][g] = V::zero();
  for (int w = 0; w < W; ++w) {
    const int32_t* kw = kp + w * kp_w;
    V words[NV];
    for (int v = 0; v < NV; ++v) {
      __builtin_prefetch(kw + v * L + AHEAD_SLOTS);
      words[v] = V::load(kw + v * L);
    }
#pragma GCC unroll 4
    for (int sh = 0; sh < E; ++sh)
      for (int v = 0; v < NV; ++v) {
        const V c = words[v].srl(BITS * sh) & mask;
        for (int g = 0; g < GB; ++g) acc[v][g] = acc[v][g].dot(c, V::set1(qw[v][g * D / 4 + w * E + sh]));
      }
  }
  for (int v = 0; v < NV; ++v)
    for (int g = 0; g < GB; ++g) out[v * GB + g] = acc[v][g];
}

// scores of NV vectors of 16 slots from t0 (integer dot products), masked, their maximum folded into mv
template <int ISA, int BITS, int GB, int D, int NV>
static void score_block_int(const float* q, const Row& r, int64_t n, int64_t t0, IntFold<BITS, GB, D>* f, float* s,
                            int64_t npad, v16* mv, std::vector<RingHit>& hits) {
  const IntFold<BITS, GB, D>* fv[NV];
  const int32_t* qw[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t grp = (t0 + v * L) / r.G;
    f[grp & 1].template enter<ISA>(q, r, grp);
    fv[v] = &f[grp & 1];
    qw[v] = fv[v]->qw[0];
  }
  IV<ISA> acc[NV * GB];
  int_sweep<ISA, BITS, GB, D, NV>(r.kp + t0, r.kp_w, qw, acc);
  for (int v = 0; v < NV; ++v) {
    v16 x[GB];
    for (int g = 0; g < GB; ++g) x[g] = acc[v * GB + g].to_float() * fv[v]->a[g] + fv[v]->z[g];
    store_scores<GB, D>(q, r, n, t0 + v * L, x, s, npad, mv, hits);
  }
}

template <int ISA, int BITS, int GB, int D>
static void dense_scores_int(const float* q, const Row& r, int64_t n, int64_t npad, float* s, float* m,
                             std::vector<RingHit>& hits) {
  IntFold<BITS, GB, D> f[2];
  v16 mv[GB];
  for (int g = 0; g < GB; ++g) mv[g] = bcast(-INFINITY);
  int64_t t = 0;
  DenseAhead ahead(r);
  for (; t + 2 * L <= npad; t += 2 * L) {
    ahead.block(t, n);
    score_block_int<ISA, BITS, GB, D, 2>(q, r, n, t, f, s, npad, mv, hits);
  }
  if (t < npad) score_block_int<ISA, BITS, GB, D, 1>(q, r, n, t, f, s, npad, mv, hits);
  for (int g = 0; g < GB; ++g) {
    float mg = -INFINITY;
    for (int l = 0; l < L; ++l) mg = std::max(mg, mv[g][l]);
    m[g] = std::isinf(mg) ? 0.f : mg;
  }
}

constexpr int64_t CHI = 256;           // integer value chunk: slots whose u8 weights stay in L1

// lane tables of the value pass, G slots a group (VG = G / 16 vectors), NCG = D / G channel groups.
// The transposed layout, shift sh: lane l = (blk, i) = 4 blk + i holds channel plane E i + sh of the
// slots 4 blk .. 4 blk + 3 (of each 16), channel group c(l) = (E i + sh) W / G.  The block maxima of
// a (row, slot group) are packed 4 channel groups a vector: lane 4 c' + blk of vector c / 4 (c' = c % 4).
//   wsel: byte 4 l + m of the weights' bytes (slot 4 blk + m, channel group c(l)): with NCG <= 2 byte
//         4 (4 blk + m) of the int32 codes of group c (two sources of 64 bytes), else where IV::pack4 of
//         groups 4 (c / 4) .. puts it
//   bsel: lane l <- lane 4 c(l) + blk of the packed scales (two sources: vectors 0 and NQ - 1)
//   isel: per channel group c, lane l <- lane 4 c' + l / 4 (its inverse maxima by slot lane)
template <int BITS, int D, int G>
struct ValueLanes {
  static constexpr int E = 8 / BITS, W = D * BITS / 32, NCG = D / G, VG = G / L, NQ = (NCG + 3) / 4;
  static_assert(G % L == 0 && NCG <= 8, "ValueLanes: G % 16 == 0, D / G <= 8");
  v64b wsel[E];
  v16i bsel[E], isel[NCG];
  ValueLanes() {
    for (int sh = 0; sh < E; ++sh)
      for (int l = 0; l < 16; ++l) {
        const int blk = l / 4, i = l % 4, c = (E * i + sh) * W / G;
        for (int m = 0; m < 4; ++m)
          wsel[sh][4 * l + m] = (uint8_t)(NCG <= 2 ? 64 * c + 4 * (4 * blk + m) : 64 * (c / 4) + pack_pos(c % 4, 4 * blk + m));
        bsel[sh][l] = 4 * c + blk;
      }
    for (int c = 0; c < NCG; ++c)
      for (int l = 0; l < 16; ++l) isel[c][l] = 4 * (c % 4) + l / 4;
  }
};

// lane k < 8: max of a's lanes 2k, 2k + 1; lane 8 + k: of b's
static inline v16 pair_max(v16 a, v16 b) {
  const v16 x = __builtin_shuffle(a, b, (v16i){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30});
  const v16 y = __builtin_shuffle(a, b, (v16i){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
  return y > x ? y : x;
}

// the block maxima of mx[c] (lane by slot lane, c < NCG) packed: lane 4 c' + blk of q[c / 4] = the
// largest of lanes 4 blk .. 4 blk + 3 of mx[c]
template <int NCG>
static inline void packed_block_max(const v16* mx, v16* q) {
  constexpr int NP = (NCG + 1) / 2;
  v16 p[4];
  for (int k = 0; k < NP; ++k) p[k] = pair_max(mx[2 * k], mx[std::min(2 * k + 1, NCG - 1)]);
  for (int k = 0; k < (NP + 1) / 2; ++k) q[k] = pair_max(p[2 * k], p[std::min(2 * k + 1, NP - 1)]);
}

// weights of the chunk [t0, t0 + len) (whole slot groups): e = exp(s - m) summed into lsum, zc[g * NCG + c]
// += e m_v; per slot group j, value channel group c and lane block (the slots t of the group with
// t % 16 in [4 blk, 4 blk + 4), which the value pass sums in one int32 lane) the u8 weights
// round(e s_v * 255 / max) in the value pass's layout, wq[(v GB + g) E + sh] (v: the chunk's 16-slot
// vector), and their scales bq[(j GB + g) E + sh] (lane (blk, i): max / 255 of its block and channel group)
template <int ISA, int BITS, int GB, int D, int G>
static void chunk_weights_int(const Row& r, const float* s, int64_t npad, const float* m, int64_t t0, int64_t len,
                              const ValueLanes<BITS, D, G>& vl, IV<ISA>* wq, v16* bq, v16* lsum, v16* zc) {
  using V = IV<ISA>;
  using VL = ValueLanes<BITS, D, G>;
  constexpr int E = VL::E, VG = VL::VG, NCG = VL::NCG, NQ = VL::NQ;
  const v16 zero = {}, one = zero + 1.f;
  for (int64_t j = 0; j < len / G; ++j) {
    const int64_t tj = t0 + j * G;
    for (int g = 0; g < GB; ++g) {
      v16 pv[NCG][VG], mx[NCG] = {};
      for (int v = 0; v < VG; ++v) {
        const int64_t t = tj + v * L;
        const v16 e = vexp(load16(s + g * npad + t) - m[g]);
        lsum[g] += e;
        for (int c = 0; c < NCG; ++c) {
          if (g == 0) {
            __builtin_prefetch(r.vs + c * r.v_c + t + AHEAD_SLOTS);
            __builtin_prefetch(r.vm + c * r.v_c + t + AHEAD_SLOTS);
          }
          pv[c][v] = e * load16(r.vs + c * r.v_c + t);
          mx[c] = pv[c][v] > mx[c] ? pv[c][v] : mx[c];
          zc[g * NCG + c] += e * load16(r.vm + c * r.v_c + t);
        }
      }
      v16 pmax[NQ], inv[NQ], bt[NQ];                          // packed block maxima (ValueLanes)
      packed_block_max<NCG>(mx, pmax);
      for (int k = 0; k < NQ; ++k) {
        inv[k] = pmax[k] > zero ? 255.f / (pmax[k] > zero ? pmax[k] : one) : zero;
        bt[k] = pmax[k] * (1.f / 255.f);
      }
      for (int sh = 0; sh < E; ++sh) bq[(j * GB + g) * E + sh] = __builtin_shuffle(bt[0], bt[NQ - 1], vl.bsel[sh]);
      for (int v = 0; v < VG; ++v) {
        V rc[NCG];
        for (int c = 0; c < NCG; ++c) rc[c] = V::round(pv[c][v] * __builtin_shuffle(inv[c / 4], vl.isel[c]));
        v64b lo, hi;
        if constexpr (NCG <= 2) {                             // the int32 codes' bytes, two sources
          std::memcpy(&lo, &rc[0], 64);
          std::memcpy(&hi, &rc[NCG - 1], 64);
        } else {
          V r4[8];
          for (int c = 0; c < 8; ++c) r4[c] = rc[std::min(c, NCG - 1)];
          lo = V::template pack4<false>(r4);
          hi = NCG > 4 ? V::template pack4<false>(r4 + 4) : lo;
        }
        for (int sh = 0; sh < E; ++sh)
          wq[((j * VG + v) * GB + g) * E + sh] = from_bytes<ISA>(__builtin_shuffle(lo, hi, vl.wsel[sh]));
      }
    }
  }
}

// acc[g * D + d] += the chunk's packed values weighted by the u8 weights of chunk_weights_int (not inlined,
// as int_sweep).  The byte transpose commutes with the per-byte shift and mask, so it runs once a word
template <int ISA, int BITS, int GB, int D, int G>
__attribute__((noinline)) static void chunk_values_int(const Row& r, int64_t t0, int64_t len, const IV<ISA>* wq,
                                                       const v16* bq, float* acc) {
  using V = IV<ISA>;
  constexpr int E = 8 / BITS, W = D * BITS / 32, VG = G / L;
  const V mask = V::set1(code_mask<BITS>()), tr = transpose_pattern<ISA>();
  for (int w = 0; w < W; ++w) {
    const int32_t* vw = r.vp + w * r.vp_w + t0;
    v16 fa[GB][E] = {};
    for (int64_t j = 0; j < len / G; ++j) {
      V ia[GB][E];
      for (int g = 0; g < GB; ++g)
        for (int sh = 0; sh < E; ++sh) ia[g][sh] = V::zero();
      for (int v = 0; v < VG; ++v) {
        const int64_t vi = j * VG + v;
        __builtin_prefetch(vw + vi * L + AHEAD_SLOTS);
        const V x = V::load(vw + vi * L).bytes(tr);
        const V* wv = wq + vi * GB * E;
#pragma GCC unroll 4
        for (int sh = 0; sh < E; ++sh) {
          const V c = x.srl(BITS * sh) & mask;
          for (int g = 0; g < GB; ++g) ia[g][sh] = ia[g][sh].dot(wv[g * E + sh], c);
        }
      }
      for (int g = 0; g < GB; ++g)
        for (int sh = 0; sh < E; ++sh) fa[g][sh] += ia[g][sh].to_float() * bq[(j * GB + g) * E + sh];
    }
    for (int g = 0; g < GB; ++g)
      for (int sh = 0; sh < E; ++sh)
        for (int i = 0; i < 4; ++i)
          acc[g * D + (E * i + sh) * W + w] += (fa[g][sh][i] + fa[g][sh][4 + i]) + (fa[g][sh][8 + i] + fa[g][sh][12 + i]);
  }
}

template <int ISA, int BITS, int GB, int D, int G>
static void dense_rows_int(const float* q, const Row& r, int64_t n, std::vector<float>& work, float* out, float* lse) {
  constexpr int E = 8 / BITS, NCG = D / G;
  const int64_t npad = (n + G - 1) / G * G;                  // whole slot groups
  work.resize(GB * npad + GB * D);
  float* s = work.data();
  float* acc = s + GB * npad;
  std::fill(acc, acc + GB * D, 0.f);
  std::vector<RingHit> hits;
  float m[GB], lring[GB];
  dense_scores_int<ISA, BITS, GB, D>(q, r, n, npad, s, m, hits);
  std::vector<float> ring_p;
  take_ring_weights<GB>(hits, s, npad, m, ring_p, lring);
  const ValueLanes<BITS, D, G> vl;
  std::vector<IV<ISA>> wq(GB * E * (CHI / L));
  std::vector<v16> bq(GB * E * (CHI / G));
  v16 lsum[GB] = {}, zc[GB * NCG] = {};
  for (int64_t t0 = 0; t0 < npad; t0 += CHI) {
    const int64_t len = std::min(CHI, npad - t0);
    chunk_weights_int<ISA, BITS, GB, D, G>(r, s, npad, m, t0, len, vl, wq.data(), bq.data(), lsum, zc);
    chunk_values_int<ISA, BITS, GB, D, G>(r, t0, len, wq.data(), bq.data(), acc);
  }
  float l[GB];
  for (int g = 0; g < GB; ++g) {
    float* og = out + g * D;
    for (int d = 0; d < D; ++d) og[d] = acc[g * D + d] + hsum(zc[g * NCG + d / G]);
    l[g] = hsum(lsum[g]) + lring[g];
  }
  log_sum_exp<GB>(m, l, lse);
  finish_rows<GB, D>(r, hits, ring_p, l, out);
}

// D and G as template parameters (G % 16 == 0 and G | D: the op and SlotStore check)
template <int ISA, int BITS, int GB>
static void dense_rows_int_d(const float* q, const Row& r, int64_t n, std::vector<float>& work, float* out,
                             float* lse) {
  switch (r.D * 1000 + r.G) {
    case 64016: return dense_rows_int<ISA, BITS, GB, 64, 16>(q, r, n, work, out, lse);
    case 64032: return dense_rows_int<ISA, BITS, GB, 64, 32>(q, r, n, work, out, lse);
    case 64064: return dense_rows_int<ISA, BITS, GB, 64, 64>(q, r, n, work, out, lse);
    case 128016: return dense_rows_int<ISA, BITS, GB, 128, 16>(q, r, n, work, out, lse);
    case 128032: return dense_rows_int<ISA, BITS, GB, 128, 32>(q, r, n, work, out, lse);
    case 128064: return dense_rows_int<ISA, BITS, GB, 128, 64>(q, r, n, work, out, lse);
    case 128128: return dense_rows_int<ISA, BITS, GB, 128, 128>(q, r, n, work, out, lse);
  }
  TORCH_CHECK(false, "kvc::kivi_attention: integer arithmetic needs D 64 or 128 and G 16, 32, 64 or D, got D ", r.D,
              ", G ", r.G);
}

// the integer dense read in the arithmetic r.arith names (built: checked by the op)
template <int BITS, int GB>
static void dense_int(const float* q, const Row& r, int64_t n, std::vector<float>& work, float* out, float* lse) {
  if constexpr (BITS == 2 || BITS == 4) {
#ifdef KVC_KIVI_VNNI
    if (r.arith == ARITH_VNNI) return dense_rows_int_d<ARITH_VNNI, BITS, GB>(q, r, n, work, out, lse);
#endif
#ifdef KVC_KIVI_AVX2
    if (r.arith == ARITH_AVX2) return dense_rows_int_d<ARITH_AVX2, BITS, GB>(q, r, n, work, out, lse);
#endif
  }
  TORCH_CHECK(false, "kvc::kivi_attention: integer arithmetic ", r.arith, " is not built for ", BITS, " bits");
}

// ------------------------------------------------------------------------------------ sparse path
// Per (batch row, KV head) and block of GB query rows, two passes over the index list in its order
// (the readers' lists are ascending: neighbouring entries share key groups and cache lines, which
// the prefetches and the folded query exploit; any order is still correct).  Channel lanes: slot t's
// W words come into one vector (word l % W in lane l, repeated when W < 16; W / 16 vectors when
// W > 16: one load from the readers' slot-major copy, a gather from the token-contiguous words), and
// channel d = 16c + l of vector c comes out of lane l with one per-lane shift (bits * (d / W), the
// planar layout) and the code table: no permute, no scalar unpacking.
//   scores: when the list enters a new key group, its scale folds into the query (qs = q * s_k) and
//           its minimum into a vector z = q * m_k; an entry's GB score vectors are z + qs * code
//           (16 partial sums each), reduced 16 entries at a time (reduce_lanes);
//   values: weights e = exp(s - m) over the whole list (vectorized), then each value dequantized in
//           registers (code * s_v + m_v, its own scale and minimum: one broadcast per vector when
//           G >= 16) and added with e to GB accumulators in registers.
// Ring entries: exact keys and values from their ring rows.  Prefetches run AHEAD entries ahead,
// once per new 16-slot line (words, value scales) or key group (its scales and minimums).

#if !defined(__AVX512F__) && defined(__AVX2__)
// a 16-lane vector as its two AVX2 halves (lanes 0-7, 8-15), and two halves as one vector
static inline void halves(v16i x, __m256i& lo, __m256i& hi) {
  std::memcpy(&lo, &x, 32);
  std::memcpy(&hi, (const char*)&x + 32, 32);
}
template <typename V, typename H>
static inline V join(H lo, H hi) {
  V x;
  std::memcpy(&x, &lo, 32);
  std::memcpy((char*)&x + 32, &hi, 32);
  return x;
}
#endif

// the W words of a slot, repeated over the 16 lanes when W < 16 (lane l: p[ix[l]], ix lane l the
// offset of word l % W): AVX-512 gathers the W distinct words once (4, 8 or 16 lanes) and broadcasts;
// AVX2 the same with its 4- and 8-lane gathers (a lane-by-lane loop ran the sparse 4-bit op 1.6x slower)
template <int W>
static inline v16i slot_words(const int32_t* p, v16i ix) {
#if defined(__AVX512F__)
  if constexpr (W == 4)
    return (v16i)_mm512_broadcast_i32x4(_mm_i32gather_epi32(p, _mm512_castsi512_si128((__m512i)ix), 4));
  else if constexpr (W == 8)
    return (v16i)_mm512_broadcast_i64x4(_mm256_i32gather_epi32(p, _mm512_castsi512_si256((__m512i)ix), 4));
  else
    return (v16i)_mm512_i32gather_epi32((__m512i)ix, p, 4);
#elif defined(__AVX2__)
  __m256i lo, hi;
  halves(ix, lo, hi);
  if constexpr (W == 4) {
    const __m256i w = _mm256_broadcastsi128_si256(_mm_i32gather_epi32(p, _mm256_castsi256_si128(lo), 4));
    return join<v16i>(w, w);
  } else {
    const __m256i a = _mm256_i32gather_epi32(p, lo, 4);
    return join<v16i>(a, W == 8 ? a : _mm256_i32gather_epi32(p, hi, 4));
  }
#else
  v16i x;
  for (int l = 0; l < L; ++l) x[l] = p[ix[l]];
  return x;
#endif
}

// the same from W consecutive words (the slot-major copy): one load, broadcast over the lanes when W < 16
template <int W>
static inline v16i slot_row(const int32_t* p) {
#if defined(__AVX512F__)
  if constexpr (W == 4)
    return (v16i)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p));
  else if constexpr (W == 8)
    return (v16i)_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p));
  else
    return (v16i)_mm512_loadu_si512(p);
#elif defined(__AVX2__)
  const __m256i* v = (const __m256i*)p;
  if constexpr (W == 4) {
    const __m256i w = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
    return join<v16i>(w, w);
  } else {
    const __m256i a = _mm256_loadu_si256(v);
    return join<v16i>(a, W == 8 ? a : _mm256_loadu_si256(v + 1));
  }
#else
  v16i x;
  for (int l = 0; l < L; ++l) x[l] = p[l % W];
  return x;
#endif
}

static inline v16 gather16f(const float* p, v16i ix) {
#if defined(__AVX512F__)
  return (v16)_mm512_i32gather_ps((__m512i)ix, p, 4);
#elif defined(__AVX2__)
  __m256i lo, hi;
  halves(ix, lo, hi);
  return join<v16>(_mm256_i32gather_ps(p, lo, 4), _mm256_i32gather_ps(p, hi, 4));
#else
  v16 x;
  for (int l = 0; l < L; ++l) x[l] = p[ix[l]];
  return x;
#endif
}

// lane tables of one slot's unpacking: D/16 vectors of 16 channels from NW = max(1, W/16) word vectors
template <int BITS, int D>
struct SlotLanes {
  static constexpr int W = D * BITS / 32, NW = W > L ? W / L : 1, DV = D / L;
  v16i wix[NW];                        // word vector k, lane l: offset of word (16k + l) % W
  v16i shift[DV];                      // vector c, lane l: shift of channel 16c + l
  v16i vix[DV];                        // vector c, lane l: offset of channel 16c + l's value scale
  int64_t step;                        // slot stride of the words (1: token-contiguous; W: slot-major)
  SlotLanes(const Row& r) : step(r.kp_t) {
    for (int k = 0; k < NW; ++k)
      for (int l = 0; l < L; ++l) wix[k][l] = (int)(((k * L + l) % W) * r.kp_w);
    for (int c = 0; c < DV; ++c)
      for (int l = 0; l < L; ++l) {
        shift[c][l] = BITS * ((c * L + l) / W);
        vix[c][l] = (int)((c * L + l) / r.G * r.v_c);
      }
  }
  // the D codes of slot t of words p (k_packed or v_packed), channel order, as floats
  void codes_of(const int32_t* p, int64_t t, v16* out) const {
    v16i wv[NW];
    for (int k = 0; k < NW; ++k)                 // slot-major (step > 1): the words are consecutive
      wv[k] = step > 1 ? slot_row<std::min(W, L)>(p + t * step + k * L) : slot_words<std::min(W, L)>(p + t, wix[k]);
    for (int c = 0; c < DV; ++c) out[c] = codes<BITS>(wv[c % NW], shift[c]);
  }
  // the value scale (row vs) or minimum (row vm) of slot t for the channels of vector c: one
  // broadcast when they share a value group (G >= 16), else a gather
  v16 value_param(const float* row, int64_t t, int c, int G) const {
    return G >= L ? bcast(row[vix[c][0] + t]) : gather16f(row + t, vix[c]);
  }
};

// whether entry i is read: valid, and visible
static inline bool readable(const Row& r, const int64_t* il, const bool* vl, int64_t i) {
  return (!vl || vl[i]) && (!r.vis || r.vis[il[i]]);
}

// prefetches for the entry AHEAD on: its words (slot-major: the slot's own line; token-contiguous: one
// line per word row when it starts a new line of 16 slots), and, for keys, its group's scale and
// minimum when it starts a new group; for values, its scales and minimums (one line per value group)
template <int BITS, int D, bool KEYS>
__attribute__((always_inline)) static inline void prefetch_ahead(const Row& r, const SlotLanes<BITS, D>& ln, const int64_t* il,
                                  const bool* vl, int64_t i, int64_t N) {
  const int64_t a = i + AHEAD;
  if (a >= N || (vl && !vl[a])) return;
  const int64_t t = il[a], before = il[a - 1];
  const int32_t* p = KEYS ? r.kp : r.vp;
  if (ln.step > 1) prefetch_lines(p + t * ln.step, ln.W * sizeof(int32_t));   // slot-major: the slot's own words
  if ((t >> 4) != (before >> 4)) {
    if (ln.step == 1)
      for (int w = 0; w < ln.W; ++w) __builtin_prefetch(p + ln.wix[w / L][w % L] + t);
    if (!KEYS)
      for (int c = 0; c < D / r.G; ++c) {
        __builtin_prefetch(r.vs + c * r.v_c + t);
        __builtin_prefetch(r.vm + c * r.v_c + t);
      }
  }
  if (KEYS && t / r.G != before / r.G) {
    prefetch_lines(r.ks + t / r.G * r.k_g, D * sizeof(float));
    prefetch_lines(r.km + t / r.G * r.k_g, D * sizeof(float));
  }
}

// the key group's scale and minimum folded into GB query rows: qs = q * s_k, z = q * m_k (lanes)
template <int GB, int D>
struct KeyFold {
  int64_t grp = -1;
  v16 qs[GB][D / L], z[GB];
  void enter(const float* q, const Row& r, int64_t g) {
    if (g == grp) return;
    grp = g;
    const float* ks = r.ks + g * r.k_g;
    const float* km = r.km + g * r.k_g;
    for (int b = 0; b < GB; ++b) {
      z[b] = v16{};
      for (int c = 0; c < D / L; ++c) {
        const v16 qv = load16(q + b * D + c * L);
        qs[b][c] = qv * load16(ks + c * L);
        z[b] += qv * load16(km + c * L);
      }
    }
  }
};

// scores s[b * npad + i] of the list (-inf for entries not read and in the padding up to npad) and
// each row's maximum m[b] (0 when nothing is read)
template <int BITS, int GB, int D>
static void sparse_scores(const float* q, const Row& r, const SlotLanes<BITS, D>& ln, const int64_t* il,
                          const bool* vl, int64_t N, int64_t npad, float* s, float* m) {
  constexpr int DV = D / L;
  KeyFold<GB, D> f;
  v16 mv[GB];
  for (int b = 0; b < GB; ++b) mv[b] = bcast(-INFINITY);
  for (int64_t i0 = 0; i0 < npad; i0 += L) {
    v16 part[GB][L];                                          // entry j's partial products
    v16i read = {};
    for (int j = 0; j < L; ++j) {
      const int64_t i = i0 + j;
      if (i >= N || !readable(r, il, vl, i)) {
        for (int b = 0; b < GB; ++b) part[b][j] = v16{};
        continue;
      }
      read[j] = -1;
      prefetch_ahead<BITS, D, true>(r, ln, il, vl, i, N);
      const int64_t t = il[i], p = r.pos[t];
      v16 k[DV];
      if (r.ring_k(p)) {
        for (int c = 0; c < DV; ++c) k[c] = load16(r.kr + (p % r.R) * r.r_row + c * L);
        for (int b = 0; b < GB; ++b) {
          part[b][j] = v16{};
          for (int c = 0; c < DV; ++c) part[b][j] += load16(q + b * D + c * L) * k[c];
        }
      } else {
        f.enter(q, r, t / r.G);
        ln.codes_of(r.kp, t, k);
        for (int b = 0; b < GB; ++b) {
          part[b][j] = f.z[b];
          for (int c = 0; c < DV; ++c) part[b][j] += f.qs[b][c] * k[c];
        }
      }
    }
    for (int b = 0; b < GB; ++b) {
      const v16 x = read ? reduce_lanes(part[b]) : bcast(-INFINITY);
      mv[b] = x > mv[b] ? x : mv[b];
      store16(s + b * npad + i0, x);
    }
  }
  for (int b = 0; b < GB; ++b) {
    float mb = -INFINITY;
    for (int l = 0; l < L; ++l) mb = std::max(mb, mv[b][l]);
    m[b] = std::isinf(mb) ? 0.f : mb;
  }
}

// out[b * D + d]: the weighted values of the list, weights e[b * npad + i] (0 for entries not read)
// summing to l[b]; each value dequantized in registers (code * s_v + m_v) and added to GB rows
template <int BITS, int GB, int D>
static void sparse_values(const Row& r, const SlotLanes<BITS, D>& ln, const int64_t* il, const bool* vl,
                          int64_t N, const float* e, int64_t npad, const float* l, float* out) {
  constexpr int DV = D / L;
  v16 acc[GB][DV] = {};
  for (int64_t i = 0; i < N; ++i) {
    if (!readable(r, il, vl, i)) continue;
    prefetch_ahead<BITS, D, false>(r, ln, il, vl, i, N);
    const int64_t t = il[i], p = r.pos[t];
    v16 x[DV], eb[GB];
    for (int b = 0; b < GB; ++b) eb[b] = bcast(e[b * npad + i]);
    if (r.ring_v(p)) {
      for (int c = 0; c < DV; ++c) x[c] = load16(r.vr + (p % r.R) * r.r_row + c * L);
    } else {
      ln.codes_of(r.vp, t, x);
      for (int c = 0; c < DV; ++c) x[c] = x[c] * ln.value_param(r.vs, t, c, r.G) + ln.value_param(r.vm, t, c, r.G);
    }
    for (int b = 0; b < GB; ++b)
      for (int c = 0; c < DV; ++c) acc[b][c] += eb[b] * x[c];
  }
  for (int b = 0; b < GB; ++b) {
    const float inv = l[b] > 0.f ? 1.f / l[b] : 0.f;
    for (int c = 0; c < DV; ++c) store16(out + b * D + c * L, acc[b][c] * inv);
  }
}

template <int BITS, int GB, int D>
static void sparse_rows(const float* q, const Row& r, const int64_t* il, const bool* vl, int64_t N,
                        std::vector<float>& work, float* out) {
  const int64_t npad = (N + L - 1) / L * L;
  work.resize(GB * npad);
  float* s = work.data();
  const SlotLanes<BITS, D> ln(r);
  float m[GB], l[GB];
  sparse_scores<BITS, GB, D>(q, r, ln, il, vl, N, npad, s, m);
  for (int b = 0; b < GB; ++b) {                               // s -> e = exp(s - m), in place
    v16 lv = {};
    for (int64_t i = 0; i < npad; i += L) {
      const v16 x = vexp(load16(s + b * npad + i) - m[b]);
      store16(s + b * npad + i, x);
      lv += x;
    }
    l[b] = hsum(lv);
  }
  sparse_values<BITS, GB, D>(r, ln, il, vl, N, s, npad, l, out);
}

// ------------------------------------------------------------------------------------ dispatch
template <int BITS>
static void run_block(const float* q, int gb, const Row& r, int64_t n, const int64_t* il, const bool* vl,
                      int64_t N, std::vector<float>& work, float* out, float* lse) {
  switch (gb) {
#define KVC_CASE(GB)                                                                   \
    case GB:                                                                           \
      if (il && r.D == 64) sparse_rows<BITS, GB, 64>(q, r, il, vl, N, work, out);      \
      else if (il) sparse_rows<BITS, GB, 128>(q, r, il, vl, N, work, out);             \
      else if (r.arith) dense_int<BITS, GB>(q, r, n, work, out, lse);                  \
      else if (r.D == 64) dense_rows<BITS, GB, 64>(q, r, n, work, out, lse);           \
      else dense_rows<BITS, GB, 128>(q, r, n, work, out, lse);                         \
      break;
    KVC_CASE(1) KVC_CASE(2) KVC_CASE(3) KVC_CASE(4)
#undef KVC_CASE
  }
}

// GL query rows of one list; lse (dense reads, or null): each row's log-sum-exp of its scores, for split reads
static void run_rows(const float* q, int64_t GL, int bits, const Row& r, int64_t n, const int64_t* il,
                     const bool* vl, int64_t N, std::vector<float>& work, float* out, float* lse = nullptr) {
  const int D = r.D;
  for (int64_t g = 0; g < GL; g += 4) {
    const int gb = (int)std::min<int64_t>(4, GL - g);
    float* lg = lse ? lse + g : nullptr;
    if (bits == 4) run_block<4>(q + g * D, gb, r, n, il, vl, N, work, out + g * D, lg);
    else if (bits == 2) run_block<2>(q + g * D, gb, r, n, il, vl, N, work, out + g * D, lg);
    else run_block<8>(q + g * D, gb, r, n, il, vl, N, work, out + g * D, lg);
  }
}

// Split dense reads (flash-decoding, as kvc::decode_attention): with fewer lists than make an even share
// per thread (batch 1: 3 KV heads on 2 threads), each list's slots go in chunks of whole SPAN-slot spans,
// each chunk a dense read of its own (sub_row) with its rows' log-sum-exps, merged by merge_chunks.
constexpr int64_t SPAN = 256;          // chunk alignment: whole key groups and whole value chunks (CH, CHI)

static int64_t split_chunks(int64_t lists, int64_t n, int64_t threads) {
  if (threads < 2 || lists % threads == 0) return 1;
  const int64_t most = std::max<int64_t>(1, n / SPAN);
  const int64_t c = std::min(most, (2 * threads + lists - 1) / lists);
  for (int64_t t = c; t <= most && t <= c + threads; ++t)
    if ((lists * t) % threads == 0) return t;
  return c;
}

// slots [a, ...) of r as the slots [0, ...) of a row (a % SPAN == 0: whole key groups)
static Row sub_row(const Row& r, int64_t a) {
  Row s = r;
  s.kp += a * r.kp_t; s.ks += a / r.G * r.k_g; s.km += a / r.G * r.k_g;
  s.vp += a * r.vp_t; s.vs += a * r.v_t; s.vm += a * r.v_t;
  s.pos += a;
  if (s.vis) s.vis += a;
  return s;
}

// out [D] <- the chunks' outputs src + c * stride (c < chunks) weighted by exp(lse[c * lstride] - max), normalized;
// zeros where no chunk saw a visible slot (as an unsplit read)
static void merge_chunks(int64_t chunks, const float* src, int64_t stride, const float* lse, int64_t lstride, int D,
                         float* out) {
  float m = -INFINITY, total = 0.f;
  for (int64_t c = 0; c < chunks; ++c) m = std::max(m, lse[c * lstride]);
  std::fill(out, out + D, 0.f);
  if (std::isinf(m)) return;
  for (int64_t c = 0; c < chunks; ++c) {
    const float w = std::exp(lse[c * lstride] - m);
    for (int d = 0; d < D; ++d) out[d] += w * src[c * stride + d];
    total += w;
  }
  for (int d = 0; d < D; ++d) out[d] /= total;
}

}  // namespace

// the best arithmetic this build has for kvc::kivi_attention's dense reads: 2 AVX-512 VNNI, 1 AVX2, 0 fp32 only
int64_t kivi_arith() {
  return arith_built(ARITH_VNNI) ? ARITH_VNNI : arith_built(ARITH_AVX2) ? ARITH_AVX2 : ARITH_FP32;
}

torch::Tensor kivi_attention(torch::Tensor q, torch::Tensor k_packed, torch::Tensor k_scale, torch::Tensor k_min,
                             torch::Tensor v_packed, torch::Tensor v_scale, torch::Tensor v_min,
                             torch::Tensor k_ring, torch::Tensor v_ring, torch::Tensor pos, torch::Tensor visible,
                             torch::Tensor now, torch::Tensor idx, torch::Tensor valid, int64_t n, int64_t bits,
                             int64_t group, double scale, int64_t arith) {
  const std::vector<torch::Tensor> bufs = {k_packed, k_scale, k_min, v_packed, v_scale, v_min, k_ring, v_ring};
  check_buffers(bufs, pos, now);
  TORCH_CHECK(q.dim() == 3 && q.dtype() == torch::kFloat, "kvc::kivi_attention: q must be fp32 [B, Hq, D]");
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "kvc::kivi_attention: bits 2, 4 or 8");
  q = q.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), H = k_packed.size(1), G = group, Gq = Hq / H;
  TORCH_CHECK(D == 64 || D == 128, "kvc::kivi_attention: head_dim 64 or 128");
  TORCH_CHECK(G % 8 == 0 && D % G == 0 && D / G <= 16, "kvc::kivi_attention: group must divide D, G % 8 == 0");
  const bool sparse = idx.numel() > 0;
  const bool slot_major = k_packed.stride(3) == 1 && k_packed.stride(2) == k_packed.size(3);
  TORCH_CHECK((k_packed.stride(2) == 1 || (sparse && slot_major)) && v_scale.stride(2) == 1,
              "kvc::kivi_attention: packed words must be token-contiguous (or, for sparse reads, slot-major) and "
              "value scales token-contiguous");
  TORCH_CHECK(sparse || G % L == 0, "kvc::kivi_attention: the dense path needs group % 16 == 0");
  const int64_t Hidx = sparse ? idx.size(1) : H, N = sparse ? idx.size(2) : 0;
  TORCH_CHECK(!sparse || D * bits / 32 * k_packed.stride(3) < INT32_MAX,
              "kvc::kivi_attention: sparse reads address words with int32 offsets (capacity too large)");
  TORCH_CHECK(!sparse || (idx.is_contiguous() && idx.dtype() == torch::kLong && (Hidx == H || Hidx == Hq)),
              "kvc::kivi_attention: idx must be a contiguous long [B, H or Hq, N]");
  TORCH_CHECK(arith_built(arith), "kvc::kivi_attention: arith ", arith, " (0 fp32, 1 AVX2 integer, 2 AVX-512 VNNI "
              "integer) is not built for this CPU");
  TORCH_CHECK(arith == ARITH_FP32 || (!sparse && (bits == 2 || bits == 4)),
              "kvc::kivi_attention: integer arithmetic is for dense reads of 2- or 4-bit storage");
  const bool has_valid = valid.numel() > 0, has_vis = visible.numel() > 0;
  TORCH_CHECK(!has_valid || (valid.is_contiguous() && valid.sizes() == idx.sizes()), "valid must be shaped like idx");
  TORCH_CHECK(!has_vis || (visible.dtype() == torch::kBool && visible.stride(2) == 1), "visible must be bool");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* nowp = now.data_ptr<int64_t>();
  const int64_t GL = (sparse && Hidx == Hq) ? 1 : Gq, lists = B * Hidx;
  // dense lists too few for an even share of the threads: `parts` chunks of `span` slots each (split_chunks)
  const int64_t chunks = sparse ? 1 : split_chunks(lists, n, at::get_num_threads());
  const int64_t span = chunks > 1 ? ((n + chunks - 1) / chunks + SPAN - 1) / SPAN * SPAN : n;
  const int64_t parts = chunks > 1 ? (n + span - 1) / span : 1;
  torch::Tensor part, lse;                                    // split reads: each chunk's rows and log-sum-exps
  if (parts > 1) {
    part = torch::empty({lists, parts, GL, D}, q.options());
    lse = torch::empty({lists, parts, GL}, q.options());
  }
  at::parallel_for(0, lists * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work, qscaled(GL * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t rr = i / parts, a = i % parts * span;
      const int64_t b = rr / Hidx, hi = rr % Hidx, h = Hidx == H ? hi : hi / Gq, hq = Hidx == H ? hi * Gq : hi;
      Row r = row_at(bufs, pos, b, h, nowp[b], (int)bits, (int)G);
      r.vis = has_vis ? row_of<bool>(visible, b, h) : nullptr;
      r.arith = (int)arith;
      for (int64_t j = 0; j < GL * D; ++j) qscaled[j] = qp[(b * Hq + hq) * D + j] * (float)scale;
      const int64_t* il = sparse ? idx.data_ptr<int64_t>() + rr * N : nullptr;
      const bool* vl = has_valid ? valid.data_ptr<bool>() + rr * N : nullptr;
      if (parts == 1)
        run_rows(qscaled.data(), GL, (int)bits, r, n, il, vl, N, work, op + (b * Hq + hq) * D);
      else
        run_rows(qscaled.data(), GL, (int)bits, sub_row(r, a), std::min(n - a, span), nullptr, nullptr, 0, work,
                 part.data_ptr<float>() + i * GL * D, lse.data_ptr<float>() + i * GL);
    }
  });
  for (int64_t rr = 0; parts > 1 && rr < lists; ++rr)       // split (dense): list rr = b H + h, rows rr GL + g
    for (int64_t g = 0; g < GL; ++g)
      merge_chunks(parts, part.data_ptr<float>() + (rr * parts * GL + g) * D, GL * D,
                   lse.data_ptr<float>() + rr * parts * GL + g, GL, (int)D, op + (rr * GL + g) * D);
  return out;
}

// ------------------------------------------------------------------------------------ slot write
//   kvc::kivi_write(k_packed!, k_scale!, k_min!, v_packed!, v_scale!, v_min!, k_ring!, v_ring!,
//                   slot [B, H] long, k, v [B, H, D] fp32, pos [B, 1 or H, S] long, now [B] long,
//                   where [B, H] bool (or empty), bits, group)
//   SlotStore.write's twin (cache/quantized.py), bit for bit: the token goes into its slot; the slot's
//   key group is re-coded from its members' best values (the new key, ring rows for members among the
//   newest R, dequantized codes for the others; min/max over the members holding a token); the value
//   is quantized alone; a slot among the newest R also writes its ring rows.  Rows where `where` is
//   False change nothing.  The arithmetic is the torch ops' (fp32, no fused multiply-add).
namespace {

struct Quant { float scale, minimum; };

__attribute__((optimize("fp-contract=off")))
static Quant scale_min(float lo, float hi, int bits) {
  const float levels = (float)((1 << bits) - 1), span = hi - lo;
  float scale = span / levels;
  const float back = scale * levels;
  if (back < span) scale = std::nextafter(scale, INFINITY);   // rounded down: one step up
  return {scale, lo};
}

// scale_min's scales of 16 channels (span = hi - lo >= 0), bit for bit: a scale rounded down is one ulp up
__attribute__((optimize("fp-contract=off")))
static inline v16 scale16(v16 lo, v16 hi, int bits) {
  const v16 levels = bcast((float)((1 << bits) - 1)), span = hi - lo, scale = span / levels;
  return (v16)((v16i)scale - (v16i)(scale * levels < span));     // -1 where true: the next float up
}

__attribute__((optimize("fp-contract=off")))
static float dequant(uint32_t code, float scale, float minimum) {
  const float t = (float)code * scale;
  return t + minimum;
}

// the D channels of x coded, code = clamp(nearbyint((x - mn) / safe), 0, 2^bits - 1) with per-channel
// minimums mn and scales safe (> 0), 16 channels a vector (each lane the torch ops' fp32 arithmetic, no
// fused multiply-add), and packed: word w holds the codes of channels j W + w (BITS a template parameter:
// the packing loops vectorize)
template <int BITS>
__attribute__((optimize("fp-contract=off")))
static void code_words(const float* x, const float* mn, const float* safe, int D, uint32_t* __restrict words) {
  constexpr int P = 32 / BITS;
  const int W = D * BITS / 32;
  const v16 top = bcast((float)((1u << BITS) - 1)), zero = {}, magic = bcast(12582912.f);  // 1.5 * 2^23:
  int32_t c[128];                                             // (v + magic) - magic rounds half to even
  for (int d = 0; d < D; d += L) {
    const v16 v = (load16(x + d) - load16(mn + d)) / load16(safe + d);
    v16 q = (v + magic) - magic;
    q = q < zero ? zero : q;                                  // std::max(q, 0)
    q = top < q ? top : q;                                    // std::min(q, top)
    const v16i qi = __builtin_convertvector(q, v16i);
    std::memcpy(c + d, &qi, sizeof qi);
  }
  for (int j = 0; j < P; ++j)
    for (int w = 0; w < W; ++w) words[w] |= (uint32_t)c[j * W + w] << (BITS * j);
}

__attribute__((optimize("fp-contract=off")))
static void code_words(const float* x, const float* mn, const float* safe, int bits, int D, uint32_t* words) {
  if (bits == 2) code_words<2>(x, mn, safe, D, words);
  else if (bits == 4) code_words<4>(x, mn, safe, D, words);
  else code_words<8>(x, mn, safe, D, words);
}

// the members of key group [g0, g0 + G) at their best: rows[i] points at member i's D floats (new keys for
// the slots [a, b) at kn + (t - a) * D, ring rows for members among the newest R, the others' codes
// dequantized into x + i * D); returns the mask of the members that count: those holding a token, and
// with force the new ones (the others are don't-care rows, coded 0: never read, so not even fetched)
__attribute__((optimize("fp-contract=off")))
static uint64_t gather_group(const Row& r, int64_t g0, int64_t S, int64_t a, int64_t b, const float* kn, bool force,
                             float* x, const float** rows) {
  const int bits = r.bits, G = r.G, D = r.D, W = D * bits / 32, P = 32 / bits;
  const uint32_t lvl = (1u << bits) - 1;
  const int64_t g = g0 / G;
  uint64_t counted = 0;
  for (int i = 0; i < G; ++i) {
    const int64_t t = g0 + i, p = t < S ? r.pos[t] : -1;
    const bool is_new = t >= a && t < b;
    if (p < 0 && !(force && is_new)) continue;                // a don't-care member: coded 0
    counted |= uint64_t(1) << i;
    if (is_new) {
      rows[i] = kn + (t - a) * D;
    } else if (r.ring_v(p)) {
      rows[i] = r.kr + (p % r.R) * r.r_row;
    } else {
      float* xr = x + i * D;
      rows[i] = xr;
      for (int w = 0; w < W; ++w) {
        const uint32_t word = (uint32_t)r.kp[t * r.kp_t + w * r.kp_w];
        for (int j = 0; j < P; ++j)
          xr[j * W + w] = dequant((word >> (bits * j)) & lvl, r.ks[g * r.k_g + j * W + w], r.km[g * r.k_g + j * W + w]);
      }
    }
  }
  return counted;
}

// re-code the key group of slots [g0, g0 + G) from its members at their best (gather_group); min/max
// per channel over the counted members.  16 channels per vector (D % 16 == 0, G <= 64: the only
// shapes check_write admits), each lane the scalar torch arithmetic (no fused multiply-add)
__attribute__((optimize("fp-contract=off")))
static void requant_group(const Row& r, int64_t g0, int64_t S, int64_t a, int64_t b, const float* kn, bool force) {
  const int bits = r.bits, G = r.G, D = r.D, W = D * bits / 32;
  const int64_t g = g0 / G;
  static thread_local std::vector<float> xbuf;
  xbuf.resize((size_t)G * D);
  float* x = xbuf.data();
  const float* rows[64];
  const uint64_t counted = gather_group(r, g0, S, a, b, kn, force, x, rows);
  float mn[128], safe[128];
  for (int c = 0; c < D; c += L) {                            // min/max over the counted members
    v16 lo = bcast(INFINITY), hi = bcast(-INFINITY);
    for (int i = 0; i < G; ++i)
      if (counted >> i & 1) {
        const v16 xi = load16(rows[i] + c);
        lo = xi < lo ? xi : lo;                               // std::min(lo, xi)
        hi = hi < xi ? xi : hi;                               // std::max(hi, xi)
      }
    const v16 zero = {}, scale = counted ? scale16(lo, hi, bits) : zero, minimum = counted ? lo : zero;
    store16(r.ks + g * r.k_g + c, scale);
    store16(r.km + g * r.k_g + c, minimum);
    store16(mn + c, minimum);
    store16(safe + c, scale > zero ? scale : zero + 1.f);
  }
  for (int i = 0; i < G; ++i) {
    uint32_t words[32] = {};
    if (counted >> i & 1) code_words(rows[i], mn, safe, bits, D, words);
    for (int w = 0; w < W; ++w) r.kp[(g0 + i) * r.kp_t + w * r.kp_w] = (int32_t)words[w];
    if (r.kc) std::memcpy(r.kc + (g0 + i) * W, words, W * sizeof(int32_t));
  }
}

// the value v (D floats) of slot t, quantized alone (per token over groups of G channels), and the
// slot's ring rows when its position is among the newest R
static void write_value(const Row& r, int64_t t, int64_t S, const float* k, const float* v) {
  const int bits = r.bits, G = r.G, D = r.D, W = D * bits / 32;
  float mn[128], safe[128];
  for (int c = 0; c < D / G; ++c) {
    float lo = INFINITY, hi = -INFINITY;
    for (int d = c * G; d < (c + 1) * G; ++d) { lo = std::min(lo, v[d]); hi = std::max(hi, v[d]); }
    const Quant q = scale_min(lo, hi, bits);
    r.vs[t * r.v_t + c * r.v_c] = q.scale;
    r.vm[t * r.v_t + c * r.v_c] = q.minimum;
    std::fill(mn + c * G, mn + (c + 1) * G, q.minimum);
    std::fill(safe + c * G, safe + (c + 1) * G, q.scale > 0.f ? q.scale : 1.f);
  }
  uint32_t words[32] = {};
  code_words(v, mn, safe, bits, D, words);
  for (int w = 0; w < W; ++w) {
    r.vp[t * r.vp_t + w * r.vp_w] = (int32_t)words[w];
    if (r.vc) r.vc[t * W + w] = (int32_t)words[w];
  }
  const int64_t p = t < S ? r.pos[t] : -1;
  if (r.ring_v(p))
    for (int d = 0; d < D; ++d) {
      r.kr[(p % r.R) * r.r_row + d] = k[d];
      r.vr[(p % r.R) * r.r_row + d] = v[d];
    }
}

}  // namespace

// checks shared by the two write ops; k, v [B, H, T, D] (or [B, H, D])
static void check_write(const std::vector<torch::Tensor>& bufs, const torch::Tensor& pos, const torch::Tensor& now,
                        const torch::Tensor& k, const torch::Tensor& v, int64_t bits, int64_t group) {
  check_buffers(bufs, pos, now);
  TORCH_CHECK(k.dtype() == torch::kFloat && v.dtype() == torch::kFloat && k.is_contiguous() && v.is_contiguous() &&
              k.sizes() == v.sizes() && (bits == 2 || bits == 4 || bits == 8) && k.size(-1) % group == 0 &&
              k.size(-1) / group <= 16 && k.size(-1) % 16 == 0 && k.size(-1) <= 128 && group <= 64,
              "kvc::kivi_write: unexpected inputs");
}

void kivi_write(torch::Tensor k_packed, torch::Tensor k_scale, torch::Tensor k_min, torch::Tensor v_packed,
                torch::Tensor v_scale, torch::Tensor v_min, torch::Tensor k_ring, torch::Tensor v_ring,
                torch::Tensor slot, torch::Tensor k, torch::Tensor v, torch::Tensor pos, torch::Tensor now,
                torch::Tensor where, int64_t bits, int64_t group, torch::Tensor k_copy, torch::Tensor v_copy) {
  const std::vector<torch::Tensor> bufs = {k_packed, k_scale, k_min, v_packed, v_scale, v_min, k_ring, v_ring};
  check_write(bufs, pos, now, k, v, bits, group);
  TORCH_CHECK(k.dim() == 3 && slot.is_contiguous() && slot.dtype() == torch::kLong, "kvc::kivi_write: slot [B, H] long");
  const bool copies = k_copy.numel() > 0;
  TORCH_CHECK(!copies || (k_copy.is_contiguous() && v_copy.is_contiguous() && k_copy.sizes() == k_packed.sizes()
                          && v_copy.sizes() == v_packed.sizes() && k_copy.dtype() == torch::kInt),
              "kvc::kivi_write: slot-major copies must be contiguous int32 like the words (or empty)");
  const int64_t B = k.size(0), H = k.size(1), D = k.size(2), S = pos.size(2);
  const bool has_where = where.numel() > 0;
  TORCH_CHECK(!has_where || (where.is_contiguous() && where.dtype() == torch::kBool), "where must be bool [B, H]");
  const int64_t* sp = slot.data_ptr<int64_t>();
  const int64_t* nowp = now.data_ptr<int64_t>();
  at::parallel_for(0, B * H, 8, [&](int64_t begin, int64_t end) {
    for (int64_t rr = begin; rr < end; ++rr) {
      if (has_where && !where.data_ptr<bool>()[rr]) continue;
      Row r = row_at(bufs, pos, rr / H, rr % H, nowp[rr / H], (int)bits, (int)group);
      if (copies) {
        r.kc = row_of<int32_t>(k_copy, rr / H, rr % H);
        r.vc = row_of<int32_t>(v_copy, rr / H, rr % H);
      }
      const float* kr = k.data_ptr<float>() + rr * D;
      requant_group(r, sp[rr] / group * group, S, sp[rr], sp[rr] + 1, kr, true);
      write_value(r, sp[rr], S, kr, v.data_ptr<float>() + rr * D);
    }
  });
}

//   kvc::kivi_write_range(buffers!, start, k, v [B, H, T, D], pos, now, bits, group): SlotStore.write_range's
//   twin, bit for bit: T tokens into slots [start, start + T), the key groups they touch re-coded once
void kivi_write_range(torch::Tensor k_packed, torch::Tensor k_scale, torch::Tensor k_min, torch::Tensor v_packed,
                      torch::Tensor v_scale, torch::Tensor v_min, torch::Tensor k_ring, torch::Tensor v_ring,
                      int64_t start, torch::Tensor k, torch::Tensor v, torch::Tensor pos, torch::Tensor now,
                      int64_t bits, int64_t group) {
  const std::vector<torch::Tensor> bufs = {k_packed, k_scale, k_min, v_packed, v_scale, v_min, k_ring, v_ring};
  check_write(bufs, pos, now, k, v, bits, group);
  TORCH_CHECK(k.dim() == 4, "kvc::kivi_write_range: k, v [B, H, T, D]");
  const int64_t B = k.size(0), H = k.size(1), T = k.size(2), D = k.size(3), S = pos.size(2), end = start + T;
  const int64_t* nowp = now.data_ptr<int64_t>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t rr = begin; rr < stop; ++rr) {
      const Row r = row_at(bufs, pos, rr / H, rr % H, nowp[rr / H], (int)bits, (int)group);
      const float* kr = k.data_ptr<float>() + rr * T * D;
      const float* vr = v.data_ptr<float>() + rr * T * D;
      for (int64_t g0 = start / group * group; g0 < end; g0 += group) requant_group(r, g0, S, start, end, kr, false);
      for (int64_t t = start; t < end; ++t) write_value(r, t, S, kr + (t - start) * D, vr + (t - start) * D);
    }
  });
}

TORCH_LIBRARY_FRAGMENT(kvc, m) {
  m.def("kivi_attention(Tensor q, Tensor k_packed, Tensor k_scale, Tensor k_min, Tensor v_packed, Tensor v_scale, "
        "Tensor v_min, Tensor k_ring, Tensor v_ring, Tensor pos, Tensor visible, Tensor now, Tensor idx, "
        "Tensor valid, SymInt n, int bits, int group, float scale, int arith=0) -> Tensor");
  m.def("kivi_write(Tensor(a!) k_packed, Tensor(b!) k_scale, Tensor(c!) k_min, Tensor(d!) v_packed, "
        "Tensor(e!) v_scale, Tensor(f!) v_min, Tensor(g!) k_ring, Tensor(h!) v_ring, Tensor slot, Tensor k, "
        "Tensor v, Tensor pos, Tensor now, Tensor where, int bits, int group, Tensor(i!) k_copy, Tensor(j!) v_copy) -> ()");
  m.def("kivi_write_range(Tensor(a!) k_packed, Tensor(b!) k_scale, Tensor(c!) k_min, Tensor(d!) v_packed, "
        "Tensor(e!) v_scale, Tensor(f!) v_min, Tensor(g!) k_ring, Tensor(h!) v_ring, SymInt start, Tensor k, "
        "Tensor v, Tensor pos, Tensor now, int bits, int group) -> ()");
}

TORCH_LIBRARY_IMPL(kvc, CPU, m) {
  m.impl("kivi_attention", &kivi_attention);
  m.impl("kivi_write", &kivi_write);
  m.impl("kivi_write_range", &kivi_write_range);
}
