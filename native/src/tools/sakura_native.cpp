// sakura-native: the native runtime without Python (host or phone).
//
//   sakura-native selftest                 pipeline semantics: back-pressure, cancel, errors
//   sakura-native overhead [SHARDS]        microseconds per shard of a no-op pipeline
//   sakura-native run DIR [--threads T] [--capacity C] [--exec-ms X]
//       streams the shards listed in DIR/shards.txt through receive (read the file) ->
//       reconstruct (native decode) -> execute (compare with the expected tensors written
//       by the host, then hold the shard X ms, standing in for the DiT shard's compute)
//
//   sakura-native tokenize VOCAB [--max-tokens T] [TEXT]
//       the text encoder's WordPiece ids and attention mask of TEXT (or of each line of
//       stdin) as one JSON line each (built with utf8proc: SAKURA_HAVE_TEXT)
//
// DIR/shards.txt (written by `sakura bench native --export DIR`):
//   rope FILE                       optional: float32 [N, C/2, 2] cos/sin of the keys
//   shard FILE RANKS EXPECTED       RANKS = r0,r1,...; EXPECTED = float32 [M, N, C] or "-"
// Prints one JSON object; exit status 1 when a shard does not match.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "sakura/pipeline.hpp"
#include "sakura/shard.hpp"
#ifdef SAKURA_HAVE_TEXT
#include "sakura/tokenizer.hpp"
#endif

