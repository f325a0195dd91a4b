// OpenCLDecoder: host side of the GPU reconstruction (see opencl_decode.hpp). OpenCL 1.2
// C API (what Adreno drivers, pocl and every ICD expose).
#define CL_TARGET_OPENCL_VERSION 120
#define CL_USE_DEPRECATED_OPENCL_1_2_APIS
#include "sakura/opencl_decode.hpp"

#include <CL/cl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "sakura/opencl_kernels.hpp"
#include "sakura/shard.hpp"

namespace sakura {
namespace {

constexpr std::size_t kTokensPerItem = 4;  // SAKURA_TOKENS in opencl_kernels.hpp

void check(cl_int err, const char* what) {
  if (err != CL_SUCCESS) {
    throw std::runtime_error(std::string("OpenCL: ") + what + " failed (error " +
                             std::to_string(err) + ")");
  }
}

std::string device_string(cl_device_id d, cl_device_info what) {
  std::size_t n = 0;
  if (clGetDeviceInfo(d, what, 0, nullptr, &n) != CL_SUCCESS || n == 0) return "";
  std::string s(n, '\0');
  clGetDeviceInfo(d, what, n, s.data(), nullptr);
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

std::string platform_string(cl_platform_id p, cl_platform_info what) {
  std::size_t n = 0;
  if (clGetPlatformInfo(p, what, 0, nullptr, &n) != CL_SUCCESS || n == 0) return "";
  std::string s(n, '\0');
  clGetPlatformInfo(p, what, n, s.data(), nullptr);
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

struct Found {
  cl_platform_id platform;
  cl_device_id id;
  OpenCLDevice info;
};

std::vector<Found> enumerate() {
  std::vector<Found> out;
  cl_uint np = 0;
  if (clGetPlatformIDs(0, nullptr, &np) != CL_SUCCESS || np == 0) return out;
  std::vector<cl_platform_id> plats(np);
  clGetPlatformIDs(np, plats.data(), nullptr);
  for (cl_platform_id p : plats) {
    cl_uint nd = 0;
    if (clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 0, nullptr, &nd) != CL_SUCCESS || nd == 0) continue;
    std::vector<cl_device_id> devs(nd);
    clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, nd, devs.data(), nullptr);
    for (cl_device_id d : devs) {
      OpenCLDevice info;
      info.platform = platform_string(p, CL_PLATFORM_NAME);
      info.name = device_string(d, CL_DEVICE_NAME);
      info.version = device_string(d, CL_DEVICE_VERSION);
      cl_device_type type = 0;
      clGetDeviceInfo(d, CL_DEVICE_TYPE, sizeof type, &type, nullptr);
      info.type = (type & CL_DEVICE_TYPE_GPU) ? "gpu"
                  : (type & CL_DEVICE_TYPE_CPU) ? "cpu"
                  : (type & CL_DEVICE_TYPE_ACCELERATOR) ? "accelerator"
                                                         : "other";
      info.fp16_arithmetic =
          device_string(d, CL_DEVICE_EXTENSIONS).find("cl_khr_fp16") != std::string::npos;
      std::size_t wg = 0;
      clGetDeviceInfo(d, CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof wg, &wg, nullptr);
      info.max_work_group = wg;
      out.push_back({p, d, info});
    }
  }
  return out;
}

// A device buffer that grows to the largest size asked for.
struct Buffer {
  cl_mem mem = nullptr;
  std::size_t bytes = 0;
  void reserve(cl_context ctx, std::size_t need, cl_mem_flags flags) {
    need = std::max<std::size_t>(need, 4);
    if (need <= bytes) return;
    if (mem) clReleaseMemObject(mem);
    cl_int err = CL_SUCCESS;
    mem = clCreateBuffer(ctx, flags, need, nullptr, &err);
    check(err, "clCreateBuffer");
    bytes = need;
  }
  ~Buffer() {
    if (mem) clReleaseMemObject(mem);
  }
};

double event_ms(cl_event e) {
  cl_ulong a = 0, b = 0;
  clGetEventProfilingInfo(e, CL_PROFILING_COMMAND_START, sizeof a, &a, nullptr);
  clGetEventProfilingInfo(e, CL_PROFILING_COMMAND_END, sizeof b, &b, nullptr);
  return b > a ? static_cast<double>(b - a) * 1e-6 : 0.0;
}

// The segment plan of codec.quant (the same as shard.cpp's): per part (tokens, channels),
// full groups, then the tail as one step split into pieces of descending powers of two.
struct Plan {
  std::vector<int> group_of, start, size;
  std::vector<float> sign_scale;
  int max_piece = 1;
};

Plan plan(const ShardHeader& h) {
  Plan p;
  const int len = h.length();
  p.group_of.assign(len, 0);
  p.start.assign(len, 0);
  p.size.assign(len, 1);
  p.sign_scale.assign(len, 0.0f);
  auto piece = [&](int start, int size, int group) {
    const double norm = 1.0 / std::sqrt(static_cast<double>(size));
    for (int i = start; i < start + size; ++i) {
      p.group_of[i] = group;
      p.start[i] = start;
      p.size[i] = size;
      const std::uint64_t top =
          ((static_cast<std::uint64_t>(i) * 2654435761ull) & 0xffffffffull) >> 31;
      p.sign_scale[i] = static_cast<float>((1.0 - 2.0 * static_cast<double>(top)) * norm);
    }
    p.max_piece = std::max(p.max_piece, size);
  };
  const int parts[2] = {h.tokens, h.channels};
  int start = 0, gid = 0;
  for (int part : parts) {
    const int full = part / h.group;
    int tail = part % h.group;
    for (int b = 0; b < full; ++b) piece(start + b * h.group, h.group, gid + b);
    gid += full;
    int pos = start + full * h.group;
    if (tail) ++gid;
    for (int bit = 1 << 30; tail; bit >>= 1) {
      if (tail & bit) {
        piece(pos, bit, gid - 1);
        pos += bit;
        tail -= bit;
      }
    }
    start += part;
  }
  return p;
}

}  // namespace

std::vector<OpenCLDevice> opencl_devices() {
  std::vector<OpenCLDevice> out;
  for (const Found& f : enumerate()) out.push_back(f.info);
  return out;
}

struct OpenCLDecoder::Impl {
  OpenCLDevice info;
  cl_device_id device = nullptr;
  cl_context ctx = nullptr;
  cl_command_queue queue = nullptr;
  cl_program program_f32 = nullptr, program_f16 = nullptr;
  cl_kernel dequant = nullptr, product_f32 = nullptr, product_f16 = nullptr;
  std::size_t dq_wg = 64;
  std::size_t tile = 16;
  Buffer data, offsets, bits, halves, lscales, group_of, sign_scale, pstart, psize, slot,
      mstart, rope, a, b, out;
  OpenCLTimings timings;

