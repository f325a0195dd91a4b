// Header parsing, progressive dequantization, rotation and RoPE. Compiled with
// -ffp-contract=off: every float operation rounds exactly as the Python decoder's.
#include "sakura/shard.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

namespace sakura {
namespace {

constexpr int kMaxDim = 1 << 20;  // bounds N and C so sizes never overflow

std::uint32_t read_u32(const std::uint8_t* p) {
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
         static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
}

std::uint16_t read_u16(const std::uint8_t* p) {
  return static_cast<std::uint16_t>(p[0] | p[1] << 8);
}

float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000) << 16;
  std::uint32_t exp = (h >> 10) & 0x1f;
  std::uint32_t man = h & 0x3ff;
  std::uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// acc[i] (+)= (code_i - half) * scale for the codes of one packed row (LSB-first, BITS per
// code). `lut[byte]` holds (code - half) of the byte's 8 / BITS codes, so a byte is one
// small vector operation.
template <int BITS, bool FIRST>
void accumulate_fixed(const std::uint8_t* row, int length, const float* lut, float scale,
                      float* acc) {
  constexpr int kPer = 8 / BITS;
  const int bytes = length / kPer;
  for (int j = 0; j < bytes; ++j) {
    const float* v = lut + row[j] * kPer;
    float* a = acc + j * kPer;
    for (int p = 0; p < kPer; ++p) {
      if (FIRST) {
        a[p] = v[p];
      } else {
        a[p] += v[p] * scale;
      }
    }
  }
  if (bytes * kPer < length) {
    const float* v = lut + row[bytes] * kPer;
    for (int p = 0; bytes * kPer + p < length; ++p) {
      if (FIRST) {
        acc[bytes * kPer + p] = v[p];
      } else {
        acc[bytes * kPer + p] += v[p] * scale;
      }
    }
  }
}

// (code - half) for every byte value: 256 x (8 / bits) floats.
std::vector<float> byte_table(int bits, float half) {
  const int per = 8 / bits;
  std::vector<float> lut(256 * per);
  for (int b = 0; b < 256; ++b) {
    for (int p = 0; p < per; ++p) {
      lut[b * per + p] = static_cast<float>((b >> (p * bits)) & ((1 << bits) - 1)) - half;
    }
  }
  return lut;
}

// Any width 1..8 (codes may straddle bytes).
template <bool FIRST>
void accumulate_any(const std::uint8_t* row, int bits, int length, float half, float scale,
                    float* acc) {
  const unsigned mask = (1u << bits) - 1;
  const std::size_t row_bytes = (static_cast<std::size_t>(length) * bits + 7) / 8;
  for (int i = 0; i < length; ++i) {
    const std::size_t pos = static_cast<std::size_t>(i) * bits;
    const std::size_t byte = pos >> 3;
    unsigned word = row[byte];
    if (byte + 1 < row_bytes) word |= static_cast<unsigned>(row[byte + 1]) << 8;
    const float v = static_cast<float>((word >> (pos & 7)) & mask) - half;
    if (FIRST) {
      acc[i] = v;
    } else {
      acc[i] += v * scale;
    }
  }
}

template <bool FIRST>
void accumulate(const std::uint8_t* row, int bits, int length, float half, const float* lut,
                float scale, float* acc) {
  switch (bits) {
    case 1: return accumulate_fixed<1, FIRST>(row, length, lut, scale, acc);
    case 2: return accumulate_fixed<2, FIRST>(row, length, lut, scale, acc);
    case 4: return accumulate_fixed<4, FIRST>(row, length, lut, scale, acc);
    case 8: return accumulate_fixed<8, FIRST>(row, length, lut, scale, acc);
    default: return accumulate_any<FIRST>(row, bits, length, half, scale, acc);
  }
}

struct Piece {
  int start;
  int size;
  int group;  // its quantization step
};

// Pieces of the segment plan (codec.quant.SegmentPlan): per part, full groups, then the
// tail in descending powers of two; the step index of every position.
void plan_pieces(const ShardHeader& h, std::vector<Piece>& pieces, std::vector<int>& gidx) {
  const int parts[2] = {h.tokens, h.channels};
  int start = 0;
  int gid = 0;
  gidx.assign(h.length(), 0);
  for (int part : parts) {
    const int full = part / h.group;
    int tail = part % h.group;
    for (int b = 0; b < full; ++b) {
      pieces.push_back({start + b * h.group, h.group, gid + b});
      for (int i = 0; i < h.group; ++i) gidx[start + b * h.group + i] = gid + b;
    }
    gid += full;
    int pos = start + full * h.group;
    if (tail) {
      for (int i = pos; i < start + part; ++i) gidx[i] = gid;
      ++gid;
    }
    for (int bit = 1 << 30; tail; bit >>= 1) {
      if (tail & bit) {
        pieces.push_back({pos, bit, gid - 1});
        pos += bit;
        tail -= bit;
      }
    }
    start += part;
  }
}

// In-place unnormalised Walsh-Hadamard transform (Sylvester order) of x[0..n). Every sum
// here is exact (see dequantize), so the butterfly order does not change the result.
void fwht(float* x, int n) {
  int len = 1;
  if (n >= 4) {  // the first two stages, four values at a time
    for (int i = 0; i < n; i += 4) {
      const float a = x[i] + x[i + 1], b = x[i] - x[i + 1];
      const float c = x[i + 2] + x[i + 3], d = x[i + 2] - x[i + 3];
      x[i] = a + c;
      x[i + 1] = b + d;
      x[i + 2] = a - c;
      x[i + 3] = b - d;
    }
    len = 4;
  }
  for (; len < n; len <<= 1) {
    for (int i = 0; i < n; i += len << 1) {
      float* lo = x + i;
      float* hi = x + i + len;
      for (int j = 0; j < len; ++j) {
        const float u = lo[j];
        const float v = hi[j];
        lo[j] = u + v;
        hi[j] = u - v;
      }
    }
  }
}

void rope_rotate(float* x, const float* table, int n, int c) {
  const int pairs = c / 2;
  for (int t = 0; t < n; ++t) {
    float* row = x + static_cast<std::size_t>(t) * c;
    const float* ph = table + static_cast<std::size_t>(t) * pairs * 2;
    for (int j = 0; j < pairs; ++j) {
      const float re = row[2 * j];
      const float im = row[2 * j + 1];
      const float cs = ph[2 * j];
      const float sn = ph[2 * j + 1];
      row[2 * j] = re * cs - im * sn;
      row[2 * j + 1] = re * sn + im * cs;
    }
  }
}

int round_up(int x, int m) { return (x + m - 1) / m * m; }

}  // namespace

