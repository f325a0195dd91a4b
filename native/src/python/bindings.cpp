// pybind11 bindings: module `sakura_native`. Every call that computes releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string_view>
#include <utility>

#include "sakura/pipeline.hpp"
#include "sakura/shard.hpp"

namespace py = pybind11;
using sakura::FormatError;

void bind_allocation(py::module_& m);  // bind_allocation.cpp
#ifdef SAKURA_EDIT_RUNTIME
void bind_edit(py::module_& m);  // bind_edit.cpp
#endif

namespace {

std::string_view bytes_view(const py::bytes& b) {
  char* ptr = nullptr;
  Py_ssize_t len = 0;
  if (PyBytes_AsStringAndSize(b.ptr(), &ptr, &len) != 0) throw py::error_already_set();
  return {ptr, static_cast<std::size_t>(len)};
}

const std::uint8_t* u8(std::string_view v) {
  return reinterpret_cast<const std::uint8_t*>(v.data());
}

// The RoPE table as a float pointer after checking it is [N, C/2, 2] float32 C-contiguous.
const float* rope_ptr(const std::optional<py::array>& rope, const sakura::ShardHeader& h) {
  if (!rope) return nullptr;
  const py::array& a = *rope;
  if (!py::isinstance<py::array_t<float>>(a) || !(a.flags() & py::array::c_style) ||
      a.ndim() != 3 || a.shape(0) != h.tokens || a.shape(1) != h.channels / 2 ||
      a.shape(2) != 2 || h.channels % 2) {
    throw FormatError("rope must be a C-contiguous float32 array [N, C/2, 2] = [" +
                      std::to_string(h.tokens) + ", " + std::to_string(h.channels / 2) +
                      ", 2]");
  }
  return static_cast<const float*>(a.data());
}

py::array_t<float> decode(const py::bytes& data, const std::vector<int>& ranks,
                          const std::optional<py::array>& rope, int threads) {
  const std::string_view v = bytes_view(data);
  const sakura::ShardHeader h = sakura::parse_header(u8(v), v.size());
  const float* table = rope_ptr(rope, h);
  py::array_t<float> out({h.matrices, h.tokens, h.channels});
  float* dst = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    sakura::decode_shard(u8(v), v.size(), ranks, table, dst, threads);
  }
  return out;
}

py::tuple dequantize(const py::bytes& data, const std::vector<int>& ranks) {
  const std::string_view v = bytes_view(data);
  sakura::Factors f;
  {
    py::gil_scoped_release nogil;
    const sakura::ShardHeader h = sakura::parse_header(u8(v), v.size());
    f = sakura::dequantize(u8(v), v.size(), h, ranks);
  }
  py::array_t<std::uint8_t> owner(f.rows);
  std::memcpy(owner.mutable_data(), f.owner.data(), f.owner.size());
  py::array_t<float> values({f.rows, f.length});
  std::memcpy(values.mutable_data(), f.values.data(), f.values.size() * sizeof(float));
  return py::make_tuple(owner, values);
}

sakura::ShardHeader header(const py::bytes& data) {
  const std::string_view v = bytes_view(data);
  return sakura::parse_header(u8(v), v.size());
}

// A struct as a Python class with one read-only property per listed field and to_dict()
// (the fields in the listed order), so each field is named once.
template <class T, class... M>
void readonly_fields(py::class_<T> cls, std::pair<const char*, M T::*>... fields) {
  (cls.def_readonly(fields.first, fields.second), ...);
  cls.def("to_dict", [=](const T& v) {
    py::dict d;
    ((d[fields.first] = py::cast(v.*(fields.second))), ...);
    return d;
  }, "Every field by name.");
}

// A Python reference that is only ever released with the GIL held (stage threads do not
// hold it).
class PyRef {
 public:
  PyRef() = default;
  explicit PyRef(py::object o) : obj_(std::move(o)) {}
  PyRef(PyRef&& other) noexcept : obj_(std::move(other.obj_)) {}
  PyRef& operator=(PyRef&& other) noexcept {
    if (this != &other) {
      reset();
      obj_ = std::move(other.obj_);
    }
    return *this;
  }
  ~PyRef() { reset(); }
  py::object& get() { return obj_; }
  void reset() {
    if (obj_) {
      py::gil_scoped_acquire gil;
      obj_ = py::object();
    }
  }

 private:
  py::object obj_;
};

// What travels through the Python-facing pipeline: a Python object, or (native
// reconstruction) the shard bytes and ranks, then the decoded floats.
struct Item {
  PyRef obj;
  std::string data;
  std::vector<int> ranks;
  std::shared_ptr<std::vector<float>> out;
  int m = 0, n = 0, c = 0;
};

// A Python object's float32 [M, N, C] view of a decoded shard (owns the buffer).
py::array to_array(Item& it) {
  auto* keep = new std::shared_ptr<std::vector<float>>(it.out);
  py::capsule owner(keep, [](void* p) { delete static_cast<std::shared_ptr<std::vector<float>>*>(p); });
  return py::array_t<float>({it.m, it.n, it.c}, it.out->data(), owner);
}

