// CPU kernels of the sparse readers, the dense caches' decode step and RMSNorm (the CPU counterpart
// of the Triton kernels; built on first use by kernels/cpu.py with torch.utils.cpp_extension,
// -O3 -march=native).  Ops, fp32:
//
//   kvc::sparse_attention(q [B, Hq, D], k, v [B, Hkv, S, D] (rows contiguous), idx [B, Hidx, N] long,
//                         valid [B, Hidx, N] bool (or an empty tensor: all valid), scale) -> [B, Hq, D]
//       exact attention of each decode query over its index list, reading the selected K/V rows in
//       place (no gathered copy): per list, scores q.k for the G query heads sharing it (Hidx = Hkv)
//       or for the one head owning it (Hidx = Hq), softmax, weighted sum of V rows.  D % 16 == 0.
//   kvc::decode_attention(q [B, Hq, D], k, v [B, Hkv, S, D] (rows contiguous, fp32 or bf16), visible
//                         [B, 1 or Hkv, >= S] bool (or empty: all visible), scale, lanes = 0) -> [B, Hq, D]
//       dense decode attention over every slot [0, S) (masked ones skipped), split into chunks of the
//       slots so that all threads work when B * Hkv is small; the chunks merge by log-sum-exp.  Scores
//       of 8 or 16 slots reduced together (attend_dense); lanes: the vector width, 16 (AVX-512) or 8
//       (AVX2), 0: the build's ISA's (forced by tests and KVC_ATTN_LANES, see kernels/cpu.py)
//   kvc::dense_attention(q, k, v, n, scale, lanes = 0): the same over rows 0..n-1, all visible
//   kvc::prefix_attention(q, k, v, visible, pk, pv [1, Hkv, P, D], own_from [B] long, scale, lanes = 0)
//       decode_attention with a prefix shared by rows: row b reads its slots [own_from[b], S) and, where
//       own_from[b] > 0, the P prefix rows (read once for all such rows: their query heads together)
//   The eager step's small ops below take fp32 or bf16 activations (computing in fp32, rounding where the torch
//   twins round); the dense decode attention's q is fp32, its K/V fp32 or bf16.
//   kvc::rms_norm(x [..., D], weight [D], eps) -> x * rsqrt(mean(x^2) + eps) * weight (one op for the eager step)
//   kvc::rope_split(qkv [B, T, (Hq + 2 Hkv) D], cos, sin [B, T, D] (or [B, 1, T, D]), Hq, Hkv) -> q [B, Hq, T, D], k, v [B, Hkv, T, D]
//       the fused projection's heads split out, q and k rotated (model.apply_rope), all contiguous
//   kvc::silu_mul(gu [..., 2 F]) -> silu(gu[..., :F]) * gu[..., F:] (SwiGLU's gate times up)
//   kvc::dense_decode(qkv [B, 1, (Hq + 2 Hkv) D], cos, sin [B, 1, D], k_cache, v_cache [B, Hkv, C, D], visible,
//                     start, Hq, Hkv, scale, lanes = 0) -> [B, 1, Hq D]
//       a decode step's attention over a dense cache in one op: rope_split, k and v stored into slot
//       `start`, decode_attention over slots [0, start] (visible [B, R, >= start + 1] bool, row 0, or empty)
//   kvc::add_rms_norm(x, y [..., D], weight [D], eps) -> (x + y, rms_norm(x + y)) (a residual add and a norm)
//   kvc::select_top(scores [B, h, S], bias [B, 1 or h, S + n], n) -> (idx, valid) [B, h, n]
//       the n largest of scores + bias per row (torch.topk's set; ties go to the lower slot), in
//       ascending slot order; where fewer than n entries exceed -inf, the rest are marked invalid
//       (idx = S + j, never to be read).  Exact: a 3-pass radix select on the floats' order-preserving
//       integer keys (the first pass fused with computing them, the other two over the first pass's bin
//       only), then one pass collecting the slots (collect_slots: with AVX-512, 16 keys a step and the
//       taken slots compressed, 1.40x faster than a branch per key at B8 x 9 lists of 4096 -> 512).
//
// Both parallelise over the B * heads lists with at::parallel_for (torch's thread pool).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

constexpr int64_t PREFETCH = 8;      // rows ahead: the selected rows are random DRAM reads

// 16 channels of a K/V row as fp32: fp32 rows as they are, bf16 rows (uint16_t) widened in registers
static inline v16 load_row(const float* p, int c) { v16 x; std::memcpy(&x, p + 16 * c, sizeof x); return x; }
static inline v16 load_row(const uint16_t* p, int c) {
  typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
  typedef uint32_t v16u __attribute__((vector_size(64)));
  v16h h;
  std::memcpy(&h, p + 16 * c, sizeof h);
  return (v16)(__builtin_convertvector(h, v16u) << 16);
}

// GB query rows (qr, consecutive, D = 16 * DV floats each) over the rows il[0..N) of kb / vb (il null:
// rows 0..N-1): each K and V row is loaded once for the GB rows (their q and accumulators stay in
// registers).  T: the cache's element type, float or bf16 (uint16_t)
template <int DV, int GB, typename T>
static void attend_rows(const float* __restrict qr, const T* kb, int64_t k_row, const T* vb,
                        int64_t v_row, const int64_t* il, const bool* vl, int64_t N, float scale,
                        float* __restrict s, float* __restrict out, float* lse = nullptr) {
  constexpr int D = DV * 16;
  v16 q[GB][DV];
#pragma GCC unroll 16
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 16
    for (int c = 0; c < DV; ++c) std::memcpy(&q[g][c], qr + g * D + c * 16, sizeof(v16));
  float m[GB];
#pragma GCC unroll 16
  for (int g = 0; g < GB; ++g) m[g] = -INFINITY;
  for (int64_t n = 0; n < N; ++n) {                              // scores s[g * N + n]
    if (vl && !vl[n]) {
#pragma GCC unroll 16
      for (int g = 0; g < GB; ++g) s[g * N + n] = -INFINITY;
      continue;
    }
    if (il && n + PREFETCH < N) {
      const char* kf = (const char*)(kb + il[n + PREFETCH] * k_row);
      const char* vf = (const char*)(vb + il[n + PREFETCH] * v_row);
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c) { __builtin_prefetch(kf + 64 * c); __builtin_prefetch(vf + 64 * c); }
    }
    const T* kr = kb + (il ? il[n] : n) * k_row;
    v16 k[DV];
#pragma GCC unroll 16
    for (int c = 0; c < DV; ++c) k[c] = load_row(kr, c);
#pragma GCC unroll 16
    for (int g = 0; g < GB; ++g) {
      v16 a = q[g][0] * k[0];
#pragma GCC unroll 16
      for (int c = 1; c < DV; ++c) a += q[g][c] * k[c];
      const float d = hsum(a) * scale;
      s[g * N + n] = d;
      m[g] = d > m[g] ? d : m[g];
    }
  }
  float inv[GB];
