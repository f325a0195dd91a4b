#include "sakura/edit.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>
#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

#include "sakura/shard.hpp"
#ifdef SAKURA_HAVE_OPENCL
#include "sakura/opencl_decode.hpp"
#endif

namespace sakura {

int stale_source(const std::vector<ShardRecord>& shards, int shard, int max_age,
                 int unfetched_from) {
  if (max_age <= 0) return -1;
  const ShardRecord& me = shards.at(static_cast<std::size_t>(shard));
  for (int i = shard - 1; i >= 0; --i) {
    const ShardRecord& r = shards[static_cast<std::size_t>(i)];
    if (me.step - r.step > max_age) return -1;
    const bool skipped = r.planned_stale || (unfetched_from >= 0 && i >= unfetched_from);
    if (r.blocks == me.blocks && !skipped) return r.step;
  }
  return -1;
}

namespace {

constexpr double kPollCapS = 0.05;  // longest poll while waiting for a slot or a transfer
// Deadlines (edge/README.md, "Deadlines"): once execution has waited this share of the
// shard's predicted execution time (at least kMinGraceS) for a transfer, the shard runs on
// the longest verified prefix its policy accepts; with none yet, a transfer that made no
// progress for that time, 3 request latencies and kStallFloorS is re-requested on a fresh
// connection (once per wait). The stall
// watchdog restarts any attempt silent for max(kStallFloorS, 3 round trips, 2x the expected
// time of its remaining bytes), doubling per restart in a row.
constexpr double kGraceFraction = 0.5;
constexpr double kMinGraceS = 0.001;
constexpr double kStallFloorS = 0.05;
// Prefix refinement (issue 28 item 5): a received shard is extended by the next ranges of
// its stream only if the extension's expected time (its bytes at the rate estimate plus one
// request latency), taken kRefineMargin times, ends before the shard's predicted execution
// start; a late extension costs at most the deadline's grace, then the shard runs on what
// it had.
constexpr double kRefineMargin = 2.0;

// Pin the calling thread to ``cpus`` (none: unchanged).
void pin_this_thread(const std::vector<int>& cpus) {
#ifdef __linux__
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE) {
      throw std::invalid_argument("pipeline_cpus: no CPU " + std::to_string(c));
    }
    CPU_SET(c, &set);
  }
  const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) {
    throw std::invalid_argument("pipeline_cpus: cannot run the pipeline threads on those CPUs (" +
                                std::string(std::strerror(rc)) + ")");
  }
#else
  (void)cpus;
#endif
}

void check_size(const std::vector<float>& v, std::int64_t want, const char* what) {
  if (static_cast<std::int64_t>(v.size()) != want) {
    throw std::invalid_argument(std::string(what) + " has " + std::to_string(v.size()) +
                                " values, the graphs want " + std::to_string(want));
  }
}

}  // namespace

void half_to_float(const std::uint8_t* data, std::size_t count, float* out) {
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint16_t h = static_cast<std::uint16_t>(data[2 * i] | (data[2 * i + 1] << 8));
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000) << 16;
    std::uint32_t exp = (h >> 10) & 0x1f;
    std::uint32_t man = h & 0x3ff;
    std::uint32_t bits;
    if (exp == 0) {
      if (man == 0) {
        bits = sign;
      } else {  // subnormal: normalise
        exp = 1;
        while ((man & 0x400) == 0) {
          man <<= 1;
          --exp;
        }
        man &= 0x3ff;
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
      }
    } else if (exp == 0x1f) {
      bits = sign | 0x7f800000u | (man << 13);
    } else {
      bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    std::memcpy(out + i, &bits, sizeof bits);
  }
}

void decode_intq(const std::uint8_t* data, std::size_t size, int bits, int group,
                 std::int64_t rows, std::int64_t channels, float* out) {
  if (bits < 1 || bits > 8 || group < 1 || rows < 0 || channels < 1) {
    throw FormatError("intq: " + std::to_string(bits) + " bits, group " + std::to_string(group) +
                      " is not a layout (bits 1-8, group >= 1)");
  }
  const std::int64_t groups = (channels + group - 1) / group;
  const std::int64_t code_bytes = (channels * bits + 7) / 8;
  const std::int64_t row_bytes = 4 * groups + code_bytes;
  if (static_cast<std::int64_t>(size) != rows * row_bytes) {
    throw FormatError("intq " + std::to_string(bits) + "-bit: " + std::to_string(size) +
                      " bytes, the layout needs " + std::to_string(rows * row_bytes));
  }
  std::vector<float> scale(static_cast<std::size_t>(groups)), lo(static_cast<std::size_t>(groups));
  const unsigned mask = (1u << bits) - 1u;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::uint8_t* row = data + r * row_bytes;
    half_to_float(row, static_cast<std::size_t>(groups), scale.data());
    half_to_float(row + 2 * groups, static_cast<std::size_t>(groups), lo.data());
    const std::uint8_t* codes = row + 4 * groups;
    float* o = out + r * channels;
    for (std::int64_t c = 0; c < channels; ++c) {
      const std::int64_t bit = c * bits;  // the code's first bit, little-endian in the row
      unsigned word = codes[bit >> 3];
      if ((bit & 7) + bits > 8) word |= static_cast<unsigned>(codes[(bit >> 3) + 1]) << 8;
      const unsigned code = (word >> (bit & 7)) & mask;
      const std::int64_t g = c / group;
      // as torch: codes.float() * scale, then + lo, rounded apart (no fused multiply-add)
      volatile float prod = static_cast<float>(code) * scale[static_cast<std::size_t>(g)];
      o[c] = prod + lo[static_cast<std::size_t>(g)];
    }
  }
}

// ------------------------------------------------------------------------- ResidentFeed

ResidentFeed::ResidentFeed(std::vector<std::vector<float>> shards,
                           std::vector<ShardRecord> records, double origin)
    : shards_(std::move(shards)), records_(std::move(records)), origin_(origin) {
  if (shards_.size() != records_.size()) {
    throw std::invalid_argument("resident feed: one record per shard");
  }
}

const float* ResidentFeed::acquire(int shard) {
  if (shard < 0 || static_cast<std::size_t>(shard) >= shards_.size()) {
    throw std::out_of_range("the resident cache has no shard " + std::to_string(shard));
  }
  const double now = now_s();
  if (current_ >= 0 && current_ != shard) records_[current_].exec_end = now - origin_;
  records_[shard].exec_start = now - origin_;
  current_ = shard;
  return shards_[shard].data();
}

