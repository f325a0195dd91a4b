// Bindings of the native edit runtime (sakura/edit.hpp): Python prepares the request and
// the graphs, calls one of run_full / run_resident / run_stream, and collects the latent and
// the per-shard records (sakura_native.ShardRecord). The shard loop runs on a C++ thread
// without the GIL; the calling thread waits with the GIL released, checking for Ctrl-C
// every 50 ms.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <memory>
#include <string>

#include "sakura/edit.hpp"
#include "sakura/graph.hpp"
#include "sakura/shard.hpp"

namespace py = pybind11;

namespace {

std::vector<float> floats(const py::handle& obj, const char* what) {
  auto a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(obj);
  if (!a) throw py::value_error(std::string(what) + " must be a float32 array");
  return std::vector<float>(a.data(), a.data() + a.size());
}

py::object none_if_nan(double v) {
  if (std::isnan(v)) return py::none();
  return py::float_(v);
}

py::object none_if_negative(int v) {
  if (v < 0) return py::none();
  return py::int_(v);
}

// The per-shard record crosses the binding as the class sakura_native.ShardRecord (read-only
// properties, to_dict()). One row per field: its name, the Python type of its value (that of
// the field of edge.pipeline.ShardRecord, tests/edge/test_record_parity.py) and its value;
// the properties, to_dict() and ShardRecord.field_types are all made from this table.
using Record = sakura::ShardRecord;
struct RecordField {
  const char* name;
  const char* type;
  py::object (*get)(const Record&);
};

const RecordField kRecordFields[] = {
    {"shard", "int", [](const Record& r) -> py::object { return py::int_(r.shard); }},
    {"step", "int", [](const Record& r) -> py::object { return py::int_(r.step); }},
    {"blocks", "list[int]", [](const Record& r) -> py::object { return py::cast(r.blocks); }},
    {"config", "int | None", [](const Record& r) { return none_if_negative(r.config); }},
    {"bytes", "int", [](const Record& r) -> py::object { return py::int_(r.bytes); }},
    {"window_s", "float | None", [](const Record& r) { return none_if_nan(r.window_s); }},
    {"lead_s", "float", [](const Record& r) -> py::object { return py::float_(r.lead_s); }},
    {"carry_s", "float | None", [](const Record& r) { return none_if_nan(r.carry_s); }},
    {"rate_bps", "float | None", [](const Record& r) { return none_if_nan(r.rate_bps); }},
    {"deadline", "float | None", [](const Record& r) { return none_if_nan(r.deadline); }},
    {"recv_start", "float | None", [](const Record& r) { return none_if_nan(r.recv_start); }},
    {"recv_first_byte", "float | None",
     [](const Record& r) { return none_if_nan(r.recv_first_byte); }},
    {"recv_end", "float | None", [](const Record& r) { return none_if_nan(r.recv_end); }},
    {"recon_start", "float | None", [](const Record& r) { return none_if_nan(r.recon_start); }},
    {"recon_end", "float | None", [](const Record& r) { return none_if_nan(r.recon_end); }},
    {"exec_start", "float | None", [](const Record& r) { return none_if_nan(r.exec_start); }},
    {"exec_end", "float | None", [](const Record& r) { return none_if_nan(r.exec_end); }},
    {"stall_s", "float", [](const Record& r) -> py::object { return py::float_(r.stall_s); }},
    {"attempts", "int", [](const Record& r) -> py::object { return py::int_(r.attempts); }},
    {"resumes", "int", [](const Record& r) -> py::object { return py::int_(r.resumes); }},
    {"refetches", "int", [](const Record& r) -> py::object { return py::int_(r.refetches); }},
    {"requested", "int | None", [](const Record& r) { return none_if_negative(r.requested); }},
    {"hedges", "int", [](const Record& r) -> py::object { return py::int_(r.hedges); }},
    {"truncated", "bool", [](const Record& r) -> py::object { return py::bool_(r.truncated); }},
    {"damage", "str | None",
     [](const Record& r) -> py::object {
       if (r.damage.empty()) return py::none();
       return py::str(r.damage);
     }},
    {"local", "bool", [](const Record& r) -> py::object { return py::bool_(r.local); }},
    {"outage", "bool", [](const Record& r) -> py::object { return py::bool_(r.outage); }},
    {"refinements", "int",
     [](const Record& r) -> py::object { return py::int_(r.refinements); }},
    {"stale_from", "int | None", [](const Record& r) { return none_if_negative(r.stale_from); }},
};

// The record as a dict of every field, in the table's order (the JSON timeline's keys).
py::dict record_dict(const Record& r) {
  py::dict d;
  for (const auto& f : kRecordFields) d[f.name] = f.get(r);
  return d;
}

void bind_record(py::module_& m) {
  py::class_<Record> cls(m, "ShardRecord",
                         "One shard's way through the native pipeline (sakura/edit.hpp "
                         "ShardRecord); times in seconds since the edit started, None where "
                         "there is no value. The fields of edge.pipeline.ShardRecord but "
                         "params (a description of the configuration the Python side adds).");
  py::dict types;
  for (const auto& f : kRecordFields) {
    cls.def_property_readonly(f.name, py::cpp_function([get = f.get](const Record& r) {
                                return get(r);
                              }),
                              f.type);
    types[f.name] = f.type;
  }
  cls.attr("field_types") = types;
  cls.def("to_dict", &record_dict, "Every field by name (the timeline's record).");
  cls.def("__repr__", [](const Record& r) {
    return "ShardRecord(" + py::repr(record_dict(r)).cast<std::string>() + ")";
  });
}

std::vector<sakura::ShardRecord> shard_records(const py::list& shards) {
  std::vector<sakura::ShardRecord> out;
  int i = 0;
  for (const auto& item : shards) {
    auto d = item.cast<py::dict>();
    sakura::ShardRecord r;
    r.shard = i++;
    r.step = d["step"].cast<int>();
    r.blocks = d["blocks"].cast<std::vector<int>>();
    out.push_back(std::move(r));
  }
  return out;
}

sakura::EditInputs edit_inputs(const py::dict& d) {
  sakura::EditInputs in;
  in.steps = d["steps"].cast<int>();
  in.x = floats(d["x"], "x");
  in.txt = floats(d["txt"], "txt");
  in.vec_txt = floats(d["vec_txt"], "vec_txt");
  in.vec_img = floats(d["vec_img"], "vec_img");
  in.cos = floats(d["cos"], "cos");
  in.sin = floats(d["sin"], "sin");
  in.dt = floats(d["dt"], "dt");
  in.guidance = d["guidance"].cast<float>();
  if (d.contains("pinned")) {
    in.pinned = d["pinned"].cast<std::vector<std::int64_t>>();
    in.pin_x0 = floats(d["pin_x0"], "pin_x0");
    in.pin_noise = floats(d["pin_noise"], "pin_noise");
    in.t = floats(d["t"], "t");
  }
  return in;
}

std::array<std::uint8_t, 32> sha_bytes(const std::string& hex) {
  std::array<std::uint8_t, 32> out{};
  if (hex.size() != 64) throw py::value_error("a sha256 must be 64 hex digits");
  for (int i = 0; i < 32; ++i) out[i] = static_cast<std::uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
  return out;
}

// Runs `body` on a C++ thread; waits with the GIL released and turns Ctrl-C into a
// cancellation (then re-raises KeyboardInterrupt).
template <class F>
auto run_nogil(F body, std::atomic<bool>& cancel) {
  using R = decltype(body());
  std::packaged_task<R()> task(std::move(body));
  auto future = task.get_future();
  std::thread worker;
  {
    py::gil_scoped_release nogil;
    worker = std::thread(std::move(task));
  }
  for (;;) {
    std::future_status st;
    {
      py::gil_scoped_release nogil;
      st = future.wait_for(std::chrono::milliseconds(50));
    }
    if (st == std::future_status::ready) break;
    if (PyErr_CheckSignals() != 0) {
      py::error_already_set interrupt;
      cancel.store(true);
      {
        py::gil_scoped_release nogil;
        worker.join();
      }
      throw interrupt;
    }
  }
  {
    py::gil_scoped_release nogil;
    worker.join();
  }
  return future.get();  // rethrows what the edit threw
}

class PyEditGraphs {
 public:
  PyEditGraphs(const std::string& step_in, const std::vector<std::string>& groups,
               const std::string& step_out, const std::vector<int>& group_blocks,
               bool takes_cache) {
    py::gil_scoped_release nogil;
    graphs_.step_in = std::make_unique<sakura::CompiledGraph>(step_in);
    for (const auto& p : groups) graphs_.groups.push_back(std::make_unique<sakura::CompiledGraph>(p));
    graphs_.step_out = std::make_unique<sakura::CompiledGraph>(step_out);
    graphs_.group_blocks = group_blocks;
    graphs_.takes_cache = takes_cache;
    graphs_.check();
  }

