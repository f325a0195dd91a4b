// Python bindings of the OpenCL reconstruction (sakura/opencl_decode.hpp): the
// OpenCLDecoder class, opencl_device() and opencl_available(). Without OpenCL at build time
// (CMake option SAKURA_OPENCL off, or no OpenCL headers / loader found) the same names exist
// and say so: opencl_available() -> (False, why), OpenCLDecoder() raises RuntimeError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "sakura/shard.hpp"
#ifdef SAKURA_HAVE_OPENCL
#include "sakura/opencl_decode.hpp"
#endif

namespace py = pybind11;

namespace {

#ifdef SAKURA_HAVE_OPENCL
py::dict device_dict(const sakura::OpenCLDevice& d) {
  py::dict out;
  out["platform"] = d.platform;
  out["name"] = d.name;
  out["version"] = d.version;
  out["type"] = d.type;
  out["fp16_arithmetic"] = d.fp16_arithmetic;
  out["max_work_group_size"] = d.max_work_group;
  return out;
}

// The device OpenCLDecoder("") picks (first GPU, else the first device), or None.
py::object default_device() {
  const std::vector<sakura::OpenCLDevice> all = sakura::opencl_devices();
  if (all.empty()) return py::none();
  for (const auto& d : all) {
    if (d.type == "gpu") return device_dict(d);
  }
  return device_dict(all.front());
}

py::array decode(sakura::OpenCLDecoder& dec, const py::bytes& data,
                 const std::vector<int>& ranks, const py::object& rope, bool half) {
  std::string_view bytes = data;
  const auto* p = reinterpret_cast<const std::uint8_t*>(bytes.data());
  const sakura::ShardHeader h = sakura::parse_header(p, bytes.size());
  const float* table = nullptr;
  py::array_t<float, py::array::c_style> rope_arr;
  if (!rope.is_none()) {
    py::array arr = py::array::ensure(rope);
    if (!arr || !py::isinstance<py::array_t<float>>(arr) ||
        !(arr.flags() & py::array::c_style) || arr.ndim() != 3 ||
        arr.shape(0) != h.tokens || arr.shape(1) != h.channels / 2 || arr.shape(2) != 2) {
      throw sakura::FormatError("rope must be a C-contiguous float32 array [N, C/2, 2] = [" +
                                std::to_string(h.tokens) + ", " +
                                std::to_string(h.channels / 2) + ", 2]");
    }
    rope_arr = arr;
    table = rope_arr.data();
  }
  const std::vector<py::ssize_t> shape = {h.matrices, h.tokens, h.channels};
  if (half) {
    py::array out(py::dtype("float16"), shape);
    auto* dst = static_cast<std::uint16_t*>(out.mutable_data());
    {
      py::gil_scoped_release release;
      dec.decode_half(p, bytes.size(), ranks, table, dst);
    }
    return out;
  }
  py::array_t<float> out(shape);
  float* dst = out.mutable_data();
  {
    py::gil_scoped_release release;
    dec.decode(p, bytes.size(), ranks, table, dst);
  }
  return out;
}
#endif

}  // namespace

void bind_opencl(py::module_& m) {
#ifdef SAKURA_HAVE_OPENCL
  m.def("opencl_available", []() -> py::tuple {
    if (sakura::opencl_devices().empty()) {
      return py::make_tuple(false, std::string("no OpenCL platform or device (install an "
                                               "OpenCL driver; on Debian pocl-opencl-icd)"));
    }
    return py::make_tuple(true, std::string());
  }, "(True, \"\"), or (False, why): whether an OpenCL device can decode.");
  m.def("opencl_device", &default_device,
        "The device OpenCLDecoder() picks (dict: platform, name, version, type, "
        "fp16_arithmetic, max_work_group_size), or None.");
  py::class_<sakura::OpenCLDecoder>(m, "OpenCLDecoder",
                                    "GPU (OpenCL) reconstruction of sakura/svd shards.")
      .def(py::init<const std::string&>(), py::arg("device") = "",
           "device: a substring of the device name (default: the first GPU, else the "
           "first device).")
      .def("decode", &decode, py::arg("data"), py::arg("ranks"), py::arg("rope") = py::none(),
           py::arg("half") = false,
           "decode()'s contract on the GPU: float32 [M, N, C] (half=True: float16).")
      .def_property_readonly("device", [](const sakura::OpenCLDecoder& d) {
        return device_dict(d.device());
      })
      .def_property_readonly("work_groups", [](const sakura::OpenCLDecoder& d) {
        py::dict out;
        out["dequantize"] = d.dequantize_work_group();
        out["product"] = py::make_tuple(d.product_tile(), d.product_tile());
        return out;
      })
      .def_property_readonly("last_timings", [](const sakura::OpenCLDecoder& d) {
        const sakura::OpenCLTimings& t = d.last_timings();
        py::dict out;
        out["upload_ms"] = t.upload_ms;
        out["dequantize_ms"] = t.dequantize_ms;
        out["product_ms"] = t.product_ms;
        out["download_ms"] = t.download_ms;
        return out;
      });
#else
  static const char* why = "sakura_native was built without OpenCL (install "
                           "ocl-icd-opencl-dev and opencl-headers, then rebuild native/)";
  m.def("opencl_available", []() -> py::tuple { return py::make_tuple(false, std::string(why)); },
        "(True, \"\"), or (False, why): whether an OpenCL device can decode.");
  m.def("opencl_device", [] { return py::none(); }, "None: built without OpenCL.");
  struct OpenCLDecoder {};
  py::class_<OpenCLDecoder>(m, "OpenCLDecoder")
      .def(py::init([](const std::string&) -> OpenCLDecoder { throw std::runtime_error(why); }),
           py::arg("device") = "");
#endif
}
