// CPU kernels of the weight-quantized linear layers (built with kernels/cpu_kernels.cpp by
// kernels/cpu.py; the Python side, layouts and twins are in kernels/qlinear.py):
//
//   kvc::qlinear(x [..., K] fp32, w tiles, scales fp16 [N/16, K/G, 16], mins fp16 like scales (int4) or an
//                empty tensor (int8), bits 4|8, group G, isa 0|1|2) -> y [..., N] fp32
//       One arithmetic for every row count (batch-invariant: a row's result does not depend on how many rows
//       x has, which they are, the register blocking or the thread split).  x~ = int8 codes per row and
//       block of 32 channels (d = max|x| / 127, q_x = round(x / d), symmetric: llama.cpp's Q8 activations),
//       y[m, n] = sum over blocks b, in order, of (fp32, fused multiply-adds)
//         acc = fma(S, scale[n, g(b)] * d[m, b], acc);  acc = fma(min[n, g(b)], d[m, b] * sum_k q_x, acc)  (int4)
//       with S = sum_k q_w q_x the block's exact int32 sum (kernels/qlinear.py `qlinear_int_reference` is the
//       twin).  `isa` picks the instructions, never the result (all three are bitwise equal):
//         2 VNNI:     vpdpbusd (u8 x s8, 4 products per int32 lane); int4 codes are the u8 operand, int8 codes
//                     are made u8 by + 128 (xor 0x80) and 128 * sum q_x is subtracted from the block's sum.
//         1 AVX2:     vpmaddubsw (u8 x s8 -> int16 pair sums), vpmaddwd by 1 -> int32.  int4: a block's 8
//                     pair sums fit int16 (8 * 2 * 15 * 127 = 30480), one vpmaddwd per block; int8:
//                     |q_w| x sign(q_x, q_w) (2 * 127 * 127 = 32258), one vpmaddwd per load.
//         0 portable: plain loops (std::fma), for CPUs without AVX2 and as the others' check.
//   kvc::qdequant(w, scales, mins, bits, group, K) -> W~ [N, K] fp32
//   kvc::qembed(w, scales, mins, bits, group, K, rows [L]) -> rows of W~ [L, K] fp32 (a tied head's embeddings)
//
// Tiles of 16 output rows (kernels/qlinear.py `to_tiles` writes them from the row-major codes), read as
// one dword per row (lane) of a 64-byte load:
//   int8: [N/16, K/4, 16, 4] int8:  bytes (q0, q2, q1, q3) of channels 4c..4c+3
//   int4: [N/16, K/8, 16, 4] uint8: bytes (q0 | q2 << 4, q4 | q6 << 4, q1 | q3 << 4, q5 | q7 << 4) of
//         channels 8c..8c+7
// The codes of x are written in the byte order of a tile dword (int4: channels 0 4 1 5 | 2 6 3 7 of each 8,
// the low and the high nibbles of a dword; int8: 0 2 1 3 of each 4), so a broadcast dword of x~ meets 4 codes
// of each of 16 rows with no shuffle and no horizontal sums.  Work: threads split the tiles; each walks the
// rows in chunks of ROWS_CHUNK (its tiles stay in L2, a chunk of x~ in L1/L2) with a register block of MR
// rows x TT tiles (decode: 1 row x 2 tiles).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVC_VNNI 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVC_QINT_AVX2 1
#endif

