// CPU kernels of the weight-only quantized linear layers (built with kernels/cpu_kernels.cpp by
// kernels/cpu.py; the Python side, layouts and twins are in kernels/qlinear.py):
//
//   kvc::qlinear(x [M, K] fp32, w uint8/int8 tiles, scales fp16 [N/16, K/G, 16], mins fp16 like scales
//                (int4) or an empty tensor (int8), bits 4|8, group G, portable bool) -> y [M, N] fp32
//       y = x W~^T with W~ = scale * q (int8) or scale * q + min (int4, q in [0, 16)), in fp32: the
//       activations are used as they are (weight-only; no activation rounding), so the result is the
//       dense product with the dequantized weight up to the order of fp32 additions.  Per group,
//       sum_k x_k (s q_k + m) = s * sum_k x_k q_k + m * sum_k x_k: the codes are converted to fp32 and
//       multiplied in registers, the scale and minimum applied once per group.  For decode-sized M
//       (batches); kernels/qlinear.py uses qdequant + a dense matmul for prefill.
//   kvc::qdequant(w, scales, mins, bits, group, portable) -> W~ [N, K] fp32
//
// Tiles (16 output rows; kernels/qlinear.py `to_tiles` writes them from the row-major codes):
//   int8: [N/16, K, 16] int8:        [t, k, r] = q[16t + r, k]
//   int4: [N/16, K/2, 16] uint8:     [t, i, r] = q[16t + r, 2i] | q[16t + r, 2i + 1] << 4
// so a 16-byte load holds one (int8) or two (int4) input channels of 16 rows: a row per AVX-512 lane,
// no horizontal sums.  Work is split over pairs of tiles with at::parallel_for.  Without AVX-512 (or with
// portable=true) the same arithmetic runs as plain loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#define KVC_AVX512 1
#endif

namespace {

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

struct Problem {
  const uint8_t* w;
  const uint16_t* scale;
  const uint16_t* mins;          // nullptr for int8
  const float* x;                // [M, K]
  const float* xsum;             // [M, K/G] group sums of x (int4)
  float* out;                    // [M, N]
  int64_t M, N, K, G;
  int bits;
  int64_t tile_bytes() const { return K * 16 * bits / 8; }
};

// ---------------------------------------------------------------------------------------- portable
void tile_portable(const Problem& p, int64_t t, int64_t m) {
  const int64_t NG = p.K / p.G;
  const uint8_t* wt = p.w + t * p.tile_bytes();
  const float* x = p.x + m * p.K;
  float acc[16] = {};
  for (int64_t g = 0; g < NG; ++g) {
    float part[16] = {};
    for (int64_t k = g * p.G; k < (g + 1) * p.G; ++k)
      for (int r = 0; r < 16; ++r) {
        const float q = p.bits == 8 ? static_cast<float>(reinterpret_cast<const int8_t*>(wt)[k * 16 + r])
                                    : static_cast<float>((wt[(k / 2) * 16 + r] >> (4 * (k & 1))) & 15);
        part[r] += x[k] * q;
      }
    for (int r = 0; r < 16; ++r) {
      acc[r] += part[r] * half_to_float(p.scale[(t * NG + g) * 16 + r]);
      if (p.mins) acc[r] += half_to_float(p.mins[(t * NG + g) * 16 + r]) * p.xsum[m * NG + g];
    }
  }
  std::memcpy(p.out + m * p.N + t * 16, acc, sizeof acc);
}

#ifdef KVC_AVX512
// ------------------------------------------------------------------------------------------ AVX-512
inline __m512 load_half16(const uint16_t* h) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}

// TT consecutive tiles x MR rows of x, all in registers: per input channel one load of 16 codes per
// tile (two channels per load for int4), converted once and used by the MR rows
template <int BITS, int MR, int TT>
void tiles_avx512(const Problem& p, int64_t t, int64_t m0) {
  const int64_t NG = p.K / p.G, TB = p.tile_bytes();
  const __m512i low4 = _mm512_set1_epi32(15);
  __m512 acc[MR][TT];
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < TT; ++u) acc[m][u] = _mm512_setzero_ps();
  for (int64_t g = 0; g < NG; ++g) {
    __m512 part[MR][TT];
    for (int m = 0; m < MR; ++m)
      for (int u = 0; u < TT; ++u) part[m][u] = _mm512_setzero_ps();
    for (int64_t k = g * p.G; k < (g + 1) * p.G; k += 2) {
#pragma GCC unroll 4
      for (int u = 0; u < TT; ++u) {
        const uint8_t* wt = p.w + (t + u) * TB;
        __m512 w0, w1;
        if (BITS == 8) {
          const __m128i* src = reinterpret_cast<const __m128i*>(wt + k * 16);
          w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src)));
          w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1)));
        } else {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wt + k * 8)));
          w0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, low4));
          w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        }
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          const float* x = p.x + (m0 + m) * p.K + k;
          part[m][u] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[0]), part[m][u]);
          part[m][u] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[1]), part[m][u]);
        }
      }
    }
