// Per-shard choice of configuration: the C++ twin of sakura/edge/allocator.py's
// AdaptiveAllocator and FixedAllocator (tests/edge/test_allocator.py runs the same tests
// against both). Which configurations a policy offers, and their quality order, is decided
// in Python from the manifest (options_from_manifest, the policy registry); the tables given
// here are already ranked best quality first.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace sakura {

struct AllocOption {
  int id = 0;
  std::int64_t nbytes = 0;
};

// Bytes that fit in the window at the estimated rate after the request latency.
double budget_bytes(double window_s, double rate_bps, double latency_s = 0.0,
                    double safety = 1.0);

// Whether shard m may run on its group's kept K/V at no bytes (the stale plan, as the
// receive stage judges it for a plan from the shard at hand); empty: never.
using StaleOptions = std::function<bool(int)>;

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual int choose(int shard, double window_s, double rate_bps,
                     const StaleOptions& stale = {}) const = 0;
  virtual int num_shards() const = 0;
  // The configurations of `shard` the policy accepts in place of its choice (a received
  // prefix at the deadline, the part before a damaged unit); none: it waits for its choice.
  virtual std::vector<int> fallbacks(int) const { return {}; }
  // Whether the stale plan (edge/stale_plan.py) may run `shard` on its group's kept K/V
  // instead of fetching `config`: the policy's smallest configuration.
  virtual bool skippable(int /*shard*/, int /*config*/) const { return false; }
};

// The stale plan's threshold (edge/stale_plan.py STALE_PLAN_DB, the same measurement): a
// configuration profiled below this output PSNR is not worth its bytes while recent K/V are
// at hand; one without a PSNR is judged by whether it is the smallest.
constexpr double kStalePlanDb = 50.0;
bool stale_skippable(std::optional<double> psnr_db, bool smallest);

// Tail-aware choice (edge/lookahead.py, with the same arithmetic in the same order): plan
// the next `horizon` shards to minimize their summed output error (costs, aligned with the
// tables) under the cumulative budgets at each one's deadline (windows grow by the predicted
// execution slots), a dynamic program over `bins` steps of the last budget; commit the first.
// A shard that may run stale (stale[m]) has one more option: no bytes at kStaleCost.
struct Lookahead {
  static constexpr int kStale = -2;  // edge/lookahead.py STALE
  std::vector<std::vector<double>> costs;
  std::vector<double> slots_s;
  int horizon = 8;
  int bins = 256;
  // index into shard's table; kStale when the plan runs it stale, -1 when nothing fits
  // budgets[0] and it may not
  int choose(int shard, const std::vector<std::vector<AllocOption>>& tables,
             const std::vector<double>& budgets, const std::vector<bool>& stale = {}) const;
};
// edge/lookahead.py STALE_COST: kStalePlanDb as an additive output error
inline double stale_cost() { return std::pow(10.0, -kStalePlanDb / 10.0); }

// Highest-quality configuration whose bytes fit rate x (window - latency) x safety; the
// smallest one when none fits. With a lookahead, the first choice of its plan.
class AdaptiveAllocator final : public Allocator {
 public:
  // tables[shard]: the candidates, best first (non-empty).
  AdaptiveAllocator(std::vector<std::vector<AllocOption>> tables, double latency_s = 0.0,
                    double safety = 0.8);
  int choose(int shard, double window_s, double rate_bps,
             const StaleOptions& stale = {}) const override;
  int num_shards() const override { return static_cast<int>(tables_.size()); }
  std::vector<int> fallbacks(int shard) const override;  // every candidate of its table
  // the smallest configuration, or (set_skippable) those the policy lists per shard
  bool skippable(int shard, int config) const override;
  void set_skippable(std::vector<std::vector<int>> ids);
  int smallest(int shard) const;
  void set_lookahead(Lookahead lookahead);
  bool has_lookahead() const { return has_lookahead_; }

 private:
  std::vector<std::vector<AllocOption>> tables_;
  Lookahead lookahead_;
  bool has_lookahead_ = false;
  std::vector<int> smallest_;
  std::vector<std::vector<int>> skippable_;  // empty: the smallest only
  double latency_s_, safety_;
};

// A precomputed configuration per shard, whatever the window.
class FixedAllocator final : public Allocator {
 public:
  explicit FixedAllocator(std::vector<int> configs);
  int choose(int shard, double window_s, double rate_bps,
             const StaleOptions& stale = {}) const override;
  int num_shards() const override { return static_cast<int>(configs_.size()); }

 private:
  std::vector<int> configs_;
};

}  // namespace sakura
