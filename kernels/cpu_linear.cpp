// Decode-sized linear layer, fp32 or bf16 (built with kernels/cpu_kernels.cpp by kernels/cpu.py):
//
//   kvc::linear_small_m(x [M, K], w [N, K] (nn.Linear's weight, row-major, not repacked), bias [N] or an empty
//                       tensor) -> y = x w^T + bias  [M, N], M <= 16, all fp32 or all bf16
//
// bf16: the sums are fp32 and rounded to bf16 once at the end, as oneDNN's bf16 inner product does.  Where the
// build has AVX-512 BF16, x stays bf16 and one vdpbf16ps multiplies 32 columns of a W row by a row of x (the
// products of two bf16 values are exact in fp32, each pair's sum added into an fp32 lane): W is read as it is
// stored, and at M = 8 the layer runs at the memory's speed instead of twice the stream's time (273 against
// 150 us for a [3072, 576] W, Intel Xeon, 2 threads, 2026-11-29).  Elsewhere W's rows are widened to fp32 in
// registers and x is copied to fp32 (exact).
//
// With a handful of activation rows the layer is a stream over W: every weight is used only M times,
// so the kernel must read W once, at memory speed, and spend few instructions per W vector.  W is
// walked R rows at a time in step (R sequential streams); x (copied once into a zero-padded
// [M, K rounded up to 16] buffer) in blocks of at most 4 rows.  Per 16 columns, the block's x vectors
// and each W vector are loaded into registers once and feed MB * R FMAs into MB * R accumulators
// (R = 16, 8, 4 for M = 1, 2-3, >= 4: at most 24 accumulators + 4 x vectors + a W vector in the 32
// registers), so the loads per FMA are (MB + R) / (MB R), not the 1 + 1/R of re-reading x from L1 for
// every FMA.  The first x block reads the R W rows from memory (prefetching the next R rows when
// there are more blocks), the other blocks re-read them from L1.  The K tail is a masked
// (zero-filled) load of W.
//
// The accumulators of a tile of 16 output rows are parked in an L1 scratch [M][16] of vectors and
// folded by a transposing tree (reduce16: 15 two-source shuffles + adds give the 16 row sums in
// one vector, instead of 16 separate horizontal sums), then bias-added and stored.  at::parallel_for
// splits the tiles into contiguous ranges, one per thread, so each thread streams its own part of W.
// The vectors are GCC vector extensions (cpu_vec.h): one AVX-512 register with -march=native on
// AVX-512 CPUs, the same source compiled for narrower registers elsewhere.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"

namespace {

constexpr int TILE = 16;          // output rows reduced together
constexpr int MAX_M = 16;

// T: the weight's, bias's and output's element type, float or uint16_t (bf16 bits); X: x's copy, float, or
// uint16_t (bf16, the pairs of vdpbf16ps)
template <typename T, typename X = float>
struct Problem {
  const X* x;                     // [M, Kp] zero-padded copy
  const T* w;                     // [N, K]
  const T* bias;                  // [N] or nullptr
  T* out;                         // [M, N]
  int64_t M, N, K, Kp;
};

inline v16 load(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline v16 load(const uint16_t* p) { return load_vec<v16>(p); }
inline float widen(float x) { return x; }
inline float widen(uint16_t h) { return c10::detail::f32_from_bits(h); }
inline void narrow(float* p, float x) { *p = x; }
inline void narrow(uint16_t* p, float x) { *p = c10::detail::round_to_nearest_even(x); }

// the first n (< 16) floats at p, zeros after
inline v16 load_head(const float* p, int n) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16>(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p));
#else
  v16 v = {};
  std::memcpy(&v, p, n * sizeof(float));
  return v;
#endif
}

// the first n (< 16) bf16 values at p widened, zeros after
inline v16 load_head(const uint16_t* p, int n) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return reinterpret_cast<v16>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#else
  uint16_t h[16] = {};
  std::memcpy(h, p, n * sizeof(uint16_t));
  return load_vec<v16>(h);
#endif
}

