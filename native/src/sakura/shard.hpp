// Reconstruction kernels of the `sakura` / `svd` low-rank codec (codec/FORMAT.md, section 3).
//
// decode_shard() turns the bytes of one configuration (a prefix of the shard's embedded
// stream: the stream header, then coding units = one rank segment at one precision level,
// in the order the header lists) into the shard's M matrices [N, C] (float32), exactly as
// codec.lowrank.LowRankCodec.decode does in Python: progressive (bit-plane group)
// dequantization, the signed block-Hadamard rotation back, the low-rank product A^T B per
// matrix, and the optional RoPE rotation of the keys.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace sakura {

// Malformed, truncated or inconsistent shard bytes or parameters.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One coding unit of the stream: components [first, end) at `level`.
struct StreamUnit {
  int level = 0;
  int first = 0;
  int end = 0;
};

// The stream header (codec/FORMAT.md, section 3): geometry, level bits, the rank ladder
// and the level of every unit in stream order.
struct ShardHeader {
  int levels = 0;
  int matrices = 0;
  int tokens = 0;    // N
  int channels = 0;  // C
  int group = 0;     // G
  std::vector<int> level_bits;        // bits added by each level
  std::vector<int> ladder;            // mean-rank ladder points, increasing
  std::vector<StreamUnit> units;      // every unit of the stream, in order
  std::vector<std::uint32_t> stored;  // components the whole stream holds per level
  std::size_t header_size = 0;        // bytes of the header

  std::size_t header_bytes() const { return header_size; }
  int length() const { return tokens + channels; }
  int groups() const;                        // quantization steps per component
  std::size_t chunk_bytes(int level) const;  // bytes of one component at `level`
};

// Parses and checks the header (magic, version, level bits, group, sizes, ladder, and that
// every prefix of the unit list is a staircase).
ShardHeader parse_header(const std::uint8_t* data, std::size_t size);

// Components per level (ranks[l] * M) after checking that ranks is a prefix of the stream;
// throws FormatError when it is not, or when `size` is not exactly that prefix's bytes.
std::vector<int> config_counts(const ShardHeader& h, const std::vector<int>& ranks,
                               std::size_t size);

// Number of units of the prefix whose per-level components are `counts` (throws
// FormatError when no prefix has them).
int prefix_units(const ShardHeader& h, const std::vector<int>& counts);

// Dequantized and rotated factors: row r = [a_r (N) | b_r (C)] of component r, owner[r] its
// matrix. Bit-equal to codec.quant.ProgressiveQuantizer.decode.
struct Factors {
  int rows = 0;
  int length = 0;
  std::vector<std::uint8_t> owner;
  std::vector<float> values;  // rows x length
};

Factors dequantize(const std::uint8_t* data, std::size_t size, const ShardHeader& h,
                   const std::vector<int>& ranks);

// X_m = sum over the components of matrix m of a_c b_c^T, written to out[m] ([M, N, C],
// float32), keys (even m) then rotated by `rope` ([N, C/2, 2] cos/sin, or nullptr).
// Matrices are spread over `threads` threads; the result does not depend on `threads`.
void reconstruct(const Factors& f, const ShardHeader& h, const float* rope, float* out,
                 int threads);

// Everything above: header, checks, dequantize, reconstruct. `out` holds M * N * C floats.
void decode_shard(const std::uint8_t* data, std::size_t size, const std::vector<int>& ranks,
                  const float* rope, float* out, int threads);

// out[t, j] = sum_p a[p, t] * b[p, j] for t < n, j < c (a: [k, lda], b: [k, ldb], out
// row stride ldc); lda >= round_up(n, 6) and ldb >= round_up(c, 32), padding zeroed.
// Picks the widest SIMD kernel the CPU supports.
void lowrank_product(const float* a, int lda, const float* b, int ldb, int k, int n, int c,
                     float* out, int ldc);

// Name of the kernel lowrank_product uses on this CPU ("avx512", "avx2", "generic").
const char* product_kernel();

constexpr int kProductRows = 6;   // rows of the product tile (padding of a)
constexpr int kProductCols = 32;  // columns of the product tile (padding of b)

}  // namespace sakura