  ~Impl() {
    for (cl_kernel k : {dequant, product_f32, product_f16})
      if (k) clReleaseKernel(k);
    for (cl_program p : {program_f32, program_f16})
      if (p) clReleaseProgram(p);
    if (queue) clReleaseCommandQueue(queue);
    if (ctx) clReleaseContext(ctx);
  }

  cl_program build(const std::string& options) {
    const char* src = opencl_kernel_source();
    cl_int err = CL_SUCCESS;
    cl_program p = clCreateProgramWithSource(ctx, 1, &src, nullptr, &err);
    check(err, "clCreateProgramWithSource");
    err = clBuildProgram(p, 1, &device, options.c_str(), nullptr, nullptr);
    if (err != CL_SUCCESS) {
      std::size_t n = 0;
      clGetProgramBuildInfo(p, device, CL_PROGRAM_BUILD_LOG, 0, nullptr, &n);
      std::string log(n, '\0');
      clGetProgramBuildInfo(p, device, CL_PROGRAM_BUILD_LOG, n, log.data(), nullptr);
      clReleaseProgram(p);
      throw std::runtime_error("OpenCL: the reconstruction kernels do not build on " +
                               info.name + ": " + log.substr(0, 2000));
    }
    return p;
  }

  std::size_t kernel_max(cl_kernel k) const {
    std::size_t wg = 0;
    clGetKernelWorkGroupInfo(k, device, CL_KERNEL_WORK_GROUP_SIZE, sizeof wg, &wg, nullptr);
    return wg;
  }