std::int64_t ResidentFeed::matrix_floats() const {
  return static_cast<std::int64_t>(shards_.at(0).size() / (2 * records_.at(0).blocks.size()));
}

void ResidentFeed::finish() {
  if (current_ >= 0 && std::isnan(records_[current_].exec_end)) {
    records_[current_].exec_end = now_s() - origin_;
  }
}

// ------------------------------------------------------------------------- StreamFeed

StreamFeed::StreamFeed(StreamSpec spec, std::shared_ptr<const Allocator> allocator,
                       std::shared_ptr<BandwidthMonitor> monitor,
                       std::shared_ptr<ExecutionProgress> progress)
    : spec_(std::move(spec)),
      allocator_(std::move(allocator)),
      monitor_(std::move(monitor)),
      progress_(std::move(progress)),
      http_(spec_.http),
      records_(spec_.shards) {
  const std::size_t n = records_.size();
  if (n == 0) throw std::invalid_argument("an edit needs at least one shard");
  if (spec_.configs.size() != n || allocator_->num_shards() != static_cast<int>(n) ||
      progress_->num_shards() != static_cast<int>(n)) {
    throw std::invalid_argument("shards, configurations, allocator and progress disagree on "
                                "the number of shards");
  }
  if (spec_.options.max_ahead < 1 || spec_.options.max_ready < 1) {
    throw std::invalid_argument("max_ahead and max_ready must be >= 1");
  }
  spec_.options.max_ready = std::min(spec_.options.max_ready, spec_.options.max_ahead);
  spec_.options.max_ahead_cap = std::max(spec_.options.max_ahead, spec_.options.max_ahead_cap);
  spec_.options.max_inflight = std::max(1, spec_.options.max_inflight);
  if (spec_.decode == DecodeKind::Callback && !spec_.callback) {
    throw std::invalid_argument("a callback decoder needs a callback");
  }
  if (spec_.reconstruct != "cpu" && spec_.reconstruct.rfind("opencl", 0) != 0) {
    throw std::invalid_argument("reconstruct must be cpu or opencl[:device], got " +
                                spec_.reconstruct);
  }
}

StreamFeed::~StreamFeed() {
  cancel();
  stop_threads();
}

void StreamFeed::start() {
  receive_thread_ = std::thread([this] {
    try {
      pin_this_thread(spec_.pipeline_cpus);
      receive_loop();
    } catch (...) {
      fail(std::current_exception());
    }
  });
  reconstruct_thread_ = std::thread([this] {
    try {
      pin_this_thread(spec_.pipeline_cpus);
      reconstruct_loop();
    } catch (...) {
      fail(std::current_exception());
    }
  });
}

void StreamFeed::fail(std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_) error_ = e;
  }
  cv_.notify_all();
  http_.wakeup();
}

void StreamFeed::cancel() {
  cancelled_.store(true);
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
  }
  cv_.notify_all();
  http_.wakeup();
}

void StreamFeed::stop_threads() {
  if (receive_thread_.joinable()) receive_thread_.join();
  if (reconstruct_thread_.joinable()) reconstruct_thread_.join();
}

std::vector<ShardRecord> StreamFeed::records() const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_;
}

bool StreamFeed::link_allows(double* wait_s) {
  *wait_s = kPollCapS;
  const int active = http_.active();
  if (active == 0) return true;
  const double rate = monitor_->estimate_bps();
  const double latency = monitor_->latency_s();
  if (active < spec_.options.max_inflight && rate > 0) {
    // the next request may go out once the bytes still due arrive within one request
    // latency, so its body starts right behind them (edge/pipeline.py, _wait_link)
    const double due_s = static_cast<double>(http_.outstanding_bytes()) * 8.0 / rate;
    if (due_s <= latency) return true;
    *wait_s = std::min(0.01, std::max(0.001, due_s - latency));
  }
  return false;
}

void StreamFeed::issue(int j) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (records_[j].local) return;  // computed on the device: never requested
    bool step_local = false;  // an earlier shard of its step was planned local
    for (int i = j - 1; i >= 0 && records_[i].step == records_[j].step; --i) {
      step_local = step_local || records_[i].planned_local;
    }
    records_[j].planned_local = step_local;  // its step is recomputed: never requested
  }
  if (records_[j].planned_local) {
    progress_->received(j, now_s());
    cv_.notify_all();
    return;
  }
  const double now = now_s();
  const Window window = progress_->window(j, now);
  const double estimate = monitor_->estimate_bps();
  const double rate = std::isnan(estimate) ? 0.0 : estimate;
  const double due = rate > 0 ? static_cast<double>(http_.outstanding_bytes()) * 8.0 / rate : 0.0;
  // the body starts after the bytes still due and after the request latency
  const double lead = std::max(due, monitor_->latency_s());
  StaleOptions stale;  // the plan's view (edge/pipeline.py _stale_options)
  std::vector<ShardRecord> seen;
  if (spec_.options.stale_plan_age > 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      seen = records_;
    }
    const int age = spec_.options.stale_plan_age;
    stale = [&seen, j, age](int m) { return stale_source(seen, m, age, j) >= 0; };
  }
  const int config = allocator_->choose(j, window.window_s - lead, rate, stale);
  if (spec_.options.stale_plan_age > 0 && allocator_->skippable(j, config)) {
    bool planned = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // the stale plan (edge/stale_plan.py, plan_unfetched): never requested, run on its
      // group's K/V when they are recent enough, else (a recompute step) its step local
      const bool recent = stale_source(records_, j, spec_.options.stale_plan_age) >= 0;
      if (recent || (plan_local_.load() && rate > 0 && measured_since_local_)) {
        ShardRecord& rec = records_[j];
        planned = true;
        (recent ? rec.planned_stale : rec.planned_local) = true;
        if (!recent) measured_since_local_ = false;
        rec.window_s = window.window_s;
        rec.carry_s = window.carry_s;
        rec.rate_bps = rate;
        rec.lead_s = lead;
        rec.deadline = window.deadline - spec_.origin;
      }
    }
    if (planned) {
      progress_->received(j, now);  // nothing to receive: ready at once
      cv_.notify_all();             // execution may be waiting for it
      return;
    }
  }
  auto it = spec_.configs[j].find(config);
  if (it == spec_.configs[j].end()) {
    throw std::runtime_error("the allocator chose configuration " + std::to_string(config) +
                             " that shard " + std::to_string(j) + " does not have");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ShardRecord& rec = records_[j];
    rec.config = config;
    rec.window_s = window.window_s;
    rec.carry_s = window.carry_s;
    rec.rate_bps = rate;
    rec.lead_s = lead;
    rec.deadline = window.deadline - spec_.origin;
  }
  FetchRequest req = it->second.request;
  req.shard = j;
  req.config = config;
  // the policy's configurations of this shard that are prefixes of the chosen one (same
  // stream: same range start, its first units), longest first
  for (int id : allocator_->fallbacks(j)) {
    if (id == config) continue;
    auto f = spec_.configs[j].find(id);
    if (f == spec_.configs[j].end()) continue;
    const FetchRequest& fr = f->second.request;
    if (fr.url != req.url || fr.offset != req.offset || fr.length >= req.length ||
        fr.units.empty() || fr.units.size() > req.units.size()) {
      continue;
    }
    bool prefix = true;
    for (std::size_t u = 0; u < fr.units.size() && prefix; ++u) {
      prefix = fr.units[u].length == req.units[u].length && fr.units[u].sha256 == req.units[u].sha256;
    }
    if (prefix) req.fallbacks.emplace_back(id, fr.length);
  }
  std::sort(req.fallbacks.begin(), req.fallbacks.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  http_.start(std::move(req));
}