namespace {

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

constexpr int64_t BLOCK = 32;   // activation block
constexpr int64_t ROWS_CHUNK = 64;

enum QIsa { QISA_PORTABLE = 0, QISA_AVX2 = 1, QISA_VNNI = 2 };      // kernels/cpu.py QLINEAR_ISA codes

bool isa_built(int64_t isa) {
#ifdef KVC_VNNI
  if (isa == QISA_VNNI) return true;
#endif
#ifdef KVC_QINT_AVX2
  if (isa == QISA_AVX2) return true;
#endif
  return isa == QISA_PORTABLE;
}

struct Problem {
  const uint8_t* w;
  const uint16_t* scale;
  const uint16_t* mins;          // nullptr for int8
  const int8_t* xq;              // [M, K] x~ codes in tile byte order
  const float* xd;               // [M, K/32] block scales d
  const float* xs;               // [M, K/32] d * sum q_x (int4's min term)
  const int32_t* xi;             // [M, K/32] sum q_x (int8 VNNI's + 128 correction)
  float* out;                    // [M, N]
  int64_t M, N, K, G;
  int bits;
  int64_t tile_bytes() const { return K * 2 * bits; }
};

// the code of channel k of tile row r (layouts in the header)
inline int32_t code(const uint8_t* wt, int bits, int64_t k, int r) {
  if (bits == 8) {
    static const int slot[4] = {0, 2, 1, 3};
    return reinterpret_cast<const int8_t*>(wt)[((k / 4) * 16 + r) * 4 + slot[k % 4]];
  }
  const int j = k % 8, byte = (j % 2) * 2 + (j / 2) / 2, shift = 4 * ((j / 2) % 2);
  return (wt[((k / 8) * 16 + r) * 4 + byte] >> shift) & 15;
}

// position of channel i (0..31) of a block in the tile byte order
inline int tile_slot(int bits, int i) {
  static const int int4[8] = {0, 2, 4, 6, 1, 3, 5, 7};   // channel j of 8 -> its byte (inverse of 0 4 1 5 2 6 3 7)
  static const int int8[4] = {0, 2, 1, 3};
  return bits == 4 ? (i & ~7) + int4[i & 7] : (i & ~3) + int8[i & 3];
}

// x [M, K] -> int8 codes in tile byte order, d, d * sum q_x and sum q_x per row and block (each row alone)
void quantize_rows(const float* x, int64_t M, int64_t K, int bits, int8_t* q, float* d, float* s, int32_t* si) {
  const int64_t KB = K / BLOCK;
  int slot[BLOCK];
  for (int i = 0; i < BLOCK; ++i) slot[i] = tile_slot(bits, i);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < KB; ++b) {
        const float* xb = x + m * K + b * BLOCK;
        int8_t* qb = q + m * K + b * BLOCK;
        float amax = 0.f;
        for (int i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float dm = amax / 127.f, inv = dm > 0.f ? 1.f / dm : 0.f;
        int32_t sum = 0;
        for (int i = 0; i < BLOCK; ++i) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
          qb[slot[i]] = static_cast<int8_t>(v);
          sum += v;
        }
        d[m * KB + b] = dm;
        s[m * KB + b] = dm * static_cast<float>(sum);
        si[m * KB + b] = sum;
      }
  });
}

// ---------------------------------------------------------------------------------------- portable
// tile t for row m: the vector kernels' arithmetic one lane at a time
void tile_portable(const Problem& p, int64_t t, int64_t m) {
  const int64_t NG = p.K / p.G, KB = p.K / BLOCK;
  const uint8_t* wt = p.w + t * p.tile_bytes();
  const int8_t* xq = p.xq + m * p.K;
  float acc[16] = {};
  for (int64_t b = 0; b < KB; ++b) {
    const int64_t g = b * BLOCK / p.G, xb = m * KB + b;
    for (int r = 0; r < 16; ++r) {
      int32_t isum = 0;
      for (int i = 0; i < BLOCK; ++i) isum += code(wt, p.bits, b * BLOCK + i, r) * xq[b * BLOCK + tile_slot(p.bits, i)];
      const int64_t so = (t * NG + g) * 16 + r;
      const float f = half_to_float(p.scale[so]) * p.xd[xb];
      acc[r] = std::fma(static_cast<float>(isum), f, acc[r]);
      if (p.mins) acc[r] = std::fma(half_to_float(p.mins[so]), p.xs[xb], acc[r]);
    }
  }
  std::memcpy(p.out + m * p.N + t * 16, acc, sizeof acc);
}

#if defined(__AVX2__) && defined(__F16C__)
inline __m256 load_half8(const uint16_t* h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}
#endif

#ifdef KVC_VNNI
// ------------------------------------------------------------------------------------------- VNNI
inline __m512 load_half16(const uint16_t* h) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}

