// sakura-edge: one whole edit with no Python (issue 31 item 2).
//
//   sakura-edge edit --origin URL --template ID --prompt TEXT --seed N --out edit.png
//                    [--policy POLICY] [--bits N] [--timeline PATH] [--float-out PATH]
//
// catalog entry and device bundle (downloaded once, sha256-checked, cached) -> manifest
// (ETag revalidation, the per-origin rate memory) -> prompt -> WordPiece ids -> the text
// encoder program -> txt_in -> request tensors -> the shard loop of sakura_native (edit.cpp:
// libcurl receive, verify, reconstruct, ExecuTorch graphs) -> compose -> PNG (libpng), the
// float output (.npy) and a timeline JSON. Errors: one "sakura-edge: error: ..." line, exit 1
// for bad input (files, the origin's answers, the prompt), 2 for bad usage.
#include <curl/curl.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "edge/origin.hpp"
#include "edge/request.hpp"
#include "sakura/allocator.hpp"
#include "sakura/edit.hpp"
#include "sakura/graph.hpp"
#include "sakura/http.hpp"
#include "sakura/monitor.hpp"
#include "sakura/text_encoder.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using sakura::edge::InputError;

namespace {

constexpr int kGraphsFormat = 1;  // edge/native_runtime.py GRAPHS_FORMAT
constexpr const char* kBundleFormat = "sakura-bundle";
constexpr int kBundleVersion = 1;
constexpr const char* kManifestFormat = "sakura-pack";
constexpr int kManifestVersion = 2;
constexpr double kStartupFraction = 0.1;  // edge/monitor.py DEFAULT_STARTUP_FRACTION
constexpr double kStallFloorS = 0.05;     // edge/deadlines.py STALL_FLOOR_S
// edge/shard_records.py STALL_EPS_S: shorter waits are scheduling noise; shard 0's wait is
// the startup, not a stall (pipeline_stats)
constexpr double kStallEpsS = 1e-3;
#ifndef SAKURA_EXECUTORCH_VERSION
#define SAKURA_EXECUTORCH_VERSION "unknown"
#endif

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

const char* kUsage =
    "usage: sakura-edge edit --origin URL --template ID --prompt TEXT --seed N --out FILE.png\n"
    "                        [--policy sakura|svd|sakura-greedy|sakura-optimistic|sakura-floor|\n"
    "                                  sakura-fixed-bits|sakura-fixed-config|fp16|intq]\n"
    "                         (default sakura)\n"
    "                        [--bits N]\n"
    "                        [--budget-rate-bps BPS]\n"
    "                        [--timeline PATH] [--float-out PATH.npy] [--token TOKEN]\n"
    "                        [--state-dir DIR | --no-state] [--cache-dir DIR] [--threads N]\n"
    "                        [--retry-window S] [--no-local-fallback] [--truncate]\n"
    "                        [--precision fp32|int8] [--http-version 1.1|2]\n"
    "                        [--pack-origin URL] [--reconstruct cpu|opencl[:DEVICE]]\n";

struct Args {
  // the policy: `sakura edit`'s default (an ablation as the default gave, with no
  // --budget-rate-bps and no rate sample yet, the smallest configuration on every shard)
  std::string origin, template_id, prompt, out, policy = "sakura";
  std::string timeline, float_out, token, state_dir, cache_dir;
  std::string precision = "fp32";  // the shard graphs: the bundle's fp32 or int8 sets
  // pack ranges over HTTP/1.1 or HTTP/2 (h2c, prior knowledge), from --origin or from the
  // same paths on --pack-origin (edge/options.py: http_version, pack_origin)
  std::string http_version = "1.1", pack_origin;
  // where sakura/svd shards are decoded: cpu (the SIMD kernels) or opencl[:DEVICE] (the GPU
  // path, sakura/opencl_decode.hpp), as `sakura edit --reconstruct`
  std::string reconstruct = "cpu";
  std::uint64_t seed = 0;
  bool have_seed = false, no_state = false, local_fallback = true, truncate = false;
  double budget_rate_bps = NAN, retry_window_s = 30.0;
  int threads = 1;
  int bits = 4;  // sakura-fixed-bits (edge/allocator.py _fixed_bits: options["bits"], 4)
};

double number(const std::string& flag, const std::string& text) {
  try {
    std::size_t used = 0;
    const double v = std::stod(text, &used);
    if (used != text.size() || !std::isfinite(v)) throw std::invalid_argument("");
    return v;
  } catch (const std::exception&) {
    throw UsageError(flag + " takes a number, got '" + text + "'");
  }
}

Args parse(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) != "edit") {
    throw UsageError(argc < 2 ? "no command given (edit)"
                              : "unknown command '" + std::string(argv[1]) + "' (edit)");
  }
  Args a;
  for (int i = 2; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(f + " needs a value");
      return argv[++i];
    };
    if (f == "--origin" || f == "--server") a.origin = value();
    else if (f == "--template") a.template_id = value();
    else if (f == "--prompt") a.prompt = value();
    else if (f == "--out") a.out = value();
    else if (f == "--policy") a.policy = value();
    else if (f == "--timeline") a.timeline = value();
    else if (f == "--float-out") a.float_out = value();
    else if (f == "--token") a.token = value();
    else if (f == "--state-dir") a.state_dir = value();
    else if (f == "--cache-dir") a.cache_dir = value();
    else if (f == "--no-state") a.no_state = true;
    else if (f == "--no-local-fallback") a.local_fallback = false;
    else if (f == "--truncate") a.truncate = true;
    else if (f == "--budget-rate-bps") a.budget_rate_bps = number(f, value());
    else if (f == "--retry-window") a.retry_window_s = number(f, value());
    else if (f == "--threads") a.threads = static_cast<int>(number(f, value()));
    else if (f == "--precision") a.precision = value();
    else if (f == "--http-version") a.http_version = value();
    else if (f == "--pack-origin") a.pack_origin = value();
    else if (f == "--reconstruct") a.reconstruct = value();
    else if (f == "--bits") {
      const double b = number(f, value());
      if (b != std::floor(b) || b < 1 || b > 16) throw UsageError("--bits takes a bit width 1-16");
      a.bits = static_cast<int>(b);
    }
    else if (f == "--seed") {
      const std::string v = value();
      if (v.empty() || v.size() > 19 || !std::all_of(v.begin(), v.end(), ::isdigit)) {
        throw UsageError("seed " + v + " is out of range: give an integer from 0 to "
                         "9223372036854775807 (2**63 - 1)");
      }
      a.seed = std::stoull(v);
      if (a.seed > 9223372036854775807ULL) throw UsageError("seed " + v + " is out of range");
      a.have_seed = true;
    } else if (f == "-h" || f == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else {
      throw UsageError("unknown option " + f);
    }
  }
  if (a.origin.empty()) throw UsageError("--origin is required");
  if (a.origin.rfind("http://", 0) != 0 && a.origin.rfind("https://", 0) != 0) {
    throw UsageError("'" + a.origin + "' is not an http(s) URL such as http://127.0.0.1:8000");
  }
  while (a.origin.size() > 8 && a.origin.back() == '/') a.origin.pop_back();
  if (a.template_id.empty()) throw UsageError("--template is required");
  if (a.prompt.find_first_not_of(" \t\r\n") == std::string::npos) {
    throw UsageError("the prompt is empty: give the edit in words, e.g. --prompt 'a red hat'");
  }
  if (!a.have_seed) throw UsageError("--seed is required");
  if (a.out.empty()) throw UsageError("--out is required");
  static const std::set<std::string> kPolicies = {
      "sakura",         "svd",          "sakura-greedy",       "sakura-optimistic",
      "sakura-floor",   "sakura-fixed-bits", "sakura-fixed-config", "fp16", "intq"};
  if (!kPolicies.count(a.policy)) {
    throw UsageError("policy '" + a.policy + "' is not in sakura-edge (sakura, svd, "
                     "sakura-greedy, sakura-optimistic, sakura-floor, sakura-fixed-bits, "
                     "sakura-fixed-config, fp16, intq); the others run in `sakura edit "
                     "--runtime native`");
  }
  if (a.threads < 1) throw UsageError("--threads must be >= 1");
  if (a.precision != "fp32" && a.precision != "int8") {
    throw UsageError("--precision takes fp32 or int8, got '" + a.precision + "'");
  }
  if (!(a.retry_window_s > 0)) throw UsageError("--retry-window must be > 0");
  if (a.reconstruct != "cpu" && a.reconstruct != "opencl" &&
      a.reconstruct.rfind("opencl:", 0) != 0) {
    throw UsageError("--reconstruct takes cpu, opencl or opencl:DEVICE, got '" + a.reconstruct +
                     "'");
  }
  if (a.http_version != "1.1" && a.http_version != "2") {
    throw UsageError("--http-version takes 1.1 or 2, got '" + a.http_version + "'");
  }
  if (!a.pack_origin.empty()) {
    if (a.pack_origin.rfind("http://", 0) != 0 && a.pack_origin.rfind("https://", 0) != 0) {
      throw UsageError("--pack-origin '" + a.pack_origin + "' is not an http(s) URL such as "
                       "http://127.0.0.1:8081");
    }
    while (!a.pack_origin.empty() && a.pack_origin.back() == '/') a.pack_origin.pop_back();
    if (a.pack_origin.find_first_of("/?#", a.pack_origin.find("://") + 3) != std::string::npos) {
      throw UsageError("--pack-origin takes scheme://host:port only (the packs' paths are "
                       "--origin's), got '" + a.pack_origin + "'");
    }
  }
  return a;
}

