#include "edge/origin.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "sakura/http.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace sakura::edge {

double wall_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string origin_url(const std::string& base, const std::string& key) {
  // urllib.parse.quote(key): letters, digits, "_.-~" and "/" stay
  std::string out = base;
  while (!out.empty() && out.back() == '/') out.pop_back();
  out.push_back('/');
  static const char* hex = "0123456789ABCDEF";
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '_' || c == '.' || c == '-' || c == '~' || c == '/') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(hex[c >> 4]);
      out.push_back(hex[c & 15]);
    }
  }
  return out;
}

std::string origin_of(const std::string& url) {
  const auto scheme_end = url.find("://");
  std::string out;
  if (scheme_end == std::string::npos) {
    out = url;
  } else {
    const auto rest = url.find_first_of("/?#", scheme_end + 3);
    out = url.substr(0, rest);
  }
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

namespace {

struct Transfer {
  std::string body, etag;
  double first_byte = 0;
};

std::size_t on_body(char* data, std::size_t size, std::size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  if (t->first_byte == 0) t->first_byte = sakura::now_s();
  t->body.append(data, size * n);
  return size * n;
}

std::size_t on_header(char* data, std::size_t size, std::size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  std::string line(data, size * n);
  if (t->first_byte == 0) t->first_byte = sakura::now_s();
  std::string lower = line.substr(0, 5);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "etag:") {
    std::string v = line.substr(5);
    while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.erase(v.begin());
    while (!v.empty() && (v.back() == '\r' || v.back() == '\n' || v.back() == ' ')) v.pop_back();
    t->etag = v;
  }
  return size * n;
}

}  // namespace

Got http_get(const std::string& url, const std::vector<std::string>& headers,
             const std::string& etag, const sakura::HttpOptions& retry) {
  static const bool initialised = [] {
    curl_global_init(CURL_GLOBAL_DEFAULT);
    return true;
  }();
  (void)initialised;
  std::mt19937_64 rng(std::random_device{}());
  const double began = sakura::now_s();
  int failures = 0;
  std::string last;
  for (;;) {
    CURL* curl = curl_easy_init();
    if (!curl) throw std::runtime_error("libcurl could not start");
    Transfer t;
    curl_slist* list = nullptr;
    for (const auto& h : headers) list = curl_slist_append(list, h.c_str());
    if (!etag.empty()) list = curl_slist_append(list, ("If-None-Match: " + etag).c_str());
    curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, list);
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &t);
    curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(curl, CURLOPT_HEADERDATA, &t);
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS,
                     static_cast<long>(retry.connect_timeout_s * 1000));
    // a response silent for read_timeout_s is a failure (below 1 byte/s for that long)
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME,
                     std::max(1L, static_cast<long>(retry.read_timeout_s)));
    curl_easy_setopt(curl, CURLOPT_ACCEPT_ENCODING, "");
    Got got;
    got.start = sakura::now_s();
    const CURLcode rc = curl_easy_perform(curl);
    got.end = sakura::now_s();
    curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &got.status);
    curl_slist_free_all(list);
    curl_easy_cleanup(curl);
    bool again = false;
    if (rc != CURLE_OK) {
      last = curl_easy_strerror(rc);
      again = true;
    } else if (got.status >= 500 || got.status == 408 || got.status == 429) {
      // the origin's permanent codes (edge/retry.py PERMANENT_CODES) are answers, not outages
      bool permanent = false;
      try {
        const auto doc = nlohmann::json::parse(t.body);
        const std::string code = doc.is_object() ? doc.value("code", "") : "";
        permanent = code == "pack_damaged" || code == "publish_broken";
      } catch (const std::exception&) {
      }
      last = "HTTP " + std::to_string(got.status);
      again = !permanent;
    }
    if (!again) {
      got.body = std::move(t.body);
      got.etag = std::move(t.etag);
      got.first_byte = t.first_byte > 0 ? t.first_byte : got.end;
      return got;
    }
    ++failures;
    const double backoff = std::min(retry.backoff_max_s,
                                    retry.backoff_s * std::pow(2.0, failures - 1)) *
                           std::uniform_real_distribution<double>(1.0 - retry.jitter, 1.0)(rng);
    if (sakura::now_s() + backoff - began > retry.window_s) {
      throw Unreachable("cannot reach " + origin_of(url) + ": " + last + " (" +
                        std::to_string(failures) + " attempts over " +
                        std::to_string(static_cast<int>(std::lround(sakura::now_s() - began))) +
                        " s)");
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(backoff));
  }
}

double decayed(double rate_bps, double age_s) {
  constexpr double kFloor = 0.2, kHalfLife = 30.0;
  if (age_s < 0) age_s = INFINITY;
  return rate_bps * std::pow(kFloor, 1.0 - std::pow(0.5, age_s / kHalfLife));
}

