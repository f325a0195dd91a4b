// CompiledGraph over ExecuTorch's C++ runtime (the `executorch` wheel's _portable_lib, with
// the XNNPACK backend registered). The program bytes stay in memory for the graph's
// lifetime; memory planning follows the method's metadata (one buffer per planned id).
#include "sakura/graph.hpp"

#include <atomic>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <executorch/extension/tensor/tensor_ptr_maker.h>
#include <executorch/extension/threadpool/threadpool.h>
#include <executorch/runtime/core/data_loader.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/runtime.h>

namespace sakura {

namespace et = ::executorch::runtime;
using ::executorch::aten::ScalarType;

std::int64_t TensorSpec::numel() const {
  std::int64_t n = 1;
  for (auto s : sizes) n *= s;
  return n;
}

std::string TensorSpec::describe() const {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  os << "]";
  return os.str();
}

namespace {

// The whole .pte in one buffer; segments are views into it.
class BufferLoader final : public et::DataLoader {
 public:
  explicit BufferLoader(std::vector<std::uint8_t> data) : data_(std::move(data)) {}

  et::Result<et::FreeableBuffer> load(std::size_t offset, std::size_t size,
                                      const SegmentInfo&) const override {
    if (offset > data_.size() || size > data_.size() - offset) return et::Error::InvalidArgument;
    return et::FreeableBuffer(data_.data() + offset, size, nullptr);
  }

  et::Result<std::size_t> size() const override { return data_.size(); }

 private:
  std::vector<std::uint8_t> data_;
};

std::vector<std::uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open compiled graph " + path);
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(f), {});
}

void check(et::Error e, const std::string& what) {
  if (e != et::Error::Ok) {
    throw std::runtime_error(what + " (ExecuTorch error " +
                             std::to_string(static_cast<int>(e)) + ")");
  }
}

TensorSpec spec_of(const et::TensorInfo& info, const std::string& what) {
  if (info.scalar_type() != ScalarType::Float) {
    throw std::runtime_error(what + " is not float32");
  }
  TensorSpec s;
  for (auto d : info.sizes()) s.sizes.push_back(d);
  return s;
}

void init_runtime_once() {
  static const bool done = [] {
    et::runtime_init();
    return true;
  }();
  (void)done;
}

}  // namespace

// Programs alive in this process. Their XNNPACK runtimes hold ExecuTorch's process-wide
// threadpool from the moment they load, so that pool may not be replaced while any is alive
// (a text encoder loaded before set_graph_threads(1) replaced the pool segfaulted on its
// next run): a count as process-wide as the pool it guards.
namespace {
std::atomic<int> g_live_programs{0};
}  // namespace

struct CompiledGraph::Impl {
  explicit Impl(std::vector<std::uint8_t> bytes) : loader(std::move(bytes)) { ++g_live_programs; }
  ~Impl() { --g_live_programs; }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  BufferLoader loader;
  std::unique_ptr<et::Program> program;
  std::vector<std::vector<std::uint8_t>> planned;
  std::vector<et::Span<std::uint8_t>> spans;
  std::unique_ptr<et::HierarchicalAllocator> planned_alloc;
  std::vector<std::uint8_t> method_pool, temp_pool;
  std::unique_ptr<et::MemoryAllocator> method_alloc, temp_alloc;
  std::unique_ptr<et::MemoryManager> memory;
  std::unique_ptr<et::Method> method;
};