std::string cache_root() {
  if (const char* s = std::getenv("SAKURA_CACHE"); s && *s) return s;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/sakura";
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/sakura";
}

// fd 2 to /dev/null for a block: ExecuTorch's threadpool logs its CPU probing there
struct QuietStderr {
  int saved = -1;
  QuietStderr() {
    std::fflush(stderr);
    saved = dup(2);
    const int null = open("/dev/null", O_WRONLY);
    if (null >= 0) {
      dup2(null, 2);
      close(null);
    }
  }
  ~QuietStderr() {
    if (saved >= 0) {
      dup2(saved, 2);
      close(saved);
    }
  }
};

json parse_json(const std::string& body, const std::string& what) {
  try {
    return json::parse(body);
  } catch (const json::exception&) {
    throw InputError(what + " is not JSON");
  }
}

// the origin's own message (sakura serve: {"error": ..., "code": ...}; edge/retry.py)
std::string short_body(const std::string& body) {
  try {
    const json d = json::parse(body);
    if (d.is_object()) {
      std::string msg;
      for (const char* k : {"error", "detail"}) {
        if (d.contains(k) && d[k].is_string()) {
          msg = d[k].get<std::string>().substr(0, 300);
          break;
        }
      }
      if (d.contains("code") && d["code"].is_string()) {
        const std::string code = d["code"];
        if (code == "pack_damaged" || code == "publish_broken") {
          msg += " (the origin says " + code + ": retrying will not help)";
        }
      }
      if (!msg.empty()) return msg;
    }
  } catch (const json::exception&) {
  }
  std::string text = body.substr(0, 200);
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

std::string hex(const std::array<std::uint8_t, 32>& h) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (auto b : h) {
    s.push_back(digits[b >> 4]);
    s.push_back(digits[b & 15]);
  }
  return s;
}

std::array<std::uint8_t, 32> sha_bytes(const std::string& text) {
  std::array<std::uint8_t, 32> out{};
  if (text.size() != 64) throw InputError("a sha256 in the manifest is not 64 hex digits");
  for (int i = 0; i < 32; ++i) {
    out[i] = static_cast<std::uint8_t>(std::stoul(text.substr(2 * i, 2), nullptr, 16));
  }
  return out;
}

std::string file_sha256(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return hex(sakura::sha256(reinterpret_cast<const std::uint8_t*>(data.data()), data.size()));
}

// ------------------------------------------------------------------------------ bundle
struct Bundle {
  json doc;
  std::map<std::string, fs::path> paths;
};

