// Picks the widest compiled product kernel the CPU supports.
#include "sakura/shard.hpp"

namespace sakura {

void product_generic(const float*, int, const float*, int, int, int, int, float*, int);
#if defined(SAKURA_X86_KERNELS)
void product_avx2(const float*, int, const float*, int, int, int, int, float*, int);
void product_avx512(const float*, int, const float*, int, int, int, int, float*, int);
#endif

namespace {
using Kernel = void (*)(const float*, int, const float*, int, int, int, int, float*, int);

struct Choice {
  Kernel fn;
  const char* name;
};

Choice choose() {
#if defined(SAKURA_X86_KERNELS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return {product_avx512, "avx512"};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return {product_avx2, "avx2"};
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
  // arm64: the generic kernel's 4-float vectors are NEON registers (fmla v.4s; checked in
  // tests/edge/test_backends_arm64.py on the cross-compiled object)
  return {product_generic, "neon"};
#else
  return {product_generic, "generic"};
#endif
}

const Choice& chosen() {
  static const Choice c = choose();  // a CPU property, computed once
  return c;
}
}  // namespace

void lowrank_product(const float* a, int lda, const float* b, int ldb, int k, int n, int c,
                     float* out, int ldc) {
  chosen().fn(a, lda, b, ldb, k, n, c, out, ldc);
}

const char* product_kernel() { return chosen().name; }

}  // namespace sakura