  void build_all() {
    for (std::size_t t : {std::size_t{16}, std::size_t{8}}) {
      const std::string opt = "-DSAKURA_TILE=" + std::to_string(t);
      cl_program pf = build(opt);
      cl_int err = CL_SUCCESS;
      cl_kernel kf = clCreateKernel(pf, "sakura_product", &err);
      check(err, "clCreateKernel(sakura_product)");
      if (kernel_max(kf) < t * t && t > 8) {  // this device cannot run 16 x 16 groups
        clReleaseKernel(kf);
        clReleaseProgram(pf);
        continue;
      }
      program_f32 = pf;
      product_f32 = kf;
      tile = t;
      program_f16 = build(opt + " -DSAKURA_HALF_OUT");
      product_f16 = clCreateKernel(program_f16, "sakura_product", &err);
      check(err, "clCreateKernel(sakura_product, half)");
      dequant = clCreateKernel(program_f32, "sakura_dequantize", &err);
      check(err, "clCreateKernel(sakura_dequantize)");
      dq_wg = std::min<std::size_t>(64, std::max<std::size_t>(1, kernel_max(dequant)));
      return;
    }
    throw std::runtime_error("OpenCL: " + info.name + " cannot run 8 x 8 work-groups");
  }

  template <typename T>
  void write(Buffer& buf, const std::vector<T>& v, cl_event* ev = nullptr) {
    buf.reserve(ctx, v.size() * sizeof(T), CL_MEM_READ_ONLY);
    if (!v.empty()) {
      check(clEnqueueWriteBuffer(queue, buf.mem, CL_FALSE, 0, v.size() * sizeof(T), v.data(),
                                 0, nullptr, ev),
            "clEnqueueWriteBuffer");
    }
  }