Bundle fetch_bundle(const Args& a, const json& entry, const std::vector<std::string>& headers,
                    const sakura::HttpOptions& retry, const std::string& root) {
  if (!entry.contains("bundle") || !entry["bundle"].is_object()) {
    throw InputError(a.origin + " publishes no device bundle for " + a.template_id +
                     " (packs built before bundles, or with --no-bundle): rebuild them with "
                     "`sakura build`");
  }
  Bundle b{entry["bundle"], {}};
  const json& d = b.doc;
  const std::string who = "the device bundle of " + a.template_id;
  if (d.value("format", "") != kBundleFormat || d.value("version", -1) != kBundleVersion) {
    throw InputError(who + " is refused: not a " + std::string(kBundleFormat) + " version " +
                     std::to_string(kBundleVersion));
  }
  if (d.value("graphs_format", -1) != kGraphsFormat) {
    throw InputError(who + " is refused: its graphs format is " +
                     d.value("graphs_format", json(nullptr)).dump() + ", this runtime reads " +
                     std::to_string(kGraphsFormat) + " (rebuild it with this version of "
                     "`sakura build`)");
  }
  const std::string et = d.value("executorch", "");
  const std::string want = std::string("executorch-") + SAKURA_EXECUTORCH_VERSION + "-";
  if (et.rfind(want, 0) != 0) {
    throw InputError(who + " is refused: it was exported with " + et + ", this binary runs "
                     "executorch " + SAKURA_EXECUTORCH_VERSION);
  }
  if (!d.contains("text_encoder") || !d["text_encoder"].is_object()) {
    throw InputError(who + " has no text encoder program (a bundle of a model with its own "
                     "prompt encoder): sakura-edge runs the shipped MiniLM encoder");
  }
  for (const auto& f : d.at("files")) {
    const std::string name = f.at("name"), sha = f.at("sha256"), key = f.at("key");
    const std::int64_t bytes = f.at("bytes");
    if (name.find('/') != std::string::npos || name.empty() || name[0] == '.') {
      throw InputError(who + " names a file '" + name + "'");
    }
    const fs::path folder = fs::path(root) / sha;
    const fs::path path = folder / name;
    b.paths[name] = path;
    std::error_code ec;
    if (fs::file_size(path, ec) == static_cast<std::uintmax_t>(bytes) && !ec &&
        file_sha256(path) == sha) {
      continue;
    }
    const auto got = sakura::edge::http_get(sakura::edge::origin_url(a.origin, key), headers, "",
                                            retry);
    if (got.status != 200) {
      throw InputError(a.origin + " answered " + std::to_string(got.status) +
                       " for the device bundle file " + name + " of " + a.template_id + ": " +
                       short_body(got.body));
    }
    const std::string digest = hex(sakura::sha256(
        reinterpret_cast<const std::uint8_t*>(got.body.data()), got.body.size()));
    if (digest != sha || static_cast<std::int64_t>(got.body.size()) != bytes) {
      throw InputError("the device bundle file " + name + " of " + a.template_id + " (" + key +
                       ") fails its checksum: " + std::to_string(got.body.size()) +
                       " bytes with sha256 " + digest.substr(0, 16) + "..., the catalog says " +
                       std::to_string(bytes) + " bytes with " + sha.substr(0, 16) +
                       "...; it is not used");
    }
    fs::create_directories(folder);
    const fs::path tmp = path.string() + ".part" + std::to_string(getpid());
    {
      std::ofstream out(tmp, std::ios::binary);
      out.write(got.body.data(), static_cast<std::streamsize>(got.body.size()));
      if (!out) throw std::runtime_error("cannot write " + tmp.string());
    }
    fs::rename(tmp, path);
  }
  return b;
}

const json& graph_set(const json& bundle, const std::string& name) {
  for (const auto& gs : bundle.at("graph_sets")) {
    if (gs.at("name") == name) return gs;
  }
  throw InputError("the device bundle has no '" + name + "' graph chain");
}

// A chain at a precision: fp32 is the set named `chain`, int8 the set `chain-int8` (the
// block groups' int8 XNNPACK graphs, edge/bundle.py), which only `sakura build --int8`
// publishes; each set records its precision.
const json& chain_set(const json& bundle, const std::string& chain, const std::string& precision) {
  const std::string name = precision == "fp32" ? chain : chain + "-" + precision;
  for (const auto& gs : bundle.at("graph_sets")) {
    if (gs.at("name") != name) continue;
    if (gs.value("precision", std::string("fp32")) != precision) {
      throw InputError("the device bundle's '" + name + "' graphs are " +
                       gs.value("precision", std::string("fp32")) + ", not " + precision);
    }
    return gs;
  }
  if (precision != "fp32") {
    throw InputError("the device bundle has no " + precision + " graphs: publish them with "
                     "`sakura build --int8`, or edit with --precision fp32");
  }
  return graph_set(bundle, name);
}

std::unique_ptr<sakura::EditGraphs> load_graphs(const json& gs, const Bundle& b) {
  auto path = [&](const std::string& n) -> std::string {
    auto it = b.paths.find(n);
    if (it == b.paths.end()) throw InputError("the device bundle lists no file " + n);
    return it->second.string();
  };
  auto g = std::make_unique<sakura::EditGraphs>();
  g->step_in = std::make_unique<sakura::CompiledGraph>(path(gs.at("step_in")));
  for (const auto& f : gs.at("group_files")) {
    g->groups.push_back(std::make_unique<sakura::CompiledGraph>(path(f)));
  }
  g->step_out = std::make_unique<sakura::CompiledGraph>(path(gs.at("step_out")));
  for (const auto& grp : gs.at("groups")) g->group_blocks.push_back(static_cast<int>(grp.size()));
  g->takes_cache = gs.at("takes_cache");
  g->check();
  return g;
}

// ------------------------------------------------------------------------------ policy
struct Option {
  int id;
  std::int64_t nbytes;
  json params;
  std::optional<double> psnr, werr;
};

std::optional<double> opt_number(const json& q, const char* key) {
  if (!q.is_object() || !q.contains(key) || !q[key].is_number()) return std::nullopt;
  return q[key].get<double>();
}

bool uniform(const json& params) {
  std::vector<int> ranks;
  if (params.contains("ranks")) {
    for (const auto& r : params["ranks"]) {
      if (r.get<int>() > 0) ranks.push_back(r.get<int>());
    }
  }
  return std::all_of(ranks.begin(), ranks.end(), [&](int r) { return r == ranks[0]; });
}

// edge/allocator.py options_from_manifest (Pareto only) with rank_by_quality (best first;
// `shard_docs` sorted by index). With `keep` (a policy that restricts the set, as
// ShardOptions.filtered): the configurations it keeps, on the front or off it.
std::vector<std::vector<Option>> option_tables(
    const std::vector<json>& shard_docs,
    const std::function<bool(const Option&)>& keep = nullptr) {
  std::vector<std::vector<Option>> tables;
  for (const auto& s : shard_docs) {
    std::vector<Option> opts, pareto, kept;
    for (const auto& c : s.at("configs")) {
      const json q = c.value("quality", json::object());
      Option o{c.at("id"), c.at("bytes"), c.value("params", json::object()),
               opt_number(q, "psnr_db"), opt_number(q, "weighted_err")};
      opts.push_back(o);
      if (c.value("pareto", true)) pareto.push_back(o);
      if (keep && keep(o)) kept.push_back(o);
    }
    if (keep && kept.empty()) {
      throw InputError("shard " + std::to_string(s.at("index").get<int>()) +
                       ": no configuration matches the policy");
    }
    auto t = keep ? kept : pareto.empty() ? opts : pareto;
    if (t.empty()) throw InputError("a shard has no configurations in the manifest");
    const bool psnr = std::all_of(t.begin(), t.end(), [](const Option& o) {
      return o.psnr && std::isfinite(*o.psnr);
    });
    const bool werr = std::all_of(t.begin(), t.end(), [](const Option& o) { return o.werr.has_value(); });
    std::stable_sort(t.begin(), t.end(), [&](const Option& x, const Option& y) {
      if (psnr) {
        if (*x.psnr != *y.psnr) return *x.psnr > *y.psnr;
        if (x.werr.value_or(0) != y.werr.value_or(0)) return x.werr.value_or(0) < y.werr.value_or(0);
        return x.nbytes < y.nbytes;
      }
      if (werr) {
        if (*x.werr != *y.werr) return *x.werr < *y.werr;
        return x.nbytes < y.nbytes;
      }
      return x.nbytes > y.nbytes;
    });
    tables.push_back(std::move(t));
  }
  return tables;
}