class PyPipeline {
 public:
  PyPipeline(std::size_t received_capacity, std::size_t ready_capacity)
      : options_{received_capacity, ready_capacity} {
    if (received_capacity < 1 || ready_capacity < 1) {
      throw py::value_error("queue capacities must be >= 1");
    }
  }

  sakura::PipelineStats run(std::size_t count, py::function receive, py::function execute,
               std::optional<py::function> reconstruct, std::optional<py::array> rope,
               int decode_threads) {
    const bool native = !reconstruct.has_value();
    auto rope_ref = std::make_shared<PyRef>(rope ? py::object(*rope) : py::object());
    auto recv_ref = std::make_shared<PyRef>(receive);
    auto exec_ref = std::make_shared<PyRef>(execute);
    auto recon_ref = std::make_shared<PyRef>(native ? py::object() : py::object(*reconstruct));

    auto recv = [=](std::size_t i) -> std::optional<Item> {
      py::gil_scoped_acquire gil;
      py::object got = recv_ref->get()(i);
      if (got.is_none()) return std::nullopt;
      Item it;
      if (native) {
        auto pair = got.cast<py::tuple>();
        if (pair.size() != 2) throw FormatError("receive must return (bytes, ranks) or None");
        it.data = std::string(bytes_view(pair[0].cast<py::bytes>()));
        it.ranks = pair[1].cast<std::vector<int>>();
      } else {
        it.obj = PyRef(std::move(got));
      }
      return it;
    };
    auto recon = [=](std::size_t i, Item& it) -> Item {
      Item out;
      if (native) {
        const auto* p = reinterpret_cast<const std::uint8_t*>(it.data.data());
        const sakura::ShardHeader h = sakura::parse_header(p, it.data.size());
        const float* table = nullptr;
        if (rope_ref->get()) {
          py::gil_scoped_acquire gil;
          table = rope_ptr(rope_ref->get().cast<py::array>(), h);
        }
        out.m = h.matrices;
        out.n = h.tokens;
        out.c = h.channels;
        out.out = std::make_shared<std::vector<float>>(
            static_cast<std::size_t>(h.matrices) * h.tokens * h.channels);
        sakura::decode_shard(p, it.data.size(), it.ranks, table, out.out->data(),
                             decode_threads);
      } else {
        py::gil_scoped_acquire gil;
        out.obj = PyRef(recon_ref->get()(i, it.obj.get()));
      }
      return out;
    };
    auto exec = [=](std::size_t i, Item& it) {
      py::gil_scoped_acquire gil;
      if (native) {
        exec_ref->get()(i, to_array(it));
      } else {
        exec_ref->get()(i, it.obj.get());
      }
    };

    auto pipe = std::make_shared<sakura::Pipeline<Item, Item>>(options_, recv, recon, exec);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (current_) throw std::logic_error("this Pipeline is already running");
      current_ = pipe;
    }
    struct Clear {
      PyPipeline* self;
      ~Clear() {
        std::lock_guard<std::mutex> lock(self->mu_);
        self->current_.reset();
      }
    } clear{this};
    {
      py::gil_scoped_release nogil;
      pipe->start(count);
    }
    for (;;) {
      bool done;
      {
        py::gil_scoped_release nogil;
        done = pipe->wait_for(std::chrono::milliseconds(50));
      }
      if (done) break;
      if (PyErr_CheckSignals() != 0) {  // Ctrl-C: stop the stages, then raise
        py::error_already_set interrupt;
        pipe->cancel();
        py::gil_scoped_release nogil;
        try {
          pipe->finish();
        } catch (...) {
        }
        py::gil_scoped_acquire gil;
        throw interrupt;
      }
    }
    sakura::PipelineStats stats;
    {
      py::gil_scoped_release nogil;
      stats = pipe->finish();  // rethrows a stage's exception
    }
    return stats;
  }

  void cancel() {
    std::shared_ptr<sakura::Pipeline<Item, Item>> pipe;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pipe = current_;
    }
    if (pipe) {
      py::gil_scoped_release nogil;
      pipe->cancel();
    }
  }

  bool running() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<bool>(current_);
  }

  std::size_t received_capacity() const { return options_.received_capacity; }
  std::size_t ready_capacity() const { return options_.ready_capacity; }

 private:
  sakura::PipelineOptions options_;
  std::mutex mu_;
  std::shared_ptr<sakura::Pipeline<Item, Item>> current_;
};

sakura::PipelineStats pipeline_overhead(std::size_t count, std::size_t received_capacity,
                           std::size_t ready_capacity) {
  sakura::PipelineStats s;
  {
    py::gil_scoped_release nogil;
    std::size_t sink = 0;
    sakura::Pipeline<std::size_t, std::size_t> pipe(
        {received_capacity, ready_capacity},
        [](std::size_t i) -> std::optional<std::size_t> { return i; },
        [](std::size_t, std::size_t& x) { return x + 1; },
        [&sink](std::size_t, std::size_t& x) { sink += x; });
    s = pipe.run(count);
  }
  return s;
}

}  // namespace