namespace {

using Clock = std::chrono::steady_clock;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

std::vector<float> read_floats(const std::string& path) {
  const std::string raw = read_file(path);
  if (raw.size() % sizeof(float)) throw std::runtime_error(path + ": not float32 data");
  std::vector<float> out(raw.size() / sizeof(float));
  std::copy(raw.data(), raw.data() + raw.size(), reinterpret_cast<char*>(out.data()));
  return out;
}

struct Entry {
  std::string file;
  std::vector<int> ranks;
  std::string expected;
};

struct Decoded {
  std::vector<float> values;
  double decode_ms = 0;
};

int check(bool ok, const char* what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  return ok ? 0 : 1;
}

int selftest() {
  int failures = 0;
  using P = sakura::Pipeline<int, int>;
  {  // back-pressure: a slow executor never lets a queue exceed its capacity
    std::atomic<int> received{0}, executed{0}, max_ahead{0};
    P pipe({2, 2},
           [&](std::size_t i) -> std::optional<int> {
             int ahead = ++received - executed.load();
             int prev = max_ahead.load();
             while (ahead > prev && !max_ahead.compare_exchange_weak(prev, ahead)) {}
             return static_cast<int>(i);
           },
           [](std::size_t, int& x) { return x; },
           [&](std::size_t, int&) {
             std::this_thread::sleep_for(std::chrono::milliseconds(2));
             ++executed;
           });
    auto s = pipe.run(40);
    failures += check(s.executed == 40, "all 40 shards executed");
    failures += check(s.max_received_depth <= 2 && s.max_ready_depth <= 2,
                      "queues never exceed capacity 2");
    failures += check(s.max_ready_depth == 2, "the ready queue filled (executor is the bottleneck)");
    failures += check(max_ahead.load() <= 2 + 2 + 3, "receive is held back");
  }
  {  // cancellation from the execute stage
    P* self = nullptr;
    P pipe({2, 2}, [](std::size_t i) -> std::optional<int> { return static_cast<int>(i); },
           [](std::size_t, int& x) { return x; },
           [&](std::size_t i, int&) {
             if (i == 5) self->cancel();
           });
    self = &pipe;
    auto s = pipe.run(1000);
    failures += check(s.cancelled && s.executed == 6, "cancel stops the run after shard 5");
  }
  {  // an error in reconstruct stops the others and is rethrown
    P pipe({2, 2}, [](std::size_t i) -> std::optional<int> { return static_cast<int>(i); },
           [](std::size_t i, int& x) {
             if (i == 3) throw std::runtime_error("bad shard 3");
             return x;
           },
           [](std::size_t, int&) {});
    bool caught = false;
    try {
      pipe.run(1000000);
    } catch (const std::runtime_error& e) {
      caught = std::string(e.what()) == "bad shard 3";
    }
    failures += check(caught, "a reconstruct error is rethrown to the caller");
  }
  std::printf("%s\n", failures ? "selftest FAILED" : "selftest passed");
  return failures ? 1 : 0;
}

int overhead(std::size_t shards) {
  sakura::Pipeline<std::size_t, std::size_t> pipe(
      {2, 2}, [](std::size_t i) -> std::optional<std::size_t> { return i; },
      [](std::size_t, std::size_t& x) { return x; }, [](std::size_t, std::size_t&) {});
  auto s = pipe.run(shards);
  std::printf("{\"shards\": %zu, \"us_per_shard\": %.3f}\n", s.executed,
              s.wall_s * 1e6 / std::max<std::size_t>(1, s.executed));
  return 0;
}

int run(const std::string& dir, int threads, std::size_t capacity, double exec_ms) {
  std::ifstream list(dir + "/shards.txt");
  if (!list) throw std::runtime_error("cannot read " + dir + "/shards.txt");
  std::vector<Entry> entries;
  std::vector<float> rope;
  std::string line;
  while (std::getline(list, line)) {
    std::istringstream in(line);
    std::string kind;
    if (!(in >> kind) || kind[0] == '#') continue;
    if (kind == "rope") {
      std::string f;
      in >> f;
      rope = read_floats(dir + "/" + f);
    } else if (kind == "shard") {
      Entry e;
      std::string ranks;
      in >> e.file >> ranks >> e.expected;
      std::stringstream rs(ranks);
      for (std::string r; std::getline(rs, r, ',');) e.ranks.push_back(std::stoi(r));
      entries.push_back(e);
    }
  }
  std::size_t mismatches = 0;
  double worst = 0, decode_ms = 0;
  sakura::Pipeline<std::string, Decoded> pipe(
      {capacity, capacity},
      [&](std::size_t i) -> std::optional<std::string> { return read_file(dir + "/" + entries[i].file); },
      [&](std::size_t i, std::string& data) {
        const auto* p = reinterpret_cast<const std::uint8_t*>(data.data());
        const sakura::ShardHeader h = sakura::parse_header(p, data.size());
        if (!rope.empty() && rope.size() != static_cast<std::size_t>(h.tokens) * h.channels) {
          throw sakura::FormatError("rope table does not match the shard geometry");
        }
        Decoded d;
        d.values.resize(static_cast<std::size_t>(h.matrices) * h.tokens * h.channels);
        const auto t0 = Clock::now();
        sakura::decode_shard(p, data.size(), entries[i].ranks, rope.empty() ? nullptr : rope.data(),
                             d.values.data(), threads);
        d.decode_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        return d;
      },
      [&](std::size_t i, Decoded& d) {
        decode_ms += d.decode_ms;
        if (entries[i].expected != "-") {
          const std::vector<float> want = read_floats(dir + "/" + entries[i].expected);
          double scale = 0, err = 0;
          if (want.size() != d.values.size()) {
            ++mismatches;
          } else {
            for (std::size_t j = 0; j < want.size(); ++j) {
              scale = std::max(scale, static_cast<double>(std::fabs(want[j])));
              err = std::max(err, static_cast<double>(std::fabs(want[j] - d.values[j])));
            }
            const double rel = scale > 0 ? err / scale : err;
            worst = std::max(worst, rel);
            if (rel > 1e-5) ++mismatches;
          }
        }
        if (exec_ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(exec_ms));
      });
  const auto s = pipe.run(entries.size());
  std::printf(
      "{\"shards\": %zu, \"mismatches\": %zu, \"max_rel_err\": %.3g, \"decode_ms_mean\": %.4f, "
      "\"wall_s\": %.4f, \"max_received_depth\": %zu, \"max_ready_depth\": %zu, "
      "\"kernel\": \"%s\", \"threads\": %d}\n",
      s.executed, mismatches, worst, decode_ms / std::max<std::size_t>(1, s.executed), s.wall_s,
      s.max_received_depth, s.max_ready_depth, sakura::product_kernel(), threads);
  return mismatches || s.executed != entries.size() ? 1 : 0;
}

#ifdef SAKURA_HAVE_TEXT
void print_ids(const char* key, const std::vector<std::int64_t>& v) {
  std::printf("\"%s\": [", key);
  for (std::size_t i = 0; i < v.size(); ++i) std::printf(i ? ", %lld" : "%lld", static_cast<long long>(v[i]));
  std::printf("]");
}

int tokenize(int argc, char** argv) {
  const sakura::WordPieceTokenizer tok = sakura::WordPieceTokenizer::from_file(argv[2]);
  int max_tokens = 16;
  std::vector<std::string> texts;
  bool from_stdin = true;
  for (int i = 3; i < argc; ++i) {
    const std::string opt = argv[i];
    if (opt == "--max-tokens" && i + 1 < argc) {
      max_tokens = std::stoi(argv[++i]);
    } else {
      texts.push_back(opt);
      from_stdin = false;
    }
  }
  if (from_stdin) {
    for (std::string line; std::getline(std::cin, line);) texts.push_back(line);
  }
  for (const std::string& text : texts) {
    const sakura::TokenizedPrompt out = tok.encode(text, max_tokens);
    std::printf("{");
    print_ids("ids", out.ids);
    std::printf(", ");
    print_ids("attention_mask", out.mask);
    std::printf(", \"total\": %d}\n", out.total);
  }
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "selftest") return selftest();
    if (cmd == "overhead") return overhead(argc > 2 ? std::stoul(argv[2]) : 100000);
    if (cmd == "run" && argc > 2) {
      int threads = 1;
      std::size_t capacity = 2;
      double exec_ms = 0;
      for (int i = 3; i + 1 < argc; i += 2) {
        const std::string opt = argv[i];
        if (opt == "--threads") threads = std::stoi(argv[i + 1]);
        else if (opt == "--capacity") capacity = std::stoul(argv[i + 1]);
        else if (opt == "--exec-ms") exec_ms = std::stod(argv[i + 1]);
        else throw std::invalid_argument("unknown option " + opt);
      }
      return run(argv[2], threads, capacity, exec_ms);
    }
#ifdef SAKURA_HAVE_TEXT
    if (cmd == "tokenize" && argc > 2) return tokenize(argc, argv);
#endif
    std::fprintf(stderr,
                 "usage: sakura-native selftest | overhead [SHARDS] | run DIR [--threads T] "
                 "[--capacity C] [--exec-ms X]"
#ifdef SAKURA_HAVE_TEXT
                 " | tokenize VOCAB [--max-tokens T] [TEXT]"
#endif
                 "\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sakura-native: error: %s\n", e.what());
    return 1;
  }
}