// edge/allocator.py floored: each shard's options at or above `floor_db` (an option without
// a PSNR is kept); a shard with none keeps its best
std::vector<std::vector<Option>> floored(const std::vector<std::vector<Option>>& tables,
                                         double floor_db) {
  std::vector<std::vector<Option>> out;
  for (const auto& t : tables) {
    std::vector<Option> kept;
    for (const auto& o : t) {
      if (!o.psnr || *o.psnr >= floor_db) kept.push_back(o);
    }
    if (kept.empty()) kept.push_back(t.front());
    out.push_back(std::move(kept));
  }
  return out;
}

// _adaptive / _greedy_sakura / _optimistic: the plan over the next shards (edge/lookahead.py:
// cost 10^(-psnr/10), else the weighted error; none known: no plan) or the greedy rule
std::shared_ptr<sakura::Allocator> adaptive(const std::vector<std::vector<Option>>& tables,
                                            const std::vector<double>& exec_s, double safety,
                                            bool plan) {
  std::vector<std::vector<sakura::AllocOption>> t;
  std::vector<std::vector<double>> costs;
  bool known = true;
  for (const auto& shard : tables) {
    std::vector<sakura::AllocOption> row;
    std::vector<double> cost;
    for (const auto& o : shard) {
      row.push_back({o.id, o.nbytes});
      if (o.psnr && std::isfinite(*o.psnr)) cost.push_back(std::pow(10.0, -*o.psnr / 10.0));
      else if (o.werr && std::isfinite(*o.werr)) cost.push_back(*o.werr);
      else known = false;
    }
    t.push_back(std::move(row));
    costs.push_back(std::move(cost));
  }
  auto out = std::make_shared<sakura::AdaptiveAllocator>(t, 0.0, safety);
  // the stale plan's configurations (edge/stale_plan.py: the smallest, or below
  // kStalePlanDb)
  std::vector<std::vector<int>> skip;
  for (std::size_t s = 0; s < tables.size(); ++s) {
    std::vector<int> ids;
    for (const auto& o : tables[s]) {
      if (sakura::stale_skippable(o.psnr, o.id == out->smallest(static_cast<int>(s)))) {
        ids.push_back(o.id);
      }
    }
    skip.push_back(std::move(ids));
  }
  out->set_skippable(std::move(skip));
  if (plan && known && !exec_s.empty()) {
    sakura::Lookahead la;
    la.costs = std::move(costs);
    la.slots_s = exec_s;
    out->set_lookahead(std::move(la));
  }
  return out;
}

std::vector<int> fixed_config(const json& manifest, const std::vector<double>& exec_s,
                              double budget_rate_bps, double safety) {
  std::vector<json> docs(manifest.at("shards").begin(), manifest.at("shards").end());
  std::sort(docs.begin(), docs.end(),
            [](const json& x, const json& y) { return x.at("index").get<int>() < y.at("index").get<int>(); });
  const auto tables = option_tables(docs);
  std::map<std::string, std::vector<Option>> common;
  std::vector<std::string> order;  // first appearance (Python's dict order)
  for (const auto& t : tables) {
    for (const auto& o : t) {
      if (!uniform(o.params)) continue;
      const std::string key = o.params.dump();  // sorted keys: params_key()
      if (!common.count(key)) order.push_back(key);
      common[key].push_back(o);
    }
  }
  std::vector<std::string> keys;
  for (const auto& k : order) {
    if (common[k].size() == tables.size()) keys.push_back(k);
  }
  if (keys.empty()) throw InputError("no configuration (same parameters) is offered by every shard");
  double mean_exec = 0;
  for (double e : exec_s) mean_exec += e;
  mean_exec /= static_cast<double>(exec_s.size());
  const double budget = (budget_rate_bps > 0 && std::isfinite(budget_rate_bps))
                            ? std::max(0.0, mean_exec) * budget_rate_bps / 8.0 * safety
                            : 0.0;
  auto mean_bytes = [](const std::vector<Option>& v) {
    double s = 0;
    for (const auto& o : v) s += static_cast<double>(o.nbytes);
    return s / static_cast<double>(v.size());
  };
  auto quality = [](const std::vector<Option>& v) {
    bool all_psnr = true, all_werr = true;
    double p = 0, w = 0, b = 0;
    for (const auto& o : v) {
      all_psnr = all_psnr && o.psnr.has_value();
      all_werr = all_werr && o.werr.has_value();
      p += o.psnr.value_or(0);
      w += o.werr.value_or(0);
      b += static_cast<double>(o.nbytes);
    }
    const double n = static_cast<double>(v.size());
    return all_psnr ? p / n : all_werr ? -w / n : b;
  };
  const std::vector<Option>* chosen = nullptr;
  for (const auto& k : keys) {
    const auto& v = common[k];
    if (mean_bytes(v) > budget) continue;
    if (!chosen || quality(v) > quality(*chosen) ||
        (quality(v) == quality(*chosen) && mean_bytes(v) < mean_bytes(*chosen))) {
      chosen = &v;
    }
  }
  if (!chosen) {
    for (const auto& k : keys) {
      if (!chosen || mean_bytes(common[k]) < mean_bytes(*chosen)) chosen = &common[k];
    }
  }
  std::vector<int> ids;
  for (const auto& o : *chosen) ids.push_back(o.id);
  return ids;
}

// the keys' RoPE table [N, C/2, 2] of a low-rank codec (codec/lowrank.py rope_angles +
// rope_phasors), or empty
std::vector<float> rope_table(const json& options, std::int64_t tokens, std::int64_t channels) {
  if (!options.is_object() || !options.contains("rope") || options["rope"].is_null()) return {};
  const json& r = options["rope"];
  const int heads = r.at("heads");
  const std::vector<int> axes = r.at("axes").get<std::vector<int>>();
  const double theta = r.at("theta");
  const auto& pos = r.at("positions");
  if (static_cast<std::int64_t>(pos.size()) != tokens) {
    throw InputError("the manifest's rope has " + std::to_string(pos.size()) +
                     " positions, the shard " + std::to_string(tokens) + " tokens");
  }
  const std::int64_t half = channels / heads / 2;
  std::vector<float> out(static_cast<std::size_t>(tokens * heads * half * 2));
  for (std::int64_t n = 0; n < tokens; ++n) {
    std::vector<float> angles;
    for (std::size_t i = 0; i < axes.size(); ++i) {
      const int dim = axes[i];
      const double p = pos[n][i].get<double>();
      for (int k = 0; k < dim; k += 2) {
        const double freq = 1.0 / std::pow(theta, static_cast<double>(k) / dim);
        angles.push_back(static_cast<float>(p * freq));
      }
    }
    if (static_cast<std::int64_t>(angles.size()) != half) {
      throw InputError("the manifest's rope axes do not match its channels");
    }
    for (int h = 0; h < heads; ++h) {
      for (std::int64_t j = 0; j < half; ++j) {
        float* o = out.data() + ((n * heads + h) * half + j) * 2;
        o[0] = std::cos(angles[j]);
        o[1] = std::sin(angles[j]);
      }
    }
  }
  return out;
}