#pragma GCC unroll 16
  for (int g = 0; g < GB; ++g) {                                 // softmax numerators, in place
    float* sg = s + g * N;
    const float mg = std::isinf(m[g]) ? 0.f : m[g];             // no valid entry: output 0
    v16 lv = {};
    int64_t n = 0;
    for (; n + 16 <= N; n += 16) {
      v16 x;
      std::memcpy(&x, sg + n, sizeof x);
      x = vexp(x - mg);
      std::memcpy(sg + n, &x, sizeof x);
      lv += x;
    }
    float l = hsum(lv);
    for (; n < N; ++n) { sg[n] = std::exp(sg[n] - mg); l += sg[n]; }
    inv[g] = l > 0.f ? 1.f / l : 0.f;
    if (lse) lse[g] = l > 0.f ? mg + std::log(l) : -INFINITY;   // for merging partials
  }
  v16 acc[GB][DV] = {};
  for (int64_t n = 0; n < N; ++n) {
    if (vl && !vl[n]) continue;
    const T* vr = vb + (il ? il[n] : n) * v_row;
    v16 v[DV];
#pragma GCC unroll 16
    for (int c = 0; c < DV; ++c) v[c] = load_row(vr, c);
#pragma GCC unroll 16
    for (int g = 0; g < GB; ++g) {
      const float p = s[g * N + n];
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c) acc[g][c] += p * v[c];
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 16
    for (int c = 0; c < DV; ++c) {
      const v16 o = acc[g][c] * inv[g];
      std::memcpy(out + g * D + c * 16, &o, sizeof o);
    }
}

// one index list read by GL query rows, in register blocks of up to 4 (D 64) or 2 (D 128) rows
template <int DV, typename T>
static void attend_list(const float* qr, int64_t GL, const T* kb, int64_t k_row, const T* vb,
                        int64_t v_row, const int64_t* il, const bool* vl, int64_t N, float scale, float* s,
                        float* out, float* lse = nullptr) {
  constexpr int D = DV * 16, MAX_GB = DV == 4 ? 4 : 2;
  for (int64_t g = 0; g < GL;) {
    const int64_t gb = std::min<int64_t>(MAX_GB, GL - g);
    const float* q = qr + g * D;
    float* o = out + g * D;
    float* l = lse ? lse + g : nullptr;
    if (gb >= 4) attend_rows<DV, MAX_GB>(q, kb, k_row, vb, v_row, il, vl, N, scale, s, o, l);
    else if (gb == 3) attend_rows<DV, 3>(q, kb, k_row, vb, v_row, il, vl, N, scale, s, o, l);
    else if (gb == 2) attend_rows<DV, 2>(q, kb, k_row, vb, v_row, il, vl, N, scale, s, o, l);
    else attend_rows<DV, 1>(q, kb, k_row, vb, v_row, il, vl, N, scale, s, o, l);
    g += gb;
  }
}

// every (batch row, list) of q [B, Hq, D] over k, v [B, Hkv, S, D] (element type T): lists idx
// [B, Hidx, N] (Hidx = Hkv: shared by a KV head's query rows; Hq: one per query row), or idx null:
// rows 0..N-1 of each KV head
template <typename T>
static torch::Tensor attend_lists(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const int64_t* ip, const bool* vap, int64_t Hidx, int64_t N, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.dtype() == torch::kFloat, "q must be a contiguous fp32 [B, Hq, D]");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k/v rows must be contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1), G = Hq / Hkv;
  TORCH_CHECK(D == 64 || D == 128, "kvc attention kernels: head_dim 64 or 128");
  const int64_t GL = Hidx == Hkv ? G : 1;                        // query rows per list
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const T* kp = (const T*)k.data_ptr();
  const T* vp = (const T*)v.data_ptr();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  at::parallel_for(0, B * Hidx, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(4 * N);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / Hidx, h = r % Hidx;
      const int64_t hk = Hidx == Hkv ? h : h / G, hq = Hidx == Hkv ? h * G : h;
      const T* kb = kp + b * ks0 + hk * ks1;
      const T* vb = vp + b * vs0 + hk * vs1;
      const float* qr = qp + (b * Hq + hq) * D;
      float* o = op + (b * Hq + hq) * D;
      const int64_t* il = ip ? ip + r * N : nullptr;
      const bool* vl = vap ? vap + r * N : nullptr;
      if (D == 64) attend_list<4>(qr, GL, kb, ks2, vb, vs2, il, vl, N, (float)scale, s.data(), o);
      else attend_list<8>(qr, GL, kb, ks2, vb, vs2, il, vl, N, (float)scale, s.data(), o);
    }
  });
  return out;
}

torch::Tensor sparse_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor idx,
                               torch::Tensor valid, double scale) {
  TORCH_CHECK(k.dtype() == torch::kFloat && v.dtype() == torch::kFloat, "kvc::sparse_attention: fp32 only");
  TORCH_CHECK(idx.dim() == 3 && idx.is_contiguous() && idx.dtype() == torch::kLong, "idx must be a contiguous long [B, H, N]");
  const bool has_valid = valid.numel() > 0;
  TORCH_CHECK(!has_valid || (valid.is_contiguous() && valid.sizes() == idx.sizes()), "valid must be shaped like idx");
  return attend_lists<float>(q, k, v, idx.data_ptr<int64_t>(), has_valid ? valid.data_ptr<bool>() : nullptr,
                             idx.size(1), idx.size(2), scale);
}

// ------------------------------------------------------------------------------------- dense decode attention
// G query rows (q [G, D], consecutive) over rows 0..N-1 of kb / vb (row strides k_row, v_row; T float or
// bf16), vis[n] false hiding row n (vis may be null), in vectors V of W = 8 (AVX2) or 16 (AVX-512) lanes:
//   scores: for every block of W rows and query row, the W rows' products with q (D / W lanes each) are
//           reduced together (reduce_lanes: W - 1 blend-and-add rounds instead of a horizontal add per
//           row), one vector of W scores; K is read once for all G rows (the block stays in L1)
//   softmax: exp(s - max) in place over the G x N scores (vectorized)
//   values: per block of PV_ROWS rows, register blocks of GB query rows x CB vectors of D accumulate the
//           weighted rows (V read once, the block re-read from L1 per register block)
// s: G * round_up(N, W) floats, acc: G * D floats (the caller's per-thread buffers), out [G, D], lse [G]
// (null: not wanted) the log-sum-exp of each row's scores for merging partials (-inf: nothing visible).
constexpr int64_t PV_ROWS = 32;

