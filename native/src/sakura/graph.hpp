// One compiled graph (an ExecuTorch `.pte` program, XNNPACK-delegated) run from C++: the
// execute stage of the native runtime. Python exports the graphs (sakura.edge.native_graphs)
// and hands their paths over; nothing here touches Python.
//
// Inputs and outputs are float32 tensors. A program exported with static shapes takes
// exactly those; one exported with dynamic sizes (edge/backends/shard.py, `dynamic=True`)
// reports its upper bounds as the shapes and takes any sizes within them: `run` gets every
// input's actual sizes, sets them (Method::set_input resizes the planned input tensor),
// executes, and copies each output out with the size it came out with (the XNNPACK
// delegate resizes its outputs). A CompiledGraph is not thread-safe; each is used by the
// execute stage only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sakura {

struct TensorSpec {
  std::vector<std::int64_t> sizes;  // the exported shape (upper bounds when dynamic)
  std::int64_t numel() const;
  std::string describe() const;
};

// One input: its data and actual sizes.
struct GraphInput {
  const float* data;
  std::vector<std::int64_t> sizes;
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

  // outputs[i] has room for outputs()[i].numel() floats; returns the outputs' actual sizes.
  // Throws std::runtime_error for an input whose rank differs or that exceeds the bounds.
  std::vector<std::vector<std::int64_t>> run(const std::vector<GraphInput>& inputs,
                                             const std::vector<float*>& outputs);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_;
  std::vector<TensorSpec> inputs_, outputs_;
};

// Threads the graphs' XNNPACK work may use (ExecuTorch's process-wide threadpool); 0 leaves
// it as it is, and so does the count already in effect. Returns the thread count in effect.
// Throws std::runtime_error for a change while any program (CompiledGraph, TextEncoder) is
// loaded: their XNNPACK runtimes hold the pool, which a change replaces.
int set_graph_threads(int threads);

// True when this build can run compiled graphs (it was built against ExecuTorch).
bool graphs_available();

}  // namespace sakura