int ShardHeader::groups() const {
  return (tokens + group - 1) / group + (channels + group - 1) / group;
}

std::size_t ShardHeader::chunk_bytes(int level) const {
  const std::size_t codes = (static_cast<std::size_t>(length()) * level_bits[level] + 7) / 8;
  return codes + (level == 0 ? 1 + 2 * static_cast<std::size_t>(groups()) : 0);
}

ShardHeader parse_header(const std::uint8_t* data, std::size_t size) {
  if (size < 19) {
    throw FormatError(std::to_string(size) + " bytes is too short for a header");
  }
  if (std::memcmp(data, "SKLR", 4) != 0) throw FormatError("not a low-rank shard stream (bad magic)");
  if (data[4] != 2) {
    throw FormatError("low-rank stream version " + std::to_string(data[4]) +
                      " is not supported (this decoder reads version 2; rebuild the pack)");
  }
  ShardHeader h;
  h.levels = data[5];
  h.matrices = read_u16(data + 6);
  const std::uint32_t n = read_u32(data + 8);
  const std::uint32_t c = read_u32(data + 12);
  h.group = read_u16(data + 16);
  if (h.levels < 1 || h.levels > 15) throw FormatError("header has 0 or more than 15 levels");
  if (h.matrices < 1 || h.matrices > 255) {
    throw FormatError("header has " + std::to_string(h.matrices) + " matrices (1..255)");
  }
  if (n < 1 || c < 1 || n > kMaxDim || c > kMaxDim) {
    throw FormatError("header geometry " + std::to_string(n) + " x " + std::to_string(c) +
                      " is out of range");
  }
  h.tokens = static_cast<int>(n);
  h.channels = static_cast<int>(c);
  if (h.group < 1 || (h.group & (h.group - 1))) {
    throw FormatError("group " + std::to_string(h.group) + " is not a power of two");
  }
  std::size_t pos = 18;
  if (size < pos + h.levels + 2) {
    throw FormatError(std::to_string(size) + " bytes is too short for a " +
                      std::to_string(h.levels) + "-level header");
  }
  for (int l = 0; l < h.levels; ++l) {
    const int b = data[pos + l];
    if (b < 1 || b > 8) throw FormatError("level " + std::to_string(l) + " has " +
                                          std::to_string(b) + " bits (1..8)");
    h.level_bits.push_back(b);
  }
  pos += h.levels;
  const int top = read_u16(data + pos);
  pos += 2;
  const std::size_t bitmap = (static_cast<std::size_t>(top) + 7) / 8;
  if (top < 1 || size < pos + bitmap + 2) throw FormatError("header truncated in its rank ladder");
  for (int r = 1; r <= top; ++r) {
    if ((data[pos + (r - 1) / 8] >> ((r - 1) % 8)) & 1) h.ladder.push_back(r);
  }
  if (h.ladder.empty() || h.ladder.back() != top) {
    throw FormatError("rank ladder bitmap does not end at its top rank");
  }
  pos += bitmap;
  const int count = read_u16(data + pos);
  pos += 2;
  if (size < pos + (static_cast<std::size_t>(count) + 1) / 2) {
    throw FormatError("header truncated in its unit list");
  }
  std::vector<int> counts(h.levels, 0), seen(h.levels, 0);
  for (int k = 0; k < count; ++k) {
    const int lv = (data[pos + k / 2] >> (4 * (k % 2))) & 15;
    if (lv >= h.levels || seen[lv] >= static_cast<int>(h.ladder.size())) {
      throw FormatError("unit " + std::to_string(k) + " is beyond the stream's levels or ladder");
    }
    const long long end = static_cast<long long>(h.ladder[seen[lv]]) * h.matrices;
    if (lv && end > counts[lv - 1]) {
      throw FormatError("unit " + std::to_string(k) + " refines components level " +
                        std::to_string(lv - 1) + " does not hold yet");
    }
    h.units.push_back({lv, counts[lv], static_cast<int>(end)});
    counts[lv] = static_cast<int>(end);
    ++seen[lv];
  }
  pos += (static_cast<std::size_t>(count) + 1) / 2;
  h.header_size = pos;
  for (int l = 0; l < h.levels; ++l) h.stored.push_back(static_cast<std::uint32_t>(counts[l]));
  return h;
}