  sakura::EditGraphs& get() { return graphs_; }
  std::mutex& mutex() { return mu_; }

  py::dict shapes() const {
    auto spec = [](const std::vector<sakura::TensorSpec>& v) {
      py::list out;
      for (const auto& s : v) out.append(py::tuple(py::cast(s.sizes)));
      return out;
    };
    py::dict d;
    d["step_in"] = py::make_tuple(spec(graphs_.step_in->inputs()), spec(graphs_.step_in->outputs()));
    py::list groups;
    for (const auto& g : graphs_.groups) groups.append(py::make_tuple(spec(g->inputs()), spec(g->outputs())));
    d["groups"] = groups;
    d["step_out"] = py::make_tuple(spec(graphs_.step_out->inputs()), spec(graphs_.step_out->outputs()));
    return d;
  }

 private:
  sakura::EditGraphs graphs_;
  std::mutex mu_;  // one edit at a time per graph set (graphs keep per-run state)
};

py::array_t<float> to_array(const std::vector<float>& v) {
  py::array_t<float> a(static_cast<py::ssize_t>(v.size()));
  std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(float));
  return a;
}

py::list records_list(const std::vector<sakura::ShardRecord>& records) {
  py::list out;
  for (const auto& r : records) out.append(py::cast(r));
  return out;
}

