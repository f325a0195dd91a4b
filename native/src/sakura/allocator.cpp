#include "sakura/allocator.hpp"

#include <algorithm>
#include <cmath>
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

int AdaptiveAllocator::smallest(int shard) const {
  check_shard(shard, tables_.size());
  return smallest_[shard];
}

int AdaptiveAllocator::choose(int shard, double window_s, double rate_bps) const {
  check_shard(shard, tables_.size());
  const double budget = budget_bytes(window_s, rate_bps, latency_s_, safety_);
  for (const auto& o : tables_[shard]) {  // best first
    if (static_cast<double>(o.nbytes) <= budget) return o.id;
  }
  return smallest_[shard];
}

FixedAllocator::FixedAllocator(std::vector<int> configs) : configs_(std::move(configs)) {}

int FixedAllocator::choose(int shard, double, double) const {
  check_shard(shard, configs_.size());
  return configs_[shard];
}

}  // namespace sakura