int prefix_units(const ShardHeader& h, const std::vector<int>& counts) {
  std::vector<int> have(h.levels, 0);
  for (std::size_t k = 0; k < h.units.size(); ++k) {
    have[h.units[k].level] = h.units[k].end;
    if (have == counts) return static_cast<int>(k) + 1;
  }
  throw FormatError("the ranks are not a prefix of this shard's stream");
}

std::vector<int> config_counts(const ShardHeader& h, const std::vector<int>& ranks,
                               std::size_t size) {
  if (static_cast<int>(ranks.size()) != h.levels) {
    throw FormatError("ranks has " + std::to_string(ranks.size()) + " entries, the shard " +
                      std::to_string(h.levels) + " levels");
  }
  std::vector<int> counts;
  for (int l = 0; l < h.levels; ++l) {
    if (ranks[l] < 0 || ranks[l] > kMaxDim) throw FormatError("negative or huge rank");
    const long long k = static_cast<long long>(ranks[l]) * h.matrices;
    if (k > h.stored[l] || (l && k > counts[l - 1])) {
      throw FormatError("ranks exceed what the pack stores or increase with precision");
    }
    counts.push_back(static_cast<int>(k));
  }
  if (counts[0] < 1) throw FormatError("a configuration needs at least one component");
  const int units = prefix_units(h, counts);
  std::size_t need = h.header_bytes();
  for (int k = 0; k < units; ++k) {
    const StreamUnit& u = h.units[k];
    need += static_cast<std::size_t>(u.end - u.first) * h.chunk_bytes(u.level);
  }
  if (size != need) {
    throw FormatError(std::to_string(size) + " bytes, the configuration needs " +
                      std::to_string(need));
  }
  return counts;
}

