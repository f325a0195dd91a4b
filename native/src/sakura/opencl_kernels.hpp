// OpenCL C source of the GPU reconstruction (opencl_decode.cpp builds it at run time).
//
// Written for a mobile GPU (Adreno: OpenCL 2.0/3.0 FP, 64/128-wide waves, fp16 storage):
//
// * sakura_dequantize: one work-group per component (work-group size 64, one wave on
//   Adreno; the host lowers it to the kernel's maximum when that is smaller). The
//   component's row [a | b] (N + C floats, < 4 KB for the shipped geometry) lives in
//   local memory: the work-items unpack the codes of every precision level (LSB-first,
//   1..8 bits), run the block Walsh-Hadamard butterflies of every piece stage by stage
//   (a barrier per stage), scale by the piece's step (stored fp16, read with vload_half)
//   and the position's sign / sqrt(piece), and write a_c and b_c to the factor buffers,
//   grouped by matrix. Every sum is exact (codec/quant.py), and FP_CONTRACT is off, so the
//   factors are bit-equal to the CPU kernels'.
// * sakura_product: out[m, t, (2j, 2j+1)] = sum_p a[p, t] b[p, (2j, 2j+1)] over the
//   components p of matrix m, in component order (the CPU kernels' order), with fma;
//   work-group 16 x 16 (16 channel pairs x 16 token lanes = 256 work-items; 8 x 8 where
//   the kernel's maximum is below 256), each work-item holding 4 tokens x 1 channel pair
//   in registers (8 accumulators), so a group covers 64 tokens x 32 channels;
//   16-component tiles of a (16 x 64) and b (16 x 32) staged in local memory (6 KB).
//   Owning a channel pair, a work-item applies the RoPE rotation of the keys (even m) in
//   registers: re*cos - im*sin, re*sin + im*cos, unfused, as the CPU does. The output is float32 or, with
//   SAKURA_HALF_OUT, fp16 (vstore_half_rte: what an fp16 DiT graph on the NPU consumes,
//   half the bytes).
#pragma once

