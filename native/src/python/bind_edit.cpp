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
#include <optional>
#include <string>
#include <string_view>

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
    {"quiet_since", "float | None", [](const Record& r) { return none_if_nan(r.quiet_since); }},
    {"refinements", "int",
     [](const Record& r) -> py::object { return py::int_(r.refinements); }},
    {"stale_from", "int | None", [](const Record& r) { return none_if_negative(r.stale_from); }},
    {"planned_stale", "bool",
     [](const Record& r) -> py::object { return py::bool_(r.planned_stale); }},
    {"planned_local", "bool",
     [](const Record& r) -> py::object { return py::bool_(r.planned_local); }},
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

// The typed inputs of the binding (issue 30 item 3): each a class made with keyword
// arguments, so a missing or misspelt field is a TypeError where it is made, not a KeyError
// inside an edit. EditInputs: the tensors of one edit (edge/native_runtime.py, inputs).
sakura::EditInputs make_inputs(int steps, const py::handle& x, const py::handle& txt,
                               const py::handle& vec_txt, const py::handle& vec_img,
                               const py::handle& cos, const py::handle& sin,
                               const py::handle& dt, float guidance,
                               std::optional<std::vector<std::int64_t>> pinned,
                               const py::object& pin_x0, const py::object& pin_noise,
                               const py::object& t) {
  sakura::EditInputs in;
  in.steps = steps;
  in.x = floats(x, "x");
  in.txt = floats(txt, "txt");
  in.vec_txt = floats(vec_txt, "vec_txt");
  in.vec_img = floats(vec_img, "vec_img");
  in.cos = floats(cos, "cos");
  in.sin = floats(sin, "sin");
  in.dt = floats(dt, "dt");
  in.guidance = guidance;
  if (pinned) {  // a full edit: the unmasked tokens follow the template's trajectory
    if (pin_x0.is_none() || pin_noise.is_none() || t.is_none()) {
      throw py::value_error("pinned tokens need pin_x0, pin_noise and t");
    }
    in.pinned = *pinned;
    in.pin_x0 = floats(pin_x0, "pin_x0");
    in.pin_noise = floats(pin_noise, "pin_noise");
    in.t = floats(t, "t");
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
py::array_t<float> run_full(PyEditGraphs& graphs, const sakura::EditInputs& in) {
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
py::tuple run_resident(PyEditGraphs& graphs, const sakura::EditInputs& in,
                       const py::list& shards, const py::list& cache, double origin) {
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

// HttpOptions: the receive stage's HTTP settings (edge/runner.py; sakura/http.hpp).
sakura::HttpOptions make_http(double connect_timeout_s, double read_timeout_s, double window_s,
                              std::optional<int> max_attempts, double backoff_s,
                              double backoff_max_s, int max_refetch, int max_connections,
                              int warm_connections, bool warm_hedges,
                              const std::string& http_version,
                              std::vector<std::string> headers, std::string display_url,
                              double jitter, const py::object& on_wait) {
  sakura::HttpOptions o;
  o.connect_timeout_s = connect_timeout_s;
  o.read_timeout_s = read_timeout_s;
  o.window_s = window_s;
  o.max_attempts = max_attempts.value_or(0);
  o.backoff_s = backoff_s;
  o.backoff_max_s = backoff_max_s;
  o.max_refetch = max_refetch;
  o.max_connections = max_connections;
  o.warm_connections = warm_connections;
  o.warm_hedges = warm_hedges;
  if (http_version != "1.1" && http_version != "2") {
    throw py::value_error("http_version must be \"1.1\" or \"2\", got \"" + http_version + "\"");
  }
  o.http_version = http_version == "2" ? 2 : 1;
  o.headers = std::move(headers);
  o.display_url = std::move(display_url);
  o.jitter = jitter;
  if (!on_wait.is_none()) {
    // called on the receive thread: the GIL is taken for the call and for the release of
    // the function, and what the callback raises is not the edit's concern
    std::shared_ptr<py::function> fn(new py::function(on_wait.cast<py::function>()),
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
        if (cd.contains("bits")) src.bits = cd["bits"].cast<int>();
        by_id[src.request.config] = std::move(src);
      }
      configs.push_back(std::move(by_id));
    }
  }
};

// StreamSpec: what a streamed edit streams and how (edge/native_runtime.py, stream_spec).
sakura::StreamSpec make_stream(const std::shared_ptr<StreamTable>& shards,
                               sakura::HttpOptions http, const std::string& decode,
                               const py::object& callback, const py::object& rope,
                               std::int64_t matrix_floats, int max_ahead, int max_ready,
                               int max_inflight, double lookahead_rtts, int max_ahead_cap,
                               bool refine, std::string reconstruct,
                               std::optional<std::vector<int>> pipeline_cpus, double origin,
                               std::int64_t channels, int intq_group, int stale_plan_age,
                               bool plan_local) {
  if (stale_plan_age < 0) throw py::value_error("stale_plan_age must be >= 0");
  sakura::StreamSpec spec;
  spec.options.stale_plan_age = stale_plan_age;
  spec.options.plan_local = plan_local;
  spec.shards = shards->shards;
  spec.configs = shards->configs;
  spec.http = std::move(http);
  if (decode == "lowrank") {
    spec.decode = sakura::DecodeKind::LowRank;
  } else if (decode == "fp16") {
    spec.decode = sakura::DecodeKind::Fp16;
  } else if (decode == "intq") {  // codec/intq.py's layout, decoded natively (decode_intq)
    if (channels < 1 || matrix_floats % channels != 0 || intq_group < 1) {
      throw py::value_error("decode=\"intq\" needs channels (dividing matrix_floats) and "
                            "intq_group >= 1");
    }
    spec.decode = sakura::DecodeKind::IntQ;
  } else if (decode == "callback") {
    if (callback.is_none()) throw py::value_error("decode=\"callback\" needs a callback");
    spec.decode = sakura::DecodeKind::Callback;
    // released with the GIL held, as it was taken
    std::shared_ptr<py::function> fn(new py::function(callback.cast<py::function>()),
                                     [](py::function* f) {
                                       py::gil_scoped_acquire gil;
                                       delete f;
                                     });
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
    throw py::value_error("decode must be lowrank, fp16, intq or callback");
  }
  spec.channels = channels;
  spec.intq_group = intq_group;
  if (!rope.is_none()) spec.rope = floats(rope, "rope");
  spec.matrix_floats = matrix_floats;
  spec.options.max_ahead = max_ahead;
  spec.options.max_ready = max_ready;
  spec.options.max_inflight = max_inflight;
  spec.options.lookahead_rtts = lookahead_rtts;
  spec.options.max_ahead_cap = max_ahead_cap;
  spec.options.refine = refine;
  spec.reconstruct = std::move(reconstruct);
  if (pipeline_cpus) spec.pipeline_cpus = *pipeline_cpus;
  spec.origin = origin;
  return spec;
}

// LocalFallback: the local fallback's part of a streamed edit (sakura/edit.hpp, LocalSteps):
// the full graphs, their inputs, the masked tokens' rows, one local step's predicted time
// and the oldest K/V a late step may reuse.
struct LocalFallback {
  std::shared_ptr<PyEditGraphs> graphs;
  sakura::EditInputs inputs;
  std::vector<std::int64_t> masked;
  double step_s = 0;
  int stale_max_age = sakura::kStaleMaxAge;
  // the recompute step (sakura/edit.hpp): K/V-emitting template-pass graphs, their inputs
  // (every token pinned, the template prompt) and the cached tokens' rows; or none
  std::shared_ptr<PyEditGraphs> recompute;
  std::optional<sakura::EditInputs> recompute_inputs;
  std::vector<std::int64_t> unmasked;
};

py::tuple run_stream(PyEditGraphs& graphs, const sakura::EditInputs& in,
                     sakura::StreamSpec& stream,
                     std::shared_ptr<sakura::Allocator> allocator,
                     std::shared_ptr<sakura::BandwidthMonitor> monitor,
                     std::shared_ptr<sakura::ExecutionProgress> progress,
                     const LocalFallback* local) {
  sakura::LocalSteps steps;
  const bool has_local = local != nullptr;
  if (has_local) {
    steps.graphs = &local->graphs->get();
    steps.inputs = &local->inputs;
    steps.masked = local->masked;
    steps.step_s = local->step_s;
    steps.stale_max_age = local->stale_max_age;
    if (local->recompute) {
      steps.recompute = &local->recompute->get();
      steps.recompute_inputs = &*local->recompute_inputs;
      steps.unmasked = local->unmasked;
    }
  }
  // a StreamSpec serves one edit: the feed takes its table without a copy (a pack's
  // table of ~1000 configurations is what the edit would copy before its first request)
  if (stream.shards.empty()) {
    throw py::value_error("this StreamSpec has no shards (one serves one edit: make another)");
  }
  sakura::StreamSpec spec = std::move(stream);
  stream.shards.clear();
  stream.configs.clear();
  std::shared_ptr<PyEditGraphs> full_graphs = has_local ? local->graphs : nullptr;
  auto feed = std::make_shared<sakura::StreamFeed>(std::move(spec), allocator, monitor, progress);
  std::atomic<bool> cancel{false};
  std::vector<float> x;
  try {
    x = run_nogil(
        [&] {
          std::lock_guard<std::mutex> lock(graphs.mutex());
          std::unique_lock<std::mutex> full_lock;
          if (has_local) full_lock = std::unique_lock<std::mutex>(full_graphs->mutex());
          std::unique_lock<std::mutex> recompute_lock;
          if (has_local && local->recompute) {
            recompute_lock = std::unique_lock<std::mutex>(local->recompute->mutex());
          }
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

  // the typed inputs (issue 30 item 3); defaults are the C++ structs' own
  py::class_<sakura::EditInputs>(m, "EditInputs", "The tensors of one edit (float32 arrays).")
      .def(py::init(&make_inputs), py::kw_only(), py::arg("steps"), py::arg("x"),
           py::arg("txt"), py::arg("vec_txt"), py::arg("vec_img"), py::arg("cos"),
           py::arg("sin"), py::arg("dt"), py::arg("guidance"), py::arg("pinned") = py::none(),
           py::arg("pin_x0") = py::none(), py::arg("pin_noise") = py::none(),
           py::arg("t") = py::none())
      .def_readonly("steps", &sakura::EditInputs::steps)
      .def_readonly("guidance", &sakura::EditInputs::guidance)
      .def_property_readonly("full", [](const sakura::EditInputs& in) { return !in.pinned.empty(); });
  const sakura::HttpOptions http;
  py::class_<sakura::HttpOptions>(m, "HttpOptions", "The receive stage's HTTP settings.")
      .def(py::init(&make_http), py::kw_only(),
           py::arg("connect_timeout_s") = http.connect_timeout_s,
           py::arg("read_timeout_s") = http.read_timeout_s, py::arg("window_s") = http.window_s,
           py::arg("max_attempts") = py::none(), py::arg("backoff_s") = http.backoff_s,
           py::arg("backoff_max_s") = http.backoff_max_s,
           py::arg("max_refetch") = http.max_refetch,
           py::arg("max_connections") = http.max_connections,
           py::arg("warm_connections") = http.warm_connections,
           py::arg("warm_hedges") = http.warm_hedges, py::arg("http_version") = "1.1",
           py::arg("headers") = std::vector<std::string>{}, py::arg("display_url") = "",
           py::arg("jitter") = http.jitter, py::arg("on_wait") = py::none())
      .def_readonly("max_connections", &sakura::HttpOptions::max_connections)
      .def_readonly("warm_connections", &sakura::HttpOptions::warm_connections)
      .def_readonly("http_version", &sakura::HttpOptions::http_version);
  const sakura::StreamOptions so;
  py::class_<sakura::StreamSpec>(m, "StreamSpec", "What a streamed edit streams and how.")
      .def(py::init(&make_stream), py::kw_only(), py::arg("shards"), py::arg("http"),
           py::arg("decode"), py::arg("callback") = py::none(), py::arg("rope") = py::none(),
           py::arg("matrix_floats"), py::arg("max_ahead") = so.max_ahead,
           py::arg("max_ready") = so.max_ready, py::arg("max_inflight") = so.max_inflight,
           py::arg("lookahead_rtts") = so.lookahead_rtts,
           py::arg("max_ahead_cap") = so.max_ahead_cap, py::arg("refine") = so.refine,
           py::arg("reconstruct") = "cpu", py::arg("pipeline_cpus") = py::none(),
           py::arg("origin") = 0.0, py::arg("channels") = 0, py::arg("intq_group") = 32,
           py::arg("stale_plan_age") = so.stale_plan_age, py::arg("plan_local") = so.plan_local)
      .def_property_readonly("shards", [](const sakura::StreamSpec& s) { return s.shards.size(); })
      .def_property_readonly("max_inflight", [](const sakura::StreamSpec& s) { return s.options.max_inflight; })
      .def_readonly("reconstruct", &sakura::StreamSpec::reconstruct);
  py::class_<LocalFallback>(m, "LocalFallback", "The local fallback of a streamed edit.")
      .def(py::init([](std::shared_ptr<PyEditGraphs> graphs, sakura::EditInputs inputs,
                       std::vector<std::int64_t> masked, double step_s, int stale_max_age,
                       std::shared_ptr<PyEditGraphs> recompute,
                       std::optional<sakura::EditInputs> recompute_inputs,
                       std::vector<std::int64_t> unmasked) {
             if (!graphs) throw py::value_error("the local fallback needs the full graphs");
             if (recompute && (!recompute_inputs || unmasked.empty() ||
                               !recompute->get().emits_kv())) {
               throw py::value_error("a recompute step needs K/V-emitting graphs, their "
                                     "inputs and the cached rows");
             }
             return LocalFallback{std::move(graphs), std::move(inputs), std::move(masked),
                                  step_s, stale_max_age, std::move(recompute),
                                  std::move(recompute_inputs), std::move(unmasked)};
           }),
           py::kw_only(), py::arg("graphs"), py::arg("inputs"), py::arg("masked"),
           py::arg("step_s"), py::arg("stale_max_age") = sakura::kStaleMaxAge,
           py::arg("recompute") = nullptr, py::arg("recompute_inputs") = py::none(),
           py::arg("unmasked") = std::vector<std::int64_t>{})
      .def_property_readonly("recomputes", [](const LocalFallback& l) { return bool(l.recompute); })
      .def_readonly("step_s", &LocalFallback::step_s)
      .def_readonly("stale_max_age", &LocalFallback::stale_max_age);

  m.def("run_full", &run_full, py::arg("graphs"), py::arg("inputs"),
        "A full (no-cache) edit; returns the final latent (flat float32).");
  m.def("run_resident", &run_resident, py::arg("graphs"), py::arg("inputs"), py::arg("shards"),
        py::arg("cache"), py::arg("origin"),
        "An edit with every shard's K/V in memory; returns (latent, [ShardRecord]).");
  m.def("run_stream", &run_stream, py::arg("graphs"), py::arg("inputs"), py::arg("stream"),
        py::arg("allocator"), py::arg("monitor"), py::arg("progress"),
        py::arg("local") = static_cast<const LocalFallback*>(nullptr),
        "A streamed edit (receive -> reconstruct -> execute); returns (latent, [ShardRecord], "
        "requests). local: the LocalFallback (sakura/edit.hpp, LocalSteps), or None.");
  m.def(
      "stale_source",
      [](const std::vector<std::pair<int, std::vector<int>>>& shard_blocks,
         const std::vector<bool>& planned, int shard, int max_age,
         std::optional<int> unfetched_from) -> py::object {
        if (planned.size() != shard_blocks.size() || shard < 0 ||
            shard >= static_cast<int>(shard_blocks.size())) {
          throw py::value_error("planned must match shard_blocks, and shard be one of them");
        }
        std::vector<sakura::ShardRecord> recs(shard_blocks.size());
        for (std::size_t i = 0; i < recs.size(); ++i) {
          recs[i].shard = static_cast<int>(i);
          recs[i].step = shard_blocks[i].first;
          recs[i].blocks = shard_blocks[i].second;
          recs[i].planned_stale = planned[i];
        }
        const int s = sakura::stale_source(recs, shard, max_age, unfetched_from.value_or(-1));
        if (s < 0) return py::none();
        return py::int_(s);
      },
      py::arg("shard_blocks"), py::arg("planned"), py::arg("shard"), py::arg("max_age"),
      py::arg("unfetched_from") = py::none(),
      "The stale plan's source step (edge/stale_plan.py stale_source), or None.");
  m.def(
      "decode_intq",
      [](const py::bytes& data, int bits, int group, std::int64_t rows, std::int64_t channels) {
        const std::string_view v(data);
        py::array_t<float> out({rows, channels});
        sakura::decode_intq(reinterpret_cast<const std::uint8_t*>(v.data()), v.size(), bits,
                            group, rows, channels, out.mutable_data());
        return out;
      },
      py::arg("data"), py::arg("bits"), py::arg("group"), py::arg("rows"), py::arg("channels"),
      "One intq configuration's bytes -> [rows, channels] float32 (codec/intq.py's decode; "
      "the streamed edit's IntQ stage)");
  m.def("set_graph_threads", &sakura::set_graph_threads, py::arg("threads"),
        "Threads of the graphs' XNNPACK work (0: unchanged); returns the count in effect. "
        "RuntimeError for a change while any program is loaded (they hold the threadpool).");
}