  void run(const std::uint8_t* bytes, std::size_t size, const std::vector<int>& ranks,
           const float* rope_table, void* host_out, bool half) {
    const ShardHeader h = parse_header(bytes, size);
    if (rope_table && h.channels % 2) throw FormatError("RoPE needs an even number of channels");
    const std::vector<int> counts = config_counts(h, ranks, size);
    const int rows = counts[0];
    const int n = h.tokens, c = h.channels, len = h.length(), M = h.matrices;
    if (static_cast<std::size_t>(len) * sizeof(float) > local_mem()) {
      throw std::runtime_error("OpenCL: a component row of " + std::to_string(len) +
                               " floats does not fit the device's local memory");
    }
    // where each component's chunk of each level is (the units of the prefix, in order)
    std::vector<int> offs(static_cast<std::size_t>(h.levels) * rows, -1);
    std::size_t off = h.header_bytes();
    const int units = prefix_units(h, counts);
    for (int k = 0; k < units; ++k) {
      const StreamUnit& u = h.units[k];
      const std::size_t chunk = h.chunk_bytes(u.level);
      for (int r = u.first; r < u.end; ++r, off += chunk) {
        offs[static_cast<std::size_t>(u.level) * rows + r] = static_cast<int>(off);
      }
    }
    // components grouped by matrix, in component order (the CPU kernels' summation order)
    std::vector<int> per(M + 1, 0), slot_of(rows);
    for (int r = 0; r < rows; ++r) {
      const int owner = bytes[offs[r]];
      if (owner >= M) {
        throw FormatError("component " + std::to_string(r) + " belongs to matrix " +
                          std::to_string(owner) + " of " + std::to_string(M));
      }
      ++per[owner + 1];
    }
    for (int m = 0; m < M; ++m) per[m + 1] += per[m];
    std::vector<int> fill(per.begin(), per.end() - 1);
    for (int r = 0; r < rows; ++r) slot_of[r] = fill[bytes[offs[r]]]++;
    std::vector<int> bits_v(h.levels);
    std::vector<float> halves_v(h.levels), lscales_v(h.levels);
    double level_scale = 1.0;
    for (int l = 0; l < h.levels; ++l) {
      bits_v[l] = h.level_bits[l];
      if (l) level_scale /= static_cast<double>(1 << bits_v[l]);
      lscales_v[l] = static_cast<float>(level_scale);
      halves_v[l] = static_cast<float>(((1 << bits_v[l]) - 1) / 2.0);
    }
    const Plan pl = plan(h);

    cl_event up = nullptr, ev_dq = nullptr, ev_pr = nullptr, down = nullptr;
    data.reserve(ctx, size, CL_MEM_READ_ONLY);
    check(clEnqueueWriteBuffer(queue, data.mem, CL_FALSE, 0, size, bytes, 0, nullptr, &up),
          "clEnqueueWriteBuffer(data)");
    write(offsets, offs);
    write(bits, bits_v);
    write(halves, halves_v);
    write(lscales, lscales_v);
    write(group_of, pl.group_of);
    write(sign_scale, pl.sign_scale);
    write(pstart, pl.start);
    write(psize, pl.size);
    write(slot, slot_of);
    write(mstart, per);
    const std::size_t rope_floats = rope_table ? static_cast<std::size_t>(n) * c : 1;
    rope.reserve(ctx, rope_floats * sizeof(float), CL_MEM_READ_ONLY);
    if (rope_table) {
      check(clEnqueueWriteBuffer(queue, rope.mem, CL_FALSE, 0, rope_floats * sizeof(float),
                                 rope_table, 0, nullptr, nullptr),
            "clEnqueueWriteBuffer(rope)");
    }
    a.reserve(ctx, static_cast<std::size_t>(rows) * n * sizeof(float), CL_MEM_READ_WRITE);
    b.reserve(ctx, static_cast<std::size_t>(rows) * c * sizeof(float), CL_MEM_READ_WRITE);
    const std::size_t values = static_cast<std::size_t>(M) * n * c;
    const std::size_t out_bytes = values * (half ? sizeof(std::uint16_t) : sizeof(float));
    out.reserve(ctx, out_bytes, CL_MEM_WRITE_ONLY);

    const cl_int levels = h.levels, rows_i = rows, n_i = n, c_i = c, groups = h.groups(),
                 max_piece = pl.max_piece;
    cl_uint i = 0;
    auto arg = [&](cl_kernel k, std::size_t sz, const void* v) {
      check(clSetKernelArg(k, i++, sz, v), "clSetKernelArg");
    };
    i = 0;
    for (Buffer* bf : {&data, &offsets, &bits, &halves, &lscales, &group_of, &sign_scale,
                       &pstart, &psize, &slot}) {
      arg(dequant, sizeof(cl_mem), &bf->mem);
    }
    for (const cl_int* v : {&levels, &rows_i, &n_i, &c_i, &groups, &max_piece}) {
      arg(dequant, sizeof(cl_int), v);
    }
    arg(dequant, sizeof(cl_mem), &a.mem);
    arg(dequant, sizeof(cl_mem), &b.mem);
    arg(dequant, static_cast<std::size_t>(len) * sizeof(float), nullptr);  // local row
    const std::size_t dq_global = static_cast<std::size_t>(rows) * dq_wg;
    check(clEnqueueNDRangeKernel(queue, dequant, 1, nullptr, &dq_global, &dq_wg, 0, nullptr,
                                 &ev_dq),
          "clEnqueueNDRangeKernel(sakura_dequantize)");

    cl_kernel prod = half ? product_f16 : product_f32;
    const cl_int use_rope = rope_table ? 1 : 0;
    i = 0;
    arg(prod, sizeof(cl_mem), &a.mem);
    arg(prod, sizeof(cl_mem), &b.mem);
    arg(prod, sizeof(cl_mem), &mstart.mem);
    arg(prod, sizeof(cl_mem), &rope.mem);
    arg(prod, sizeof(cl_int), &use_rope);
    arg(prod, sizeof(cl_int), &n_i);
    arg(prod, sizeof(cl_int), &c_i);
    arg(prod, sizeof(cl_mem), &out.mem);
    const std::size_t pairs = static_cast<std::size_t>(c + 1) / 2;
    const std::size_t rows_per_group = tile * kTokensPerItem;  // see sakura_product
    const std::size_t global[3] = {
        (pairs + tile - 1) / tile * tile,
        (static_cast<std::size_t>(n) + rows_per_group - 1) / rows_per_group * tile,
        static_cast<std::size_t>(M)};
    const std::size_t local[3] = {tile, tile, 1};
    check(clEnqueueNDRangeKernel(queue, prod, 3, nullptr, global, local, 0, nullptr, &ev_pr),
          "clEnqueueNDRangeKernel(sakura_product)");
    check(clEnqueueReadBuffer(queue, out.mem, CL_TRUE, 0, out_bytes, host_out, 0, nullptr,
                              &down),
          "clEnqueueReadBuffer");
    timings = {event_ms(up), event_ms(ev_dq), event_ms(ev_pr), event_ms(down)};
    for (cl_event e : {up, ev_dq, ev_pr, down})
      if (e) clReleaseEvent(e);
  }