// acc[m][u] += float(ia[m][u]) * (scale * d) (+ min * xs for int4): block b's int32 sums (group g) of TT
// tiles from t and MR rows of x from m0 into the fp32 accumulators (both kernels' block end)
template <int BITS, int MR, int TT>
inline void add_block(__m512 (&acc)[MR][TT], const __m512i (&ia)[MR][TT], const uint16_t* scale, const uint16_t* mins,
                      const float* xd, const float* xs, int64_t t, int64_t m0, int64_t b, int64_t g, int64_t NG,
                      int64_t KB) {
#pragma GCC unroll 4
  for (int u = 0; u < TT; ++u) {
    const int64_t so = ((t + u) * NG + g) * 16;
    const __m512 sc = load_half16(scale + so);
    const __m512 mn = BITS == 4 ? load_half16(mins + so) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const int64_t xb = (m0 + m) * KB + b;
      acc[m][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m][u]), _mm512_mul_ps(sc, _mm512_set1_ps(xd[xb])), acc[m][u]);
      if (BITS == 4) acc[m][u] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[xb]), acc[m][u]);
    }
  }
}

// the MR x TT accumulators into out (row m0, the first column of tile t; rows N apart)
template <int MR, int TT>
inline void store_tiles(float* out, int64_t N, const __m512 (&acc)[MR][TT]) {
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < TT; ++u) _mm512_storeu_ps(out + m * N + u * 16, acc[m][u]);
}

template <int MR, int TT, class V>
inline void zero(V (&a)[MR][TT], V z) {
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < TT; ++u) a[m][u] = z;
}

#endif

#ifdef KVC_VNNI
template <int BITS, int MR, int TT>
void int_tiles_vnni(const Problem& p, int64_t t, int64_t m0) {
  const int64_t NG = p.K / p.G, KB = p.K / BLOCK, TB = p.tile_bytes();
  constexpr int LOADS = BITS == 4 ? 4 : 8;           // 64-byte loads per tile and block of 32 channels
  const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR][TT];
  zero<MR, TT>(acc, _mm512_setzero_ps());
  for (int64_t b = 0; b < KB; ++b) {
    const int64_t g = b * BLOCK / p.G;
    __m512i ia[MR][TT];
    zero<MR, TT>(ia, _mm512_setzero_si512());
#pragma GCC unroll 8
    for (int l = 0; l < LOADS; ++l) {
#pragma GCC unroll 4
      for (int u = 0; u < TT; ++u) {
        const __m512i v = _mm512_loadu_si512(p.w + (t + u) * TB + (b * LOADS + l) * 64);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(p.xq + (m0 + m) * p.K + b * BLOCK);
          if (BITS == 4) {
            ia[m][u] = _mm512_dpbusd_epi32(ia[m][u], _mm512_and_si512(v, nib), _mm512_set1_epi32(xq[2 * l]));
            ia[m][u] = _mm512_dpbusd_epi32(ia[m][u], _mm512_and_si512(_mm512_srli_epi32(v, 4), nib),
                                           _mm512_set1_epi32(xq[2 * l + 1]));
          } else {
            ia[m][u] = _mm512_dpbusd_epi32(ia[m][u], _mm512_xor_si512(v, flip), _mm512_set1_epi32(xq[l]));
          }
        }
      }
    }
    if (BITS == 8)                               // the + 128 of the u8 operand: 128 * sum q_x per row
      for (int m = 0; m < MR; ++m)
        for (int u = 0; u < TT; ++u)
          ia[m][u] = _mm512_sub_epi32(ia[m][u], _mm512_set1_epi32(128 * p.xi[(m0 + m) * KB + b]));
    add_block<BITS, MR, TT>(acc, ia, p.scale, p.mins, p.xd, p.xs, t, m0, b, g, NG, KB);
  }
  store_tiles<MR, TT>(p.out + m0 * p.N + t * 16, p.N, acc);
}

template <int BITS, int TT>
void int_rows_vnni(const Problem& p, int64_t t, int64_t m0, int64_t m1) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) int_tiles_vnni<BITS, 4, TT>(p, t, m);
  for (; m < m1; ++m) int_tiles_vnni<BITS, 1, TT>(p, t, m);
}
#endif

