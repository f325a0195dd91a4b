// One masked edit run natively: the shard loop with no Python in it.
//
// The execute stage (run_edit) walks the denoising steps: per step the `step_in` graph
// embeds the masked latent, every block-group graph runs its blocks with the shard's K/V
// from a ShardFeed, and the `step_out` graph applies the final layer, guidance and the Euler
// update. Everything per-request that is not a graph input (prompt embeddings, modulation
// vectors, RoPE tables, timesteps) is prepared by Python before and handed over as tensors.
//
// A ShardFeed delivers shard j's K/V ([2 * blocks, U, C] float32) when execution reaches it:
// * ResidentFeed: every shard in memory (the compute floor, calibration, `exact`);
// * StreamFeed: the receive -> reconstruct -> execute pipeline of the device: a receive
//   thread (libcurl, HttpReceiver) that asks the allocator for each shard's configuration
//   from the window and rate estimate of that moment, pipelines requests, verifies bodies;
//   a reconstruct thread (the native decoders, or a Python callback for codecs without
//   one); bounded buffers (max_ahead shards in flight .. ready, max_ready reconstructed)
//   exactly as sakura/edge/pipeline.py, which stays the reference implementation.
// Full (no-cache) edits run the same loop with graphs that take no K/V and pin the
// unmasked tokens to the template trajectory before every step.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sakura/allocator.hpp"
#include "sakura/graph.hpp"
#include "sakura/http.hpp"
#include "sakura/monitor.hpp"

namespace sakura {

struct ShardRecord {
  int shard = 0;
  int step = 0;
  std::vector<int> blocks;
  int config = -1;  // -1: none (resident)
  std::int64_t bytes = 0;
  double window_s = kNoValue, lead_s = 0.0, carry_s = kNoValue, rate_bps = kNoValue;
  double deadline = kNoValue;
  double recv_start = kNoValue, recv_first_byte = kNoValue, recv_end = kNoValue;
  double recon_start = kNoValue, recon_end = kNoValue;
  double exec_start = kNoValue, exec_end = kNoValue;
  double stall_s = 0.0;
  int attempts = 0, resumes = 0, refetches = 0;
  int requested = -1;      // the configuration requested (config differs: a fallback)
  int hedges = 0;          // re-requests on a fresh connection
  bool truncated = false;  // executed from the prefix received by its deadline
  std::string damage;      // a unit that failed its checksum ("" : none)
  bool local = false;      // its step was computed on the device (local fallback): no bytes
  bool outage = false;     // the wait for it ended early: the link had carried nothing for
                           // the wait bound while requests were out (outage evidence)
  double quiet_since = kNoValue;  // (outage) since when the link had carried nothing, as the
                                  // rule counted it: its last byte, or when transfers resumed
  int refinements = 0;     // extensions of its received configuration (prefix refinement)
  int stale_from = -1;     // its step ran on the K/V of this earlier step (stale reuse; -1 no)
  bool planned_stale = false;  // never requested: the stale plan ran it on its group's K/V
  // never requested: its group held no recent K/V, so the stale plan had its step
  // recomputed on the device (edge/stale_plan.py, plan_unfetched)
  bool planned_local = false;
};

// Raised when an edit is cancelled (Ctrl-C in Python).
class Cancelled : public std::runtime_error {
 public:
  Cancelled() : std::runtime_error("the edit was cancelled") {}
};

class ShardFeed {
 public:
  virtual ~ShardFeed() = default;
  virtual void start() {}
  // Shard j's matrices, valid until the next acquire() or finish(); blocks until ready.
  virtual const float* acquire(int shard) = 0;
  // Local fallback (run_edit with LocalSteps): true once shard j is ready, false if it is
  // not within timeout_s (0: ready now); never marks it executing.
  virtual bool ready_within(int, double) { return true; }
  // Shard j's step is computed locally from now: its bytes are not needed (its transfer is
  // dropped, it is never requested), its slot is free, its record says local; or, with
  // stale_from >= 0, the step runs on that earlier step's K/V (stale reuse) and the record
  // says so.
  virtual void skip(int, int /*stale_from*/ = -1) {}
  // Whether the receive stage chose not to fetch shard j (the stale plan: planned stale or
  // planned local): it runs on its group's kept K/V when they are recent enough (run_edit),
  // else its step is late. Known once ready_within(j, ...) returned true.
  virtual bool unfetched(int) const { return false; }
  // Set by run_edit before start(): the local step is a recompute step, so the stale plan
  // may plan a step local where a skippable shard's group holds no recent K/V.
  virtual void plan_local(bool) {}
  // After the last shard executed: stamps its end, stops the stages.
  virtual void finish() {}
  virtual void cancel() {}
  virtual std::vector<ShardRecord> records() const = 0;
  virtual std::int64_t matrix_floats() const = 0;  // U * C of each K or V matrix
};

class ResidentFeed final : public ShardFeed {
 public:
  ResidentFeed(std::vector<std::vector<float>> shards, std::vector<ShardRecord> records,
               double origin);
  const float* acquire(int shard) override;
  void finish() override;
  std::vector<ShardRecord> records() const override { return records_; }
  std::int64_t matrix_floats() const override;