bool StreamFeed::try_refine() {
  if (!spec_.options.refine || http_.active() > 0) return false;
  const double estimate = monitor_->estimate_bps();
  if (std::isnan(estimate) || estimate <= 0) return false;
  const double latency = monitor_->latency_s();
  std::vector<std::pair<int, int>> received;  // (shard, configuration) that may grow
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [j, got] : pending_) {
      const ShardRecord& rec = records_[j];
      if (j <= executing_ || rec.local || rec.truncated || !rec.damage.empty()) continue;
      received.emplace_back(j, got.first);
    }
  }
  for (const auto& [j, config] : received) {
    auto b = spec_.configs[j].find(config);
    if (b == spec_.configs[j].end()) continue;
    const FetchRequest& base = b->second.request;
    const double now = now_s();
    const double slack = progress_->deadline(j, now) - now;
    // the policy's configurations whose stream starts with this one's bytes (prefix)
    std::vector<std::pair<int, const FetchRequest*>> longer;
    for (int id : allocator_->fallbacks(j)) {
      auto f = spec_.configs[j].find(id);
      if (f == spec_.configs[j].end()) continue;
      const FetchRequest& fr = f->second.request;
      if (fr.url != base.url || fr.offset != base.offset || fr.length <= base.length ||
          fr.units.size() <= base.units.size()) {
        continue;
      }
      bool prefix = true;
      for (std::size_t u = 0; u < base.units.size() && prefix; ++u) {
        prefix = fr.units[u].length == base.units[u].length &&
                 fr.units[u].sha256 == base.units[u].sha256;
      }
      if (prefix) longer.emplace_back(id, &fr);
    }
    // the longest extension that fits in time
    const FetchRequest* best = nullptr;
    int best_id = -1;
    for (const auto& [id, fr] : longer) {
      const double need = static_cast<double>(fr->length - base.length) * 8.0 / estimate + latency;
      if (kRefineMargin * need <= slack && (best == nullptr || fr->length > best->length)) {
        best = fr;
        best_id = id;
      }
    }
    if (best == nullptr) continue;
    FetchRequest ext;
    ext.shard = j;
    ext.config = best_id;
    ext.url = base.url;
    ext.offset = base.offset + base.length;
    ext.length = best->length - base.length;
    ext.pack_bytes = base.pack_bytes;
    ext.units.assign(best->units.begin() + static_cast<std::ptrdiff_t>(base.units.size()),
                     best->units.end());
    for (const auto& [id, fr] : longer) {  // those in between: the extension's fallbacks
      if (fr->length < best->length) ext.fallbacks.emplace_back(id, fr->length - base.length);
    }
    std::sort(ext.fallbacks.begin(), ext.fallbacks.end(),
              [](const auto& x, const auto& y) { return x.second > y.second; });
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto p = pending_.find(j);  // (the reconstruct thread may have taken it meanwhile)
      if (p == pending_.end() || p->second.first != config) continue;
      refining_[j] = std::move(p->second);
      pending_.erase(p);
    }
    http_.start(std::move(ext));
    return true;
  }
  return false;
}

void StreamFeed::complete(FetchDone&& done) {
  const int j = done.shard;
  // a request on a kept-alive connection pays one round trip, a new connection one more:
  // the monitor's request latency (the lead of later requests, which reuse connections)
  // counts from when the connection was open (the first requests of an edit open theirs)
  monitor_->record(j, static_cast<std::int64_t>(done.data.size()), done.start + done.connect_s,
                   done.first_byte, done.end);
  if (!done.data.empty()) measured_since_local_ = true;
  progress_->received(j, done.end);
  std::lock_guard<std::mutex> lock(mu_);
  ShardRecord& rec = records_[j];
  auto refined = refining_.find(j);
  if (refined != refining_.end()) {  // an extension of what the shard had
    auto got = std::move(refined->second);
    refining_.erase(refined);
    if (rec.local) return;
    if (!done.data.empty()) {
      got.second.insert(got.second.end(), done.data.begin(), done.data.end());
      got.first = done.config;
      rec.config = done.config;
      rec.bytes = static_cast<std::int64_t>(got.second.size());
      rec.recv_end = done.end - spec_.origin;
      rec.refinements += 1;
    }
    pending_[j] = std::move(got);
    cv_.notify_all();
    return;
  }
  if (rec.local) return;  // its step ran locally meanwhile: a rate sample only
  rec.recv_start = done.start - spec_.origin;
  rec.recv_first_byte = done.first_byte - spec_.origin;
  rec.recv_end = done.end - spec_.origin;
  rec.bytes = static_cast<std::int64_t>(done.data.size());
  rec.attempts = done.attempts;
  rec.resumes = done.resumes;
  rec.refetches = done.refetches;
  rec.requested = done.requested;
  rec.config = done.config;
  rec.hedges = done.hedges;
  rec.truncated = done.truncated;
  rec.damage = done.damage;
  // a prefix cut at the deadline that the stale plan would not have fetched: the shard runs
  // on its group's recent K/V, or (none) its step is recomputed (edge/pipeline.py,
  // _unfetched_at_deadline; the received bytes were a rate sample)
  if (done.truncated && spec_.options.stale_plan_age > 0 && allocator_->skippable(j, done.config)) {
    const bool recent = stale_source(records_, j, spec_.options.stale_plan_age) >= 0;
    if (recent || plan_local_.load()) {
      (recent ? rec.planned_stale : rec.planned_local) = true;
      rec.config = -1;
      cv_.notify_all();
      return;
    }
  }
  pending_[j] = {done.config, std::move(done.data)};
  cv_.notify_all();
}