#pragma GCC unroll 4
    for (int u = 0; u < TT; ++u) {
      const int64_t so = ((t + u) * NG + g) * 16;
      const __m512 sc = load_half16(p.scale + so);
      const __m512 mn = BITS == 4 ? load_half16(p.mins + so) : _mm512_setzero_ps();
      for (int m = 0; m < MR; ++m) {
        acc[m][u] = _mm512_fmadd_ps(part[m][u], sc, acc[m][u]);
        if (BITS == 4) acc[m][u] = _mm512_fmadd_ps(mn, _mm512_set1_ps(p.xsum[(m0 + m) * NG + g]), acc[m][u]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < TT; ++u) _mm512_storeu_ps(p.out + (m0 + m) * p.N + (t + u) * 16, acc[m][u]);
}

template <int BITS, int TT>
void rows_avx512(const Problem& p, int64_t t) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) tiles_avx512<BITS, 4, TT>(p, t, m);
  for (; m + 2 <= p.M; m += 2) tiles_avx512<BITS, 2, TT>(p, t, m);
  for (; m < p.M; ++m) tiles_avx512<BITS, 1, TT>(p, t, m);
}
#endif

void run(const Problem& p, bool portable) {
  const int64_t NT = p.N / 16;
  at::parallel_for(0, (NT + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = 2 * begin; t < std::min(2 * end, NT); t += 2) {
      const bool pair = t + 1 < NT;
#ifdef KVC_AVX512
      if (!portable) {
        if (p.bits == 4) pair ? rows_avx512<4, 2>(p, t) : rows_avx512<4, 1>(p, t);
        else pair ? rows_avx512<8, 2>(p, t) : rows_avx512<8, 1>(p, t);
        continue;
      }
#endif
      for (int64_t u = t; u < t + (pair ? 2 : 1); ++u)
        for (int64_t m = 0; m < p.M; ++m) tile_portable(p, u, m);
    }
  });
}

void check(const torch::Tensor& w, const torch::Tensor& scales, const torch::Tensor& mins, int64_t bits,
           int64_t group, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 8, "kvc::qlinear: bits must be 4 or 8");
  TORCH_CHECK(group > 0 && group % 2 == 0 && K % group == 0, "kvc::qlinear: the group must be even and divide K");
  const int64_t NT = w.size(0);
  TORCH_CHECK(w.is_contiguous() && w.numel() == NT * K * 2 * bits && w.element_size() == 1,
              "kvc::qlinear: w must hold [N/16] tiles of 16 rows x K codes");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.numel() == NT * 16 * (K / group),
              "kvc::qlinear: scales must be fp16 [N/16, K/G, 16]");
  TORCH_CHECK(bits == 8 || (mins.scalar_type() == torch::kHalf && mins.sizes() == scales.sizes() && mins.is_contiguous()),
              "kvc::qlinear: int4 needs fp16 mins shaped like the scales");
}

}  // namespace

torch::Tensor qlinear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor mins, int64_t bits,
                      int64_t group, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat,
              "kvc::qlinear: x must be a contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * 16;
  check(w, scales, mins, bits, group, K);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  torch::Tensor xsum = bits == 4 ? x.view({M, K / group, group}).sum(-1).contiguous() : torch::Tensor();
  Problem p{reinterpret_cast<const uint8_t*>(w.data_ptr()), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
            bits == 4 ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr,
            x.data_ptr<float>(), bits == 4 ? xsum.data_ptr<float>() : nullptr, out.data_ptr<float>(),
            M, N, K, group, static_cast<int>(bits)};
  run(p, portable);
  return out;
}

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
          const float q = bits == 8 ? static_cast<float>(reinterpret_cast<const int8_t*>(wt)[k * 16 + r])
                                    : static_cast<float>((wt[(k / 2) * 16 + r] >> (4 * (k & 1))) & 15);
          row[k] = q * half_to_float(sp[so]) + (mp ? half_to_float(mp[so]) : 0.f);
        }
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvc, m) {
  m.def("qlinear(Tensor x, Tensor w, Tensor scales, Tensor mins, int bits, int group, bool portable) -> Tensor");
  m.def("qdequant(Tensor w, Tensor scales, Tensor mins, int bits, int group, int K) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvc, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("qdequant", &qdequant);
}