// ----------------------------------------------------------------------------- state
DeviceState::DeviceState(std::string dir) : dir_(std::move(dir)) {
  doc_ = json::object();
  if (dir_.empty()) return;
  try {
    std::ifstream f(fs::path(dir_) / "state.json");
    if (f) doc_ = json::parse(f);
    if (!doc_.is_object()) doc_ = json::object();
  } catch (const std::exception&) {
    doc_ = json::object();  // a damaged state is dropped, never trusted
  }
}

std::optional<double> DeviceState::prior_bps(const std::string& server, double now) const {
  try {
    const auto& e = doc_.at("rates").at(origin_of(server));
    const double rate = e.at("rate_bps").get<double>(), at = e.at("at").get<double>();
    if (!(std::isfinite(rate) && rate > 0 && std::isfinite(at))) return std::nullopt;
    return decayed(rate, now - at);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

void DeviceState::remember(const std::string& server, double rate_bps, double latency_s,
                           double now) {
  const std::string key = origin_of(server);
  if (!doc_.contains("rates") || !doc_["rates"].is_object()) doc_["rates"] = json::object();
  auto& rates = doc_["rates"];
  const bool lat = std::isfinite(latency_s);
  if (!(std::isfinite(rate_bps) && rate_bps > 0)) {  // nothing learnt but the latency
    if (lat && rates.contains(key) && rates[key].is_object()) rates[key]["latency_s"] = latency_s;
    return;
  }
  json old_lat = nullptr;
  if (rates.contains(key) && rates[key].is_object() && rates[key].contains("latency_s")) {
    old_lat = rates[key]["latency_s"];
  }
  rates[key] = {{"rate_bps", rate_bps}, {"at", now}, {"latency_s", lat ? json(latency_s) : old_lat}};
}

std::optional<DeviceState::Manifest> DeviceState::manifest(const std::string& tmpl,
                                                           const std::string& codec) const {
  if (dir_.empty()) return std::nullopt;
  for (const auto& [tt, cc, m] : dirty_) {
    if (tt == tmpl && cc == codec) return m;
  }
  try {
    const std::string name = tmpl + "." + codec + ".json";
    const auto& names = doc_.at("manifests");
    if (std::find(names.begin(), names.end(), json(name)) == names.end()) return std::nullopt;
    std::ifstream f(fs::path(dir_) / "manifests" / name);
    const json entry = json::parse(f);
    if (entry.at("template") != tmpl || entry.at("codec") != codec) return std::nullopt;
    return Manifest{entry.at("etag").get<std::string>(), entry.at("manifest"),
                    entry.at("size").get<std::int64_t>()};
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

void DeviceState::keep_manifest(const std::string& tmpl, const std::string& codec, Manifest m) {
  for (auto& [tt, cc, held] : dirty_) {
    if (tt == tmpl && cc == codec) {
      held = std::move(m);
      return;
    }
  }
  dirty_.emplace_back(tmpl, codec, std::move(m));
}

std::optional<std::vector<double>> DeviceState::profile(const std::string& key) const {
  try {
    return doc_.at("profiles").at(key).get<std::vector<double>>();
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

void DeviceState::keep_profile(const std::string& key, const std::vector<double>& block_s) {
  if (!doc_.contains("profiles") || !doc_["profiles"].is_object()) doc_["profiles"] = json::object();
  doc_["profiles"][key] = block_s;
}

std::optional<double> DeviceState::local_step_s(const std::string& key) const {
  try {
    return doc_.at("local_step_s").at(key).get<double>();
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

void DeviceState::keep_local_step_s(const std::string& key, double s) {
  if (!doc_.contains("local_step_s") || !doc_["local_step_s"].is_object()) {
    doc_["local_step_s"] = json::object();
  }
  doc_["local_step_s"][key] = s;
}

namespace {
void write_atomic(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary);
    f << text;
    f.flush();
    if (!f) throw std::runtime_error("cannot write " + tmp.string());
  }
  fs::rename(tmp, path);
}
}  // namespace

void DeviceState::save() {
  if (dir_.empty()) return;
  const fs::path folder = fs::path(dir_) / "manifests";
  fs::create_directories(folder);
  if (!doc_.contains("manifests") || !doc_["manifests"].is_array()) doc_["manifests"] = json::array();
  for (auto& [tmpl, codec, m] : dirty_) {
    const std::string name = tmpl + "." + codec + ".json";
    const json entry = {{"template", tmpl}, {"codec", codec}, {"etag", m.etag},
                        {"size", m.size}, {"manifest", m.doc}};
    write_atomic(folder / name, entry.dump());
    auto& names = doc_["manifests"];
    if (std::find(names.begin(), names.end(), json(name)) == names.end()) names.push_back(name);
  }
  dirty_.clear();
  for (const char* k : {"profiles", "local_step_s", "rates"}) {
    if (!doc_.contains(k)) doc_[k] = json::object();
  }
  write_atomic(fs::path(dir_) / "state.json", doc_.dump(1));
}

}  // namespace sakura::edge