  std::size_t local_mem() const {
    cl_ulong bytes = 0;
    clGetDeviceInfo(device, CL_DEVICE_LOCAL_MEM_SIZE, sizeof bytes, &bytes, nullptr);
    return static_cast<std::size_t>(bytes);
  }
};

OpenCLDecoder::OpenCLDecoder(const std::string& device) : impl_(std::make_unique<Impl>()) {
  const std::vector<Found> all = enumerate();
  if (all.empty()) {
    throw std::runtime_error("OpenCL: no platform or device (install an OpenCL driver; on "
                             "Debian pocl-opencl-icd runs OpenCL on the CPU)");
  }
  const Found* pick = nullptr;
  for (const Found& f : all) {
    if (!device.empty()) {
      if (f.info.name.find(device) != std::string::npos) {
        pick = &f;
        break;
      }
    } else if (f.info.type == "gpu") {
      pick = &f;
      break;
    }
  }
  if (!pick && device.empty()) pick = &all.front();
  if (!pick) throw std::runtime_error("OpenCL: no device whose name contains '" + device + "'");
  Impl& s = *impl_;
  s.info = pick->info;
  s.device = pick->id;
  cl_int err = CL_SUCCESS;
  const cl_context_properties props[] = {
      CL_CONTEXT_PLATFORM, reinterpret_cast<cl_context_properties>(pick->platform), 0};
  s.ctx = clCreateContext(props, 1, &s.device, nullptr, nullptr, &err);
  check(err, "clCreateContext");
  s.queue = clCreateCommandQueue(s.ctx, s.device, CL_QUEUE_PROFILING_ENABLE, &err);
  check(err, "clCreateCommandQueue");
  s.build_all();
}

OpenCLDecoder::~OpenCLDecoder() = default;

const OpenCLDevice& OpenCLDecoder::device() const { return impl_->info; }
std::size_t OpenCLDecoder::dequantize_work_group() const { return impl_->dq_wg; }
std::size_t OpenCLDecoder::product_tile() const { return impl_->tile; }
const OpenCLTimings& OpenCLDecoder::last_timings() const { return impl_->timings; }

void OpenCLDecoder::decode(const std::uint8_t* data, std::size_t size,
                           const std::vector<int>& ranks, const float* rope, float* out) {
  impl_->run(data, size, ranks, rope, out, false);
}

void OpenCLDecoder::decode_half(const std::uint8_t* data, std::size_t size,
                                const std::vector<int>& ranks, const float* rope,
                                std::uint16_t* out) {
  impl_->run(data, size, ranks, rope, out, true);
}

}  // namespace sakura