#ifdef KVC_QINT_AVX2
// one half (8 rows) of a tile, MR rows of x
template <int BITS, int MR>
void int_half_avx2(const Problem& p, int64_t t, int h, int64_t m0) {
  const int64_t NG = p.K / p.G, KB = p.K / BLOCK;
  constexpr int LOADS = BITS == 4 ? 4 : 8;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* wt = p.w + t * p.tile_bytes() + 32 * h;
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const int64_t g = b * BLOCK / p.G;
    __m256i ia[MR];
    for (int m = 0; m < MR; ++m) ia[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int l = 0; l < LOADS; ++l) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + (b * LOADS + l) * 64));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(p.xq + (m0 + m) * p.K + b * BLOCK);
        if (BITS == 4) {          // int16 pair sums over the whole block (ia: int16 lanes here)
          ia[m] = _mm256_add_epi16(ia[m], _mm256_maddubs_epi16(_mm256_and_si256(v, nib), _mm256_set1_epi32(xq[2 * l])));
          ia[m] = _mm256_add_epi16(ia[m], _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi32(v, 4), nib),
                                                               _mm256_set1_epi32(xq[2 * l + 1])));
        } else {
          const __m256i pr = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(_mm256_set1_epi32(xq[l]), v));
          ia[m] = _mm256_add_epi32(ia[m], _mm256_madd_epi16(pr, ones));
        }
      }
    }
    const int64_t so = (t * NG + g) * 16 + 8 * h;
    const __m256 sc = load_half8(p.scale + so);
    const __m256 mn = BITS == 4 ? load_half8(p.mins + so) : _mm256_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const int64_t xb = (m0 + m) * KB + b;
      const __m256i s = BITS == 4 ? _mm256_madd_epi16(ia[m], ones) : ia[m];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(sc, _mm256_set1_ps(p.xd[xb])), acc[m]);
      if (BITS == 4) acc[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(p.xs[xb]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(p.out + (m0 + m) * p.N + t * 16 + 8 * h, acc[m]);
}

template <int BITS>
void int_rows_avx2(const Problem& p, int64_t t, int64_t m0, int64_t m1) {
  for (int h = 0; h < 2; ++h) {
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) int_half_avx2<BITS, 4>(p, t, h, m);
    for (; m < m1; ++m) int_half_avx2<BITS, 1>(p, t, h, m);
  }
}
#endif

// tiles [t0, t1) for rows [m0, m1) in the instructions of `isa` (built: checked by the op)
void rows(const Problem& p, int64_t isa, int64_t t0, int64_t t1, int64_t m0, int64_t m1) {
#ifdef KVC_VNNI
  if (isa == QISA_VNNI) {
    int64_t t = t0;
    for (; t + 2 <= t1; t += 2) p.bits == 4 ? int_rows_vnni<4, 2>(p, t, m0, m1) : int_rows_vnni<8, 2>(p, t, m0, m1);
    if (t < t1) p.bits == 4 ? int_rows_vnni<4, 1>(p, t, m0, m1) : int_rows_vnni<8, 1>(p, t, m0, m1);
    return;
  }
#endif
#ifdef KVC_QINT_AVX2
  if (isa == QISA_AVX2) {
    for (int64_t t = t0; t < t1; ++t) p.bits == 4 ? int_rows_avx2<4>(p, t, m0, m1) : int_rows_avx2<8>(p, t, m0, m1);
    return;
  }
#endif
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m = m0; m < m1; ++m) tile_portable(p, t, m);
}

void run(const Problem& p, int64_t isa) {
  const int64_t NT = p.N / 16;
  at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < p.M; m0 += ROWS_CHUNK) rows(p, isa, t0, t1, m0, std::min(p.M, m0 + ROWS_CHUNK));
  });
}

void check(const torch::Tensor& w, const torch::Tensor& scales, const torch::Tensor& mins, int64_t bits,
           int64_t group, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 8, "kvc::qlinear: bits must be 4 or 8");
  TORCH_CHECK(K % BLOCK == 0 && group % BLOCK == 0 && K % group == 0,
              "kvc::qlinear: K and the group must be multiples of 32, the group must divide K");
  const int64_t NT = w.size(0);
  TORCH_CHECK(w.is_contiguous() && w.numel() == NT * K * 2 * bits && w.element_size() == 1,
              "kvc::qlinear: w must hold [N/16] tiles of 16 rows x K codes");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.numel() == NT * 16 * (K / group),
              "kvc::qlinear: scales must be fp16 [N/16, K/G, 16]");
  TORCH_CHECK(bits == 8 ||
                  (mins.scalar_type() == torch::kHalf && mins.sizes() == scales.sizes() && mins.is_contiguous()),
              "kvc::qlinear: int4 needs fp16 mins shaped like the scales");
}

}  // namespace