CompiledGraph::CompiledGraph(const std::string& path) : path_(path) {
  init_runtime_once();
  impl_ = std::make_unique<Impl>(read_file(path));
  auto program = et::Program::load(&impl_->loader, et::Program::Verification::Minimal);
  if (!program.ok()) throw std::runtime_error(path + " is not an ExecuTorch program");
  impl_->program = std::make_unique<et::Program>(std::move(program.get()));
  auto meta = impl_->program->method_meta("forward");
  if (!meta.ok()) throw std::runtime_error(path + " has no forward method");
  for (std::size_t i = 0; i < meta->num_memory_planned_buffers(); ++i) {
    auto size = meta->memory_planned_buffer_size(i);
    check(size.error(), path + ": memory plan");
    impl_->planned.emplace_back(static_cast<std::size_t>(size.get()));
  }
  for (auto& b : impl_->planned) impl_->spans.emplace_back(b.data(), b.size());
  impl_->planned_alloc = std::make_unique<et::HierarchicalAllocator>(
      et::Span<et::Span<std::uint8_t>>(impl_->spans.data(), impl_->spans.size()));
  // method structures (values, delegate handles) and kernel scratch space
  impl_->method_pool.resize(8 << 20);
  impl_->temp_pool.resize(8 << 20);
  impl_->method_alloc = std::make_unique<et::MemoryAllocator>(
      static_cast<std::uint32_t>(impl_->method_pool.size()), impl_->method_pool.data());
  impl_->temp_alloc = std::make_unique<et::MemoryAllocator>(
      static_cast<std::uint32_t>(impl_->temp_pool.size()), impl_->temp_pool.data());
  impl_->memory = std::make_unique<et::MemoryManager>(
      impl_->method_alloc.get(), impl_->planned_alloc.get(), impl_->temp_alloc.get());
  auto method = impl_->program->load_method("forward", impl_->memory.get());
  if (!method.ok()) {
    throw std::runtime_error(path + ": cannot load its forward method (ExecuTorch error " +
                             std::to_string(static_cast<int>(method.error())) + ")");
  }
  impl_->method = std::make_unique<et::Method>(std::move(method.get()));
  for (std::size_t i = 0; i < meta->num_inputs(); ++i) {
    auto info = meta->input_tensor_meta(i);
    check(info.error(), path + ": input " + std::to_string(i) + " is not a tensor");
    inputs_.push_back(spec_of(info.get(), path + ": input " + std::to_string(i)));
  }
  for (std::size_t i = 0; i < meta->num_outputs(); ++i) {
    auto info = meta->output_tensor_meta(i);
    check(info.error(), path + ": output " + std::to_string(i) + " is not a tensor");
    outputs_.push_back(spec_of(info.get(), path + ": output " + std::to_string(i)));
  }
}

CompiledGraph::~CompiledGraph() = default;

std::vector<std::vector<std::int64_t>> CompiledGraph::run(const std::vector<GraphInput>& inputs,
                                                          const std::vector<float*>& outputs) {
  if (inputs.size() != inputs_.size() || outputs.size() != outputs_.size()) {
    throw std::runtime_error(path_ + ": called with " + std::to_string(inputs.size()) +
                             " inputs / " + std::to_string(outputs.size()) + " outputs, wants " +
                             std::to_string(inputs_.size()) + " / " +
                             std::to_string(outputs_.size()));
  }
  auto& method = *impl_->method;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const auto& want = inputs_[i].sizes;
    const auto& got = inputs[i].sizes;
    bool fits = got.size() == want.size();
    for (std::size_t d = 0; fits && d < got.size(); ++d) fits = got[d] >= 1 && got[d] <= want[d];
    if (!fits) {
      TensorSpec g{got};
      throw std::runtime_error(path_ + ": input " + std::to_string(i) + " of shape " +
                               g.describe() + " does not fit the graph's " +
                               inputs_[i].describe());
    }
    std::vector<::executorch::aten::SizesType> sizes(got.begin(), got.end());
    auto tensor = ::executorch::extension::from_blob(const_cast<float*>(inputs[i].data), sizes,
                                                     ScalarType::Float);
    check(method.set_input(et::EValue(*tensor), i),
          path_ + ": input " + std::to_string(i) + " (shape not accepted)");
  }
  check(method.execute(), path_ + ": execution failed");
  std::vector<std::vector<std::int64_t>> shapes;
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const et::EValue& out = method.get_output(i);
    if (!out.isTensor()) throw std::runtime_error(path_ + ": output is not a tensor");
    const auto& t = out.toTensor();
    if (t.numel() > outputs_[i].numel()) {
      throw std::runtime_error(path_ + ": output " + std::to_string(i) + " has " +
                               std::to_string(t.numel()) + " values, more than its bound " +
                               std::to_string(outputs_[i].numel()));
    }
    std::memcpy(outputs[i], t.const_data_ptr<float>(), sizeof(float) * t.numel());
    shapes.emplace_back(t.sizes().begin(), t.sizes().end());
  }
  return shapes;
}

int set_graph_threads(int threads) {
  auto* pool = ::executorch::extension::threadpool::get_threadpool();
  if (pool == nullptr) return 1;
  const int now = static_cast<int>(pool->get_thread_count());
  if (threads > 0 && threads != now) {
    const int live = g_live_programs.load();
    if (live > 0) {
      throw std::runtime_error(
          "the graphs' thread count cannot change from " + std::to_string(now) + " to " +
          std::to_string(threads) + " while " + std::to_string(live) +
          " programs are loaded (they hold ExecuTorch's threadpool): set it before loading any");
    }
    pool->_unsafe_reset_threadpool(static_cast<std::uint32_t>(threads));
  }
  return static_cast<int>(pool->get_thread_count());
}

bool graphs_available() { return true; }

}  // namespace sakura