// pairwise sums of neighbouring `half`-lane blocks: the first 8 lanes from a, the last 8 from b
template <int half>
inline v16 fold(v16 a, v16 b) {
  v16i lo, hi;
  for (int i = 0; i < 16; ++i) {
    const int block = i / half, src = (block < 8 / half ? 0 : 16) + block % (8 / half) * 2 * half + i % half;
    lo[i] = src;
    hi[i] = src + half;
  }
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// lane j of the result = the sum of the 16 lanes of p[j]
inline v16 reduce16(const v16* p) {
  v16 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) l1[i] = fold<8>(p[2 * i], p[2 * i + 1]);
  for (int i = 0; i < 4; ++i) l2[i] = fold<4>(l1[2 * i], l1[2 * i + 1]);
  for (int i = 0; i < 2; ++i) l3[i] = fold<2>(l2[2 * i], l2[2 * i + 1]);
  return fold<1>(l3[0], l3[1]);
}

// keeps v in a register: stops the compiler from re-reading v's source as a memory operand of every
// FMA that uses it (the load ports, not the FMA units, would then bound the kernel)
inline void pin(v16& v) {
#if defined(__x86_64__) && defined(__AVX512F__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// acc[m][r] += x[m][k, k + 16) * W row r [k, k + 16) (TAIL: only the first `tail` columns of W)
template <int MB, int R, bool TAIL, typename T>
inline void fma_step(v16 (&acc)[MB][R], const float* x, int64_t Kp, const T* const* rows, int64_t k, int tail,
                     int64_t ahead) {
  v16 xv[MB];
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) pin(xv[m] = load(x + m * Kp + k));
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    v16 w = TAIL ? load_head(rows[r] + k, tail) : load(rows[r] + k);
    pin(w);
    if (ahead) __builtin_prefetch(rows[r] + k + ahead);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) acc[m][r] += xv[m] * w;
  }
}

#if defined(__AVX512BF16__)
// acc[m][r] += x[m][k, k + 32) . W row r [k, k + 32) in pairs: lane i gets the products of columns 2i, 2i + 1
// (bf16 x and W; TAIL: only the first `tail` columns of W, the rest zeros)
template <int MB, int R, bool TAIL>
inline void fma_step(v16 (&acc)[MB][R], const uint16_t* x, int64_t Kp, const uint16_t* const* rows, int64_t k,
                     int tail, int64_t ahead) {
  __m512i xv[MB];
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) xv[m] = _mm512_loadu_si512(x + m * Kp + k);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512i w = TAIL ? _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << tail) - 1), rows[r] + k)
                           : _mm512_loadu_si512(rows[r] + k);
    if (ahead) __builtin_prefetch(rows[r] + k + ahead);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m)
      acc[m][r] = reinterpret_cast<v16>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc[m][r]),
                                                          reinterpret_cast<__m512bh>(xv[m]),
                                                          reinterpret_cast<__m512bh>(w)));
  }
}
#endif

// dot products of W rows `rows` (R of them) with x rows [m0, m0 + MB) -> part[m * TILE + j + r];
// with `ahead` (elements) the W lines that far ahead are prefetched
template <int MB, int R, typename T, typename X>
inline void dot_rows(const Problem<T, X>& p, const T* const* rows, int m0, v16* part, int j, int64_t ahead) {
  constexpr int64_t S = 64 / sizeof(X);         // columns per step: 16 fp32 x lanes, or 32 bf16 (pairs)
  v16 acc[MB][R] = {};
  const X* x = p.x + m0 * p.Kp;
  int64_t k = 0;
  for (; k + S <= p.K; k += S) fma_step<MB, R, false>(acc, x, p.Kp, rows, k, S, ahead);
  if (k < p.K) fma_step<MB, R, true>(acc, x, p.Kp, rows, k, static_cast<int>(p.K - k), ahead);
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) part[(m0 + m) * TILE + j + r] = acc[m][r];
}

