// `sakura-edge`'s requests for whole documents of an origin (catalog, manifest, bundle files)
// with libcurl, and the device state it keeps between runs: the manifests with their ETags
// (revalidated with If-None-Match) and the per-origin rate memory of edge/state.py.
//
// The state is the Python runtime's own layout (edge/runtime.py save_state): `state.json`
// ({"profiles", "local_step_s", "rates", "manifests"}) and `manifests/<template>.<codec>.json`,
// so the binary and `sakura edit` share one device state; keys it does not use are kept.
#pragma once

#include <nlohmann/json.hpp>

#include "sakura/http.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace sakura::edge {

// The origin could not be reached (exit 1, "cannot reach ...").
class Unreachable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};


struct Got {
  long status = 0;
  std::string body;
  std::string etag;
  double start = 0, first_byte = 0, end = 0;  // steady clock (sakura::now_s)
};

// `base` + "/" + percent-encoded `key` (edge/origins.py HttpOrigin.url).
std::string origin_url(const std::string& base, const std::string& key);
// scheme://host:port, lower-cased (edge/state.py origin_of).
std::string origin_of(const std::string& url);

// One GET (with If-None-Match when `etag` is given); connection errors, 5xx, 408 and 429
// are retried with backoff for window_s, other answers are returned. Throws Unreachable.
Got http_get(const std::string& url, const std::vector<std::string>& headers,
             const std::string& etag, const sakura::HttpOptions& retry);

// The rate memory (edge/state.py RateMemory, FLOOR 0.2, HALF_LIFE_S 30).
double decayed(double rate_bps, double age_s);

class DeviceState {
 public:
  explicit DeviceState(std::string dir);  // "" : no state
  bool enabled() const { return !dir_.empty(); }

  std::optional<double> prior_bps(const std::string& server, double now_wall) const;
  void remember(const std::string& server, double rate_bps, double latency_s,
                double now_wall);

  struct Manifest {
    std::string etag;
    nlohmann::json doc;
    std::int64_t size = 0;
  };
  std::optional<Manifest> manifest(const std::string& tmpl, const std::string& codec) const;
  void keep_manifest(const std::string& tmpl, const std::string& codec, Manifest m);

  std::optional<std::vector<double>> profile(const std::string& key) const;
  void keep_profile(const std::string& key, const std::vector<double>& block_s);
  std::optional<double> local_step_s(const std::string& key) const;
  void keep_local_step_s(const std::string& key, double s);

  void save();  // atomically (rename); a damaged state was dropped on load

 private:
  std::string dir_;
  nlohmann::json doc_;
  std::vector<std::tuple<std::string, std::string, Manifest>> dirty_;  // template, codec
};

// wall clock (time.time())
double wall_s();

}  // namespace sakura::edge