Factors dequantize(const std::uint8_t* data, std::size_t size, const ShardHeader& h,
                   const std::vector<int>& ranks) {
  const std::vector<int> counts = config_counts(h, ranks, size);
  const int len = h.length();
  const int groups = h.groups();
  Factors f;
  f.rows = counts[0];
  f.length = len;
  f.owner.resize(f.rows);
  f.values.assign(static_cast<std::size_t>(f.rows) * len, 0.0f);

  std::vector<Piece> pieces;
  std::vector<int> gidx;
  plan_pieces(h, pieces, gidx);
  // sign / sqrt(piece) per position: the double rounded once to float (as Python)
  std::vector<float> scale(len);
  for (const Piece& p : pieces) {
    const double norm = 1.0 / std::sqrt(static_cast<double>(p.size));
    for (int i = p.start; i < p.start + p.size; ++i) {
      const std::uint64_t top = ((static_cast<std::uint64_t>(i) * 2654435761ull) & 0xffffffffull) >> 31;
      scale[i] = static_cast<float>((1.0 - 2.0 * static_cast<double>(top)) * norm);
    }
  }

  // where each component's chunk of each level is (the units of the prefix, in order)
  std::vector<std::vector<const std::uint8_t*>> rows(h.levels);
  for (int l = 0; l < h.levels; ++l) rows[l].reserve(counts[l]);
  std::size_t off = h.header_bytes();
  const int units = prefix_units(h, counts);
  for (int k = 0; k < units; ++k) {
    const StreamUnit& u = h.units[k];
    const std::size_t chunk = h.chunk_bytes(u.level);
    for (int r = u.first; r < u.end; ++r, off += chunk) rows[u.level].push_back(data + off);
  }

  std::vector<float> halves(h.levels), level_scales(h.levels);
  std::vector<std::vector<float>> luts(h.levels);
  double level_scale = 1.0;
  for (int l = 0; l < h.levels; ++l) {
    const int bits = h.level_bits[l];
    if (l) level_scale /= static_cast<double>(1 << bits);
    level_scales[l] = static_cast<float>(level_scale);
    halves[l] = static_cast<float>(((1 << bits) - 1) / 2.0);
    if (8 % bits == 0) luts[l] = byte_table(bits, halves[l]);
  }
  std::vector<float> steps(groups);
  for (int r = 0; r < f.rows; ++r) {
    float* acc = f.values.data() + static_cast<std::size_t>(r) * len;
    const std::uint8_t* chunk = rows[0][r];
    f.owner[r] = chunk[0];
    if (chunk[0] >= h.matrices) {
      throw FormatError("component " + std::to_string(r) + " belongs to matrix " +
                        std::to_string(chunk[0]) + " of " + std::to_string(h.matrices));
    }
    for (int g = 0; g < groups; ++g) steps[g] = half_to_float(read_u16(chunk + 1 + 2 * g));
    accumulate<true>(chunk + 1 + 2 * groups, h.level_bits[0], len, halves[0],
                     luts[0].data(), 1.0f, acc);
    for (int l = 1; l < h.levels && r < counts[l]; ++l) {
      accumulate<false>(rows[l][r], h.level_bits[l], len, halves[l], luts[l].data(),
                        level_scales[l], acc);
    }
    // exact: the +-1 sums of dyadic values fit in float32 (see codec/quant.py); then one
    // rounding for the step (constant within a piece), one for sign / sqrt(piece)
    for (const Piece& p : pieces) {
      float* x = acc + p.start;
      if (p.size > 1) fwht(x, p.size);
      const float step = steps[p.group];
      const float* sc = scale.data() + p.start;
      for (int i = 0; i < p.size; ++i) x[i] *= step;
      for (int i = 0; i < p.size; ++i) x[i] *= sc[i];
    }
  }
  return f;
}

void reconstruct(const Factors& f, const ShardHeader& h, const float* rope, float* out,
                 int threads) {
  const int n = h.tokens;
  const int c = h.channels;
  const int lda = round_up(n, kProductRows);
  const int ldb = round_up(c, kProductCols);
  std::vector<std::vector<int>> comps(h.matrices);
  for (int r = 0; r < f.rows; ++r) comps[f.owner[r]].push_back(r);

  auto one_matrix = [&](int m, std::vector<float>& a, std::vector<float>& b) {
    float* x = out + static_cast<std::size_t>(m) * n * c;
    const int k = static_cast<int>(comps[m].size());
    if (k == 0) {
      std::fill(x, x + static_cast<std::size_t>(n) * c, 0.0f);
    } else {
      a.assign(static_cast<std::size_t>(k) * lda, 0.0f);
      b.assign(static_cast<std::size_t>(k) * ldb, 0.0f);
      for (int p = 0; p < k; ++p) {
        const float* row = f.values.data() + static_cast<std::size_t>(comps[m][p]) * f.length;
        std::copy(row, row + n, a.data() + static_cast<std::size_t>(p) * lda);
        std::copy(row + n, row + n + c, b.data() + static_cast<std::size_t>(p) * ldb);
      }
      lowrank_product(a.data(), lda, b.data(), ldb, k, n, c, x, c);
    }
    if (rope && m % 2 == 0) rope_rotate(x, rope, n, c);
  };
  auto worker = [&](int first, int stride) {
    std::vector<float> a, b;
    for (int m = first; m < h.matrices; m += stride) one_matrix(m, a, b);
  };
  const int t = std::max(1, std::min(threads, h.matrices));
  if (t == 1) {
    worker(0, 1);
    return;
  }
  std::vector<std::thread> pool;
  for (int i = 1; i < t; ++i) pool.emplace_back(worker, i, t);
  worker(0, t);
  for (auto& th : pool) th.join();
}

void decode_shard(const std::uint8_t* data, std::size_t size, const std::vector<int>& ranks,
                  const float* rope, float* out, int threads) {
  const ShardHeader h = parse_header(data, size);
  if (rope && h.channels % 2) throw FormatError("RoPE needs an even number of channels");
  const Factors f = dequantize(data, size, h, ranks);
  reconstruct(f, h, rope, out, threads);
}

}  // namespace sakura