// A full (no-cache) edit: the latent after the last step.
py::array_t<float> run_full(PyEditGraphs& graphs, const py::dict& inputs) {
  sakura::EditInputs in = edit_inputs(inputs);
  std::atomic<bool> cancel{false};
  auto x = run_nogil(
      [&] {
        std::lock_guard<std::mutex> lock(graphs.mutex());
        return sakura::run_edit(graphs.get(), in, nullptr, cancel);
      },
      cancel);
  return to_array(x);
}

// Every shard resident in memory: (latent, records).
py::tuple run_resident(PyEditGraphs& graphs, const py::dict& inputs, const py::list& shards,
                       const py::list& cache, double origin) {
  sakura::EditInputs in = edit_inputs(inputs);
  std::vector<std::vector<float>> data;
  for (const auto& a : cache) data.push_back(floats(a, "a resident shard"));
  sakura::ResidentFeed feed(std::move(data), shard_records(shards), origin);
  std::atomic<bool> cancel{false};
  auto x = run_nogil(
      [&] {
        std::lock_guard<std::mutex> lock(graphs.mutex());
        return sakura::run_edit(graphs.get(), in, &feed, cancel);
      },
      cancel);
  return py::make_tuple(to_array(x), records_list(feed.records()));
}

sakura::HttpOptions http_options(const py::dict& d) {
  sakura::HttpOptions o;
  o.connect_timeout_s = d["connect_timeout_s"].cast<double>();
  o.read_timeout_s = d["read_timeout_s"].cast<double>();
  o.window_s = d["window_s"].cast<double>();
  o.max_attempts = d["max_attempts"].is_none() ? 0 : d["max_attempts"].cast<int>();
  o.backoff_s = d["backoff_s"].cast<double>();
  o.backoff_max_s = d["backoff_max_s"].cast<double>();
  o.max_refetch = d["max_refetch"].cast<int>();
  o.max_connections = d["max_connections"].cast<int>();
  if (d.contains("warm_connections")) o.warm_connections = d["warm_connections"].cast<int>();
  if (d.contains("warm_hedges")) o.warm_hedges = d["warm_hedges"].cast<bool>();
  if (d.contains("http_version")) {
    const auto v = d["http_version"].cast<std::string>();
    if (v != "1.1" && v != "2") {
      throw py::value_error("http_version must be \"1.1\" or \"2\", got \"" + v + "\"");
    }
    o.http_version = v == "2" ? 2 : 1;
  }
  o.headers = d["headers"].cast<std::vector<std::string>>();
  o.display_url = d["display_url"].cast<std::string>();
  if (d.contains("jitter")) o.jitter = d["jitter"].cast<double>();
  if (d.contains("on_wait") && !d["on_wait"].is_none()) {
    // called on the receive thread: the GIL is taken for the call and for the release of
    // the function, and what the callback raises is not the edit's concern
    std::shared_ptr<py::function> fn(new py::function(d["on_wait"].cast<py::function>()),
                                     [](py::function* f) {
                                       py::gil_scoped_acquire gil;
                                       delete f;
                                     });
    o.on_wait = [fn](const std::string& line) {
      py::gil_scoped_acquire gil;
      try {
        (*fn)(line);
      } catch (py::error_already_set&) {
      }
    };
  }
  return o;
}