void StreamFeed::enforce_deadline(double* wait_s) {
  int w;
  double since;
  bool hedged;
  {
    std::lock_guard<std::mutex> lock(mu_);
    w = waiting_;
    since = waiting_since_;
    hedged = waiting_hedged_;
  }
  if (w < 0 || !http_.has_transfer(w)) return;
  const double grace = std::max(kMinGraceS, kGraceFraction * progress_->predicted_exec_s(w));
  bool refining;
  {
    std::lock_guard<std::mutex> lock(mu_);
    refining = refining_.count(w) > 0;
  }
  // execution asks for shard 0 at once, but its deadline is the predicted start (the
  // startup allowance): the wait counts from there
  const double waited = now_s() - std::max(since, progress_->start_not_before());
  if (waited < grace) {
    *wait_s = std::min(*wait_s, std::max(1e-4, grace - waited));
    return;
  }
  FetchDone done;
  if (http_.take_prefix(w, &done)) {
    complete(std::move(done));
    return;
  }
  if (refining) {  // a late extension: the shard runs on what it had, now
    http_.cancel(w);
    std::lock_guard<std::mutex> lock(mu_);
    auto r = refining_.find(w);
    if (r != refining_.end()) {
      pending_[w] = std::move(r->second);
      refining_.erase(r);
      cv_.notify_all();
    }
    return;
  }
  // a hedge only for a transfer that has stalled, not one waiting for its first byte
  if (!hedged && http_.idle_s(w) >= std::max({grace, 3.0 * monitor_->latency_s(), kStallFloorS})) {
    http_.restart(w);
    std::lock_guard<std::mutex> lock(mu_);
    waiting_hedged_ = true;
  }
  *wait_s = std::min(*wait_s, std::max(1e-3, grace));
}

void StreamFeed::predict_late() {
  int w;
  double until;
  {
    std::lock_guard<std::mutex> lock(mu_);
    w = waiting_;
    until = waiting_until_;
  }
  if (w < 0 || !std::isfinite(until)) return;
  const double estimate = monitor_->estimate_bps();
  if (std::isnan(estimate) || estimate <= 0) return;
  const std::int64_t need = http_.needed_bytes(w);  // (-1: not out, or in a backoff)
  if (need < 0 || now_s() + static_cast<double>(need) * 8.0 / estimate <= until) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (waiting_ == w) {
    predicted_late_ = true;
    cv_.notify_all();
  }
}

void StreamFeed::receive_loop() {
  const int n = static_cast<int>(records_.size());
  int next = 0;
  // every connection opened at once, before any body fills the downlink queue (shard 0's
  // request opens one more right behind these)
  if (spec_.http.warm_connections > 0 && !spec_.configs[0].empty()) {
    http_.warm(spec_.configs[0].begin()->second.request.url, spec_.http.warm_connections);
  }
  while (true) {
    int ahead;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_ || closing_) return;
      ahead = next - executing_;
    }
    double wait = kPollCapS;
    bool slot_free = false;
    if (next < n) {
      const double now = now_s();
      const double slot = lookahead_wait(
          ahead, spec_.options.max_ahead, spec_.options.max_ahead_cap,
          progress_->deadline(next, now) - now,
          spec_.options.lookahead_rtts * monitor_->latency_s());
      slot_free = slot == 0.0;
      if (!std::isnan(slot)) wait = std::min(wait, std::max(slot, 1e-3));
    }
    if (slot_free && link_allows(&wait)) {
      issue(next++);
      continue;
    }
    {
      std::vector<int> drop;
      {
        std::lock_guard<std::mutex> lock(mu_);
        drop.swap(skipped_);
      }
      for (int j : drop) http_.cancel(j);
    }
    origin_failing_.store(http_.failing());
    link_quiet_since_.store(http_.quiet_since_s());
    if (!slot_free && try_refine()) continue;  // the link is idle, no shard may go yet
    if (next == n && http_.active() == 0) return;
    enforce_deadline(&wait);
    predict_late();
    {
      const double estimate = monitor_->estimate_bps();
      http_.restart_stalled(monitor_->latency_s(), std::isnan(estimate) ? 0.0 : estimate,
                            kStallFloorS);
    }
    for (auto& done : http_.poll(wait)) complete(std::move(done));
  }
}

std::vector<float> StreamFeed::decode(int j, int config, const std::vector<std::uint8_t>& data) {
  const std::int64_t matrices = 2 * static_cast<std::int64_t>(records_[j].blocks.size());
  std::vector<float> out(static_cast<std::size_t>(matrices * spec_.matrix_floats));
  switch (spec_.decode) {
    case DecodeKind::LowRank: {
      const ShardHeader h = parse_header(data.data(), data.size());
      if (h.matrices != matrices ||
          static_cast<std::int64_t>(h.tokens) * h.channels != spec_.matrix_floats) {
        throw FormatError("shard " + std::to_string(j) + ": the body holds " +
                          std::to_string(h.matrices) + " matrices [" + std::to_string(h.tokens) +
                          ", " + std::to_string(h.channels) + "], the edit needs " +
                          std::to_string(matrices));
      }
      const float* rope = spec_.rope.empty() ? nullptr : spec_.rope.data();
      const auto& ranks = spec_.configs[j].at(config).ranks;
      if (spec_.reconstruct == "cpu") {
        decode_shard(data.data(), data.size(), ranks, rope, out.data(),
                     spec_.options.decode_threads);
      } else {
#ifdef SAKURA_HAVE_OPENCL
        if (!gpu_) {  // built once, in the reconstruct thread that uses it
          const auto colon = spec_.reconstruct.find(':');
          gpu_ = std::make_shared<OpenCLDecoder>(
              colon == std::string::npos ? "" : spec_.reconstruct.substr(colon + 1));
        }
        static_cast<OpenCLDecoder*>(gpu_.get())->decode(data.data(), data.size(), ranks,
                                                        rope, out.data());
#else
        throw std::runtime_error("this build has no OpenCL reconstruction (--reconstruct cpu)");
#endif
      }
      break;
    }
    case DecodeKind::Fp16:
      if (static_cast<std::int64_t>(data.size()) != 2 * static_cast<std::int64_t>(out.size())) {
        throw FormatError("shard " + std::to_string(j) + ": an fp16 body of " +
                          std::to_string(data.size()) + " bytes, expected " +
                          std::to_string(2 * out.size()));
      }
      half_to_float(data.data(), out.size(), out.data());
      break;
    case DecodeKind::IntQ:
      decode_intq(data.data(), data.size(), spec_.configs[j].at(config).bits, spec_.intq_group,
                  matrices * (spec_.matrix_floats / std::max<std::int64_t>(1, spec_.channels)),
                  spec_.channels, out.data());
      break;
    case DecodeKind::Callback:
      spec_.callback(j, config, data, out.data(), out.size());
      break;
  }
  return out;
}

