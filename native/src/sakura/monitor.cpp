#include "sakura/monitor.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace sakura {

namespace {
bool has(double x) { return !std::isnan(x); }

std::string repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  std::string s = std::to_string(x);
  return s;
}
}  // namespace

double lookahead_wait(int ahead, int max_ahead, int max_ahead_cap, double until_start_s,
                      double horizon_s) {
  if (ahead <= max_ahead) return 0.0;
  if (ahead > max_ahead_cap || horizon_s <= 0) return kNoValue;
  return std::max(0.0, until_start_s - horizon_s);
}

// ----------------------------------------------------------------------- BandwidthMonitor

BandwidthMonitor::BandwidthMonitor(int k, double initial_bps, double min_body_s)
    : k_(k), initial_bps_(initial_bps), min_body_s_(min_body_s), held_(initial_bps) {
  if (k < 1) throw std::invalid_argument("k must be >= 1");
}

TransferSample BandwidthMonitor::record(int shard, std::int64_t nbytes, double start,
                                        double first_byte, double end) {
  TransferSample s{shard, nbytes, start, first_byte, end};
  std::lock_guard<std::mutex> lock(mu_);
  samples_.push_back(s);
  held_ = estimate_locked(held_);
  return s;
}

double BandwidthMonitor::begin_of(std::size_t i, const std::vector<TransferSample>& samples) {
  // its request plus one round trip (the others' smallest time to first byte), no later than
  // its first byte (edge/monitor.py, _begin)
  double round_trip = kNoValue;
  for (std::size_t j = 0; j < samples.size(); ++j) {
    if (j != i && (!has(round_trip) || samples[j].latency_s() < round_trip)) {
      round_trip = samples[j].latency_s();
    }
  }
  return std::min(samples[i].first_byte, samples[i].start + (has(round_trip) ? round_trip : 0.0));
}

namespace {
// The length of the union of [begin, end) spans.
double union_length(std::vector<std::pair<double, double>> spans) {
  std::sort(spans.begin(), spans.end());
  double total = 0.0, reach = -std::numeric_limits<double>::infinity();
  for (const auto& [begin, end] : spans) {
    if (end > reach) {
      total += end - std::max(begin, reach);
      reach = end;
    }
  }
  return total;
}
}  // namespace

double BandwidthMonitor::estimate_locked(double held) const {
  const auto& samples = samples_;
  const bool prior = has(initial_bps_) && initial_bps_ > 0;
  // bytes of the last k transfers over the union of their busy intervals (edge/monitor.py)
  const std::size_t n = samples.size();
  const std::size_t from = n > static_cast<std::size_t>(k_) ? n - k_ : 0;
  std::vector<std::pair<double, double>> spans, bodies;
  std::int64_t nbytes = 0;
  for (std::size_t i = from; i < n; ++i) {
    spans.emplace_back(begin_of(i, samples), samples[i].end);
    bodies.emplace_back(samples[i].first_byte, samples[i].end);
    nbytes += samples[i].nbytes;
  }
  const double busy = union_length(spans);
  const double body = union_length(bodies);
  double measured = 8.0 * static_cast<double>(nbytes) / std::max(busy, min_body_s_);
  const double floor = n > 1 ? held : initial_bps_;
  const bool has_floor = has(floor) && floor > 0;
  if (busy < min_body_s_) return (!has_floor || measured > floor) ? measured : floor;
  const double m = static_cast<double>(n - from);
  const double missing = prior ? static_cast<double>(k_) - m : 0.0;
  if (missing > 0 && measured > 0) {
    measured = (m + missing) / (m / measured + missing / initial_bps_);
  }
  if (has_floor && body < kAppLimitedShare * busy) return std::max(measured, floor);
  return measured;
}

double BandwidthMonitor::estimate_bps() const {
  std::lock_guard<std::mutex> lock(mu_);
  return samples_.empty() ? initial_bps_ : held_;
}

double BandwidthMonitor::latency_s() const {
  std::vector<double> lat;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const std::size_t n = samples_.size();
    const std::size_t from = n > static_cast<std::size_t>(k_) ? n - k_ : 0;
    for (std::size_t i = from; i < n; ++i) lat.push_back(samples_[i].latency_s());
  }
  if (lat.empty()) return 0.0;
  std::sort(lat.begin(), lat.end());
  const std::size_t m = lat.size() / 2;
  return lat.size() % 2 ? lat[m] : (lat[m - 1] + lat[m]) / 2.0;
}

std::int64_t BandwidthMonitor::bytes_total() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::int64_t total = 0;
  for (const auto& s : samples_) {
    if (s.shard >= 0) total += s.nbytes;
  }
  return total;
}

// ----------------------------------------------------------------------- ExecutionProgress