PYBIND11_MODULE(sakura_native, m) {
  m.doc() = "SAKURA native runtime: sakura-codec reconstruction kernels and the "
            "receive -> reconstruct -> execute pipeline (C++17).";
  static py::exception<FormatError> format_error(m, "FormatError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const FormatError& e) {
      py::set_error(format_error, e.what());
    }
  });

  // Typed results (issue 30 item 3): read-only fields and to_dict(), from one list each.
  readonly_fields(
      py::class_<sakura::ShardHeader>(m, "ShardHeader", "A sakura/svd shard stream's header."),
      std::pair{"levels", &sakura::ShardHeader::levels},
      std::pair{"matrices", &sakura::ShardHeader::matrices},
      std::pair{"tokens", &sakura::ShardHeader::tokens},
      std::pair{"channels", &sakura::ShardHeader::channels},
      std::pair{"group", &sakura::ShardHeader::group},
      std::pair{"level_bits", &sakura::ShardHeader::level_bits},
      std::pair{"stored", &sakura::ShardHeader::stored},
      std::pair{"header_size", &sakura::ShardHeader::header_size});
  readonly_fields(
      py::class_<sakura::PipelineStats>(m, "PipelineStats", "What a native pipeline run did."),
      std::pair{"received", &sakura::PipelineStats::received},
      std::pair{"reconstructed", &sakura::PipelineStats::reconstructed},
      std::pair{"executed", &sakura::PipelineStats::executed},
      std::pair{"max_received_depth", &sakura::PipelineStats::max_received_depth},
      std::pair{"max_ready_depth", &sakura::PipelineStats::max_ready_depth},
      std::pair{"cancelled", &sakura::PipelineStats::cancelled},
      std::pair{"wall_s", &sakura::PipelineStats::wall_s});

  m.def("decode", &decode, py::arg("data"), py::arg("ranks"), py::arg("rope") = py::none(),
        py::arg("threads") = 1,
        "Decode one sakura/svd configuration's bytes into float32 [M, N, C] (keys rotated "
        "by the optional RoPE table [N, C/2, 2]).");
  m.def("dequantize", &dequantize, py::arg("data"), py::arg("ranks"),
        "(owner uint8 [k], values float32 [k, N + C]): the dequantized, rotated factors.");
  m.def("header", &header, py::arg("data"), "The parsed shard header (ShardHeader).");
  m.def("product_kernel", &sakura::product_kernel, "SIMD kernel of the low-rank product.");
  m.def("pipeline_overhead", &pipeline_overhead, py::arg("count"),
        py::arg("received_capacity") = 2, py::arg("ready_capacity") = 2,
        "Run `count` shards through a pipeline of native no-op stages; its stats.");

  bind_allocation(m);
#ifdef SAKURA_EDIT_RUNTIME
  bind_edit(m);
  m.def("edit_runtime_available", [] { return py::make_tuple(true, ""); },
        "(True, \"\"), or (False, why): whether this build has the native edit runtime.");
#else
  m.def("edit_runtime_available", [] { return py::make_tuple(false, SAKURA_EDIT_UNAVAILABLE); },
        "(True, \"\"), or (False, why): whether this build has the native edit runtime.");
#endif

  py::class_<PyPipeline>(m, "Pipeline")
      .def(py::init<std::size_t, std::size_t>(), py::arg("received_capacity") = 2,
           py::arg("ready_capacity") = 2)
      .def("run", &PyPipeline::run, py::arg("count"), py::arg("receive"), py::arg("execute"),
           py::arg("reconstruct") = py::none(), py::arg("rope") = py::none(),
           py::arg("decode_threads") = 1,
           "Run shards 0..count-1: receive(i) -> item | None (end); reconstruct(i, item) -> "
           "shard (None: native decode of item = (bytes, ranks)); execute(i, shard). "
           "Returns its PipelineStats; re-raises the first stage exception.")
      .def("cancel", &PyPipeline::cancel, "Cancel the run in progress (from any thread).")
      .def_property_readonly("running", &PyPipeline::running)
      .def_property_readonly("received_capacity", &PyPipeline::received_capacity)
      .def_property_readonly("ready_capacity", &PyPipeline::ready_capacity);

  // GPU (OpenCL) reconstruction: OpenCLDecoder, opencl_device(), opencl_available()
  // (src/python/bind_opencl.cpp; issue 23)
  void bind_opencl(py::module_ & m);
  bind_opencl(m);

  // the text side: tokenize, Tokenizer, TextEncoder, TokenizerError (src/python/bind_text.cpp;
  // issue 31)
  void bind_text(py::module_ & m);
  bind_text(m);
}