// the rows of x in blocks of at most 4 (x and the accumulators of a block stay in registers; the later
// blocks read the R W rows from L1).  With several blocks the first one prefetches the next R W rows:
// the hardware prefetcher alone then leaves ~10-15% on the table; at M = 1 it keeps up by itself.
template <int M, int R, int m0 = 0, typename T, typename X>
inline void dot_blocks(const Problem<T, X>& p, const T* const* rows, v16* part, int j) {
  if constexpr (m0 < M) {
    constexpr int MB = std::min(4, M - m0);
    dot_rows<MB, R>(p, rows, m0, part, j, M > 1 && m0 == 0 ? R * p.K : 0);
    dot_blocks<M, R, m0 + MB>(p, rows, part, j);
  }
}

// output rows [n0, n0 + TILE) ∩ [0, N) for all M rows of x
template <int M, int R, typename T, typename X>
void tile(const Problem<T, X>& p, int64_t n0) {
  v16 part[M * TILE];
  const int live = static_cast<int>(std::min<int64_t>(TILE, p.N - n0));
  if (live < TILE) std::fill(part, part + M * TILE, v16{});
  for (int j = 0; j < live; j += R) {
    const T* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = p.w + std::min<int64_t>(n0 + j + r, p.N - 1) * p.K;  // past N: a repeat
    dot_blocks<M, R>(p, rows, part, j);
  }
  for (int m = 0; m < M; ++m) {
    float sums[TILE];
    *reinterpret_cast<v16*>(sums) = reduce16(part + m * TILE);
    T* y = p.out + m * p.N + n0;
    for (int i = 0; i < live; ++i) narrow(y + i, sums[i] + (p.bias ? widen(p.bias[n0 + i]) : 0.f));
  }
}

template <int M, typename T, typename X>
void run_m(const Problem<T, X>& p) {
  constexpr int R = M == 1 ? 16 : M <= 3 ? 8 : 4;     // W rows in step: <= 24 accumulators per x block
  const int64_t tiles = (p.N + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) tile<M, R>(p, t * TILE);
  });
}

template <typename T, typename X, int... Ms>
void dispatch(const Problem<T, X>& p, std::integer_sequence<int, Ms...>) {
  ((p.M == Ms + 1 ? run_m<Ms + 1>(p) : void()), ...);
}

}  // namespace

template <typename T, typename X>
void run(const torch::Tensor& xp, const torch::Tensor& w, const torch::Tensor& bias, torch::Tensor& out) {
  Problem<T, X> p{(const X*)xp.data_ptr(), (const T*)w.data_ptr(), bias.numel() ? (const T*)bias.data_ptr() : nullptr,
                  (T*)out.data_ptr(), out.size(0), out.size(1), w.size(1), xp.size(1)};
  dispatch(p, std::make_integer_sequence<int, MAX_M>{});
}

torch::Tensor linear_small_m(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16,
              "kvc::linear_small_m: fp32 or bf16 tensors, got ", dtype);
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= MAX_M, "kvc::linear_small_m: x must be [M, K] with M <= 16");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == dtype && w.is_contiguous() && w.size(1) == x.size(1),
              "kvc::linear_small_m: w must be a contiguous [N, K] in x's dtype");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), Kp = (K + 15) / 16 * 16;
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == dtype && bias.numel() == N && bias.is_contiguous()),
              "kvc::linear_small_m: bias must be empty or a contiguous [N] in x's dtype");
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if defined(__AVX512BF16__)
  if (dtype == torch::kBFloat16) {                      // x kept bf16, padded to the 32-column step
    auto xb = torch::zeros({M, (K + 31) / 32 * 32}, x.options());
    xb.narrow(1, 0, K).copy_(x);
    run<uint16_t, uint16_t>(xb, w, bias, out);
    return out;
  }
#endif
  auto xp = torch::zeros({M, Kp}, x.options().dtype(torch::kFloat));
  xp.narrow(1, 0, K).copy_(x);
  if (dtype == torch::kBFloat16) run<uint16_t, float>(xp, w, bias, out);
  else run<float, float>(xp, w, bias, out);
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvc, m) {
  m.def("linear_small_m(Tensor x, Tensor w, Tensor bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvc, CPU, m) {
  m.impl("linear_small_m", &linear_small_m);
}