 private:
  std::vector<std::vector<float>> shards_;
  std::vector<ShardRecord> records_;
  double origin_;
  int current_ = -1;
};

enum class DecodeKind { LowRank, Fp16, IntQ, Callback };

// Python's decoder for codecs without a native one: writes `count` (2 * blocks * U * C)
// floats to `out`, or throws.
using DecodeCallback = std::function<void(int shard, int config,
                                          const std::vector<std::uint8_t>& data, float* out,
                                          std::size_t count)>;

struct ConfigSource {
  FetchRequest request;    // shard, config, url, range, units
  std::vector<int> ranks;  // LowRank: the configuration's ranks
  int bits = 0;            // IntQ: the configuration's bit width
};

struct StreamOptions {
  int max_ahead = 4;     // shards in flight .. ready ahead of execution
  int max_ready = 2;     // reconstructed shards held ahead of execution
  int max_inflight = 3;  // pipelined requests
  int decode_threads = 1;
  // beyond max_ahead (up to max_ahead_cap) a shard may be requested once its predicted
  // execution start is within lookahead_rtts request latencies (lookahead_wait)
  double lookahead_rtts = 0.0;
  int max_ahead_cap = 0;
  // prefix refinement: while the link is idle and no shard may be requested yet, a
  // received shard whose execution is far enough away is extended by the next ranges of
  // its stream (one more single-range GET of the same pack; edit.cpp, try_refine)
  bool refine = true;
  // the stale plan (edge/stale_plan.py): a shard whose choice the allocator calls skippable
  // (its smallest) is not requested when its group's last fetched shard is at most this many
  // steps before it (0: off)
  int stale_plan_age = 0;
  // ... and where such a shard's group holds no recent K/V, its step is computed on the
  // device (when run_edit's local step is a recompute step: plan_local())
  bool plan_local = true;
};


struct StreamSpec {
  std::vector<ShardRecord> shards;                       // shard, step, blocks
  // LowRank decoding on "cpu" (the SIMD kernels) or "opencl" (sakura/opencl_decode.hpp, the
  // Adreno path; an OpenCL device name substring may follow: "opencl:pthread")
  std::string reconstruct = "cpu";
  std::vector<std::map<int, ConfigSource>> configs;      // per shard: config id -> source
  HttpOptions http;
  DecodeKind decode = DecodeKind::LowRank;
  DecodeCallback callback;
  std::vector<float> rope;  // LowRank keys: [N, C/2, 2] cos/sin, or empty
  std::int64_t matrix_floats = 0;  // N * C
  std::int64_t channels = 0;       // C (IntQ: rows of C channels)
  int intq_group = 32;             // IntQ: channels per (scale, minimum) group
  StreamOptions options;
  // CPUs of the receive and reconstruct threads (empty: the caller's); on a phone they are
  // the modem's DMA and the GPU, never the execution unit, so a host with few cores gives
  // them other cores than execution's (Linux; ignored elsewhere)
  std::vector<int> pipeline_cpus;
  double origin = 0;
};

class StreamFeed final : public ShardFeed {
 public:
  StreamFeed(StreamSpec spec, std::shared_ptr<const Allocator> allocator,
             std::shared_ptr<BandwidthMonitor> monitor,
             std::shared_ptr<ExecutionProgress> progress);
  ~StreamFeed() override;