template <typename V, int D, typename T>
static void dense_scores(const float* qs, int64_t G, const T* kb, int64_t k_row, const bool* vis, int64_t N,
                         float* s, int64_t NP, float* m) {
  constexpr int W = Lanes<V>::W, C = D / W;
  for (int64_t g = 0; g < G; ++g) m[g] = -INFINITY;
  for (int64_t n0 = 0; n0 < N; n0 += W) {
    const int64_t rows = std::min<int64_t>(W, N - n0);
    for (int64_t g = 0; g < G; ++g) {
      V q[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) q[c] = load_vec<V>(qs + g * D + c * W);
      V x[W];
#pragma GCC unroll 16
      for (int j = 0; j < W; ++j) {
        if (j >= rows) { x[j] = V{}; continue; }
        const T* kr = kb + (n0 + j) * k_row;
        V a = q[0] * load_vec<V>(kr);
#pragma GCC unroll 8
        for (int c = 1; c < C; ++c) a += q[c] * load_vec<V>(kr + c * W);
        x[j] = a;
      }
      V sc = reduce_lanes(x);
      if (vis || rows < W)
        for (int j = 0; j < W; ++j)
          if (j >= rows || (vis && !vis[n0 + j])) sc[j] = -INFINITY;
      __builtin_memcpy(s + g * NP + n0, &sc, sizeof sc);
      m[g] = std::max(m[g], hmax(sc));
    }
  }
}

// s[g * NP + n] <- exp(s - m[g]) in place; returns through l[g] their sums
template <typename V>
static void dense_softmax(int64_t G, float* s, int64_t NP, const float* m, float* l) {
  constexpr int W = Lanes<V>::W;
  for (int64_t g = 0; g < G; ++g) {
    const float mg = std::isinf(m[g]) ? 0.f : m[g];             // nothing visible: all weights 0
    V sum = {};
    for (int64_t n = 0; n < NP; n += W) {
      V x = vexp(load_vec<V>(s + g * NP + n) - mg);
      __builtin_memcpy(s + g * NP + n, &x, sizeof x);
      sum += x;
    }
    l[g] = hsum(sum);
  }
}

// acc[g * D + d] += sum over rows n of [n0, n0 + rows) of e[g * NP + n] v[n][d], rows g0..g0+GB-1
template <typename V, int D, int GB, int CB, typename T>
static inline void dense_values_block(const float* e, int64_t NP, const T* vb, int64_t v_row, const bool* vis,
                                      int64_t n0, int64_t rows, int64_t g0, float* acc) {
  constexpr int W = Lanes<V>::W;
#pragma GCC unroll 2
  for (int cb = 0; cb < D / W; cb += CB) {
    V a[GB][CB];
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < CB; ++c) a[g][c] = load_vec<V>(acc + (g0 + g) * D + (cb + c) * W);
    for (int64_t n = n0; n < n0 + rows; ++n) {
      if (vis && !vis[n]) continue;                             // hidden rows may hold anything
      const T* vr = vb + n * v_row + cb * W;
#pragma GCC unroll 4
      for (int c = 0; c < CB; ++c) {
        const V v = load_vec<V>(vr + c * W);
#pragma GCC unroll 4
        for (int g = 0; g < GB; ++g) a[g][c] += e[(g0 + g) * NP + n] * v;
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < CB; ++c) __builtin_memcpy(acc + (g0 + g) * D + (cb + c) * W, &a[g][c], sizeof(V));
  }
}

template <typename V, int D, typename T>
static void dense_values(const float* e, int64_t G, int64_t NP, const T* vb, int64_t v_row, const bool* vis,
                         int64_t N, float* acc) {
  constexpr int W = Lanes<V>::W, GB = W == 16 ? 4 : 2, CB = D / W < 4 ? D / W : 4;   // AVX2: 16 registers
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t n0 = 0; n0 < N; n0 += PV_ROWS) {
    const int64_t rows = std::min<int64_t>(PV_ROWS, N - n0);
    for (int64_t g = 0; g < G;) {
      const int64_t gb = std::min<int64_t>(GB, G - g);
      if (gb == 4) dense_values_block<V, D, 4, CB>(e, NP, vb, v_row, vis, n0, rows, g, acc);
      else if (gb == 3) dense_values_block<V, D, 3, CB>(e, NP, vb, v_row, vis, n0, rows, g, acc);
      else if (gb == 2) dense_values_block<V, D, 2, CB>(e, NP, vb, v_row, vis, n0, rows, g, acc);
      else dense_values_block<V, D, 1, CB>(e, NP, vb, v_row, vis, n0, rows, g, acc);
      g += gb;
    }
  }
}

// query rows from which bf16 K/V rows are widened into fp32 copies once (attend_dense): a shared prefix read for
// many rows at once (prefix_attention: G = rows x the GQA group) would otherwise widen every K and V row G and
// G / GB times.  The widening is exact, so the result is the same either way.
constexpr int64_t WIDEN_ROWS = 8;

template <typename V, int D, typename T>
static void attend_dense(const float* q, int64_t G, const T* kb, int64_t k_row, const T* vb, int64_t v_row,
                         const bool* vis, int64_t N, float scale, float* work, float* out, float* lse) {
  constexpr int W = Lanes<V>::W;
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (G >= WIDEN_ROWS) {                                      // work: [N, D] K, [N, D] V, then the fp32 path's
      float *kf = work, *vf = work + N * D;
      for (int64_t n = 0; n < N; ++n)
        for (int d = 0; d < D; d += W) {
          store_vec<V>(kf + n * D + d, load_vec<V>(kb + n * k_row + d));
          store_vec<V>(vf + n * D + d, load_vec<V>(vb + n * v_row + d));
        }
      return attend_dense<V, D, float>(q, G, kf, D, vf, D, vis, N, scale, work + 2 * N * D, out, lse);
    }
  }
  const int64_t NP = (N + W - 1) / W * W;
  float* qs = work;                                             // [G, D] the scaled queries
  float* m = qs + G * D;                                        // [G] the largest scores
  float* l = m + G;                                             // [G] the weights' sums
  float* acc = l + G;                                           // [G, D]
  float* s = acc + G * D;                                       // [G, NP]
  for (int64_t i = 0; i < G * D; ++i) qs[i] = q[i] * scale;
  dense_scores<V, D>(qs, G, kb, k_row, vis, N, s, NP, m);
  dense_softmax<V>(G, s, NP, m, l);
  dense_values<V, D>(s, G, NP, vb, v_row, vis, N, acc);
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv;
    if (lse) lse[g] = l[g] > 0.f ? m[g] + std::log(l[g]) : -INFINITY;
  }
}

// floats attend_dense's `work` needs
static int64_t dense_work(int64_t G, int64_t D, int64_t N) {
  return 2 * G * D + 2 * G + G * ((N + 15) / 16 * 16) + (G >= WIDEN_ROWS ? 2 * N * D : 0);   // (+ widened K/V)
}

// the vector width of kvc::decode_attention / dense_attention: `lanes` 8 or 16, or 0: the build's ISA's
// (16 where it has AVX-512, else 8 (AVX2): 16-lane vectors there take two registers and spill)
static int dense_lanes(int64_t lanes) {
  TORCH_CHECK(lanes == 0 || lanes == 8 || lanes == 16, "kvc dense attention: lanes must be 0 (the ISA's), 8 or 16");
#if defined(__AVX512F__)
  return lanes ? (int)lanes : 16;
#else
  return lanes ? (int)lanes : 8;
#endif
}