// ------------------------------------------------------------------------------ timeline
json record_json(const sakura::ShardRecord& r, const json& params) {
  auto num = [](double v) { return std::isnan(v) ? json(nullptr) : json(v); };
  auto idx = [](int v) { return v < 0 ? json(nullptr) : json(v); };
  return {{"shard", r.shard}, {"step", r.step}, {"blocks", r.blocks}, {"config", idx(r.config)},
          {"bytes", r.bytes}, {"window_s", num(r.window_s)}, {"lead_s", r.lead_s},
          {"carry_s", num(r.carry_s)}, {"rate_bps", num(r.rate_bps)},
          {"deadline", num(r.deadline)}, {"recv_start", num(r.recv_start)},
          {"recv_first_byte", num(r.recv_first_byte)}, {"recv_end", num(r.recv_end)},
          {"recon_start", num(r.recon_start)}, {"recon_end", num(r.recon_end)},
          {"exec_start", num(r.exec_start)}, {"exec_end", num(r.exec_end)},
          {"stall_s", r.stall_s}, {"attempts", r.attempts}, {"resumes", r.resumes},
          {"refetches", r.refetches}, {"requested", idx(r.requested)}, {"hedges", r.hedges},
          {"truncated", r.truncated}, {"damage", r.damage.empty() ? json(nullptr) : json(r.damage)},
          {"local", r.local}, {"outage", r.outage}, {"refinements", r.refinements},
          {"stale_from", idx(r.stale_from)}, {"planned_stale", r.planned_stale},
          {"planned_local", r.planned_local},
          {"params", params}};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// ------------------------------------------------------------------------------ the edit
int run(const Args& a) {
  const double t_begin = sakura::now_s();
  const std::string root = a.cache_dir.empty() ? cache_root() : a.cache_dir;
  const std::string state_dir =
      a.no_state ? "" : (a.state_dir.empty() ? root + "/edge" : a.state_dir);
  sakura::edge::DeviceState state(state_dir);
  // one set of timeouts and backoffs (sakura::HttpOptions' defaults, as the shard loop's)
  // for the catalog, bundle and manifest fetches and the shard transfers
  sakura::HttpOptions retry;
  retry.window_s = a.retry_window_s;
  std::vector<std::string> headers;
  if (!a.token.empty()) headers.push_back("Authorization: Bearer " + a.token);
  const std::string codec = a.policy == "fp16" || a.policy == "svd" || a.policy == "intq"
                                ? a.policy : "sakura";
  // the plain streaming baselines wait for their bytes (edge/allocator.py: fp16 and intq
  // have local_fallback=False)
  const bool baseline = codec == "fp16" || codec == "intq";

  // catalog entry
  const auto cat = sakura::edge::http_get(sakura::edge::origin_url(a.origin, "catalog.json"),
                                          headers, "", retry);
  if (cat.status != 200) {
    throw InputError(a.origin + " answered " + std::to_string(cat.status) +
                     " for its catalog: " + short_body(cat.body));
  }
  const json catalog = parse_json(cat.body, a.origin + "'s catalog.json");
  if (!catalog.is_object() || !catalog.contains("templates") || !catalog["templates"].is_object()) {
    throw InputError(a.origin + ": catalog.json is not a SAKURA catalog");
  }
  if (!catalog["templates"].contains(a.template_id)) {
    throw InputError(a.origin + ": unknown template '" + a.template_id +
                     "' (not in its catalog, or not visible to this token)");
  }
  const json entry = catalog["templates"][a.template_id];
  if (!entry.contains("template") || !entry["template"].is_object() ||
      !entry["template"].contains("image_png_b64")) {
    throw InputError("the catalog entry of '" + a.template_id + "' has no template assets "
                     "(image, mask): rebuild it with `sakura build`");
  }
  const Bundle bundle = fetch_bundle(a, entry, headers, retry, root + "/compiled/bundles");
  const json& tdoc = bundle.doc.at("tables");
  std::map<std::string, std::pair<std::int64_t, std::vector<std::int64_t>>> index;
  for (const auto& [name, v] : tdoc.at("arrays").items()) {
    index[name] = {v.at("offset").get<std::int64_t>(), v.at("shape").get<std::vector<std::int64_t>>()};
  }
  const auto tables = sakura::edge::read_tables(bundle.paths.at(tdoc.value("file", "tables.bin")).string(), index);

  // the template as the device sees it
  const json& t = entry["template"];
  const int grid = tdoc.at("grid");
  const int resolution = t.value("resolution", 0);
  const std::string image_png = sakura::edge::base64_decode(t.at("image_png_b64"), "the template image");
  const std::string mask_png = sakura::edge::base64_decode(t.at("mask_png_b64"), "the template mask");
  int size_guess = resolution > 0 ? resolution : 0;
  if (size_guess == 0) size_guess = sakura::edge::read_png(image_png, 3, "the published template image").width;
  if (grid <= 0 || size_guess % grid) throw InputError("the bundle's grid does not divide the template");
  auto tv = sakura::edge::template_view(image_png, mask_png, size_guess / grid);
  tv.steps = t.at("steps");
  tv.guidance = t.at("guidance");
  tv.strength = t.value("strength", 1.0);
  tv.seed = t.contains("seed") && t["seed"].is_number_integer() ? t["seed"].get<std::int64_t>() : -1;
  if (tdoc.value("steps", -1) != tv.steps) {
    throw InputError("the device bundle's tables are for " + std::to_string(tdoc.value("steps", -1)) +
                     " steps, the template has " + std::to_string(tv.steps));
  }

  // graphs, text encoder
  const json& cached_set = chain_set(bundle.doc, "cached", a.precision);
  const int batch = tv.guidance != 1.0 ? 2 : 1;
  if (cached_set.at("shape").value("batch", -1) != batch) {
    throw InputError("the device bundle's graphs take a batch of " +
                     cached_set.at("shape").at("batch").dump() + ", this edit " + std::to_string(batch));
  }
  const bool dynamic = cached_set.value("dynamic", false);
  std::unique_ptr<sakura::EditGraphs> graphs, full_graphs, template_graphs;
  std::unique_ptr<sakura::TextEncoder> encoder;
  // the recompute step's template pass (sakura/edit.hpp LocalSteps): a bundle from before
  // it has no "template" graphs, and its late steps run with every token
  const json* template_set = nullptr;
  for (const auto& gs : bundle.doc.at("graph_sets")) {
    if (gs.value("name", std::string()) == "template" && gs.value("emits_kv", false)) {
      template_set = &gs;
    }
  }
  const std::string template_prompt = t.value("prompt", std::string());
  {
    QuietStderr quiet;  // ExecuTorch's cpuinfo notes on x86 (harmless)
    sakura::set_graph_threads(a.threads);
    graphs = load_graphs(cached_set, bundle);
    if (a.local_fallback && !baseline) {
      full_graphs = load_graphs(chain_set(bundle.doc, "full", a.precision), bundle);
      if (template_set != nullptr && !template_prompt.empty()) {
        template_graphs = load_graphs(*template_set, bundle);
      }
    }
    const json& te = bundle.doc.at("text_encoder");
    encoder = std::make_unique<sakura::TextEncoder>(bundle.paths.at(te.at("program")).string(),
                                                    bundle.paths.at(te.at("vocab")).string());
  }
  const int T = encoder->max_tokens();
  const auto tokens = encoder->tokenizer().encode(a.prompt, T);  // TokenizerError: not UTF-8
  if (tokens.total > T) {
    const std::string why = "the prompt is " + std::to_string(tokens.total - 2) +
                            " word pieces, the text encoder reads " + std::to_string(T - 2);
    if (!a.truncate) {
      throw InputError(why + ": shorten it, or pass --truncate to edit with its first " +
                       std::to_string(T - 2) + " (as `sakura edit` does)");
    }
    std::fprintf(stderr, "sakura-edge: note: %s; it is truncated to them\n", why.c_str());
  }
  std::vector<float> emb = encoder->run(tokens.ids, tokens.mask);
  if (batch == 2) {
    const auto unc = encoder->encode("");
    emb.insert(emb.end(), unc.begin(), unc.end());
  }
  const auto& wshape = tables.shape("txt_in_weight");
  if (wshape.size() != 2 || wshape[1] != encoder->dim()) {
    throw InputError("the bundle's txt_in does not take the encoder's " +
                     std::to_string(encoder->dim()) + " channels");
  }
  const auto txt = sakura::edge::linear(emb, tables.get("txt_in_weight", wshape),
                                        tables.get("txt_in_bias", {wshape[0]}), wshape[1], wshape[0]);
  const auto inputs = sakura::edge::edit_inputs(tv, tables, txt, batch, T, a.seed, false, dynamic);
  std::unique_ptr<sakura::EditInputs> full_inputs;

  // calibration (before the clock), kept in the device state
  const int bps = graphs->group_blocks.empty() ? 0 : graphs->group_blocks[0];
  const std::string profile_key = a.template_id + "|runtime=sakura-edge|bps=" + std::to_string(bps) +
                                  "|steps=" + std::to_string(tv.steps) + "|cfg=" +
                                  (batch == 2 ? "True" : "False") + "|bundle=" +
                                  bundle.doc.value("id", "");
  const std::int64_t U = static_cast<std::int64_t>(tv.unmasked.size());
  const std::int64_t C = graphs->step_in->outputs().at(0).sizes.back();
  std::vector<std::vector<int>> groups;
  for (const auto& g : cached_set.at("groups")) groups.push_back(g.get<std::vector<int>>());
  std::vector<double> group_s;
  if (auto p = state.profile(profile_key); p && p->size() == groups.size()) {
    group_s = *p;
  } else {
    std::vector<std::vector<float>> zeros;
    std::vector<sakura::ShardRecord> recs;
    for (int s = 0; s < tv.steps; ++s) {
      for (const auto& g : groups) {
        zeros.emplace_back(static_cast<std::size_t>(2 * g.size() * U * C), 0.0f);
        sakura::ShardRecord r;
        r.shard = static_cast<int>(recs.size());
        r.step = s;
        r.blocks = g;
        recs.push_back(r);
      }
    }
    sakura::ResidentFeed feed(std::move(zeros), recs, sakura::now_s());
    std::atomic<bool> cancel{false};
    sakura::run_edit(*graphs, inputs, &feed, cancel);
    std::vector<std::vector<double>> per(groups.size());
    const auto done = feed.records();
    for (std::size_t i = 0; i < done.size(); ++i) {
      if (i >= groups.size() || tv.steps == 1) {
        per[i % groups.size()].push_back(done[i].exec_end - done[i].exec_start);
      }
    }
    for (const auto& v : per) group_s.push_back(median(v));
    state.keep_profile(profile_key, group_s);
  }
  std::optional<double> local_step = state.local_step_s(profile_key);
  std::unique_ptr<sakura::EditInputs> template_inputs;
  if (template_graphs) {  // the template prompt (public catalog data), every token pinned
    const auto temb = encoder->encode(template_prompt);
    const auto ttxt = sakura::edge::linear(temb, tables.get("txt_in_weight", wshape),
                                           tables.get("txt_in_bias", {wshape[0]}), wshape[1],
                                           wshape[0]);
    template_inputs = std::make_unique<sakura::EditInputs>(
        sakura::edge::edit_inputs(tv, tables, ttxt, 1, T, 0, true, false));
    template_inputs->pinned.clear();
    for (std::int64_t i = 0; i < tv.num_tokens(); ++i) template_inputs->pinned.push_back(i);
  }
  if (full_graphs) {
    full_inputs = std::make_unique<sakura::EditInputs>(
        sakura::edge::edit_inputs(tv, tables, txt, batch, T, a.seed, true, false));
    if (!local_step) {  // the local fallback's step, timed once (as the native runner does)
      const double began = sakura::now_s();
      std::atomic<bool> cancel{false};
      sakura::run_edit(*full_graphs, *full_inputs, nullptr, cancel);
      local_step = (sakura::now_s() - began) / std::max(1, tv.steps);
      state.keep_local_step_s(profile_key, *local_step);
    }
  }

  // the manifest (the clock starts here, as in EdgeRuntime._streamed)
  const double origin = sakura::now_s();
  const double wall = sakura::edge::wall_s();
  const auto prior = state.prior_bps(a.origin, wall);
  // the manifest's body is asked for unless a rate is remembered for this origin: its
  // transfer is then the only rate sample before the first shards are sized
  const bool known = prior.has_value();
  auto held = state.manifest(a.template_id, codec);
  const std::string mkey = "templates/" + a.template_id + "/" + codec + "/manifest.json";
  const auto got = sakura::edge::http_get(sakura::edge::origin_url(a.origin, mkey), headers,
                                          known && held ? held->etag : "", retry);
  json manifest;
  std::int64_t raw_len = 0;
  bool from_cache = false;
  if (got.status == 304 && known && held) {
    manifest = held->doc;
    from_cache = true;
  } else if (got.status == 200) {
    manifest = parse_json(got.body, a.template_id + "/" + codec + "'s manifest");
    raw_len = static_cast<std::int64_t>(got.body.size());
    if (manifest.value("format", "") != kManifestFormat) {
      throw InputError(a.template_id + "/" + codec + ": the origin's manifest is not a " + kManifestFormat);
    }
    if (manifest.value("version", -1) != kManifestVersion) {
      throw InputError(a.template_id + "/" + codec + ": unsupported pack version " +
                       manifest.value("version", json(nullptr)).dump() + " (this client reads version " +
                       std::to_string(kManifestVersion) + "; rebuild the packs with `sakura build`)");
    }
    if (manifest.value("template_id", "") != a.template_id || manifest.value("codec", "") != codec) {
      throw InputError("asked for " + a.template_id + "/" + codec + ", the manifest is for " +
                       manifest.value("template_id", "?") + "/" + manifest.value("codec", "?"));
    }
    if (!got.etag.empty()) state.keep_manifest(a.template_id, codec, {got.etag, manifest, raw_len});
  } else {
    throw InputError(a.origin + " answered " + std::to_string(got.status) + " for " + mkey + ": " +
                     short_body(got.body));
  }
  // rate memory: a body is a rate sample, a 304 gives the request latency only
  {
    const double latency = std::max(0.0, got.first_byte - got.start);
    if (from_cache || raw_len == 0) {
      state.remember(a.origin, NAN, latency, wall);
    } else {
      sakura::BandwidthMonitor one(1);
      one.record(-1, raw_len, got.start, got.first_byte, got.end);
      state.remember(a.origin, one.estimate_bps(), latency, wall);
    }
  }
  const std::string weights = manifest.value("model", json::object()).value("weights_sha256", "");
  if (!weights.empty() && weights != bundle.doc.value("weights_sha256", "")) {
    throw InputError("the device bundle of " + a.template_id + " is refused: it was made for model "
                     "weights " + bundle.doc.value("weights_sha256", "?").substr(0, 12) +
                     ", the pack for " + weights.substr(0, 12) + " (rebuild them together)");
  }
  const json& geo = manifest.at("geometry");
  if (geo.at("blocks_per_shard").get<int>() != bps || geo.at("steps").get<int>() != tv.steps ||
      geo.at("tokens").get<std::int64_t>() != U || geo.at("channels").get<std::int64_t>() != C) {
    throw InputError("the manifest's geometry " + geo.dump() + " is not the bundle's (" +
                     std::to_string(bps) + " blocks per shard, " + std::to_string(U) +
                     " cached tokens, " + std::to_string(C) + " channels)");
  }

  // the shard table
  const std::string pack_file = manifest.at("pack_file");
  if (pack_file.find('/') != std::string::npos) throw InputError("manifest: pack_file is not a pack name");
  std::string pack_url = sakura::edge::origin_url(
      a.origin, "templates/" + a.template_id + "/" + codec + "/" + pack_file);
  if (!a.pack_origin.empty()) {  // the same path on another listener (edge/runner.py)
    pack_url = a.pack_origin + pack_url.substr(sakura::edge::origin_of(a.origin).size());
  }
  sakura::StreamSpec spec;
  const json& units = manifest.value("units", json::array());
  const std::int64_t pack_bytes = manifest.value("pack_bytes", static_cast<std::int64_t>(-1));
  std::vector<json> shard_docs(manifest.at("shards").begin(), manifest.at("shards").end());
  std::sort(shard_docs.begin(), shard_docs.end(),
            [](const json& x, const json& y) { return x.at("index").get<int>() < y.at("index").get<int>(); });
  std::map<std::pair<int, int>, json> params;
  for (const auto& s : shard_docs) {
    sakura::ShardRecord r;
    r.shard = static_cast<int>(spec.shards.size());
    if (s.at("index").get<int>() != r.shard) throw InputError("the manifest's shards are not numbered 0..n-1");
    r.step = s.at("step");
    r.blocks = s.at("blocks").get<std::vector<int>>();
    std::map<int, sakura::ConfigSource> by_id;
    for (const auto& c : s.at("configs")) {
      sakura::ConfigSource src;
      src.request.config = c.at("id");
      src.request.url = pack_url;
      const auto& ranges = c.at("ranges");
      if (ranges.size() != 1) throw InputError("a configuration of the manifest is not one byte range");
      src.request.offset = ranges[0][0];
      src.request.length = ranges[0][1];
      src.request.pack_bytes = pack_bytes;
      for (const auto& u : c.value("units", json::array())) {
        const auto& row = units.at(u.get<std::size_t>());
        src.request.units.push_back({row.at(1).get<std::int64_t>(), sha_bytes(row.at(2))});
      }
      const json p = c.value("params", json::object());
      if (p.contains("ranks")) src.ranks = p["ranks"].get<std::vector<int>>();
      if (p.contains("bits") && p["bits"].is_number_integer()) src.bits = p["bits"].get<int>();
      params[{r.shard, src.request.config}] = p;
      by_id[src.request.config] = std::move(src);
    }
    spec.configs.push_back(std::move(by_id));
    spec.shards.push_back(std::move(r));
  }
  const int shards = static_cast<int>(spec.shards.size());
  std::vector<double> exec_s;
  for (const auto& s : spec.shards) {
    exec_s.push_back(group_s.at(static_cast<std::size_t>(s.blocks.at(0) / std::max(1, bps))));
  }
  spec.http = retry;
  spec.http.max_connections = 6;
  // HTTP/2: one connection carries every range (a hedge opens its own), as edge/runner.py
  spec.http.http_version = a.http_version == "2" ? 2 : 1;
  spec.http.warm_connections = spec.http.http_version == 2 ? 1 : 5;
  spec.http.headers = headers;
  spec.http.display_url = a.origin;
  const json codec_options = manifest.value("codec_options", json::object());
  spec.decode = codec == "fp16" ? sakura::DecodeKind::Fp16
                : codec == "intq" ? sakura::DecodeKind::IntQ : sakura::DecodeKind::LowRank;
  if (!baseline) spec.rope = rope_table(codec_options, U, C);
  spec.channels = C;
  if (codec == "intq") {  // codec/intq.py: channels per (scale, minimum) group, default 32
    const json g = codec_options.value("group", json(32));
    if (!g.is_number_integer() || g.get<int>() < 1) throw InputError("manifest: intq group is not a positive integer");
    spec.intq_group = g.get<int>();
  }
  spec.matrix_floats = U * C;
  spec.options.max_ahead = 4;
  spec.options.max_ready = 2;
  spec.options.max_inflight = 6;
  spec.options.lookahead_rtts = 3.0;
  spec.options.max_ahead_cap = 16;
  spec.options.refine = true;
  // the stale plan (edge/stale_plan.py): SAKURA's policies, with the local fallback
  const bool plans_stale = a.policy != "fp16" && a.policy != "intq" &&
                           a.policy != "sakura-fixed-config";
  spec.options.stale_plan_age = full_graphs && plans_stale ? sakura::kStaleMaxAge : 0;
  spec.reconstruct = a.reconstruct;
  spec.origin = origin;

  // monitor, allocator, progress
  const double init_prior = prior ? *prior : NAN;
  auto monitor = std::make_shared<sakura::BandwidthMonitor>(5, init_prior);
  monitor->record(-1, from_cache ? 0 : raw_len, got.start, got.first_byte, got.end);
  std::shared_ptr<sakura::Allocator> allocator;
  std::vector<int> chosen;
  if (a.policy == "sakura-fixed-config") {
    const double rate = std::isfinite(a.budget_rate_bps) ? a.budget_rate_bps : monitor->estimate_bps();
    chosen = fixed_config(manifest, exec_s, rate, 0.8);
    allocator = std::make_shared<sakura::FixedAllocator>(chosen);
  } else if (a.policy == "sakura-fixed-bits") {  // adaptive rank, one bit width (the plan)
    const int bits = a.bits;
    const auto tables = option_tables(shard_docs, [bits](const Option& o) {
      return o.params.contains("bits") && o.params["bits"].is_number_integer() &&
             o.params["bits"].get<int>() == bits && uniform(o.params);
    });
    allocator = adaptive(tables, exec_s, 0.8, true);
  } else {  // fp16 (its one configuration) and intq: the greedy rule of the baselines
    auto tables = option_tables(shard_docs);
    if (a.policy == "sakura-floor") {  // edge/allocator.py _floored, local_share_floor_db
      const json local = manifest.value("local_psnr_db", json());
      if (local.is_number()) {
        const double n = static_cast<double>(std::max<std::size_t>(1, tables.size()));
        tables = floored(tables, local.get<double>() + 10.0 * std::log10(n));
      } else {  // Policy.missing: a pack built before the field
        std::fprintf(stderr,
                     "sakura-edge: warning: the %s pack has no local_psnr_db (built before it "
                     "was measured): sakura-floor plans as sakura; rebuild the packs with "
                     "`sakura build` to use it\n",
                     codec.c_str());
      }
    }
    const double safety = a.policy == "sakura-optimistic" ? 0.8 * 1.25 : 0.8;
    const bool plan = a.policy == "sakura" || a.policy == "svd" ||
                      a.policy == "sakura-optimistic" || a.policy == "sakura-floor";
    allocator = adaptive(tables, exec_s, safety, plan);
  }
  double exec_total = 0;
  for (double e : exec_s) exec_total += std::max(0.0, e);
  const double allowance = kStartupFraction * exec_total;
  const double first_byte_s = std::max(0.0, got.first_byte - got.start);
  sakura::LocalSteps local;
  if (full_graphs) {
    local.graphs = full_graphs.get();
    local.inputs = full_inputs.get();
    local.masked = tv.masked;
    const double cached_step = exec_total / std::max(1, tv.steps);
    local.step_s = std::max(kStallFloorS, local_step ? *local_step
                                                     : cached_step * tv.num_tokens() / tv.masked.size());
    local.stale_max_age = sakura::kStaleMaxAge;
    if (template_graphs) {
      local.recompute = template_graphs.get();
      local.recompute_inputs = template_inputs.get();
      local.unmasked = tv.unmasked;
    }
  }
  const double loop_start = sakura::now_s();
  auto progress = sakura::ExecutionProgress::with_allowance(exec_s, origin, allowance,
                                                            sakura::now_s() + first_byte_s);
  auto feed = std::make_shared<sakura::StreamFeed>(std::move(spec), allocator, monitor, progress);
  std::atomic<bool> cancel{false};
  std::vector<float> x;
  try {
    x = sakura::run_edit(*graphs, inputs, feed.get(), cancel, full_graphs ? &local : nullptr);
  } catch (const sakura::FetchError& e) {
    if (e.kind() == "unreachable") throw sakura::edge::Unreachable(e.what());
    throw InputError(std::string(e.kind()) + ": " + e.what());
  }
  const double latency = sakura::now_s() - origin;
  const auto records = feed->records();
  state.remember(a.origin, monitor->estimate_bps(),
                 monitor->latency_s() > 0 ? monitor->latency_s() : NAN, sakura::edge::wall_s());
  state.save();

  // the image
  const auto image = sakura::edge::compose(tv, x, false);
  sakura::edge::write_png(a.out, sakura::edge::to_rgb8(image, tv.size), tv.size, tv.size);
  if (!a.float_out.empty()) sakura::edge::write_npy(a.float_out, image, {3, tv.size, tv.size});
  std::int64_t bytes = 0;
  int stalls = 0, local_steps = 0;
  json recs = json::array();
  if (chosen.empty()) {
    for (const auto& r : records) chosen.push_back(r.config);
  }
  for (const auto& r : records) {
    bytes += r.bytes;
    stalls += &r != &records.front() && r.stall_s > kStallEpsS ? 1 : 0;
    local_steps += r.local ? 1 : 0;
    recs.push_back(record_json(r, r.config >= 0 ? params[{r.shard, r.config}] : json::object()));
  }
  if (!a.timeline.empty()) {
    const json doc = {{"runtime", "sakura-edge"}, {"origin", a.origin}, {"template", a.template_id},
                      {"policy", a.policy}, {"codec", codec}, {"seed", a.seed},
                      {"precision", a.precision},
                      {"latency_s", latency}, {"bytes", bytes}, {"manifest_bytes", raw_len},
                      {"manifest_cached", from_cache}, {"startup_allowance_s", allowance},
                      {"loop_start_s", loop_start - origin}, {"predicted_exec_s", exec_s},
                      {"configs", chosen}, {"shards", shards}, {"setup_s", origin - t_begin},
                      {"timeline", recs}};
    std::ofstream f(a.timeline);
    f << doc.dump(1) << "\n";
    if (!f) throw std::runtime_error("cannot write " + a.timeline);
  }
  std::printf("sakura-edge: %s %s seed %llu: %.3f s, %lld bytes, %d shards, %d stalls, "
              "%d local -> %s\n",
              a.template_id.c_str(), a.policy.c_str(), static_cast<unsigned long long>(a.seed),
              latency, static_cast<long long>(bytes), shards, stalls, local_steps, a.out.c_str());
  return 0;
}

void error_line(const std::string& what) {
  std::string line = what;
  std::replace(line.begin(), line.end(), '\n', ' ');
  std::fprintf(stderr, "sakura-edge: error: %s\n", line.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse(argc, argv);
  } catch (const UsageError& e) {
    std::fputs(kUsage, stderr);
    error_line(e.what());
    return 2;
  }
  try {
    return run(args);
  } catch (const InputError& e) {
    error_line(e.what());
  } catch (const sakura::edge::Unreachable& e) {
    error_line(e.what());
  } catch (const sakura::TokenizerError& e) {
    error_line(std::string("the prompt: ") + e.what());
  } catch (const sakura::FetchError& e) {
    error_line(e.what());
  } catch (const json::exception& e) {
    error_line(std::string("the origin's documents are not what this binary reads: ") + e.what());
  } catch (const std::exception& e) {
    error_line(e.what());
  }
  return 1;
}
