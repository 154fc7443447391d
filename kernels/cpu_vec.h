// Vector helpers shared by the C++ CPU kernels (GCC/Clang vector extensions: 16 fp32 lanes, which
// -march=native turns into one AVX-512 register where the CPU has it, two AVX2 or four SSE registers
// elsewhere: the portable fallback is the same source).
#pragma once

#include <cmath>
#include <cstdint>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int v16i __attribute__((vector_size(64)));

static inline float hsum(v16 x) {
  x += __builtin_shuffle(x, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  x += __builtin_shuffle(x, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  x += __builtin_shuffle(x, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  x += __builtin_shuffle(x, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return x[0];
}

static inline float hmax(v16 x) {                              // the largest lane (hsum's tree, max for +)
  const v16i swaps[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                         {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                         {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                         {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
  for (const v16i& sw : swaps) {
    const v16 y = __builtin_shuffle(x, sw);
    x = y > x ? y : x;
  }
  return x[0];
}

// exp of 16 floats: 2^n * p(r) with a degree-6 polynomial (Cephes expf, relative error < 2e-7);
// exactly 0 below -87.3 (so -inf, a masked score, gives 0)
static inline v16 vexp(v16 x) {
  const v16 zero = {};
  const auto underflow = x < -87.3f;
  x = x > 88.3f ? zero + 88.3f : x;
  x = underflow ? zero : x;
  const v16 t = x * 1.44269504088896341f + 0.5f;
  v16i n = __builtin_convertvector(t, v16i);                   // truncates toward zero
  n -= (v16i)(__builtin_convertvector(n, v16) > t) & 1;          // -> floor
  const v16 nf = __builtin_convertvector(n, v16);
  x = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v16 y = 1.9875691500E-4f * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * x * x + x + 1.f;
  const v16 r = y * (v16)((n + 127) << 23);
  return underflow ? zero : r;
}