template <typename T>
static void attend_dense_any(int lanes, const float* q, int64_t G, int64_t D, const T* kb, int64_t k_row, const T* vb,
                             int64_t v_row, const bool* vis, int64_t N, float scale, float* work, float* out,
                             float* lse) {
  if (lanes == 16 && D == 64) attend_dense<v16, 64>(q, G, kb, k_row, vb, v_row, vis, N, scale, work, out, lse);
  else if (lanes == 16) attend_dense<v16, 128>(q, G, kb, k_row, vb, v_row, vis, N, scale, work, out, lse);
  else if (D == 64) attend_dense<v8, 64>(q, G, kb, k_row, vb, v_row, vis, N, scale, work, out, lse);
  else attend_dense<v8, 128>(q, G, kb, k_row, vb, v_row, vis, N, scale, work, out, lse);
}

// slot chunks per (batch row, KV head) list: enough tasks for every thread (~4 each, a multiple of the
// threads so that each gets as many), none shorter than 256 slots
static int64_t dense_chunks(int64_t lists, int64_t S, int64_t threads) {
  const int64_t most = std::max<int64_t>(1, S / 256);
  int64_t c = std::min(most, (4 * threads + lists - 1) / lists);
  for (int64_t t = c; t <= most && t <= c + threads; ++t)
    if ((lists * t) % threads == 0) return t;
  return std::max<int64_t>(1, c);
}

// o [D] <- the partial outputs src[i] [D] (i < n) mixed by the weights exp(l[i] - max l) of their log-sum-exps
// l[i] (flash-decoding's merge); every l[i] -inf (nothing visible): o stays as it is (zeros)
static void merge_partials(int64_t n, const float* const* src, const float* l, int64_t D, float* o) {
  float m = -INFINITY, total = 0.f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, l[i]);
  if (std::isinf(m)) return;
  for (int64_t i = 0; i < n; ++i) {
    const float w = std::exp(l[i] - m);
    for (int64_t d = 0; d < D; ++d) o[d] += w * src[i][d];
    total += w;
  }
  for (int64_t d = 0; d < D; ++d) o[d] /= total;
}

// dense decode attention: every query head of a GQA group over slots [from_b, S) of its KV head (from_b =
// own_from[b], 0 when own_from is empty), the slots split into chunks (flash-decoding) so that both threads
// work even with few KV heads; each chunk is attend_dense over its rows in place.  A shared prefix (pk, pv
// [1, Hkv, P, D], rows contiguous; P = 0: none): the rows with from_b > 0 also attend over its P rows, read
// once for all of them: per KV head and prefix chunk, one attend_dense of their R * G query rows together
// (K and V loaded once per block for all R * G, where each row's own copy would be read R times).  All
// partials merged by log-sum-exp.  (Slots [0, S) of k, v, whose third dim may be larger: a dense cache's
// buffers; T float or bf16, the prefix's too.)
template <typename T>
static torch::Tensor decode_attention_t(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        int64_t S, const torch::Tensor& visible, double scale, int lanes,
                                        const torch::Tensor& pk, const torch::Tensor& pv,
                                        const std::vector<int64_t>& from) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1), G = Hq / Hkv;
  const bool has_vis = visible.numel() > 0;
  const int64_t lists = B * Hkv, threads = at::get_num_threads();
  std::vector<int64_t> sharing;                                     // the rows reading the prefix
  for (int64_t b = 0; b < (int64_t)from.size(); ++b)
    if (from[b] > 0) sharing.push_back(b);
  const int64_t R = sharing.size(), RG = R * G, P = R ? pk.size(2) : 0;
  const int64_t chunks = dense_chunks(lists, S, threads), chunk = (S + chunks - 1) / chunks;
  const int64_t pchunks = R ? dense_chunks(Hkv, P, threads) : 0, pchunk = R ? (P + pchunks - 1) / pchunks : 0;
  const bool merge = chunks > 1 || R > 0;
  auto part = torch::empty({lists, chunks, G, D}, q.options());
  auto lse = merge ? torch::empty({lists, chunks, G}, q.options()) : torch::Tensor();
  const float* qp = q.data_ptr<float>();
  const T* kp = (const T*)k.data_ptr();
  const T* vp = (const T*)v.data_ptr();
  const bool* visp = has_vis ? visible.data_ptr<bool>() : nullptr;
  float* pp = part.data_ptr<float>();
  float* lp = merge ? lse.data_ptr<float>() : nullptr;
  const int64_t work_floats = dense_work(std::max(G, RG), D, std::max(chunk, pchunk));
  // each list's slots: [from_b, S) narrowed to its first and last visible one (a free row of a running batch,
  // all hidden, reads nothing; a shorter row stops at its length)
  std::vector<int64_t> lo(lists), hi(lists);
  for (int64_t r = 0; r < lists; ++r) {
    const int64_t b = r / Hkv, h = r % Hkv;
    lo[r] = from.empty() ? 0 : std::min(from[b], S);
    hi[r] = S;
    if (!visp) continue;
    const bool* vr = visp + b * visible.stride(0) + (visible.size(1) == 1 ? 0 : h * visible.stride(1));
    while (lo[r] < hi[r] && !vr[lo[r]]) ++lo[r];
    while (hi[r] > lo[r] && !vr[hi[r] - 1]) --hi[r];
  }
  at::parallel_for(0, lists * chunks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> work;
    work.resize(std::max<size_t>(work.size(), work_floats));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / chunks, c = i % chunks, b = r / Hkv, h = r % Hkv;
      const int64_t row_chunk = (hi[r] - lo[r] + chunks - 1) / chunks;
      const int64_t n0 = lo[r] + c * row_chunk, N = std::max<int64_t>(0, std::min(hi[r], n0 + row_chunk) - n0);
      const T* kb = kp + b * k.stride(0) + h * k.stride(1) + n0 * k.stride(2);
      const T* vb = vp + b * v.stride(0) + h * v.stride(1) + n0 * v.stride(2);
      const bool* vl = visp ? visp + b * visible.stride(0) + (visible.size(1) == 1 ? 0 : h * visible.stride(1)) + n0 : nullptr;
      attend_dense_any<T>(lanes, qp + (b * Hq + h * G) * D, G, D, kb, k.stride(2), vb, v.stride(2), vl, N,
                          (float)scale, work.data(), pp + i * G * D, lp ? lp + i * G : nullptr);
    }
  });
  if (!merge) return part.view({B, Hq, D});
  torch::Tensor qpre, ppart, plse;                                  // the prefix's queries [Hkv, R G, D], partials
  if (R) {
    qpre = torch::empty({Hkv, RG, D}, q.options());
    ppart = torch::empty({Hkv, pchunks, RG, D}, q.options());
    plse = torch::empty({Hkv, pchunks, RG}, q.options());
    float* qg = qpre.data_ptr<float>();
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t j = 0; j < R; ++j)
        std::memcpy(qg + (h * RG + j * G) * D, qp + (sharing[j] * Hq + h * G) * D, G * D * sizeof(float));
    const T* pkp = (const T*)pk.data_ptr();
    const T* pvp = (const T*)pv.data_ptr();
    float *ppp = ppart.data_ptr<float>(), *plp = plse.data_ptr<float>();
    at::parallel_for(0, Hkv * pchunks, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> work;
      work.resize(std::max<size_t>(work.size(), work_floats));
      for (int64_t i = begin; i < end; ++i) {
        const int64_t h = i / pchunks, n0 = (i % pchunks) * pchunk;
        const int64_t N = std::max<int64_t>(0, std::min(P, n0 + pchunk) - n0);
        attend_dense_any<T>(lanes, qg + h * RG * D, RG, D, pkp + h * pk.stride(1) + n0 * pk.stride(2), pk.stride(2),
                            pvp + h * pv.stride(1) + n0 * pv.stride(2), pv.stride(2), nullptr, N, (float)scale,
                            work.data(), ppp + i * RG * D, plp + i * RG);
      }
    });
  }
  auto out = torch::zeros({B, Hq, D}, q.options());
  float* op = out.data_ptr<float>();
  const float* ppp = R ? ppart.data_ptr<float>() : nullptr;
  const float* plp = R ? plse.data_ptr<float>() : nullptr;
  std::vector<const float*> src(chunks + pchunks);
  std::vector<float> l(chunks + pchunks);
  for (int64_t r = 0, j = 0; r < lists; ++r) {
    const int64_t b = r / Hkv, h = r % Hkv;
    const bool shares = j < R && sharing[j] == b;
    for (int64_t g = 0; g < G; ++g) {
      int64_t n = 0;
      for (int64_t c = 0; c < chunks; ++c, ++n) {
        src[n] = pp + ((r * chunks + c) * G + g) * D;
        l[n] = lp[(r * chunks + c) * G + g];
      }
      for (int64_t c = 0; shares && c < pchunks; ++c, ++n) {
        src[n] = ppp + ((h * pchunks + c) * RG + j * G + g) * D;
        l[n] = plp[(h * pchunks + c) * RG + j * G + g];
      }
      merge_partials(n, src.data(), l.data(), D, op + (r * G + g) * D);
    }
    if (shares && h == Hkv - 1) ++j;
  }
  return out;
}