  void start() override;
  const float* acquire(int shard) override;
  bool ready_within(int shard, double timeout_s) override;
  void skip(int shard, int stale_from = -1) override;
  bool unfetched(int shard) const override;
  void plan_local(bool on) override { plan_local_ = on && spec_.options.plan_local; }
  void finish() override;
  void cancel() override;
  std::vector<ShardRecord> records() const override;
  std::int64_t matrix_floats() const override { return spec_.matrix_floats; }
  std::vector<RequestLogEntry> request_log() { return http_.take_log(); }

 private:
  void receive_loop();
  void reconstruct_loop();
  bool link_allows(double* wait_s);
  void issue(int j);
  bool try_refine();  // (receive thread) one refinement request, if one is worth it
  void enforce_deadline(double* wait_s);
  void predict_late();  // (receive thread) the waited-for shard cannot arrive in its wait
  void complete(FetchDone&& done);
  void end_current(int next, double now);  // stamps the end of the shard executing (if any)
  std::vector<float> decode(int j, int config, const std::vector<std::uint8_t>& data);
  void fail(std::exception_ptr e);
  void stop_threads();

  StreamSpec spec_;
  std::shared_ptr<const Allocator> allocator_;
  std::shared_ptr<BandwidthMonitor> monitor_;
  std::shared_ptr<ExecutionProgress> progress_;
  HttpReceiver http_;
  std::vector<ShardRecord> records_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int executing_ = -1;
  int waiting_ = -1;            // the shard execution waits for (-1: none)
  double waiting_since_ = 0;    // ... since
  bool waiting_hedged_ = false;
  // the end of the wait's bound (infinite: none), and whether the rate estimate says the
  // shard's smallest verifiable prefix cannot be in before it (predict_late)
  double waiting_until_ = std::numeric_limits<double>::infinity();
  bool predicted_late_ = false;
  std::vector<int> skipped_;    // shards computed locally whose transfers are to be dropped
  std::atomic<bool> origin_failing_{false};  // (receive thread) HttpReceiver::failing()
  // (receive thread) HttpReceiver::quiet_since_s(): since when the link has carried no
  // byte while requests were out (NaN: none out)
  std::atomic<double> link_quiet_since_{std::numeric_limits<double>::quiet_NaN()};
  std::map<int, std::pair<int, std::vector<std::uint8_t>>> pending_;  // received
  // received shards whose extension is in flight: their configuration and bytes so far
  std::map<int, std::pair<int, std::vector<std::uint8_t>>> refining_;
  std::map<int, std::vector<float>> ready_;                           // reconstructed
  std::exception_ptr error_;
  bool closing_ = false;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> plan_local_{false};
  // (receive thread) a body arrived since the last step planned local (Pipeline's
  // _measured_since_local: a step is planned local only on a refreshed estimate)
  bool measured_since_local_ = true;
  std::thread receive_thread_, reconstruct_thread_;
  std::shared_ptr<void> gpu_;  // the reconstruct thread's OpenCL decoder (when used)
};

// The compiled graphs of one edit geometry (or, exported with dynamic sizes, of every
// geometry within their bounds), loaded once and reused for every edit.
struct EditGraphs {
  std::unique_ptr<CompiledGraph> step_in;   // (x [1, M, P]) -> img [B, M, D]
  std::vector<std::unique_ptr<CompiledGraph>> groups;  // (txt, img, vec_txt, vec_img, cos,
                                                       //  sin[, k_b, v_b ...]) -> txt, img
  std::unique_ptr<CompiledGraph> step_out;  // (img, vec_img, x, dt [1], guidance [1]) -> x
  std::vector<int> group_blocks;            // blocks per group
  bool takes_cache = true;                  // groups read K/V (false: full edits)