void StreamFeed::reconstruct_loop() {
  while (true) {
    int j, config;
    std::vector<std::uint8_t> data;
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (true) {
        if (closing_ || error_) return;
        if (!pending_.empty()) {
          auto it = pending_.begin();  // the lowest received shard
          if (it->first - executing_ <= spec_.options.max_ready) {
            j = it->first;
            config = it->second.first;
            data = std::move(it->second.second);
            pending_.erase(it);
            break;
          }
        }
        cv_.wait_for(lock, std::chrono::milliseconds(500));
      }
    }
    const double t0 = now_s();
    std::vector<float> tensors = decode(j, config, data);
    const double t1 = now_s();
    progress_->reconstructed(j, t0, t1);
    std::lock_guard<std::mutex> lock(mu_);
    records_[j].recon_start = t0 - spec_.origin;
    records_[j].recon_end = t1 - spec_.origin;
    if (j > executing_) ready_[j] = std::move(tensors);
    cv_.notify_all();
  }
}

void StreamFeed::end_current(int next, double now) {
  int current;
  bool local;
  {
    std::lock_guard<std::mutex> lock(mu_);
    current = executing_;
    if (current < 0 || current == next || !std::isnan(records_[current].exec_end)) return;
    records_[current].exec_end = now - spec_.origin;
    local = records_[current].local;
  }
  // a local step's time says nothing about the cached shards' (the online scale)
  if (local) {
    progress_->exec_ended_local(current, now);
  } else {
    progress_->exec_ended(current, now);
  }
}

bool StreamFeed::ready_within(int j, double timeout_s) {
  const double now = now_s();
  end_current(j, now);
  std::unique_lock<std::mutex> lock(mu_);
  if (executing_ >= 0 && executing_ != j) ready_.erase(executing_);
  auto unplanned = [&] { return !records_[j].planned_stale && !records_[j].planned_local; };
  if (!unplanned() && !error_) return true;  // the stale plan: no wait
  const double until = now + std::max(0.0, timeout_s);
  while (!ready_.count(j) && unplanned() && !error_) {
    if (cancelled_.load()) throw Cancelled();
    const double left = until - now_s();
    // an unreachable origin (a restart) is waited out within the retry window, never
    // computed around: the local fallback is for a link that carries nothing
    // outage evidence: requests are out and the link has carried no byte for the whole wait
    // bound (counted from before this wait began) and 3 request latencies: the step is
    // computed now instead of waiting out the rest of the bound (issue 28)
    const double quiet_since = link_quiet_since_.load();
    const double quiet_until =
        std::isnan(quiet_since) || origin_failing_.load()
            ? std::numeric_limits<double>::infinity()
            : quiet_since + std::max(timeout_s, 3.0 * monitor_->latency_s());
    if (timeout_s > 0 && now_s() >= quiet_until) {
      records_[j].outage = true;
      records_[j].quiet_since = quiet_since - spec_.origin;
      break;
    }
    if (left <= 0 && !origin_failing_.load()) break;
    if (waiting_ != j) {  // the receive thread enforces the deadline meanwhile
      waiting_ = j;
      waiting_since_ = now_s();
      waiting_hedged_ = false;
      waiting_until_ = timeout_s > 0 ? until : std::numeric_limits<double>::infinity();
      predicted_late_ = false;
      http_.wakeup();
    }
    // the rate estimate says not even the smallest prefix can arrive within the wait: the
    // step is computed now, not after the wait (Pipeline._cannot_arrive)
    if (predicted_late_) break;
    const double sleep = std::min(left, quiet_until - now_s());
    cv_.wait_for(lock, std::chrono::duration<double>(std::clamp(sleep, 0.001, 0.1)));
  }
  if (error_) std::rethrow_exception(error_);
  waiting_ = -1;
  waiting_until_ = std::numeric_limits<double>::infinity();
  predicted_late_ = false;
  records_[j].stall_s += now_s() - now;  // waited either way
  return ready_.count(j) > 0 || !unplanned();
}

bool StreamFeed::unfetched(int j) const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_[j].planned_stale || records_[j].planned_local;
}

void StreamFeed::skip(int j, int stale_from) {
  const double now = now_s();
  end_current(j, now);
  bool ran = false, ended = false;  // j had run as a cached group (stamped only now)
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (executing_ >= 0 && executing_ != j) ready_.erase(executing_);
    ShardRecord& rec = records_[j];
    ran = !std::isnan(rec.exec_start);
    if (ran) {
      // A group that ran before a later group of its step was late: the step is computed
      // locally and this output discarded, so the record says local but keeps its times.
      ended = std::isnan(rec.exec_end);
      if (ended) rec.exec_end = now - spec_.origin;
      // (a group the stale plan ran on older K/V, when its step then runs stale: stale)
      rec.local = stale_from < 0;
      if (stale_from >= 0) rec.stale_from = stale_from;
      ready_.erase(j);
    } else {
      rec.local = stale_from < 0;
      rec.stale_from = stale_from;
      rec.exec_start = now - spec_.origin;
      executing_ = j;
      pending_.erase(j);
      refining_.erase(j);
      ready_.erase(j);
      if (waiting_ == j) waiting_ = -1;
      skipped_.push_back(j);  // the receive thread drops its transfer
    }
  }
  if (ran) {
    if (ended) progress_->exec_ended(j, now);  // it ran as a cached group: a true sample
    return;
  }
  progress_->exec_started(j, now);
  cv_.notify_all();
  http_.wakeup();
}