ExecutionProgress::ExecutionProgress(std::vector<double> exec_s, double origin,
                                     double startup_s, double alpha)
    : origin_(origin), alpha_(alpha) {
  if (exec_s.empty()) throw std::invalid_argument("need the execution time of at least one shard");
  startup_s_ = has(startup_s) ? startup_s : exec_s[0];
  for (double& x : exec_s) x = std::max(0.0, x);
  exec_s_ = std::move(exec_s);
  if (!std::isfinite(startup_s_) || startup_s_ < 0) {
    throw std::invalid_argument("startup_s must be a finite time >= 0, got " + repr(startup_s));
  }
  shards_.resize(exec_s_.size());
}

std::shared_ptr<ExecutionProgress> ExecutionProgress::with_allowance(
    const std::vector<double>& exec_s, double origin, double allowance_s, double now,
    double alpha) {
  if (!std::isfinite(allowance_s) || allowance_s < 0) {
    throw std::invalid_argument("the startup allowance must be a finite time >= 0, got " +
                                repr(allowance_s));
  }
  const double first = exec_s.empty() ? 0.0 : std::max(0.0, exec_s[0]);
  return std::make_shared<ExecutionProgress>(exec_s, origin,
                                             std::max(first, now - origin + allowance_s), alpha);
}

void ExecutionProgress::check_shard(int shard) const {
  if (shard < 0 || shard >= num_shards()) {
    throw std::out_of_range("shard " + std::to_string(shard) + " outside 0.." +
                            std::to_string(num_shards() - 1));
  }
}

void ExecutionProgress::received(int shard, double t) {
  check_shard(shard);
  std::lock_guard<std::mutex> lock(mu_);
  shards_[shard].recv_end = t;
}

void ExecutionProgress::reconstructed(int shard, double start, double end) {
  check_shard(shard);
  std::lock_guard<std::mutex> lock(mu_);
  auto& p = shards_[shard];
  p.recon_start = start;
  p.recon_end = end;
  const double d = std::max(0.0, end - start);
  recon_est_s_ = recon_est_s_ == 0 ? d : alpha_ * d + (1 - alpha_) * recon_est_s_;
}

void ExecutionProgress::exec_started(int shard, double t) {
  check_shard(shard);
  std::lock_guard<std::mutex> lock(mu_);
  shards_[shard].exec_start = t;
}

void ExecutionProgress::exec_ended(int shard, double t) {
  check_shard(shard);
  std::lock_guard<std::mutex> lock(mu_);
  auto& p = shards_[shard];
  p.exec_end = t;
  const double predicted = exec_s_[shard];
  if (has(p.exec_start) && predicted > 0) {
    const double ratio = std::max(0.0, t - p.exec_start) / predicted;
    scale_ = alpha_ * ratio + (1 - alpha_) * scale_;
  }
}

void ExecutionProgress::exec_ended_local(int shard, double t) {
  check_shard(shard);
  std::lock_guard<std::mutex> lock(mu_);
  shards_[shard].exec_end = t;
}

double ExecutionProgress::scale() const {
  std::lock_guard<std::mutex> lock(mu_);
  return scale_;
}

double ExecutionProgress::recon_est_s() const {
  std::lock_guard<std::mutex> lock(mu_);
  return recon_est_s_;
}

double ExecutionProgress::predicted_exec_s(int shard) const {
  check_shard(shard);
  std::lock_guard<std::mutex> lock(mu_);
  return predicted_locked(shard);
}

double ExecutionProgress::ready(int i, double now) const {
  const auto& p = shards_[i];
  if (has(p.recon_end)) return p.recon_end;
  if (has(p.recon_start)) return std::max(now, p.recon_start + recon_est_s_);
  if (has(p.recv_end)) return std::max(now, p.recv_end + recon_est_s_);
  return now + recon_est_s_;  // not received yet: at best right after now
}

double ExecutionProgress::deadline_locked(int shard, double now) const {
  int started = -1;
  for (int i = 0; i < shard; ++i) {
    if (has(shards_[i].exec_start)) started = i;
  }
  double t;
  int first;
  if (started >= 0) {
    const auto& p = shards_[started];
    t = has(p.exec_end) ? p.exec_end
                        : std::max(now, p.exec_start + predicted_locked(started));
    first = started + 1;
  } else {
    // nothing executes yet: execution starts once shard 0 is ready, not before the allowance
    if (shard == 0) return std::max(now, start_not_before());
    t = std::max(ready(0, now), start_not_before()) + predicted_locked(0);
    first = 1;
  }
  for (int i = first; i < shard; ++i) t = std::max(t, ready(i, now)) + predicted_locked(i);
  return t;
}

double ExecutionProgress::deadline(int shard, double now) const {
  check_shard(shard);
  std::lock_guard<std::mutex> lock(mu_);
  return deadline_locked(shard, now);
}

Window ExecutionProgress::window(int shard, double now) const {
  check_shard(shard);
  std::lock_guard<std::mutex> lock(mu_);
  Window w;
  w.shard = shard;
  w.deadline = deadline_locked(shard, now);
  w.window_s = w.deadline - now - recon_est_s_;
  w.slot_s = shard == 0 ? startup_s_ : predicted_locked(shard - 1);
  w.carry_s = w.window_s - w.slot_s;
  return w;
}

}  // namespace sakura