// The streamed edit: (latent, records, requests).
// The shard table of a streamed edit: what run_stream needs from the manifest, converted once
// per manifest (``StreamTable(shards)``) and reused by every edit of that pack: converting a
// ~1000-configuration table with its unit checksums costs tens of ms, paid before the first
// request otherwise.
struct StreamTable {
  std::vector<sakura::ShardRecord> shards;
  std::vector<std::map<int, sakura::ConfigSource>> configs;

  explicit StreamTable(const py::list& items) : shards(shard_records(items)) {
    for (const auto& item : items) {
      std::map<int, sakura::ConfigSource> by_id;
      for (const auto& c : item.cast<py::dict>()["configs"].cast<py::list>()) {
        auto cd = c.cast<py::dict>();
        sakura::ConfigSource src;
        src.request.config = cd["id"].cast<int>();
        src.request.url = cd["url"].cast<std::string>();
        src.request.offset = cd["offset"].cast<std::int64_t>();
        src.request.length = cd["length"].cast<std::int64_t>();
        if (cd.contains("pack_bytes") && !cd["pack_bytes"].is_none()) {
          src.request.pack_bytes = cd["pack_bytes"].cast<std::int64_t>();
        }
        for (const auto& u : cd["units"].cast<py::list>()) {
          auto pair = u.cast<py::tuple>();
          src.request.units.push_back(
              {pair[0].cast<std::int64_t>(), sha_bytes(pair[1].cast<std::string>())});
        }
        if (cd.contains("ranks")) src.ranks = cd["ranks"].cast<std::vector<int>>();
        by_id[src.request.config] = std::move(src);
      }
      configs.push_back(std::move(by_id));
    }
  }
};

py::tuple run_stream(PyEditGraphs& graphs, const py::dict& inputs, const py::dict& stream,
                     std::shared_ptr<sakura::Allocator> allocator,
                     std::shared_ptr<sakura::BandwidthMonitor> monitor,
                     std::shared_ptr<sakura::ExecutionProgress> progress,
                     const py::object& local) {
  sakura::EditInputs in = edit_inputs(inputs);
  // the local fallback: {"graphs": full EditGraphs, "inputs": full inputs, "masked": rows,
  // "step_s": one local step's predicted time, "stale_max_age": the oldest K/V a late step
  // may reuse (optional; kStaleMaxAge)}
  std::shared_ptr<PyEditGraphs> full_graphs;
  sakura::EditInputs full_in;
  sakura::LocalSteps steps;
  const bool has_local = !local.is_none();
  if (has_local) {
    auto d = local.cast<py::dict>();
    full_graphs = d["graphs"].cast<std::shared_ptr<PyEditGraphs>>();
    full_in = edit_inputs(d["inputs"].cast<py::dict>());
    steps.graphs = &full_graphs->get();
    steps.inputs = &full_in;
    steps.masked = d["masked"].cast<std::vector<std::int64_t>>();
    steps.step_s = d["step_s"].cast<double>();
    if (d.contains("stale_max_age")) steps.stale_max_age = d["stale_max_age"].cast<int>();
  }
  sakura::StreamSpec spec;
  const auto table = stream["shards"].cast<std::shared_ptr<StreamTable>>();
  spec.shards = table->shards;
  spec.configs = table->configs;
  spec.http = http_options(stream["http"]);
  const std::string decode = stream["decode"].cast<std::string>();
  if (decode == "lowrank") {
    spec.decode = sakura::DecodeKind::LowRank;
  } else if (decode == "fp16") {
    spec.decode = sakura::DecodeKind::Fp16;
  } else if (decode == "callback") {
    spec.decode = sakura::DecodeKind::Callback;
    auto fn = std::make_shared<py::function>(stream["callback"].cast<py::function>());
    spec.callback = [fn](int shard, int config, const std::vector<std::uint8_t>& data,
                         float* out, std::size_t count) {
      py::gil_scoped_acquire gil;
      py::bytes b(reinterpret_cast<const char*>(data.data()), data.size());
      auto arr = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(
          (*fn)(shard, config, b));
      if (!arr || static_cast<std::size_t>(arr.size()) != count) {
        throw std::runtime_error("shard " + std::to_string(shard) + ": the decoder returned " +
                                 (arr ? std::to_string(arr.size()) : std::string("no")) +
                                 " floats, expected " + std::to_string(count));
      }
      std::memcpy(out, arr.data(), count * sizeof(float));
    };
  } else {
    throw py::value_error("decode must be lowrank, fp16 or callback");
  }
  if (!stream["rope"].is_none()) spec.rope = floats(stream["rope"], "rope");
  spec.matrix_floats = stream["matrix_floats"].cast<std::int64_t>();
  spec.options.max_ahead = stream["max_ahead"].cast<int>();
  spec.options.max_ready = stream["max_ready"].cast<int>();
  spec.options.max_inflight = stream["max_inflight"].cast<int>();
  spec.options.lookahead_rtts = stream["lookahead_rtts"].cast<double>();
  if (stream.contains("refine")) spec.options.refine = stream["refine"].cast<bool>();
  spec.reconstruct = stream["reconstruct"].cast<std::string>();
  if (stream.contains("pipeline_cpus") && !stream["pipeline_cpus"].is_none()) {
    spec.pipeline_cpus = stream["pipeline_cpus"].cast<std::vector<int>>();
  }
  spec.options.max_ahead_cap = stream["max_ahead_cap"].cast<int>();
  spec.origin = stream["origin"].cast<double>();

  auto feed = std::make_shared<sakura::StreamFeed>(std::move(spec), allocator, monitor, progress);
  std::atomic<bool> cancel{false};
  std::vector<float> x;
  try {
    x = run_nogil(
        [&] {
          std::lock_guard<std::mutex> lock(graphs.mutex());
          std::unique_lock<std::mutex> full_lock;
          if (has_local) full_lock = std::unique_lock<std::mutex>(full_graphs->mutex());
          try {
            return sakura::run_edit(graphs.get(), in, feed.get(), cancel,
                                    has_local ? &steps : nullptr);
          } catch (...) {
            feed->cancel();
            feed->finish();  // joins the stages
            throw;
          }
        },
        cancel);
  } catch (...) {
    py::gil_scoped_release nogil;
    feed->cancel();
    feed->finish();
    throw;
  }
  py::list requests;
  for (const auto& r : feed->request_log()) {
    py::dict d;
    d["method"] = r.method;
    d["url"] = r.url;
    d["headers"] = r.headers;
    d["time"] = r.time;
    requests.append(d);
  }
  return py::make_tuple(to_array(x), records_list(feed->records()), requests);
}

}  // namespace

