// One compiled graph (an ExecuTorch `.pte` program, XNNPACK-delegated) run from C++: the
// execute stage of the native runtime. Python exports the graphs (sakura.edge.native_graphs)
// and hands their paths over; nothing here touches Python.
//
// Inputs and outputs are float32 tensors of the static shapes the program was exported
// with (checked at load time and on every run). `run` copies the inputs into the
// program's planned memory, executes, and copies the outputs out, so a caller may reuse its
// buffers freely. A CompiledGraph is not thread-safe; each is used by the execute stage only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sakura {

struct TensorSpec {
  std::vector<std::int64_t> sizes;
  std::int64_t numel() const;
  std::string describe() const;
};

class CompiledGraph {
 public:
  // Loads `path` (a .pte file) and its "forward" method; throws std::runtime_error with the
  // reason (missing file, not a program, non-float32 inputs, ...).
  explicit CompiledGraph(const std::string& path);
  ~CompiledGraph();
  CompiledGraph(const CompiledGraph&) = delete;
  CompiledGraph& operator=(const CompiledGraph&) = delete;

  const std::vector<TensorSpec>& inputs() const { return inputs_; }
  const std::vector<TensorSpec>& outputs() const { return outputs_; }
  const std::string& path() const { return path_; }

  // inputs[i] holds inputs()[i].numel() floats; outputs[i] receives outputs()[i].numel().
  void run(const std::vector<const float*>& inputs, const std::vector<float*>& outputs);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_;
  std::vector<TensorSpec> inputs_, outputs_;
};

// Threads the graphs' XNNPACK work may use (ExecuTorch's process-wide threadpool); 0 leaves
// it as it is. Returns the thread count in effect.
int set_graph_threads(int threads);

// True when this build can run compiled graphs (it was built against ExecuTorch).
bool graphs_available();

}  // namespace sakura
