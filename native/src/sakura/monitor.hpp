// Bandwidth and execution-progress bookkeeping for the allocator: the C++ twin of
// sakura/edge/monitor.py (same rules, same numbers; tests/edge/test_allocator.py runs the
// same tests against both). Times are seconds on one monotonic clock; "no value" is NaN.
//
// BandwidthMonitor: one sample per transfer; the estimate is the bytes of the last k
// transfers over the union of their busy intervals (each from its request plus the others'
// smallest time to first byte, no later than its first byte, to its end), the prior standing
// for transfers missing from the k; a window busy for less than min_body_s only raises the
// estimate held before it, and so does an app-limited window (bytes arriving less than
// kAppLimitedShare of its busy time); the estimate is kept as of each record(); the latency
// is the median time to first byte of the last k transfers.
//
// ExecutionProgress: calibrated execution time per shard, corrected online by the
// exponentially averaged ratio measured / predicted; predicts each shard's execution start
// (its deadline) and the allocator's window for it. Both classes are thread-safe.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

namespace sakura {

constexpr double kNoValue = std::numeric_limits<double>::quiet_NaN();
// edge/monitor.py APP_LIMITED_SHARE
constexpr double kAppLimitedShare = 0.5;

struct TransferSample {
  int shard = -1;  // -1: not a shard (the manifest)
  std::int64_t nbytes = 0;
  double start = 0, first_byte = 0, end = 0;

  double latency_s() const { return std::max(0.0, first_byte - start); }
};

class BandwidthMonitor {
 public:
  explicit BandwidthMonitor(int k = 5, double initial_bps = kNoValue, double min_body_s = 0.002);

  TransferSample record(int shard, std::int64_t nbytes, double start, double first_byte,
                        double end);
  double estimate_bps() const;  // NaN before any estimate
  double latency_s() const;     // 0 before any transfer
  std::int64_t bytes_total() const;
  int k() const { return k_; }

 private:
  static double begin_of(std::size_t i, const std::vector<TransferSample>& samples);
  double estimate_locked(double held) const;  // the estimate with samples_ as they are

  int k_;
  double initial_bps_, min_body_s_;
  std::vector<TransferSample> samples_;
  double held_;  // the estimate as of the last record() (initial_bps_ before any)
  mutable std::mutex mu_;
};

struct Window {
  int shard = 0;
  double window_s = 0;  // time left to receive the shard
  double slot_s = 0;    // nominal part: execution time of the previous shard (or startup)
  double carry_s = 0;   // window_s - slot_s
  double deadline = 0;  // predicted execution start of the shard (absolute)
};

class ExecutionProgress {
 public:
  // startup_s NaN: exec_s[0]. Throws std::invalid_argument for bad values.
  ExecutionProgress(std::vector<double> exec_s, double origin, double startup_s = kNoValue,
                    double alpha = 0.5);
  // Execution predicted to start allowance_s after `now` at the earliest, never before
  // origin + exec_s[0] (edge/monitor.py, ExecutionProgress.with_allowance).
  static std::shared_ptr<ExecutionProgress> with_allowance(const std::vector<double>& exec_s,
                                                           double origin, double allowance_s,
                                                           double now, double alpha = 0.5);

  void received(int shard, double t);
  void reconstructed(int shard, double start, double end);
  void exec_started(int shard, double t);
  void exec_ended(int shard, double t);
  // A shard whose step ran locally (local fallback) ended: its time does not move the scale.
  void exec_ended_local(int shard, double t);

  double predicted_exec_s(int shard) const;
  double deadline(int shard, double now) const;
  Window window(int shard, double now) const;

  double startup_s() const { return startup_s_; }
  double origin() const { return origin_; }
  double start_not_before() const { return origin_ + startup_s_; }
  int num_shards() const { return static_cast<int>(exec_s_.size()); }
  double scale() const;
  double recon_est_s() const;

 private:
  struct Shard {
    double recv_end = kNoValue, recon_start = kNoValue, recon_end = kNoValue;
    double exec_start = kNoValue, exec_end = kNoValue;
  };
  void check_shard(int shard) const;
  double ready(int i, double now) const;
  double deadline_locked(int shard, double now) const;
  double predicted_locked(int shard) const { return exec_s_[shard] * scale_; }

  std::vector<double> exec_s_;
  double origin_, startup_s_, alpha_;
  double scale_ = 1.0, recon_est_s_ = 0.0;
  std::vector<Shard> shards_;
  mutable std::mutex mu_;
};

// When a shard `ahead` shards past the executing one may be requested: 0 (now) within
// max_ahead; beyond it, up to max_ahead_cap, once its predicted execution start is horizon_s
// away; NaN (when execution advances) otherwise. sakura/edge/pipeline.py, lookahead_wait.
double lookahead_wait(int ahead, int max_ahead, int max_ahead_cap, double until_start_s,
                      double horizon_s);

}  // namespace sakura
