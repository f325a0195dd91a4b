// A three-stage pipeline: receive -> reconstruct -> execute, one thread per stage, joined by
// two bounded FIFO queues.
//
// * Back-pressure: a stage blocks while the queue after it is full, so at most
//   `received_capacity` received and `ready_capacity` reconstructed shards wait; the
//   deepest each queue got is reported (never above its capacity).
// * Order: shards are executed in the order they were received.
// * End of stream: `receive` returning std::nullopt (or `count` shards) ends the run once
//   everything received has been executed.
// * Cancellation: cancel() (any thread, a stage included) wakes every stage; shards not yet
//   executed are dropped and run() returns with stats.cancelled set.
// * Errors: the first exception thrown by a stage cancels the others and is rethrown by
//   finish() / run() on the caller's thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <utility>

namespace sakura {

template <class T>
class BoundedQueue {
 public:
  explicit BoundedQueue(std::size_t capacity) : capacity_(std::max<std::size_t>(1, capacity)) {}

  // Blocks while full; false when the queue was aborted (the item is dropped).
  bool push(T&& item) {
    std::unique_lock<std::mutex> lock(mu_);
    not_full_.wait(lock, [&] { return aborted_ || items_.size() < capacity_; });
    if (aborted_) return false;
    items_.push_back(std::move(item));
    max_depth_ = std::max(max_depth_, items_.size());
    not_empty_.notify_one();
    return true;
  }

  // Blocks while empty; nullopt when closed and drained, or aborted.
  std::optional<T> pop() {
    std::unique_lock<std::mutex> lock(mu_);
    not_empty_.wait(lock, [&] { return aborted_ || closed_ || !items_.empty(); });
    if (aborted_ || items_.empty()) return std::nullopt;
    std::optional<T> out(std::move(items_.front()));
    items_.pop_front();
    not_full_.notify_one();
    return out;
  }

  // No more pushes: consumers drain what is there, then get nullopt.
  void close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    not_empty_.notify_all();
  }

  // Wake everyone and drop the items (destroyed outside the lock: an item's destructor may
  // need another lock, e.g. Python's GIL).
  void abort() {
    std::deque<T> dropped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      aborted_ = true;
      dropped.swap(items_);
      not_full_.notify_all();
      not_empty_.notify_all();
    }
  }

  std::size_t capacity() const { return capacity_; }
  std::size_t max_depth() const {
    std::lock_guard<std::mutex> lock(mu_);
    return max_depth_;
  }

 private:
  const std::size_t capacity_;
  mutable std::mutex mu_;
  std::condition_variable not_full_, not_empty_;
  std::deque<T> items_;
  std::size_t max_depth_ = 0;
  bool closed_ = false;
  bool aborted_ = false;
};

struct PipelineOptions {
  std::size_t received_capacity = 2;  // received shards waiting for reconstruction
  std::size_t ready_capacity = 2;     // reconstructed shards waiting for execution
};

struct PipelineStats {
  std::size_t received = 0;
  std::size_t reconstructed = 0;
  std::size_t executed = 0;
  std::size_t max_received_depth = 0;
  std::size_t max_ready_depth = 0;
  bool cancelled = false;
  double wall_s = 0.0;
};

// R: what receive produces; D: what reconstruct produces (both movable).
template <class R, class D>
class Pipeline {
 public:
  using Receive = std::function<std::optional<R>(std::size_t)>;
  using Reconstruct = std::function<D(std::size_t, R&)>;
  using Execute = std::function<void(std::size_t, D&)>;

  Pipeline(PipelineOptions options, Receive receive, Reconstruct reconstruct, Execute execute)
      : options_(options),
        receive_(std::move(receive)),
        reconstruct_(std::move(reconstruct)),
        execute_(std::move(execute)),
        received_q_(options.received_capacity),
        ready_q_(options.ready_capacity) {}

  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  ~Pipeline() {
    cancel();
    join();
  }

  // Starts the three stage threads on shards 0 .. count-1 (once per Pipeline object).
  void start(std::size_t count) {
    if (started_) throw std::logic_error("a Pipeline runs once");
    started_ = true;
    t0_ = std::chrono::steady_clock::now();
    threads_[0] = std::thread([this, count] { guarded([&] { receive_stage(count); }); });
    threads_[1] = std::thread([this] { guarded([&] { reconstruct_stage(); }); });
    threads_[2] = std::thread([this] { guarded([&] { execute_stage(); }); });
  }

  // True once all three stages have stopped.
  bool wait_for(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(done_mu_);
    return done_cv_.wait_for(lock, timeout, [&] { return stopped_ == 3; });
  }

  // Waits for the stages, then rethrows the first stage error, or returns the stats.
  PipelineStats finish() {
    join();
    PipelineStats s;
    s.received = received_.load();
    s.reconstructed = reconstructed_.load();
    s.executed = executed_.load();
    s.max_received_depth = received_q_.max_depth();
    s.max_ready_depth = ready_q_.max_depth();
    s.cancelled = cancelled_.load();
    s.wall_s = std::chrono::duration<double>(end_ - t0_).count();
    if (error_) std::rethrow_exception(error_);
    return s;
  }

  PipelineStats run(std::size_t count) {
    start(count);
    return finish();
  }

  // Thread-safe; idempotent. Does not wait for the stages.
  void cancel() noexcept {
    if (!cancelled_.exchange(true)) {
      received_q_.abort();
      ready_q_.abort();
    }
  }

  const PipelineOptions& options() const { return options_; }

 private:
  template <class F>
  void guarded(F&& body) {
    try {
      body();
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(done_mu_);
        if (!error_) error_ = std::current_exception();
      }
      cancel();
    }
    std::lock_guard<std::mutex> lock(done_mu_);
    if (++stopped_ == 3) end_ = std::chrono::steady_clock::now();
    done_cv_.notify_all();
  }

  void receive_stage(std::size_t count) {
    struct Closer {  // the next stage must see the end even when receive throws
      BoundedQueue<std::pair<std::size_t, R>>& q;
      ~Closer() { q.close(); }
    } closer{received_q_};
    for (std::size_t i = 0; i < count && !cancelled_.load(); ++i) {
      std::optional<R> item = receive_(i);
      if (!item) break;
      if (!received_q_.push({i, std::move(*item)})) break;
      ++received_;
    }
  }

  void reconstruct_stage() {
    struct Closer {
      BoundedQueue<std::pair<std::size_t, D>>& q;
      ~Closer() { q.close(); }
    } closer{ready_q_};
    while (auto item = received_q_.pop()) {
      D out = reconstruct_(item->first, item->second);
      ++reconstructed_;
      if (!ready_q_.push({item->first, std::move(out)})) break;
    }
  }

  void execute_stage() {
    while (auto item = ready_q_.pop()) {
      if (cancelled_.load()) break;
      execute_(item->first, item->second);
      ++executed_;
    }
  }

  void join() {
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

  PipelineOptions options_;
  Receive receive_;
  Reconstruct reconstruct_;
  Execute execute_;
  BoundedQueue<std::pair<std::size_t, R>> received_q_;
  BoundedQueue<std::pair<std::size_t, D>> ready_q_;
  std::thread threads_[3];
  bool started_ = false;
  std::atomic<bool> cancelled_{false};
  std::atomic<std::size_t> received_{0}, reconstructed_{0}, executed_{0};
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  int stopped_ = 0;
  std::exception_ptr error_;
  std::chrono::steady_clock::time_point t0_, end_;
};

}  // namespace sakura