const float* StreamFeed::acquire(int j) {
  const double now = now_s();
  end_current(j, now);
  int current;
  {
    std::lock_guard<std::mutex> lock(mu_);
    current = executing_;
  }
  const float* out;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (current >= 0 && current != j) ready_.erase(current);
    while (!ready_.count(j) && !error_) {
      if (cancelled_.load()) throw Cancelled();
      if (records_[j].planned_stale || records_[j].planned_local) {
        throw std::logic_error("shard " + std::to_string(j) + " was not fetched: the stale "
                               "plan needs the local fallback (run_edit with LocalSteps)");
      }
      if (waiting_ != j) {  // the receive thread enforces the deadline from now on
        waiting_ = j;
        waiting_since_ = now_s();
        waiting_hedged_ = false;
        http_.wakeup();
      }
      cv_.wait_for(lock, std::chrono::milliseconds(100));
    }
    waiting_ = -1;
    if (error_) std::rethrow_exception(error_);
    // the start is stamped before the other stages can see the slot it frees
    const double start = now_s();
    ShardRecord& rec = records_[j];
    rec.stall_s += start - now;
    rec.exec_start = start - spec_.origin;
    progress_->exec_started(j, start);
    executing_ = j;
    out = ready_[j].data();
  }
  cv_.notify_all();  // the reconstructor may decode one more shard now
  http_.wakeup();    // and the receiver may start one more
  return out;
}

void StreamFeed::finish() {
  end_current(-1, now_s());
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
    ready_.clear();
  }
  cv_.notify_all();
  http_.wakeup();
  stop_threads();
}

// ------------------------------------------------------------------------- EditGraphs

void EditGraphs::check() const {
  if (!step_in || !step_out || groups.empty() || group_blocks.size() != groups.size()) {
    throw std::runtime_error("an edit needs step_in, step_out and one graph per block group");
  }
  const auto& img = step_in->outputs().at(0).sizes;  // [B, M, D]
  if (step_in->inputs().size() != 1 || img.size() != 3) {
    throw std::runtime_error(step_in->path() + ": expected x [1, M, P] -> img [B, M, D]");
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& in = groups[g]->inputs();
    const std::size_t want = 6 + (takes_cache ? 2 * group_blocks[g] : 0);
    const std::size_t outs =
        2 + (emits_kv() ? 2 * static_cast<std::size_t>(group_blocks[g]) : 0);
    if (in.size() != want || groups[g]->outputs().size() != outs) {
      throw std::runtime_error(groups[g]->path() + ": " + std::to_string(in.size()) +
                               " inputs, expected " + std::to_string(want) + " and " +
                               std::to_string(outs) + " outputs");
    }
    if (emits_kv() && (takes_cache || in[0].sizes.at(0) != 1)) {
      throw std::runtime_error(groups[g]->path() + ": K/V-emitting graphs take no cache "
                               "and one batch row");
    }
    const auto& gi = in[1].sizes;
    if (gi.size() != 3 || gi[0] != img[0] || gi[2] != img[2] || in[0].sizes.size() != 3 ||
        in[0].sizes[0] != img[0] || groups[g]->outputs()[1].sizes != gi ||
        groups[g]->outputs()[0].sizes != in[0].sizes) {
      throw std::runtime_error(groups[g]->path() + ": token shapes disagree with step_in's " +
                               step_in->outputs().at(0).describe());
    }
    for (std::size_t i = 6; i < in.size(); ++i) {
      if (in[i].sizes != in[6].sizes) {
        throw std::runtime_error(groups[g]->path() + ": cache inputs of different shapes");
      }
    }
  }
  const auto& out_in = step_out->inputs();
  if (out_in.size() != 5 || out_in[0].sizes.size() != 3 || out_in[0].sizes[0] != img[0] ||
      out_in[2].sizes.size() != 3 || step_out->outputs().size() != 1) {
    throw std::runtime_error(step_out->path() + ": expected (img, vec, x, dt, guidance) -> x");
  }
}

// ------------------------------------------------------------------------- run_edit

namespace {

// One graph set's steps: the shapes of its inputs checked once, its buffers kept.
class StepRunner {
 public:
  // keep: keep each group's last K/V (stale reuse; kept_step)
  // max_age: the oldest kept K/V a shard the stale plan did not fetch may run on
  StepRunner(EditGraphs& graphs, const EditInputs& in, ShardFeed* feed, bool keep = false,
             int max_age = 0)
      : g_(graphs), in_(in), feed_(feed), keep_(keep), max_age_(max_age) {
    graphs.check();
    if (graphs.takes_cache && feed == nullptr) {
      throw std::invalid_argument("cached graphs need a shard feed");
    }
    steps_ = in.steps;
    groups_ = graphs.groups.size();
    const auto& g0 = graphs.groups[0]->inputs();
    // actual sizes: the latent's token count M (a dynamic graph takes any M within its bound)
    const auto& x_bound = graphs.step_in->inputs()[0].sizes;  // [1, M, P]
    P_ = x_bound[2];
    if (in.x.empty() || in.x.size() % P_) throw std::invalid_argument("x is not [1, M, P]");
    M_ = static_cast<std::int64_t>(in.x.size()) / P_;
    const std::int64_t B = g0[1].sizes[0], D = g0[1].sizes[2];
    x_sizes_ = {1, M_, P_};
    img_sizes_ = {B, M_, D};
    txt_sizes_ = g0[0].sizes;
    vec_sizes_ = g0[2].sizes;
    const std::int64_t half = g0[4].sizes[1];
    txt_n_ = g0[0].numel();
    vec_n_ = g0[2].numel();
    check_size(in.txt, txt_n_, "txt");
    check_size(in.vec_txt, steps_ * vec_n_, "vec_txt");
    check_size(in.vec_img, steps_ * vec_n_, "vec_img");
    check_size(in.dt, steps_, "dt");
    if (in.cos.size() != in.sin.size() || in.cos.empty() || in.cos.size() % half) {
      throw std::invalid_argument("cos and sin must be [rows, head_dim / 2] each");
    }
    rope_sizes_ = {static_cast<std::int64_t>(in.cos.size()) / half, half};
    if (graphs.takes_cache) {
      const std::int64_t C = g0[6].sizes[1];
      const std::int64_t mf = feed->matrix_floats();
      if (mf <= 0 || mf % C) throw std::invalid_argument("cache matrices are not [U, C]");
      kv_sizes_ = {mf / C, C};
    }
    if (!in.pinned.empty()) {
      check_size(in.pin_x0, M_ * P_, "pin_x0");
      check_size(in.pin_noise, M_ * P_, "pin_noise");
      check_size(in.t, steps_, "t");
      for (auto tok : in.pinned) {
        if (tok < 0 || tok >= M_) throw std::invalid_argument("pinned token out of range");
      }
    }
    if (graphs.emits_kv()) {
      emitted_.resize(groups_);
      for (std::size_t g = 0; g < groups_; ++g) {
        emitted_[g].resize(2 * graphs.group_blocks[g] * M_ * D);
      }
    }
    D_ = D;
    x_next_.resize(in.x.size());
    img_.resize(B * M_ * D);
    img_next_.resize(img_.size());
    txt_.resize(txt_n_);
    txt_next_.resize(txt_n_);
  }

