// The low-rank product A^T B, one register-tiled SIMD kernel per instruction set. This file
// is compiled once per kernel (SAKURA_KERNEL = generic / avx2 / avx512, with the matching
// -m flags) and contraction into FMA is allowed here: the summation over components is the
// one place where the native result may differ from the Python one (by float32 rounding).
#include <cstring>

#include "sakura/shard.hpp"

#ifndef SAKURA_KERNEL
#define SAKURA_KERNEL generic
#define SAKURA_WIDTH 4
#endif
#define SAKURA_CAT2(a, b) a##b
#define SAKURA_CAT(a, b) SAKURA_CAT2(a, b)

namespace sakura {

using Vec = float __attribute__((vector_size(SAKURA_WIDTH * sizeof(float))));
constexpr int kVecs = 2;  // 6 x 2 vector accumulators fit every ISA's register file
constexpr int kCols = kVecs * SAKURA_WIDTH;  // divides kProductCols (the padding)

static inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

void SAKURA_CAT(product_, SAKURA_KERNEL)(const float* a, int lda, const float* b, int ldb, int k,
                                         int n, int c, float* out, int ldc) {
  for (int t0 = 0; t0 < n; t0 += kProductRows) {
    for (int j0 = 0; j0 < c; j0 += kCols) {
      Vec acc[kProductRows][kVecs] = {};
      for (int p = 0; p < k; ++p) {
        const float* bp = b + static_cast<long>(p) * ldb + j0;
        const float* ap = a + static_cast<long>(p) * lda + t0;
        Vec bv[kVecs];
        for (int v = 0; v < kVecs; ++v) bv[v] = load(bp + v * SAKURA_WIDTH);
        for (int r = 0; r < kProductRows; ++r) {
          const float s = ap[r];
          for (int v = 0; v < kVecs; ++v) acc[r][v] += s * bv[v];
        }
      }
      const int rows = n - t0 < kProductRows ? n - t0 : kProductRows;
      const int cols = c - j0 < kCols ? c - j0 : kCols;
      for (int r = 0; r < rows; ++r) {
        float* dst = out + static_cast<long>(t0 + r) * ldc + j0;
        if (cols == kCols) {
          for (int v = 0; v < kVecs; ++v) {
            const Vec x = acc[r][v];
            std::memcpy(dst + v * SAKURA_WIDTH, &x, sizeof x);
          }
        } else {
          float tile[kCols];
          for (int v = 0; v < kVecs; ++v) {
            const Vec x = acc[r][v];
            std::memcpy(tile + v * SAKURA_WIDTH, &x, sizeof x);
          }
          std::memcpy(dst, tile, cols * sizeof(float));
        }
      }
    }
  }
}

}  // namespace sakura