// (pk, pv, own_from empty: no shared prefix)
static torch::Tensor decode_attention_n(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        int64_t S, const torch::Tensor& visible, double scale, int64_t lanes,
                                        const torch::Tensor& pk = {}, const torch::Tensor& pv = {},
                                        const torch::Tensor& own_from = {}) {
  TORCH_CHECK(q.dtype() == torch::kFloat && k.dtype() == v.dtype() &&
              (k.dtype() == torch::kFloat || k.dtype() == torch::kBFloat16),
              "kvc dense attention: fp32 q, fp32 or bf16 k/v");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, Hq, D]");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.stride(3) == 1 && v.stride(3) == 1,
              "k/v must be [B, Hkv, S, D] with contiguous rows");
  TORCH_CHECK(S >= 1 && S <= k.size(2), "kvc dense attention: 1 <= slots <= the buffers' length");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(D == 64 || D == 128, "kvc dense attention: head_dim 64 or 128");
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && Hkv > 0 && Hq % Hkv == 0, "kvc dense attention: q [B, Hq, D] "
              "against k/v [B, Hkv, S, D] with Hq a multiple of Hkv");
  TORCH_CHECK(visible.numel() == 0 || (visible.dim() == 3 && visible.size(0) == B &&
                                       (visible.size(1) == 1 || visible.size(1) == Hkv) && visible.size(2) >= S &&
                                       visible.stride(2) == 1 && visible.dtype() == torch::kBool),
              "visible must be bool [B, 1 or Hkv, >= S] with contiguous rows");
  std::vector<int64_t> from;                                        // each row's first own slot
  if (own_from.defined() && own_from.numel() > 0) {
    TORCH_CHECK(own_from.dim() == 1 && own_from.size(0) == B && own_from.dtype() == torch::kLong &&
                own_from.is_contiguous(), "kvc prefix attention: own_from must be a contiguous long [B]");
    TORCH_CHECK(pk.dim() == 4 && pk.sizes() == pv.sizes() && pk.size(0) == 1 && pk.size(1) == Hkv &&
                pk.size(2) >= 1 && pk.size(3) == D && pk.stride(3) == 1 && pv.stride(3) == 1 &&
                pk.dtype() == k.dtype() && pv.dtype() == k.dtype(),
                "kvc prefix attention: pk, pv must be [1, Hkv, P >= 1, D] with contiguous rows, in k's dtype");
    const int64_t* fp = own_from.data_ptr<int64_t>();
    from.assign(fp, fp + B);
    for (int64_t f : from) TORCH_CHECK(f >= 0, "kvc prefix attention: own_from must be >= 0");
  }
  const int w = dense_lanes(lanes);
  if (k.dtype() == torch::kFloat) return decode_attention_t<float>(q, k, v, S, visible, scale, w, pk, pv, from);
  return decode_attention_t<uint16_t>(q, k, v, S, visible, scale, w, pk, pv, from);
}

//   kvc::dense_attention(q [B, Hq, D] fp32, k, v [B, Hkv, S, D] fp32 or bf16 (rows contiguous), n, scale, lanes)
//       -> [B, Hq, D]: each decode query over slots [0, n) of its KV head (all visible), bf16 rows
//       widened in registers: the 16-bit cache's decode attention without an fp32 copy.
torch::Tensor dense_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t n, double scale,
                              int64_t lanes) {
  return decode_attention_n(q, k, v, n, torch::empty({0}, q.options().dtype(torch::kBool)), scale, lanes);
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor visible,
                               double scale, int64_t lanes) {
  return decode_attention_n(q, k, v, k.size(2), visible, scale, lanes);
}

//   kvc::prefix_attention(q [B, Hq, D] fp32, k, v [B, Hkv, S, D], visible [B, 1 or Hkv, >= S] bool (or empty),
//                         pk, pv [1, Hkv, P, D], own_from [B] long, scale, lanes) -> [B, Hq, D]
//       decode_attention where rows share a prefix: row b attends over its visible slots [own_from[b], S) and,
//       when own_from[b] > 0, over the P rows of pk, pv too (held once for every row that reads it: a served
//       document that many requests ask about)
torch::Tensor prefix_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor visible,
                               torch::Tensor pk, torch::Tensor pv, torch::Tensor own_from, double scale,
                               int64_t lanes) {
  return decode_attention_n(q, k, v, k.size(2), visible, scale, lanes, pk, pv, own_from);
}

