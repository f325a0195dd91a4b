// GPU reconstruction of a `sakura` / `svd` shard configuration with OpenCL: the same
// contract as decode_shard (shard.hpp), computed by the kernels of opencl_kernels.hpp.
//
// The host parses and checks the bytes with the CPU code (parse_header, config_counts:
// a malformed configuration throws FormatError before anything is enqueued), lays out where
// each component's chunk of each level is, and runs two kernels: dequantize (+ inverse
// rotation) and the low-rank product (+ RoPE of the keys). The dequantized factors are
// bit-equal to the CPU kernels'; the product sums the components in the CPU order with fma,
// so the K/V match the CPU within the float32 summation bound (bit-equal to the AVX2 /
// AVX-512 kernels, which also use fma, wherever the device's fma is IEEE's).
//
// Adreno is the target (the phone's GPU); here the same code runs on pocl (a CPU OpenCL).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sakura {

// The device a decoder runs on.
struct OpenCLDevice {
  std::string platform;
  std::string name;
  std::string version;       // CL_DEVICE_VERSION
  std::string type;          // "gpu", "cpu", "accelerator" or "other"
  bool fp16_arithmetic = false;  // cl_khr_fp16 (storage as fp16 works on every device)
  std::size_t max_work_group = 0;
};

// Devices of every OpenCL platform (empty without an OpenCL runtime / ICD).
std::vector<OpenCLDevice> opencl_devices();

// Kernel times of the last decode (OpenCL profiling events), milliseconds.
struct OpenCLTimings {
  double upload_ms = 0;
  double dequantize_ms = 0;
  double product_ms = 0;
  double download_ms = 0;
};

// One OpenCL context, queue and built program; reusable for any number of shards (its
// device buffers grow to the largest shard seen). Not thread-safe: one per thread (the
// pipeline's reconstruct stage is one thread).
class OpenCLDecoder {
 public:
  // `device`: a substring of the device name to pick (""/default: the first GPU, else the
  // first device of any type). Throws std::runtime_error when there is none or the kernels
  // do not build.
  explicit OpenCLDecoder(const std::string& device = "");
  ~OpenCLDecoder();
  OpenCLDecoder(const OpenCLDecoder&) = delete;
  OpenCLDecoder& operator=(const OpenCLDecoder&) = delete;

  const OpenCLDevice& device() const;
  // Work-group sizes the kernels run with: dequantize (1-D) and product (2-D, square).
  std::size_t dequantize_work_group() const;
  std::size_t product_tile() const;

  // decode_shard's contract: `out` holds M * N * C float32 ([M, N, C]); `rope` is
  // [N, C/2, 2] float32 cos/sin of the keys or nullptr. Throws FormatError for bad bytes.
  void decode(const std::uint8_t* data, std::size_t size, const std::vector<int>& ranks,
              const float* rope, float* out);
  // The same, written as fp16 (IEEE binary16 bits, round to nearest even): M * N * C values.
  void decode_half(const std::uint8_t* data, std::size_t size, const std::vector<int>& ranks,
                   const float* rope, std::uint16_t* out);

  const OpenCLTimings& last_timings() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sakura