  int steps() const { return steps_; }
  std::size_t groups() const { return groups_; }
  std::int64_t tokens() const { return M_; }
  std::int64_t patch() const { return P_; }

  // The step whose K/V group g last ran on (-1: none yet), kept for stale reuse.
  int kept_step(std::size_t g) const { return kept_step_.empty() ? -1 : kept_step_[g]; }

  // Step s on x ([1, M, P], updated): the pinned tokens set to the template trajectory
  // first (full graphs); cached graphs take shard s * groups + g's K/V from the feed. With
  // wait_s >= 0 (the local fallback), a group whose shard is not ready within wait_s (the
  // first group) or what is left of local_s after the step's earlier waits (the others)
  // ends the step early: false, x unchanged. With
  // stale, every group runs on the K/V it last ran on (kept_step) and the feed is not asked.
  bool step(int s, std::vector<float>& x, double wait_s = -1, double local_s = 0,
            bool stale = false) {
    const auto begin = std::chrono::steady_clock::now();
    double waited = 0;  // in the feed (its waits are not the step's compute)
    double shared = 0;  // of those, what the step's later groups' waits are bounded by
    if (!in_.pinned.empty()) {
      const float t = in_.t[s];
      for (auto tok : in_.pinned) {
        for (std::int64_t c = tok * P_; c < (tok + 1) * P_; ++c) {
          x[c] = (1 - t) * in_.pin_x0[c] + t * in_.pin_noise[c];
        }
      }
    }
    g_.step_in->run({{x.data(), x_sizes_}}, {img_.data()});
    std::copy(in_.txt.begin(), in_.txt.end(), txt_.begin());
    const float* vt = in_.vec_txt.data() + s * vec_n_;
    const float* vi = in_.vec_img.data() + s * vec_n_;
    for (std::size_t g = 0; g < groups_; ++g) {
      std::vector<GraphInput> args = {{txt_.data(), txt_sizes_}, {img_.data(), img_sizes_},
                                      {vt, vec_sizes_}, {vi, vec_sizes_},
                                      {in_.cos.data(), rope_sizes_}, {in_.sin.data(), rope_sizes_}};
      if (g_.takes_cache) {
        const int shard = static_cast<int>(s * groups_ + g);
        const std::int64_t n = kv_sizes_[0] * kv_sizes_[1];
        const float* kv;
        if (stale) {
          if (kept_step(g) < 0) throw std::logic_error("stale reuse before any K/V arrived");
          kv = kept_[g].data();
        } else {
          const auto w0 = std::chrono::steady_clock::now();
          // the first group waits wait_s; the others what is left of one local step after
          // the step's earlier waits (a step's shards share one local step of waiting; the
          // edit's first shard's wait is its start-up, not counted)
          const double bound = g == 0 ? wait_s : std::max(0.0, local_s - shared);
          if (wait_s >= 0 && !feed_->ready_within(shard, bound)) {
            return false;
          }
          const bool planned = wait_s >= 0 && feed_->unfetched(shard);
          if (planned) {  // the stale plan: the group's kept K/V if recent enough
            const int k = kept_step(g);
            if (!keep_ || k < 0 || s - k > max_age_) return false;  // else the step is late
            feed_->skip(shard, k);
            kv = kept_[g].data();
          } else {
            kv = feed_->acquire(shard);
          }
          const double w =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
          waited += w;
          if (s > 0 || g > 0) shared += w;
          if (keep_ && !planned) {  // acquire's matrices live until the next acquire: keep a copy
            if (kept_.empty()) {
              kept_.resize(groups_);
              kept_step_.assign(groups_, -1);
            }
            kept_[g].assign(kv, kv + 2 * g_.group_blocks[g] * n);
            kept_step_[g] = s;
          }
        }
        for (int m = 0; m < 2 * g_.group_blocks[g]; ++m) args.push_back({kv + m * n, kv_sizes_});
      }
      std::vector<float*> outs{txt_next_.data(), img_next_.data()};
      if (!emitted_.empty()) {
        for (int m = 0; m < 2 * g_.group_blocks[g]; ++m) {
          outs.push_back(emitted_[g].data() + m * M_ * D_);
        }
      }
      g_.groups[g]->run(args, outs);
      txt_.swap(txt_next_);
      img_.swap(img_next_);
    }
    if (!emitted_.empty()) {  // the template pass: its K/V are the output, not a step
      compute_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin)
                       .count() - waited;
      return true;
    }
    const float dt = in_.dt[s];
    const float guidance = in_.guidance;
    const std::vector<std::int64_t> one{1};
    g_.step_out->run({{img_.data(), img_sizes_}, {vi, vec_sizes_}, {x.data(), x_sizes_},
                      {&dt, one}, {&guidance, one}},
                     {x_next_.data()});
    x.swap(x_next_);
    compute_s_ =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count() - waited;
    return true;
  }

  // The compute time of the last step that ran (its waits for the feed left out).
  double compute_s() const { return compute_s_; }

  // (emits_kv graphs, after step) The K (m = 2j) or V (m = 2j + 1) [M, D] of group g's
  // j-th block.
  const float* emitted(std::size_t g, int m) const { return emitted_[g].data() + m * M_ * D_; }
  std::int64_t width() const { return D_; }

  // Group g's K/V ([2 * blocks, U, C], as a shard's) as those of step s: what the next
  // stale step of this runner reads (the recompute step's, dit.stale.StaleReuse.put).
  void keep(std::size_t g, int s, std::vector<float> kv) {
    if (kept_.empty()) {
      kept_.resize(groups_);
      kept_step_.assign(groups_, -1);
    }
    kept_[g] = std::move(kv);
    kept_step_[g] = s;
  }
  const std::vector<std::int64_t>& kv_sizes() const { return kv_sizes_; }
  int group_blocks(std::size_t g) const { return g_.group_blocks[g]; }

 private:
  EditGraphs& g_;
  const EditInputs& in_;
  ShardFeed* feed_;
  bool keep_;  // keep each group's last K/V (stale reuse)
  int max_age_;
  int steps_ = 0;
  std::size_t groups_ = 0;
  std::int64_t P_ = 0, M_ = 0, txt_n_ = 0, vec_n_ = 0;
  std::vector<std::int64_t> x_sizes_, img_sizes_, txt_sizes_, vec_sizes_, rope_sizes_, kv_sizes_;
  std::vector<float> x_next_, img_, img_next_, txt_, txt_next_;
  double compute_s_ = 0;
  std::int64_t D_ = 0;
  std::vector<std::vector<float>> emitted_;  // emits_kv graphs: per group, 2 * blocks [M, D]
  std::vector<std::vector<float>> kept_;
  std::vector<int> kept_step_;
};

}  // namespace