// ------------------------------------------------------------------------ the eager step's small ops, fp32 or bf16
// Each op takes its activations (and weights) in fp32 or bf16, T = float or uint16_t (bf16 bits), computes in fp32
// and rounds its results to T where model.py's torch twin rounds them (bf16: to nearest even, as torch does), so
// that the op and its twin agree to fp32 rounding in either dtype.  RoPE's cos, sin stay fp32.
static inline float widen(float x) { return x; }
static inline float widen(uint16_t h) { return c10::detail::f32_from_bits(h); }
static inline void narrow(float* p, float x) { *p = x; }
static inline void narrow(uint16_t* p, float x) { *p = c10::detail::round_to_nearest_even(x); }

// x as T holds it, back in fp32 (bf16: rounded; fp32: x)
template <typename T>
static inline float as(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return widen(c10::detail::round_to_nearest_even(x));
}

// whether the tensors of op `op` are bf16 (else fp32): all of `same` in x's dtype, fp32 or bf16
static bool bf16_op(const char* op, const torch::Tensor& x, std::initializer_list<torch::Tensor> same) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, op,
              ": fp32 or bf16 tensors, got ", x.scalar_type());
  for (const auto& t : same) TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": tensors of one dtype, got ",
                                         x.scalar_type(), " and ", t.scalar_type());
  return x.scalar_type() == torch::kBFloat16;
}

// one row of rms_norm: model.rms_norm (fp32: x * inv * w; bf16: the normalized row rounded, times w, rounded)
template <typename T>
static inline void rms_norm_row(const T* xr, const T* wp, int64_t D, float eps, T* out) {
  float ss = 0.f;
  for (int64_t d = 0; d < D; ++d) ss += widen(xr[d]) * widen(xr[d]);
  const float inv = 1.f / std::sqrt(ss / D + eps);
  for (int64_t d = 0; d < D; ++d) narrow(out + d, as<T>(widen(xr[d]) * inv) * widen(wp[d]));
}

template <typename T>
static void rms_norm_t(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Tensor& out) {
  const int64_t D = weight.numel(), rows = D ? x.numel() / D : 0;
  const T* xp = (const T*)x.data_ptr();
  const T* wp = (const T*)weight.data_ptr();
  T* op = (T*)out.data_ptr();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * D, wp, D, (float)eps, op + r * D);
  });
}

// y = x * rsqrt(mean(x^2) + eps) * weight over the last dim (one op instead of F.rms_norm's six)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  const bool bf16 = bf16_op("kvc::rms_norm", x, {weight});
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.size(-1) == weight.numel(),
              "kvc::rms_norm: contiguous x [..., D], weight [D]");
  auto out = torch::empty_like(x);
  if (bf16) rms_norm_t<uint16_t>(x, weight, eps, out);
  else rms_norm_t<float>(x, weight, eps, out);
  return out;
}

template <typename T>
static void add_rms_norm_t(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& weight, double eps,
                           torch::Tensor& h, torch::Tensor& out) {
  const int64_t D = weight.numel(), rows = D ? x.numel() / D : 0;
  const T *xp = (const T*)x.data_ptr(), *yp = (const T*)y.data_ptr(), *wp = (const T*)weight.data_ptr();
  T *hp = (T*)h.data_ptr(), *op = (T*)out.data_ptr();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t d = 0; d < D; ++d) narrow(hp + r * D + d, widen(xp[r * D + d]) + widen(yp[r * D + d]));
      rms_norm_row(hp + r * D, wp, D, (float)eps, op + r * D);
    }
  });
}

// (h, rms_norm(h)) with h = x + y: a block's residual add and the next norm in one op
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor y, torch::Tensor weight, double eps) {
  const bool bf16 = bf16_op("kvc::add_rms_norm", x, {y, weight});
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && weight.is_contiguous() && x.sizes() == y.sizes() &&
              x.size(-1) == weight.numel(), "kvc::add_rms_norm: contiguous x, y [..., D], weight [D]");
  auto h = torch::empty_like(x), out = torch::empty_like(x);
  if (bf16) add_rms_norm_t<uint16_t>(x, y, weight, eps, h, out);
  else add_rms_norm_t<float>(x, y, weight, eps, h, out);
  return {h, out};
}

// x * cos + rotate_half(x) * sin for one head of D = 2 * half elements (model.apply_rope: fp32, then rounded to T)
template <typename T>
static inline void rope_head(const T* src, const float* c, const float* s, int64_t half, T* dst) {
  for (int64_t d = 0; d < half; ++d) {
    const float lo = widen(src[d]), hi = widen(src[d + half]);
    narrow(dst + d, lo * c[d] - hi * s[d]);
    narrow(dst + d + half, hi * c[d + half] + lo * s[d + half]);
  }
}

template <typename T>
static void rope_split_t(const torch::Tensor& qkv, const float* cp, const float* sp, int64_t Hq, int64_t Hkv,
                         torch::Tensor& q, torch::Tensor& k, torch::Tensor& v) {
  const int64_t B = qkv.size(0), T_ = qkv.size(1), H = Hq + 2 * Hkv, D = qkv.size(2) / H, half = D / 2;
  const T* x = (const T*)qkv.data_ptr();
  T *qp = (T*)q.data_ptr(), *kp = (T*)k.data_ptr(), *vp = (T*)v.data_ptr();
  at::parallel_for(0, B * T_ * H, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bt = i / H, h = i % H, b = bt / T_, t = bt % T_;
      const T* src = x + i * D;
      if (h >= Hq + Hkv) {
        std::memcpy(vp + ((b * Hkv + h - Hq - Hkv) * T_ + t) * D, src, D * sizeof(T));
        continue;
      }
      T* dst = h < Hq ? qp + ((b * Hq + h) * T_ + t) * D : kp + ((b * Hkv + h - Hq) * T_ + t) * D;
      rope_head(src, cp + bt * D, sp + bt * D, half, dst);
    }
  });
}

// model.Attention.split_heads in one op: head h of token t is the D elements at qkv[b, t, h * D]; q and k
// heads get x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2])
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope_split(torch::Tensor qkv, torch::Tensor cos,
                                                                   torch::Tensor sin, int64_t Hq, int64_t Hkv) {
  const bool bf16 = bf16_op("kvc::rope_split", qkv, {});
  TORCH_CHECK(cos.dtype() == torch::kFloat && sin.dtype() == torch::kFloat && qkv.is_contiguous() &&
              cos.is_contiguous() && sin.is_contiguous() && qkv.dim() == 3,
              "kvc::rope_split: contiguous qkv [B, T, (Hq + 2 Hkv) D], fp32 cos, sin [B, T, D]");
  const int64_t B = qkv.size(0), T = qkv.size(1), H = Hq + 2 * Hkv, D = qkv.size(2) / H;
  TORCH_CHECK(D * H == qkv.size(2) && D % 2 == 0 && cos.numel() == B * T * D && sin.numel() == B * T * D,
              "kvc::rope_split: qkv's last dim must be (Hq + 2 Hkv) * D with cos, sin [B, T, D]");
  auto q = torch::empty({B, Hq, T, D}, qkv.options());
  auto k = torch::empty({B, Hkv, T, D}, qkv.options()), v = torch::empty({B, Hkv, T, D}, qkv.options());
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  if (bf16) rope_split_t<uint16_t>(qkv, cp, sp, Hq, Hkv, q, k, v);
  else rope_split_t<float>(qkv, cp, sp, Hq, Hkv, q, k, v);
  return {q, k, v};
}

