#include "sakura/allocator.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace sakura {

double budget_bytes(double window_s, double rate_bps, double latency_s, double safety) {
  if (!(rate_bps > 0 && std::isfinite(rate_bps))) return 0.0;
  return std::max(0.0, window_s - latency_s) * rate_bps / 8.0 * safety;
}

namespace {
void check_shard(int shard, std::size_t n) {
  if (shard < 0 || static_cast<std::size_t>(shard) >= n) {
    throw std::out_of_range("shard " + std::to_string(shard) + " outside the allocator's " +
                            std::to_string(n) + " shards");
  }
}
}  // namespace

AdaptiveAllocator::AdaptiveAllocator(std::vector<std::vector<AllocOption>> tables,
                                     double latency_s, double safety)
    : tables_(std::move(tables)), latency_s_(latency_s), safety_(safety) {
  for (std::size_t s = 0; s < tables_.size(); ++s) {
    const auto& t = tables_[s];
    if (t.empty()) {
      throw std::invalid_argument("shard " + std::to_string(s) +
                                  " has no configurations in the manifest");
    }
    // fewest bytes; among equal sizes the one ranked last (as edge/allocator.py)
    std::size_t best = 0;
    for (std::size_t i = 1; i < t.size(); ++i) {
      if (t[i].nbytes <= t[best].nbytes) best = i;
    }
    smallest_.push_back(t[best].id);
  }
}

std::vector<int> AdaptiveAllocator::fallbacks(int shard) const {
  std::vector<int> out;
  for (const auto& o : tables_.at(static_cast<std::size_t>(shard))) out.push_back(o.id);
  return out;
}

bool stale_skippable(std::optional<double> psnr_db, bool smallest) {
  return smallest || (psnr_db && std::isfinite(*psnr_db) && *psnr_db < kStalePlanDb);
}

bool AdaptiveAllocator::skippable(int shard, int config) const {
  check_shard(shard, tables_.size());
  if (skippable_.empty()) return config == smallest_[shard];
  const auto& ids = skippable_[shard];
  return std::find(ids.begin(), ids.end(), config) != ids.end();
}

void AdaptiveAllocator::set_skippable(std::vector<std::vector<int>> ids) {
  if (ids.size() != tables_.size()) {
    throw std::invalid_argument("set_skippable needs one list per shard");
  }
  skippable_ = std::move(ids);
}

int AdaptiveAllocator::smallest(int shard) const {
  check_shard(shard, tables_.size());
  return smallest_[shard];
}

void AdaptiveAllocator::set_lookahead(Lookahead lookahead) {
  if (lookahead.costs.size() != tables_.size() || lookahead.slots_s.size() != tables_.size()) {
    throw std::invalid_argument("the lookahead needs a cost table and a slot per shard");
  }
  for (std::size_t s = 0; s < tables_.size(); ++s) {
    if (lookahead.costs[s].size() != tables_[s].size()) {
      throw std::invalid_argument("shard " + std::to_string(s) +
                                  ": one lookahead cost per configuration");
    }
  }
  if (lookahead.horizon < 1 || lookahead.bins < 1) {
    throw std::invalid_argument("the lookahead needs horizon >= 1 and bins >= 1");
  }
  lookahead_ = std::move(lookahead);
  has_lookahead_ = true;
}

int Lookahead::choose(int shard, const std::vector<std::vector<AllocOption>>& tables,
                      const std::vector<double>& budgets,
                      const std::vector<bool>& stale) const {
  const int last = static_cast<int>(budgets.size()) - 1;
  auto may = [&](int m) { return static_cast<std::size_t>(m) < stale.size() && stale[m]; };
  if (last < 0) return -1;
  if (budgets[0] <= 0.0) return may(0) ? kStale : -1;
  const double stale_err = stale_cost();
  const double q = budgets[last] / bins;
  std::vector<long long> caps;
  for (double b : budgets) caps.push_back(std::min<long long>(bins, static_cast<long long>(std::floor(b / q))));
  caps[last] = bins;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> f(bins + 1, 0.0), g(bins + 1);
  for (int m = last; m > 0; --m) {
    const auto& table = tables[shard + m];
    const auto& cost = costs[shard + m];
    std::fill(g.begin(), g.end(), inf);
    for (std::size_t i = 0; i < table.size(); ++i) {
      const long long nb = static_cast<long long>(std::ceil(static_cast<double>(table[i].nbytes) / q));
      for (long long s = 0; s <= bins; ++s) {
        const long long nxt = s + nb;
        if (nxt > caps[m]) break;
        const double v = cost[i] + f[nxt];
        if (v < g[s]) g[s] = v;
      }
    }
    if (may(m)) {  // zero bytes: whatever the earlier shards took
      for (long long s = 0; s <= bins; ++s) g[s] = std::min(g[s], stale_err + f[s]);
    }
    // nothing fits: its smallest configuration, the link full for the shards after it
    std::size_t small = 0;
    for (std::size_t i = 1; i < table.size(); ++i) {
      if (table[i].nbytes <= table[small].nbytes) small = i;
    }
    for (long long s = 0; s <= bins; ++s) {
      if (std::isinf(g[s])) g[s] = cost[small] + f[bins];
    }
    f.swap(g);
  }
  double best = inf;
  int pick = -1;
  const auto& table = tables[shard];
  for (std::size_t i = 0; i < table.size(); ++i) {
    const long long nb = static_cast<long long>(std::ceil(static_cast<double>(table[i].nbytes) / q));
    if (nb > caps[0]) continue;
    const double v = costs[shard][i] + f[nb];
    if (v < best) {
      best = v;
      pick = static_cast<int>(i);
    }
  }
  if (may(0) && stale_err + f[0] < best) pick = kStale;
  return pick;
}

int AdaptiveAllocator::choose(int shard, double window_s, double rate_bps,
                              const StaleOptions& stale) const {
  check_shard(shard, tables_.size());
  if (has_lookahead_) {
    std::vector<double> budgets;
    std::vector<bool> may;
    double acc = window_s;
    const int end = std::min(num_shards(), shard + lookahead_.horizon);
    for (int m = shard; m < end; ++m) {
      budgets.push_back(budget_bytes(acc, rate_bps, latency_s_, safety_));
      if (stale) may.push_back(stale(m));
      acc += lookahead_.slots_s[m];
    }
    // nothing fits, or the plan runs it stale: the smallest (the receive stage skips it)
    const int pick = lookahead_.choose(shard, tables_, budgets, may);
    return pick < 0 ? smallest_[shard] : tables_[shard][pick].id;
  }
  const double budget = budget_bytes(window_s, rate_bps, latency_s_, safety_);
  for (const auto& o : tables_[shard]) {  // best first
    if (static_cast<double>(o.nbytes) <= budget) return o.id;
  }
  return smallest_[shard];
}

FixedAllocator::FixedAllocator(std::vector<int> configs) : configs_(std::move(configs)) {}

int FixedAllocator::choose(int shard, double, double, const StaleOptions&) const {
  check_shard(shard, configs_.size());
  return configs_[shard];
}

}  // namespace sakura