namespace sakura {

inline const char* opencl_kernel_source() {
  return R"CLC(
#pragma OPENCL FP_CONTRACT OFF

float sakura_half_at(__global const uchar* p) {
  ushort bits = (ushort)(p[0] | (p[1] << 8));
  return vload_half(0, (const __private half*)&bits);
}

__kernel void sakura_dequantize(
    __global const uchar* data,      // the configuration's bytes
    __global const int* offsets,     // [levels, rows]: chunk offset of (level, row), -1: none
    __constant int* bits,            // [levels]
    __constant float* halves,        // [levels]: (2^bits - 1) / 2
    __constant float* lscales,       // [levels]: 2^-(bits of levels 1..l)
    __global const int* group_of,    // [len]: quantization step of each position
    __global const float* sign_scale,// [len]: sign / sqrt(piece size)
    __global const int* piece_start, // [len]
    __global const int* piece_size,  // [len]
    __global const int* slot,        // [rows]: output row (components grouped by matrix)
    const int levels, const int rows, const int n, const int c, const int groups,
    const int max_piece,
    __global float* a_out,           // [rows, n]
    __global float* b_out,           // [rows, c]
    __local float* x) {
  const int r = get_group_id(0);
  const int lid = get_local_id(0);
  const int lsz = get_local_size(0);
  const int len = n + c;
  __global const uchar* chunk0 = data + offsets[r];
  for (int i = lid; i < len; i += lsz) {
    float acc = 0.0f;
    for (int l = 0; l < levels; ++l) {
      const int off = offsets[l * rows + r];
      if (off < 0) break;
      __global const uchar* codes = data + off + (l == 0 ? 1 + 2 * groups : 0);
      const int b = bits[l];
      const int pos = i * b;
      const int byte = pos >> 3;
      const int row_bytes = (len * b + 7) >> 3;
      uint word = codes[byte];
      if (byte + 1 < row_bytes) word |= ((uint)codes[byte + 1]) << 8;
      const float v = (float)((word >> (pos & 7)) & ((1u << b) - 1u)) - halves[l];
      if (l == 0) {
        acc = v;
      } else {
        acc += v * lscales[l];
      }
    }
    x[i] = acc;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  // unnormalised Walsh-Hadamard transform of every piece, all pieces stage by stage
  for (int h = 1; h < max_piece; h <<= 1) {
    for (int i = lid; i < len; i += lsz) {
      const int o = i - piece_start[i];
      if (h < piece_size[i] && (o & h) == 0) {
        const float u = x[i];
        const float v = x[i + h];
        x[i] = u + v;
        x[i + h] = u - v;
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const int s = slot[r];
  for (int i = lid; i < len; i += lsz) {
    const float step = sakura_half_at(chunk0 + 1 + 2 * group_of[i]);
    float v = x[i] * step;
    v = v * sign_scale[i];
    if (i < n) {
      a_out[(size_t)s * n + i] = v;
    } else {
      b_out[(size_t)s * c + (i - n)] = v;
    }
  }
}

#ifndef SAKURA_TILE
#define SAKURA_TILE 16
#endif
#define SAKURA_TOKENS 4  // tokens per work-item (register blocking)
#define SAKURA_ROWS (SAKURA_TILE * SAKURA_TOKENS)

__kernel void sakura_product(
    __global const float* a,          // [rows, n], grouped by matrix
    __global const float* b,          // [rows, c]
    __global const int* mstart,       // [matrices + 1]: first row of each matrix
    __global const float* rope,       // [n, c/2, 2] cos/sin (c even), or a 1-float dummy
    const int use_rope, const int n, const int c,
#ifdef SAKURA_HALF_OUT
    __global half* out
#else
    __global float* out
#endif
    ) {
  __local float as[SAKURA_TILE][SAKURA_ROWS];       // [component][token]
  __local float bs[SAKURA_TILE][2 * SAKURA_TILE];   // [component][channel]
  const int lj = get_local_id(0);   // channel pair within the tile
  const int lt = get_local_id(1);   // token lane within the tile
  const int jp = get_global_id(0);  // channel pair
  const int m = get_global_id(2);   // matrix
  const int pairs = (c + 1) / 2;    // an odd last channel is a pair's first half
  const int j0 = get_group_id(0) * SAKURA_TILE * 2;  // first channel of the tile
  const int t0 = get_group_id(1) * SAKURA_ROWS;      // first token of the tile
  const int first = mstart[m];
  const int last = mstart[m + 1];
  float s0[SAKURA_TOKENS], s1[SAKURA_TOKENS];
  for (int i = 0; i < SAKURA_TOKENS; ++i) s0[i] = s1[i] = 0.0f;
  for (int p0 = first; p0 < last; p0 += SAKURA_TILE) {
    // a tile: SAKURA_TILE components x SAKURA_ROWS tokens; b: x 2 * SAKURA_TILE channels
    {
      const int p = p0 + lt;
      for (int i = 0; i < SAKURA_TOKENS; ++i) {
        const int tt = t0 + lj + i * SAKURA_TILE;
        as[lt][lj + i * SAKURA_TILE] = (p < last && tt < n) ? a[(size_t)p * n + tt] : 0.0f;
      }
      const int ch = j0 + 2 * lj;
      bs[lt][2 * lj] = (p < last && ch < c) ? b[(size_t)p * c + ch] : 0.0f;
      bs[lt][2 * lj + 1] = (p < last && ch + 1 < c) ? b[(size_t)p * c + ch + 1] : 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const int kmax = min(SAKURA_TILE, last - p0);
    for (int k = 0; k < kmax; ++k) {
      const float b0 = bs[k][2 * lj];
      const float b1 = bs[k][2 * lj + 1];
      for (int i = 0; i < SAKURA_TOKENS; ++i) {
        const float av = as[k][lt + i * SAKURA_TILE];
        s0[i] = fma(av, b0, s0[i]);
        s1[i] = fma(av, b1, s1[i]);
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (jp >= pairs) return;
  const int second = 2 * jp + 1 < c;
  for (int i = 0; i < SAKURA_TOKENS; ++i) {
    const int t = t0 + lt + i * SAKURA_TILE;
    if (t >= n) break;
    float r0 = s0[i], r1 = s1[i];
    if (use_rope && (m % 2) == 0) {
      const float cs = rope[((size_t)t * pairs + jp) * 2];
      const float sn = rope[((size_t)t * pairs + jp) * 2 + 1];
      const float re_cs = s0[i] * cs;
      const float im_sn = s1[i] * sn;
      const float re_sn = s0[i] * sn;
      const float im_cs = s1[i] * cs;
      r0 = re_cs - im_sn;
      r1 = re_sn + im_cs;
    }
    const size_t o = ((size_t)m * n + t) * c + 2 * jp;
#ifdef SAKURA_HALF_OUT
    vstore_half_rte(r0, o, out);
    if (second) vstore_half_rte(r1, o + 1, out);
#else
    out[o] = r0;
    if (second) out[o + 1] = r1;
#endif
  }
}
)CLC";
}

}  // namespace sakura