// dense_decode's head split: q rotated into q [B, Hq, D], k rotated and v copied into slot `start` of the caches
template <typename T>
static void decode_heads(const torch::Tensor& qkv, const float* cp, const float* sp, int64_t Hq, int64_t Hkv,
                         torch::Tensor& q, torch::Tensor& k_cache, torch::Tensor& v_cache, int64_t start) {
  const int64_t B = qkv.size(0), H = Hq + 2 * Hkv, D = qkv.size(2) / H, half = D / 2, C = k_cache.size(2);
  const T* x = (const T*)qkv.data_ptr();
  T *qp = (T*)q.data_ptr(), *kp = (T*)k_cache.data_ptr(), *vp = (T*)v_cache.data_ptr();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const T* src = x + (b * H + h) * D;
      if (h < Hq) rope_head(src, cp + b * D, sp + b * D, half, qp + (b * Hq + h) * D);
      else if (h < Hq + Hkv) rope_head(src, cp + b * D, sp + b * D, half, kp + ((b * Hkv + h - Hq) * C + start) * D);
      else std::memcpy(vp + ((b * Hkv + h - Hq - Hkv) * C + start) * D, src, D * sizeof(T));
    }
}

// model.Attention's decode step over a model.DenseCache in one op: the heads of qkv [B, 1, (Hq + 2 Hkv) D]
// split, q and k rotated (rope_split), k and v written into slot `start` of the layer's buffers k_cache,
// v_cache [B, Hkv, C, D] (contiguous, qkv's dtype), then decode_attention of q over slots [0, start] with row 0
// of visible [B, R, >= start + 1] (bool, or empty: all visible) -> [B, 1, Hq D] (wo's input, heads in order, in
// qkv's dtype; bf16: q rounded to bf16 as rope_split gives it, the attention in fp32 over the bf16 rows)
torch::Tensor dense_decode(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                           torch::Tensor v_cache, torch::Tensor visible, int64_t start, int64_t Hq, int64_t Hkv,
                           double scale, int64_t lanes) {
  const bool bf16 = bf16_op("kvc::dense_decode", qkv, {k_cache, v_cache});
  TORCH_CHECK(cos.dtype() == torch::kFloat && sin.dtype() == torch::kFloat && qkv.is_contiguous() &&
              cos.is_contiguous() && sin.is_contiguous() && qkv.dim() == 3 && qkv.size(1) == 1,
              "kvc::dense_decode: contiguous qkv [B, 1, (Hq + 2 Hkv) D], fp32 cos, sin [B, 1, D]");
  const int64_t B = qkv.size(0), H = Hq + 2 * Hkv, D = qkv.size(2) / H;
  TORCH_CHECK(D * H == qkv.size(2) && D % 2 == 0 && cos.numel() == B * D && sin.numel() == B * D,
              "kvc::dense_decode: qkv's last dim must be (Hq + 2 Hkv) * D with cos, sin [B, 1, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B && k_cache.size(1) == Hkv &&
              k_cache.size(3) == D, "kvc::dense_decode: contiguous k_cache, v_cache [B, Hkv, C, D]");
  TORCH_CHECK(start >= 0 && start < k_cache.size(2), "kvc::dense_decode: slot out of range");
  auto q = torch::empty({B, Hq, D}, qkv.options());
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  if (bf16) decode_heads<uint16_t>(qkv, cp, sp, Hq, Hkv, q, k_cache, v_cache, start);
  else decode_heads<float>(qkv, cp, sp, Hq, Hkv, q, k_cache, v_cache, start);
  torch::Tensor vis = visible;
  if (visible.numel() > 0) {
    TORCH_CHECK(visible.dim() == 3 && visible.size(0) == B, "kvc::dense_decode: visible must be bool [B, R, >= start + 1]");
    vis = visible.select(1, 0).unsqueeze(1);                        // [B, 1, L]: the group's rows are equal
  }
  auto out = decode_attention_n(q.to(torch::kFloat), k_cache, v_cache, start + 1, vis, scale, lanes);
  return out.to(qkv.scalar_type()).view({B, 1, Hq * D});
}

template <typename T>
static void silu_mul_t(const torch::Tensor& gu, torch::Tensor& out) {
  const int64_t F = gu.size(-1) / 2, rows = F ? gu.numel() / (2 * F) : 0;
  const T* g = (const T*)gu.data_ptr();
  T* o = (T*)out.data_ptr();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *gate = g + r * 2 * F, *up = gate + F;
      T* out_r = o + r * F;
      int64_t f = 0;
      for (; f + 16 <= F; f += 16) {                       // 16 lanes: silu(a) = a / (1 + exp(-a))
        const v16 a = load_vec<v16>(gate + f), u = load_vec<v16>(up + f);
        v16 s = a / (1.f + vexp(-a));
        if constexpr (!std::is_same_v<T, float>) s = round_bf16(s);      // F.silu's bf16 result
        store_vec(out_r + f, s * u);
      }
      for (; f < F; ++f) {
        const float a = widen(gate[f]);
        narrow(out_r + f, as<T>(a / (1.f + std::exp(-a))) * widen(up[f]));
      }
    }
  });
}

// silu(gate) * up over gu = (gate, up) on the last dim (bf16: silu rounded, as F.silu gives it, then the product)
torch::Tensor silu_mul(torch::Tensor gu) {
  const bool bf16 = bf16_op("kvc::silu_mul", gu, {});
  TORCH_CHECK(gu.is_contiguous() && gu.dim() >= 1 && gu.size(-1) % 2 == 0, "kvc::silu_mul: contiguous [..., 2 F]");
  auto sizes = gu.sizes().vec();
  sizes.back() = gu.size(-1) / 2;
  auto out = torch::empty(sizes, gu.options());
  if (bf16) silu_mul_t<uint16_t>(gu, out);
  else silu_mul_t<float>(gu, out);
  return out;
}