torch::Tensor qlinear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor mins, int64_t bits,
                      int64_t group, int64_t isa) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous() && x.scalar_type() == torch::kFloat,
              "kvc::qlinear: x must be a contiguous fp32 [..., K]");
  TORCH_CHECK(isa_built(isa), "kvc::qlinear: isa ", isa, " (0 portable, 1 AVX2, 2 AVX-512 VNNI) is not built here");
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0, N = w.size(0) * 16, KB = K / BLOCK;
  check(w, scales, mins, bits, group, K);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = torch::empty(sizes, x.options());
  if (M == 0) return out;
  // the quantized activations: per-thread scratch reused across calls (no allocator round trip per layer)
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs;
  thread_local std::vector<int32_t> xi;
  xq.resize(M * K);
  xd.resize(M * KB);
  xs.resize(M * KB);
  xi.resize(M * KB);
  quantize_rows(x.data_ptr<float>(), M, K, static_cast<int>(bits), xq.data(), xd.data(), xs.data(), xi.data());
  Problem p{reinterpret_cast<const uint8_t*>(w.data_ptr()),
            reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
            bits == 4 ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr, xq.data(), xd.data(),
            xs.data(), xi.data(), out.data_ptr<float>(), M, N, K, group, static_cast<int>(bits)};
  run(p, isa);
  return out;
}

// the fastest instructions this build has for kvc::qlinear: 2 AVX-512 VNNI, 1 AVX2, 0 portable loops
int64_t qlinear_isa() { return isa_built(QISA_VNNI) ? QISA_VNNI : isa_built(QISA_AVX2) ? QISA_AVX2 : QISA_PORTABLE; }

torch::Tensor qdequant(torch::Tensor w, torch::Tensor scales, torch::Tensor mins, int64_t bits, int64_t group,
                       int64_t K) {
  check(w, scales, mins, bits, group, K);
  const int64_t NT = w.size(0), NG = K / group;
  auto out = torch::empty({NT * 16, K}, w.options().dtype(torch::kFloat));
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = bits == 4 ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, NT, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* wt = wp + t * K * 2 * bits;
      for (int r = 0; r < 16; ++r) {
        float* row = op + (t * 16 + r) * K;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t so = (t * NG + k / group) * 16 + r;
          row[k] = code(wt, bits, k, r) * half_to_float(sp[so]) + (mp ? half_to_float(mp[so]) : 0.f);
        }
      }
    }
  });
  return out;
}

// rows `rows` (long [L]) of W~ in fp32 [L, K]: a tied head's embedding lookups, each row dequantized from
// its tile (qdequant's arithmetic) instead of the whole tile or a row-major copy
torch::Tensor qembed(torch::Tensor w, torch::Tensor scales, torch::Tensor mins, int64_t bits, int64_t group,
                     int64_t K, torch::Tensor rows) {
  check(w, scales, mins, bits, group, K);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kLong && rows.is_contiguous(),
              "kvc::qembed: rows must be a contiguous long [L]");
  const int64_t NT = w.size(0), NG = K / group, L = rows.size(0);
  auto out = torch::empty({L, K}, w.options().dtype(torch::kFloat));
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = bits == 4 ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  const int64_t* rp = rows.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < L; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < NT * 16, "kvc::qembed: row ", rp[i], " out of range");
  at::parallel_for(0, L, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = rp[i] / 16;
      const int r = static_cast<int>(rp[i] % 16);
      const uint8_t* wt = wp + t * K * 2 * bits;
      float* row = op + i * K;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t so = (t * NG + k / group) * 16 + r;
        row[k] = code(wt, bits, k, r) * half_to_float(sp[so]) + (mp ? half_to_float(mp[so]) : 0.f);
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvc, m) {
  m.def("qlinear(Tensor x, Tensor w, Tensor scales, Tensor mins, int bits, int group, int isa) -> Tensor");
  m.def("qdequant(Tensor w, Tensor scales, Tensor mins, int bits, int group, int K) -> Tensor");
  m.def("qembed(Tensor w, Tensor scales, Tensor mins, int bits, int group, int K, Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvc, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("qdequant", &qdequant);
  m.impl("qembed", &qembed);
}