  void check() const;  // inputs, outputs and batch/width agree; throws std::runtime_error
  // Groups that also output every block's image-token K and V ([M, C] each, k then v per
  // block): the template pass of the recompute step (LocalSteps). No cache, batch 1.
  bool emits_kv() const { return !groups.empty() && groups[0]->outputs().size() > 2; }
};

struct EditInputs {
  int steps = 0;
  std::vector<float> x;                  // latent entering step 0
  std::vector<float> txt;                // [B, T, D] text tokens after txt_in
  std::vector<float> vec_txt, vec_img;   // [S, B, 1, D]
  std::vector<float> cos, sin;           // [T + M, head_dim / 2] (dynamic graphs: [M, ...])
  std::vector<float> dt;                 // [S]
  float guidance = 1.0f;
  // full edits: before every step the tokens `pinned` get (1 - t) x0 + t e
  std::vector<std::int64_t> pinned;
  std::vector<float> pin_x0, pin_noise;  // [N, P]
  std::vector<float> t;                  // [S]
};

// Runs the edit on the calling thread; returns the latent after the last step. `feed` may be
// null for graphs that take no cache. Throws whatever a stage threw; Cancelled when
// `cancel` becomes true.
// Local fallback (issue 28 item 10): a step whose first shard is not ready within one local
// step's time (or sooner, once the link has carried no byte for that long while requests
// were out: outage evidence, counted from before the wait began) is computed on the device:
// as a recompute step when LocalSteps::recompute is set (below), else with the full graphs (every token, as `local` does:
// the unmasked tokens pinned to the template trajectory, public catalog data), and so is
// every next step until a shard is ready when its step begins (the edit rejoins the stream).
// Stale reuse (dit/stale.py, the same rule): a step whose shards are late runs on the K/V
// each block group last received, if that is at most this many steps old, instead of
// computing the step with every token. On the shipped model's three workloads (late runs of
// 2-10 steps, the late half, every step but the first) a cap of 3 beat local steps in all
// 18 cases, +0.6 to +15.0 dB against exact (docs/bench/stale-reuse.json); a stale step
// costs a cached step's time, about a third of a local one.
constexpr int kStaleMaxAge = 3;

// The stale plan's source (edge/stale_plan.py, stale_source): the step of the last shard
// before `shard` with the same blocks that is not planned stale (with unfetched_from >= 0,
// every shard from that one on counts as planned stale: the lookahead's view of shards not
// yet decided), when at most max_age steps before shard's; else -1.
int stale_source(const std::vector<ShardRecord>& shards, int shard, int max_age,
                 int unfetched_from = -1);

// The recompute step (dit/editing.py RecomputedKV, the same rule): with `recompute` set, a
// step computed on the device runs the template pass (the template's tokens on their
// forward-noised trajectory, the template prompt: public catalog data) through graphs
// whose groups emit every block's K/V, takes the cached tokens' rows and runs the cached
// step on them; those K/V are then each group's kept K/V (stale reuse). It is the cached
// edit's own trajectory, where a full step follows the full-token one, and it costs about a
// full step or less (one batch row where guidance gives the full step two):
// docs/bench/recompute-step.json.
struct LocalSteps {
  EditGraphs* graphs = nullptr;        // full graphs (takes_cache false)
  const EditInputs* inputs = nullptr;  // full inputs (pinned = the unmasked tokens)
  std::vector<std::int64_t> masked;    // the masked tokens' rows in the full latent
  double step_s = 0;                   // predicted time of one local step (the wait bound)
  int steps = 0;                       // (out) steps computed locally
  int stale_max_age = kStaleMaxAge;    // oldest K/V a late step may reuse (steps; 0: never)
  EditGraphs* recompute = nullptr;            // template-pass graphs (emits_kv), or null
  const EditInputs* recompute_inputs = nullptr;  // every token pinned, the template prompt
  std::vector<std::int64_t> unmasked;         // the cached tokens' rows in the full latent
  int recomputed = 0;                         // (out) of `steps`, those recomputed
};

std::vector<float> run_edit(EditGraphs& graphs, const EditInputs& inputs, ShardFeed* feed,
                            const std::atomic<bool>& cancel, LocalSteps* local = nullptr);

// Float32 values of IEEE half data (the fp16 codec's payload).
void half_to_float(const std::uint8_t* data, std::size_t count, float* out);
// codec/intq.py IntQCodec.decode: `rows` rows of `channels` values, each row stored as
// ceil(C / group) fp16 scales, as many fp16 minima, then the codes packed little-endian at
// `bits` bits each (codec/quant.py pack_codes); x = code * scale + minimum. Throws
// FormatError when `size` is not that layout's.
void decode_intq(const std::uint8_t* data, std::size_t size, int bits, int group,
                 std::int64_t rows, std::int64_t channels, float* out);

}  // namespace sakura