// the slots j of key[0 .. S) with key[j] > prefix, or == prefix and j <= last, ascending, the first n of them
// into o; returns how many.  AVX-512: 16 keys a step, the taken slots compressed into scratch (n + 16
// ints), as the taken keys lie at random a branch per key mispredicts
static int64_t collect_slots(const uint32_t* key, int64_t S, uint32_t prefix, int64_t last, int64_t n, int64_t* o,
                             int32_t* scratch) {
  int64_t w = 0, j = 0;
#if defined(__AVX512F__)
  const __m512i p = _mm512_set1_epi32((int)prefix), upto = _mm512_set1_epi32((int)last);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j + 16 <= S && w < n; j += 16) {
    const __m512i k = _mm512_loadu_si512(key + j), ix = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)j));
    const __mmask16 take = _mm512_cmpgt_epu32_mask(k, p) | (_mm512_cmpeq_epi32_mask(k, p) & _mm512_cmple_epi32_mask(ix, upto));
    _mm512_storeu_si512(scratch + w, _mm512_maskz_compress_epi32(take, ix));
    w += __builtin_popcount(take);
  }
  w = std::min(w, n);
  for (int64_t i = 0; i < w; ++i) o[i] = scratch[i];
#endif
  for (; j < S && w < n; ++j)
    if (key[j] > prefix || (key[j] == prefix && j <= last)) o[w++] = j;
  return w;
}

std::tuple<torch::Tensor, torch::Tensor> select_top(torch::Tensor scores, torch::Tensor bias, int64_t n) {
  TORCH_CHECK(scores.dtype() == torch::kFloat && bias.dtype() == torch::kFloat, "kvc::select_top: fp32 only");
  TORCH_CHECK(scores.dim() == 3 && bias.dim() == 3 && scores.stride(2) == 1 && bias.stride(2) == 1,
              "scores [B, h, S] and bias [B, 1 or h, S + n] with contiguous rows");
  const int64_t B = scores.size(0), H = scores.size(1), S = scores.size(2);
  TORCH_CHECK(bias.size(0) == B && (bias.size(1) == 1 || bias.size(1) == H) && bias.size(2) >= S,
              "bias must be [B, 1 or h, >= S]");
  auto idx = torch::empty({B, H, n}, scores.options().dtype(torch::kLong));
  auto ok = torch::empty({B, H, n}, scores.options().dtype(torch::kBool));
  const float* sp = scores.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  const int64_t ss0 = scores.stride(0), ss1 = scores.stride(1);
  const int64_t bs0 = bias.stride(0), bs1 = bias.size(1) == 1 ? 0 : bias.stride(1);
  int64_t* ip = idx.data_ptr<int64_t>();
  bool* okp = ok.data_ptr<bool>();
  const uint32_t NEG_INF_KEY = 0x007FFFFFu;                      // the key of -inf: nothing below it matters
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> key(S), cand(S), hist(2048);
    std::vector<int32_t> scratch(n + 16);
    for (int64_t r = begin; r < end; ++r) {
      const float* s = sp + (r / H) * ss0 + (r % H) * ss1;
      const float* b = bp + (r / H) * bs0 + (r % H) * bs1;
      std::fill(hist.begin(), hist.end(), 0u);
      for (int64_t j = 0; j < S; ++j) {                           // keys, and the histogram of their top 11 bits
        const float x = s[j] + b[j];
        uint32_t u;
        std::memcpy(&u, &x, 4);
        const uint32_t kj = (u & 0x80000000u) ? ~u : (u | 0x80000000u);   // larger float, larger key
        key[j] = kj;
        hist[kj >> 21]++;
      }
      int64_t finite = S;                          // entries above -inf: -inf's key is the top of its bin
      for (uint32_t bin = 0; bin <= (NEG_INF_KEY >> 21); ++bin) finite -= hist[bin];
      int64_t* o = ip + r * n;
      int64_t w = 0;
      if (finite <= n) {
        w = collect_slots(key.data(), S, NEG_INF_KEY, -1, n, o, scratch.data());
      } else {
        // the n-th largest key, 11 + 11 + 10 bits at a time; `remaining` ends as the number of entries equal
        // to it that belong to the top n.  Pass 1's bin chosen, the later passes read its candidates only.
        int64_t remaining = n;
        uint32_t bin = 2047;
        for (; bin > 0 && (int64_t)hist[bin] < remaining; --bin) remaining -= hist[bin];
        uint32_t prefix = bin << 21;
        int64_t m = 0;
        for (int64_t j = 0; j < S; ++j)
          if ((key[j] >> 21) == bin) cand[m++] = key[j];
        const int shifts[2] = {10, 0}, widths[2] = {11, 10};
        for (int p = 0; p < 2; ++p) {
          const int sh = shifts[p];
          const uint32_t bins = 1u << widths[p];
          std::fill(hist.begin(), hist.begin() + bins, 0u);
          for (int64_t i = 0; i < m; ++i) hist[(cand[i] >> sh) & (bins - 1)]++;
          uint32_t c = bins - 1;
          for (; c > 0 && (int64_t)hist[c] < remaining; --c) remaining -= hist[c];
          prefix |= c << sh;
          int64_t kept = 0;                                         // candidates sharing the longer prefix
          for (int64_t i = 0; i < m; ++i)
            if (((cand[i] >> sh) & (bins - 1)) == c) cand[kept++] = cand[i];
          m = kept;
        }
        int64_t last = -1;                     // the slot of the remaining-th key equal to prefix (ties: lowest slots)
        for (int64_t j = 0, seen = 0; j < S && seen < remaining; ++j)
          if (key[j] == prefix && ++seen == remaining) last = j;
        w = collect_slots(key.data(), S, prefix, last, n, o, scratch.data());
      }
      bool* okr = okp + r * n;
      for (int64_t j = 0; j < n; ++j) okr[j] = j < w;
      for (; w < n; ++w) o[w] = S + w;
    }
  });
  return {idx, ok};
}

TORCH_LIBRARY(kvc, m) {
  m.def("sparse_attention(Tensor q, Tensor k, Tensor v, Tensor idx, Tensor valid, float scale) -> Tensor");
  m.def("select_top(Tensor scores, Tensor bias, int n) -> (Tensor, Tensor)");
  m.def("dense_attention(Tensor q, Tensor k, Tensor v, SymInt n, float scale, int lanes=0) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor visible, float scale, int lanes=0) -> Tensor");
  m.def("prefix_attention(Tensor q, Tensor k, Tensor v, Tensor visible, Tensor pk, Tensor pv, Tensor own_from, "
        "float scale, int lanes=0) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_split(Tensor qkv, Tensor cos, Tensor sin, int Hq, int Hkv) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("dense_decode(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor visible, "
        "int start, int Hq, int Hkv, float scale, int lanes=0) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor y, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvc, CPU, m) {
  m.impl("sparse_attention", &sparse_attention);
  m.impl("select_top", &select_top);
  m.impl("dense_attention", &dense_attention);
  m.impl("decode_attention", &decode_attention);
  m.impl("prefix_attention", &prefix_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_split", &rope_split);
  m.impl("silu_mul", &silu_mul);
  m.impl("dense_decode", &dense_decode);
  m.impl("add_rms_norm", &add_rms_norm);
}
