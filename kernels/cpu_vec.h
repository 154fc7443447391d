// Vector helpers shared by the C++ CPU kernels (GCC/Clang vector extensions: 16 fp32 lanes, which
// -march=native turns into one AVX-512 register where the CPU has it, two AVX2 or four SSE registers
// elsewhere: the portable fallback is the same source; and 8 lanes, one AVX2 register, for kernels that
// pick their width by the ISA).
#pragma once

#include <cmath>
#include <cstdint>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int v16i __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));     // one AVX2 register
typedef int v8i __attribute__((vector_size(32)));

// a float vector type's lane count and its int, uint32 and uint16 (bf16) vectors of as many lanes
template <typename V> struct Lanes;
template <> struct Lanes<v8> {
  static constexpr int W = 8;
  typedef v8i I;
  typedef uint32_t U __attribute__((vector_size(32)));
  typedef uint16_t H __attribute__((vector_size(16), aligned(2)));
};
template <> struct Lanes<v16> {
  static constexpr int W = 16;
  typedef v16i I;
  typedef uint32_t U __attribute__((vector_size(64)));
  typedef uint16_t H __attribute__((vector_size(32), aligned(2)));
};

// W lanes from p: fp32 as they are, bf16 (uint16_t) widened
template <typename V> static inline V load_vec(const float* p) { V x; __builtin_memcpy(&x, p, sizeof x); return x; }
template <typename V> static inline V load_vec(const uint16_t* p) {
  typename Lanes<V>::H h;
  __builtin_memcpy(&h, p, sizeof h);
  return (V)(__builtin_convertvector(h, typename Lanes<V>::U) << 16);
}

// x rounded to the nearest bf16 (ties to even; NaN stays NaN), still as fp32 lanes: torch's float -> bf16
template <typename V> static inline V round_bf16(V x) {
  typedef typename Lanes<V>::U U;
  U u;
  __builtin_memcpy(&u, &x, sizeof u);
  const U r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  u = x == x ? r : u | 0x00400000u;                             // a NaN: quiet, its top bits kept
  __builtin_memcpy(&x, &u, sizeof x);
  return x;
}

// W lanes stored at p: fp32 as they are, bf16 (uint16_t) rounded to nearest even
template <typename V> static inline void store_vec(float* p, V x) { __builtin_memcpy(p, &x, sizeof x); }
template <typename V> static inline void store_vec(uint16_t* p, V x) {
  typename Lanes<V>::U u;
  const V r = round_bf16(x);
  __builtin_memcpy(&u, &r, sizeof u);
  const typename Lanes<V>::H h = __builtin_convertvector(u >> 16, typename Lanes<V>::H);
  __builtin_memcpy(p, &h, sizeof h);
}

// the lanes of x exchanged across distance H (lane i <- lane i ^ H)
template <int H, typename V>
static inline V swap_lanes(V x) {
  typename Lanes<V>::I sw;
  for (int i = 0; i < Lanes<V>::W; ++i) sw[i] = i ^ H;
  return __builtin_shuffle(x, sw);
}

// one round of reduce_lanes: in every segment of 2H lanes, the first H lanes get u's two halves added
// (lane i: u[i] + u[i + H]), the last H lanes v's (v[i - H] + v[i]); two blends, one in-segment swap, one add
// (a two-source shuffle per operand costs twice as much on the shuffle ports)
template <int H, typename V>
static inline V add_halves(V u, V v) {
  constexpr int W = Lanes<V>::W;
  typename Lanes<V>::I low;
  for (int i = 0; i < W; ++i) low[i] = i % (2 * H) < H ? -1 : 0;
  return (low ? u : v) + swap_lanes<H>(low ? v : u);           // blends: u where low, v elsewhere; and back
}

// x[0..W) -> one vector whose lane j is the sum of x[j]'s lanes (x is overwritten): W horizontal sums in
// W - 1 add_halves instead of W full reductions (round H pairs x[k] with x[k + H])
template <typename V>
static inline V reduce_lanes(V* x) {
  constexpr int W = Lanes<V>::W;
#pragma GCC unroll 8
  for (int k = 0; k < W / 2; ++k) x[k] = add_halves<W / 2>(x[k], x[k + W / 2]);
#pragma GCC unroll 4
  for (int k = 0; k < W / 4; ++k) x[k] = add_halves<W / 4>(x[k], x[k + W / 4]);
#pragma GCC unroll 2
  for (int k = 0; k < W / 8; ++k) x[k] = add_halves<W / 8>(x[k], x[k + W / 8]);
  if constexpr (W == 16) x[0] = add_halves<1>(x[0], x[1]);
  return x[0];
}

template <typename V>
static inline float hsum(V x) {                                // the sum of the lanes
  if constexpr (Lanes<V>::W == 16) x += swap_lanes<8>(x);
  x += swap_lanes<4>(x);
  x += swap_lanes<2>(x);
  x += swap_lanes<1>(x);
  return x[0];
}

template <typename V>
static inline float hmax(V x) {                                // the largest lane
  V y;
  if constexpr (Lanes<V>::W == 16) { y = swap_lanes<8>(x); x = y > x ? y : x; }
  y = swap_lanes<4>(x); x = y > x ? y : x;
  y = swap_lanes<2>(x); x = y > x ? y : x;
  y = swap_lanes<1>(x); x = y > x ? y : x;
  return x[0];
}

// exp of 8 or 16 floats: 2^n * p(r) with a degree-6 polynomial (Cephes expf, relative error < 2e-7);
// exactly 0 below -87.3 (so -inf, a masked score, gives 0)
template <typename V>
static inline V vexp(V x) {
  typedef typename Lanes<V>::I I;
  const V zero = {};
  const auto underflow = x < -87.3f;
  x = x > 88.3f ? zero + 88.3f : x;
  x = underflow ? zero : x;
  const V t = x * 1.44269504088896341f + 0.5f;
  I n = __builtin_convertvector(t, I);                         // truncates toward zero
  n -= (I)(__builtin_convertvector(n, V) > t) & 1;               // -> floor
  const V nf = __builtin_convertvector(n, V);
  x = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  V y = 1.9875691500E-4f * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * x * x + x + 1.f;
  const V r = y * (V)((n + 127) << 23);
  return underflow ? zero : r;
}