std::vector<float> run_edit(EditGraphs& graphs, const EditInputs& in, ShardFeed* feed,
                            const std::atomic<bool>& cancel, LocalSteps* local) {
  StepRunner cached(graphs, in, feed,
                    /*keep=*/local != nullptr && local->stale_max_age > 0,
                    /*max_age=*/local != nullptr ? local->stale_max_age : 0);
  std::unique_ptr<StepRunner> full, tmpl;
  std::vector<float> xf, xt;
  if (local != nullptr) {
    if (local->graphs == nullptr || local->inputs == nullptr || local->graphs->takes_cache ||
        feed == nullptr || !graphs.takes_cache) {
      throw std::invalid_argument("a local fallback needs full graphs beside cached ones");
    }
    full = std::make_unique<StepRunner>(*local->graphs, *local->inputs, nullptr);
    if (full->steps() != cached.steps() || full->patch() != cached.patch() ||
        static_cast<std::int64_t>(local->masked.size()) != cached.tokens()) {
      throw std::invalid_argument("the local fallback's geometry disagrees with the edit's");
    }
    for (auto r : local->masked) {
      if (r < 0 || r >= full->tokens()) throw std::invalid_argument("masked row out of range");
    }
    xf = local->inputs->x;
    local->steps = 0;
    local->recomputed = 0;
    if (local->recompute != nullptr) {
      if (local->recompute_inputs == nullptr || !local->recompute->emits_kv()) {
        throw std::invalid_argument("a recompute step needs K/V-emitting graphs and inputs");
      }
      tmpl = std::make_unique<StepRunner>(*local->recompute, *local->recompute_inputs, nullptr);
      if (tmpl->steps() != cached.steps() || tmpl->tokens() != full->tokens() ||
          static_cast<std::int64_t>(local->unmasked.size()) != cached.kv_sizes()[0] ||
          tmpl->width() != cached.kv_sizes()[1]) {
        throw std::invalid_argument("the recompute step's geometry disagrees with the edit's");
      }
      for (auto r : local->unmasked) {
        if (r < 0 || r >= tmpl->tokens()) throw std::invalid_argument("cached row out of range");
      }
      xt = local->recompute_inputs->x;
    }
  }
  std::vector<float> x = in.x;
  const std::int64_t P = cached.patch();
  enum class Mode { OnTime, Stale, Local } mode = Mode::OnTime;
  double cached_step_s = 0;  // the last cached step's time (a stale step costs as much)
  try {
    if (feed) {
      // the stale plan may plan a step local where that step is a recompute step
      feed->plan_local(local != nullptr && local->recompute != nullptr &&
                       local->stale_max_age > 0);
      feed->start();
    }
    for (int s = 0; s < cached.steps(); ++s) {
      if (cancel.load()) throw Cancelled();
      const int first = static_cast<int>(s * cached.groups());
      // the wait for a step's first shard: one local step when the stream was on time; after
      // a stale step what it saved against a local one (so a run of them is never slower
      // than local steps); none after a local step
      const double wait = !full ? -1.0
                          : mode == Mode::OnTime ? local->step_s
                          : mode == Mode::Stale  ? std::max(0.0, local->step_s - cached_step_s)
                                                 : 0.0;
      const bool on_time = !full || cached.step(s, x, wait, local->step_s);
      if (!on_time) {
        // stale reuse: every group's kept K/V at most stale_max_age steps old
        int oldest = s;
        for (std::size_t g = 0; g < cached.groups(); ++g) {
          const int k = cached.kept_step(g);
          oldest = k < 0 ? -1 : std::min(oldest, k);
        }
        if (oldest >= 0 && s - oldest <= local->stale_max_age) {
          for (std::size_t g = 0; g < cached.groups(); ++g) {
            const int k = cached.kept_step(g);
            if (k != s) feed->skip(first + static_cast<int>(g), k);  // (k == s: it ran now)
          }
          cached.step(s, x, -1, 0, /*stale=*/true);
          cached_step_s = cached.compute_s();
          mode = Mode::Stale;
          continue;
        }
        for (std::size_t g = 0; g < cached.groups(); ++g) feed->skip(first + static_cast<int>(g));
        if (tmpl) {  // the recompute step: the template pass, then the cached step on it
          tmpl->step(s, xt);
          const std::int64_t U = cached.kv_sizes()[0], C = cached.kv_sizes()[1];
          std::vector<const float*> mats;  // every block's K, V of the template pass
          for (std::size_t g = 0; g < tmpl->groups(); ++g) {
            for (int m = 0; m < 2 * tmpl->group_blocks(g); ++m) mats.push_back(tmpl->emitted(g, m));
          }
          std::size_t next = 0;
          for (std::size_t g = 0; g < cached.groups(); ++g) {
            const int n = 2 * cached.group_blocks(g);
            std::vector<float> kv(static_cast<std::size_t>(n * U * C));
            for (int m = 0; m < n; ++m, ++next) {
              for (std::int64_t u = 0; u < U; ++u) {
                std::copy_n(mats.at(next) + local->unmasked[u] * C, C, kv.begin() + (m * U + u) * C);
              }
            }
            cached.keep(g, s, std::move(kv));
          }
          cached.step(s, x, -1, 0, /*stale=*/true);
          local->steps += 1;
          local->recomputed += 1;
          mode = Mode::Local;
          continue;
        }
        for (std::size_t i = 0; i < local->masked.size(); ++i) {
          std::copy_n(x.begin() + static_cast<std::ptrdiff_t>(i) * P, P,
                      xf.begin() + local->masked[i] * P);
        }
        full->step(s, xf);
        for (std::size_t i = 0; i < local->masked.size(); ++i) {
          std::copy_n(xf.begin() + local->masked[i] * P, P,
                      x.begin() + static_cast<std::ptrdiff_t>(i) * P);
        }
        local->steps += 1;
        mode = Mode::Local;
        continue;
      }
      if (!full) cached.step(s, x);
      cached_step_s = cached.compute_s();
      mode = Mode::OnTime;
    }
  } catch (...) {
    if (feed) feed->cancel();
    throw;
  }
  if (feed) feed->finish();
  return x;
}

}  // namespace sakura
