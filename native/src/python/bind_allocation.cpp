// Bindings of the allocation bookkeeping (sakura/monitor.hpp, sakura/allocator.hpp) with
// the same names and arguments as sakura.edge.monitor / sakura.edge.allocator, so the same
// unit tests run against both. NaN in C++ is None in Python.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <optional>

#include "sakura/allocator.hpp"
#include "sakura/monitor.hpp"

namespace py = pybind11;

namespace {

double or_nan(std::optional<double> v) { return v ? *v : sakura::kNoValue; }

py::object none_if_nan(double v) {
  if (std::isnan(v)) return py::none();
  return py::float_(v);
}

}  // namespace

void bind_allocation(py::module_& m) {
  m.def(
      "lookahead_wait",
      [](int ahead, int max_ahead, int max_ahead_cap, double until_start_s, double horizon_s) {
        return none_if_nan(sakura::lookahead_wait(ahead, max_ahead, max_ahead_cap,
                                                  until_start_s, horizon_s));
      },
      py::arg("ahead"), py::arg("max_ahead"), py::arg("max_ahead_cap"),
      py::arg("until_start_s"), py::arg("horizon_s"),
      "0: request now; t: in t seconds; None: once execution advances (the receive rule).");
  m.attr("STALE_PLAN_DB") = sakura::kStalePlanDb;
  m.def("stale_skippable", &sakura::stale_skippable, py::arg("psnr_db"), py::arg("smallest"),
        "The stale plan's rule (edge/stale_plan.py skippable).");
  m.def("budget_bytes", &sakura::budget_bytes, py::arg("window_s"), py::arg("rate_bps"),
        py::arg("latency_s") = 0.0, py::arg("safety") = 1.0,
        "Bytes that fit in the window at the estimated rate after the request latency.");

  py::class_<sakura::TransferSample>(m, "TransferSample")
      .def_property_readonly("shard", [](const sakura::TransferSample& s) -> py::object {
        return s.shard < 0 ? py::object(py::none()) : py::object(py::int_(s.shard));
      })
      .def_readonly("nbytes", &sakura::TransferSample::nbytes)
      .def_readonly("start", &sakura::TransferSample::start)
      .def_readonly("first_byte", &sakura::TransferSample::first_byte)
      .def_readonly("end", &sakura::TransferSample::end)
      .def_property_readonly("latency_s", &sakura::TransferSample::latency_s);

  py::class_<sakura::BandwidthMonitor, std::shared_ptr<sakura::BandwidthMonitor>>(
      m, "BandwidthMonitor")
      .def(py::init([](int k, std::optional<double> initial_bps, double min_body_s) {
             return std::make_shared<sakura::BandwidthMonitor>(k, or_nan(initial_bps),
                                                               min_body_s);
           }),
           py::arg("k") = 5, py::arg("initial_bps") = py::none(), py::arg("min_body_s") = 0.002)
      .def(
          "record",
          [](sakura::BandwidthMonitor& mon, std::optional<int> shard, std::int64_t nbytes,
             double start, double first_byte, double end) {
            return mon.record(shard ? *shard : -1, nbytes, start, first_byte, end);
          },
          py::arg("shard"), py::arg("nbytes"), py::arg("start"), py::arg("first_byte"),
          py::arg("end"))
      .def("estimate_bps",
           [](const sakura::BandwidthMonitor& mon) { return none_if_nan(mon.estimate_bps()); })
      .def("latency_s", &sakura::BandwidthMonitor::latency_s)
      .def("bytes_total", &sakura::BandwidthMonitor::bytes_total)
      .def_property_readonly("k", &sakura::BandwidthMonitor::k);

  py::class_<sakura::Window>(m, "Window")
      .def_readonly("shard", &sakura::Window::shard)
      .def_readonly("window_s", &sakura::Window::window_s)
      .def_readonly("slot_s", &sakura::Window::slot_s)
      .def_readonly("carry_s", &sakura::Window::carry_s)
      .def_readonly("deadline", &sakura::Window::deadline);

  py::class_<sakura::ExecutionProgress, std::shared_ptr<sakura::ExecutionProgress>>(
      m, "ExecutionProgress")
      .def(py::init([](std::vector<double> exec_s, double origin, std::optional<double> startup_s,
                       double alpha) {
             return std::make_shared<sakura::ExecutionProgress>(std::move(exec_s), origin,
                                                                or_nan(startup_s), alpha);
           }),
           py::arg("exec_s"), py::arg("origin"), py::arg("startup_s") = py::none(),
           py::arg("alpha") = 0.5)
      .def_static(
          "with_allowance",
          [](const std::vector<double>& exec_s, double origin, double allowance_s, double now,
             double alpha) {
            return sakura::ExecutionProgress::with_allowance(exec_s, origin, allowance_s, now,
                                                             alpha);
          },
          py::arg("exec_s"), py::arg("origin"), py::arg("allowance_s"), py::arg("now"),
          py::arg("alpha") = 0.5)
      .def("received", &sakura::ExecutionProgress::received, py::arg("shard"), py::arg("t"))
      .def("reconstructed", &sakura::ExecutionProgress::reconstructed, py::arg("shard"),
           py::arg("start"), py::arg("end"))
      .def("exec_started", &sakura::ExecutionProgress::exec_started, py::arg("shard"),
           py::arg("t"))
      .def("exec_ended", &sakura::ExecutionProgress::exec_ended, py::arg("shard"), py::arg("t"))
      .def("exec_ended_local", &sakura::ExecutionProgress::exec_ended_local, py::arg("shard"),
           py::arg("t"))
      .def("predicted_exec_s", &sakura::ExecutionProgress::predicted_exec_s, py::arg("shard"))
      .def("deadline", &sakura::ExecutionProgress::deadline, py::arg("shard"), py::arg("now"))
      .def("window", &sakura::ExecutionProgress::window, py::arg("shard"), py::arg("now"))
      .def_property_readonly("startup_s", &sakura::ExecutionProgress::startup_s)
      .def_property_readonly("origin", &sakura::ExecutionProgress::origin)
      .def_property_readonly("start_not_before", &sakura::ExecutionProgress::start_not_before)
      .def_property_readonly("num_shards", &sakura::ExecutionProgress::num_shards)
      .def_property_readonly("scale", &sakura::ExecutionProgress::scale)
      .def_property_readonly("recon_est_s", &sakura::ExecutionProgress::recon_est_s);

  py::class_<sakura::Allocator, std::shared_ptr<sakura::Allocator>>(m, "Allocator")
      .def("choose", &sakura::Allocator::choose, py::arg("shard"), py::arg("window_s"),
           py::arg("rate_bps"), py::arg("stale") = py::none(),
           "stale(m): shard m may run on its group's kept K/V at no bytes (None: never)")
      .def("fallbacks", &sakura::Allocator::fallbacks, py::arg("shard"))
      .def("skippable", &sakura::Allocator::skippable, py::arg("shard"), py::arg("config"))
      .def_property_readonly("num_shards", &sakura::Allocator::num_shards);

  py::class_<sakura::AdaptiveAllocator, sakura::Allocator,
             std::shared_ptr<sakura::AdaptiveAllocator>>(m, "AdaptiveAllocator")
      .def(py::init([](const std::vector<std::vector<std::pair<int, std::int64_t>>>& tables,
                       double latency_s, double safety) {
             std::vector<std::vector<sakura::AllocOption>> t;
             for (const auto& shard : tables) {
               std::vector<sakura::AllocOption> opts;
               for (const auto& [id, nbytes] : shard) opts.push_back({id, nbytes});
               t.push_back(std::move(opts));
             }
             return std::make_shared<sakura::AdaptiveAllocator>(std::move(t), latency_s, safety);
           }),
           py::arg("tables"), py::arg("latency_s") = 0.0, py::arg("safety") = 0.8,
           "tables[shard] = [(config id, bytes), ...], best quality first.")
      .def("smallest", &sakura::AdaptiveAllocator::smallest, py::arg("shard"))
      .def("set_skippable", &sakura::AdaptiveAllocator::set_skippable, py::arg("ids"),
           "ids[shard]: the configurations the stale plan may leave unfetched (default: "
           "the smallest)")
      .def(
          "set_lookahead",
          [](sakura::AdaptiveAllocator& a, std::vector<std::vector<double>> costs,
             std::vector<double> slots_s, int horizon, int bins) {
            a.set_lookahead({std::move(costs), std::move(slots_s), horizon, bins});
          },
          py::arg("costs"), py::arg("slots_s"), py::arg("horizon") = 8, py::arg("bins") = 256,
          "Plan over the next shards (edge/lookahead.py): costs[shard] aligned with the "
          "tables, slots_s[shard] its predicted execution time.")
      .def_property_readonly("has_lookahead", &sakura::AdaptiveAllocator::has_lookahead);

  py::class_<sakura::FixedAllocator, sakura::Allocator, std::shared_ptr<sakura::FixedAllocator>>(
      m, "FixedAllocator")
      .def(py::init<std::vector<int>>(), py::arg("configs"));
}