void bind_edit(py::module_& m) {
  static py::exception<sakura::FetchError> fetch_error(m, "FetchError", PyExc_RuntimeError);
  static py::exception<sakura::Cancelled> cancelled(m, "Cancelled", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const sakura::FetchError& e) {
      // "<kind>: <message>": the Python runtime maps the kind to its own error types
      py::set_error(fetch_error, (e.kind() + ": " + e.what()).c_str());
    } catch (const sakura::Cancelled& e) {
      py::set_error(cancelled, e.what());
    }
  });

  bind_record(m);

  py::class_<PyEditGraphs, std::shared_ptr<PyEditGraphs>>(m, "EditGraphs")
      .def(py::init<const std::string&, const std::vector<std::string>&, const std::string&,
                    const std::vector<int>&, bool>(),
           py::arg("step_in"), py::arg("groups"), py::arg("step_out"), py::arg("group_blocks"),
           py::arg("takes_cache") = true,
           "Load the compiled graphs (.pte) of one edit geometry.")
      .def_property_readonly("shapes", &PyEditGraphs::shapes);

  py::class_<StreamTable, std::shared_ptr<StreamTable>>(m, "StreamTable")
      .def(py::init<const py::list&>(), py::arg("shards"),
           "The shard table of a streamed edit (a list of {step, blocks, configs: [{id, url, "
           "offset, length, units: [(length, sha256 hex)], ranks?}]}), converted once.")
      .def("__len__", [](const StreamTable& t) { return t.shards.size(); });

  m.def("run_full", &run_full, py::arg("graphs"), py::arg("inputs"),
        "A full (no-cache) edit; returns the final latent (flat float32).");
  m.def("run_resident", &run_resident, py::arg("graphs"), py::arg("inputs"), py::arg("shards"),
        py::arg("cache"), py::arg("origin"),
        "An edit with every shard's K/V in memory; returns (latent, [ShardRecord]).");
  m.def("run_stream", &run_stream, py::arg("graphs"), py::arg("inputs"), py::arg("stream"),
        py::arg("allocator"), py::arg("monitor"), py::arg("progress"),
        py::arg("local") = py::none(),
        "A streamed edit (receive -> reconstruct -> execute); returns (latent, [ShardRecord], "
        "requests). local: the local fallback's full graphs, inputs, masked rows and "
        "step_s (sakura/edit.hpp, LocalSteps).");
  m.def("set_graph_threads", &sakura::set_graph_threads, py::arg("threads"),
        "Threads of the graphs' XNNPACK work (0: unchanged); returns the count in effect.");
}
