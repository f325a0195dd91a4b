#include "sakura/http.hpp"

#include <curl/curl.h>
#include <openssl/evp.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <list>
#include <mutex>
#include <random>
#include <sstream>

namespace sakura {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::array<std::uint8_t, 32> sha256(const std::uint8_t* data, std::size_t size) {
  std::array<std::uint8_t, 32> out{};
  unsigned int len = 0;
  if (EVP_Digest(data, size, out.data(), &len, EVP_sha256(), nullptr) != 1 || len != 32) {
    throw std::runtime_error("OpenSSL SHA-256 failed");
  }
  return out;
}

namespace {

constexpr std::size_t kMaxErrorBody = 64 * 1024;

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

bool retry_status(long code) {
  return code == 408 || code == 429 || code == 500 || code == 502 || code == 503 || code == 504;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

// The string value of `key` in a JSON error body ({"error": "...", "code": "..."}), or "".
std::string json_string(const std::string& body, const std::string& key) {
  auto k = body.find("\"" + key + "\"");
  if (k == std::string::npos) return "";
  k = body.find(':', k);
  if (k == std::string::npos) return "";
  k = body.find('"', k);
  if (k == std::string::npos) return "";
  std::string out;
  for (std::size_t i = k + 1; i < body.size(); ++i) {
    const char c = body[i];
    if (c == '"') return out;
    if (c == '\\' && i + 1 < body.size()) {
      const char n = body[++i];
      out += n == 'n' ? '\n' : n == 't' ? '\t' : n;
    } else {
      out += c;
    }
  }
  return "";
}

std::string json_error(const std::string& body) { return json_string(body, "error"); }

// Error codes of `sakura serve` (cloud/errors.py, ErrorCode) that no retry of the same
// request changes: reported at once with the origin's reason, even on a 500.
bool permanent_code(const std::string& code) {
  return code == "pack_damaged" || code == "publish_broken";
}

// The total of a "bytes a-b/total" Content-Range, -1 when absent or "*".
std::int64_t content_range_total(const std::string& cr) {
  const auto slash = cr.rfind('/');
  if (slash == std::string::npos || slash + 1 >= cr.size()) return -1;
  std::int64_t v = 0;
  for (std::size_t i = slash + 1; i < cr.size(); ++i) {
    if (cr[i] < '0' || cr[i] > '9') return -1;
    v = v * 10 + (cr[i] - '0');
  }
  return v;
}

}  // namespace

struct Transfer {
  FetchRequest req;
  std::vector<std::uint8_t> buf;
  std::string etag;
  double start = -1, first_byte = -1;
  int attempts = 0, resumes = 0, refetches = 0, failures = 0;
  double retry_at = 0;
  double last_progress = 0;  // when the transfer last received bytes (or started)
  double* link_last_byte = nullptr;  // the receiver's last body byte of any transfer
  double attempt_start = 0;  // when the attempt in flight was sent
  double connect_s = 0;      // the first attempt's time to open a new connection (0: reused)
  std::string last_error;
  // units verified as they arrive: the first verified_units units (verified_bytes bytes)
  std::int64_t verified_bytes = 0;
  std::size_t verified_units = 0;
  bool damaged = false;       // a unit failed its checksum (damage says which)
  bool use_fallback = false;  // ... and a verified fallback ends the transfer
  std::string damage;
  int hedges = 0, stalled_restarts = 0;  // restarts on a fresh connection (in a row)
  bool fresh = false;         // the next attempt opens a new connection
  // the attempt in flight
  CURL* easy = nullptr;
  curl_slist* headers = nullptr;
  bool body_started = false;   // the attempt's first body byte has been seen
  bool progressed = false;     // the attempt added bytes to buf
  std::int64_t resume_from = 0;  // body bytes kept from earlier attempts
  std::string content_range, attempt_etag, error_body, abort_reason;
  bool fatal = false;
  char errbuf[CURL_ERROR_SIZE] = {0};
};

namespace {

// HTTP/2 over cleartext with prior knowledge (h2c without an Upgrade round trip); curl built
// without nghttp2 refuses it, which is reported once instead of silently speaking HTTP/1.1.
void set_http2(CURL* e) {
  if (curl_easy_setopt(e, CURLOPT_HTTP_VERSION,
                       static_cast<long>(CURL_HTTP_VERSION_2_PRIOR_KNOWLEDGE)) != CURLE_OK) {
    throw FetchError("http", "HTTP/2 was asked for, but this libcurl has no HTTP/2 "
                             "(nghttp2) support");
  }
}

// The body starts over: nothing received, nothing verified.
void reset_body(Transfer& t) {
  t.buf.clear();
  t.verified_bytes = 0;
  t.verified_units = 0;
  t.damaged = t.use_fallback = false;
  t.damage.clear();
}

// Verifies the units that have arrived whole since the last call; a bad one marks the
// transfer damaged (its offsets are the pack's, as the manifest gives them).
void advance_verify(Transfer& t) {
  const std::int64_t base = std::max<std::int64_t>(0, t.req.offset);
  while (!t.damaged && t.verified_units < t.req.units.size()) {
    const auto& u = t.req.units[t.verified_units];
    if (t.verified_bytes + u.length > static_cast<std::int64_t>(t.buf.size())) return;
    if (sha256(t.buf.data() + t.verified_bytes, static_cast<std::size_t>(u.length)) !=
        u.sha256) {
      t.damaged = true;
      t.damage = "unit " + std::to_string(t.verified_units) + " of shard " +
                 std::to_string(t.req.shard) + " (pack bytes " +
                 std::to_string(base + t.verified_bytes) + ".." +
                 std::to_string(base + t.verified_bytes + u.length) +
                 ") fails its checksum";
      return;
    }
    t.verified_bytes += u.length;
    t.verified_units += 1;
  }
}

// The longest fallback whose bytes have all been verified (index into fallbacks), or -1.
int best_fallback(const Transfer& t) {
  if (t.req.units.empty()) return -1;
  for (std::size_t i = 0; i < t.req.fallbacks.size(); ++i) {
    if (t.req.fallbacks[i].second <= t.verified_bytes) return static_cast<int>(i);
  }
  return -1;
}

// The transfer's result: the whole body (fallback < 0) or the first bytes of a fallback.
void fill_done(Transfer& t, int fallback, FetchDone* done) {
  const double end = now_s();
  done->shard = t.req.shard;
  done->requested = t.req.config;
  if (fallback < 0) {
    done->config = t.req.config;
    done->data = std::move(t.buf);
  } else {
    const auto& [config, length] = t.req.fallbacks[static_cast<std::size_t>(fallback)];
    done->config = config;
    done->data.assign(t.buf.begin(), t.buf.begin() + length);
  }
  done->start = t.start;
  done->first_byte = t.first_byte >= 0 ? t.first_byte : end;
  done->end = end;
  done->attempts = t.attempts;
  done->resumes = t.resumes;
  done->refetches = t.refetches;
  done->hedges = t.hedges;
  done->damage = t.damage;
  done->connect_s = std::max(0.0, t.connect_s);
}

}  // namespace

struct HttpReceiver::Impl {
  HttpOptions opts;
  CURLM* multi = nullptr;
  std::list<Transfer> transfers;  // active (in flight or waiting to retry)
  double last_byte = 0;           // when any transfer last received a body byte
  double busy_since = 0;          // when transfers last became non-empty
  std::vector<CURL*> warming;     // HEAD requests opening connections (warm())
  curl_slist* warm_headers = nullptr;
  std::vector<RequestLogEntry> log;
  std::mutex log_mu;
  std::mt19937_64 rng{std::random_device{}()};  // the backoff's jitter
  int retries_said = 0;  // the highest retry number told to on_wait (one line per retry)

  std::string unreachable(const Transfer& t) const {
    std::ostringstream os;
    os << "cannot reach the SAKURA server at " << opts.display_url << " (" << t.req.url
       << "): " << t.last_error << " (gave up after " << t.failures << " attempts and "
       << static_cast<int>(now_s() - t.last_progress) << " s without progress); check that the server is running (`sakura serve "
          "DIR`) and the URL and network are right";
    return os.str();
  }

  static std::size_t on_header(char* data, std::size_t size, std::size_t n, void* user) {
    auto* t = static_cast<Transfer*>(user);
    const std::string line(data, size * n);
    const auto colon = line.find(':');
    if (line.rfind("HTTP/", 0) == 0) {  // a new response (e.g. after a 100): reset
      t->content_range.clear();
      t->attempt_etag.clear();
    } else if (colon != std::string::npos) {
      const std::string name = lower(trim(line.substr(0, colon)));
      const std::string value = trim(line.substr(colon + 1));
      if (name == "content-range") t->content_range = value;
      if (name == "etag") t->attempt_etag = value;
    }
    return size * n;
  }

  static std::size_t on_body(char* data, std::size_t size, std::size_t n, void* user) {
    auto* t = static_cast<Transfer*>(user);
    const std::size_t bytes = size * n;
    long code = 0;
    curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &code);
    if (code < 200 || code >= 300) {
      if (t->error_body.size() < kMaxErrorBody) t->error_body.append(data, bytes);
      return bytes;
    }
    if (!t->body_started) {
      t->body_started = true;
      if (code == 206) {
        const std::int64_t from = (t->req.offset >= 0 ? t->req.offset : 0) + t->resume_from;
        const std::string want = "bytes " + std::to_string(from) + "-";
        const std::int64_t total = content_range_total(t->content_range);
        if (t->req.pack_bytes >= 0 && total >= 0 && total != t->req.pack_bytes) {
          t->fatal = true;  // the same words as the Python client (edge/client.py)
          t->abort_reason = t->req.url + " has " + std::to_string(total) +
                            " bytes, its manifest says " + std::to_string(t->req.pack_bytes) +
                            ": the published pack is truncated or was replaced";
          return 0;
        }
        if (t->content_range.rfind(want, 0) != 0) {
          t->abort_reason = "partial content '" + t->content_range + "' does not resume at " +
                            std::to_string(from);
          reset_body(*t);
          return 0;
        }
      } else if (code == 200) {
        if (t->req.offset >= 0) {
          t->fatal = true;
          t->abort_reason =
              t->resume_from > 0 && !t->etag.empty()
                  ? t->req.url + ": the pack changed on the origin during the edit (its "
                                 "ETag no longer matches " + t->etag + ")"
                  : t->req.url + ": the origin ignored the Range request (HTTP 200 with "
                                 "the whole object); serve the pack from an origin that "
                                 "supports single-range GETs";
          return 0;
        }
        reset_body(*t);
      }
      if (t->first_byte < 0) {
        t->first_byte = now_s();
        long connects = 0;
        curl_off_t connect_us = 0;
        if (curl_easy_getinfo(t->easy, CURLINFO_NUM_CONNECTS, &connects) == CURLE_OK &&
            connects > 0 &&
            curl_easy_getinfo(t->easy, CURLINFO_CONNECT_TIME_T, &connect_us) == CURLE_OK) {
          t->connect_s = std::min(t->first_byte - t->start, 1e-6 * static_cast<double>(connect_us));
        }
      }
    }
    if (t->buf.size() + bytes > static_cast<std::size_t>(t->req.length)) {
      t->abort_reason = "the body is longer than the " + std::to_string(t->req.length) +
                        " bytes of the configuration";
      return 0;
    }
    t->buf.insert(t->buf.end(), reinterpret_cast<std::uint8_t*>(data),
                  reinterpret_cast<std::uint8_t*>(data) + bytes);
    t->progressed = true;
    t->last_progress = now_s();
    if (t->link_last_byte != nullptr) *t->link_last_byte = t->last_progress;
    t->stalled_restarts = 0;
    advance_verify(*t);
    if (t->damaged) {  // the rest of this body cannot be used: stop it now
      t->use_fallback = best_fallback(*t) >= 0;
      t->abort_reason = t->damage;
      return 0;
    }
    return bytes;
  }

  void begin_attempt(Transfer& t) {
    t.attempts += 1;
    t.body_started = t.progressed = false;
    t.content_range.clear();
    t.attempt_etag.clear();
    t.error_body.clear();
    t.abort_reason.clear();
    t.errbuf[0] = 0;
    const bool ranged = t.req.offset >= 0;
    std::vector<std::string> extra;
    if (!t.buf.empty() && (ranged || !t.etag.empty())) {
      t.resumes += 1;
      t.resume_from = static_cast<std::int64_t>(t.buf.size());
    } else {
      reset_body(t);
      t.resume_from = 0;
    }
    if (ranged) {
      const std::int64_t a = t.req.offset + t.resume_from;
      const std::int64_t b = t.req.offset + t.req.length - 1;
      extra.push_back("Range: bytes=" + std::to_string(a) + "-" + std::to_string(b));
    } else if (t.resume_from > 0) {
      extra.push_back("Range: bytes=" + std::to_string(t.resume_from) + "-");
    }
    if (t.resume_from > 0 && !t.etag.empty()) extra.push_back("If-Range: " + t.etag);

    CURL* e = curl_easy_init();
    if (e == nullptr) throw std::runtime_error("curl_easy_init failed");
    t.easy = e;
    t.attempt_start = now_s();
    // a hedge: the stalled attempt's connection was closed with it (end_attempt), so curl
    // takes an idle kept-alive connection of the pool (warm()) and opens a new one only
    // when none is idle; forcing a fresh connection cost a handshake through the congested
    // downlink, and a SYN-ACK the queue dropped cost the initial SYN timeout, 1 s
    // (docs/RESULTS.md, the tail bench), unless warm_hedges is off
    // With HTTP/2, ending the stalled attempt resets its stream only: its connection stays
    // open with the other transfers' streams, and curl would put the hedge on it again, so
    // a hedge always opens a connection of its own; the other transfers wait for the first
    // connection to say it multiplexes (PIPEWAIT) and share it.
    const bool h2 = opts.http_version == 2;
    if (h2) set_http2(e);
    if (t.fresh) {
      if (h2 || !opts.warm_hedges) curl_easy_setopt(e, CURLOPT_FRESH_CONNECT, 1L);
      t.fresh = false;
    } else if (h2) {
      curl_easy_setopt(e, CURLOPT_PIPEWAIT, 1L);
    }
    curl_slist* headers = nullptr;
    std::vector<std::string> sent;
    for (const auto& h : opts.headers) {
      headers = curl_slist_append(headers, h.c_str());
      sent.push_back(h);
    }
    for (const auto& h : extra) {
      headers = curl_slist_append(headers, h.c_str());
      sent.push_back(h);
    }
    // no "Expect:" or "Accept: */*" surprises beyond what is listed
    headers = curl_slist_append(headers, "Accept:");
    t.headers = headers;
    curl_easy_setopt(e, CURLOPT_URL, t.req.url.c_str());
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, &Impl::on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, &t);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, &Impl::on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &t);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, t.errbuf);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_PROXY, "");  // like the Python client: no proxy from the env
    curl_easy_setopt(e, CURLOPT_USERAGENT, "sakura-native");
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS,
                     static_cast<long>(std::ceil(opts.connect_timeout_s * 1000)));
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME,
                     std::max(1L, static_cast<long>(std::ceil(opts.read_timeout_s))));
    curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(e, CURLOPT_PRIVATE, &t);
    {
      std::lock_guard<std::mutex> lock(log_mu);
      log.push_back({"GET", t.req.url, sent, now_s()});
    }
    if (curl_multi_add_handle(multi, e) != CURLM_OK) throw std::runtime_error("curl_multi_add_handle failed");
  }

  void end_attempt(Transfer& t) {
    if (t.easy != nullptr) {
      curl_multi_remove_handle(multi, t.easy);
      curl_easy_cleanup(t.easy);
      t.easy = nullptr;
    }
    if (t.headers != nullptr) {
      curl_slist_free_all(t.headers);
      t.headers = nullptr;
    }
  }

  // What is wrong with a complete body, or "".
  // (every unit was verified as it arrived: advance_verify)
  static std::string verify(const Transfer& t) {
    if (static_cast<std::int64_t>(t.buf.size()) != t.req.length) {
      return std::to_string(t.buf.size()) + " bytes, expected " + std::to_string(t.req.length);
    }
    if (!t.req.units.empty() && t.verified_units != t.req.units.size()) {
      return "units do not cover the body";
    }
    return "";
  }

  // An attempt ended without a usable body: schedule the next one or give up.
  void failed_attempt(Transfer& t, const std::string& error, bool keep_etag = true) {
    t.last_error = error;
    if (!keep_etag) t.etag.clear();
    t.failures = t.progressed ? 0 : t.failures + 1;
    const bool capped = opts.max_attempts > 0 && t.failures >= opts.max_attempts;
    if (capped || now_s() - t.last_progress >= opts.window_s) {
      throw FetchError("unreachable", unreachable(t));
    }
    double delay =
        t.failures ? std::min(opts.backoff_max_s,
                              opts.backoff_s * std::pow(2.0, std::max(0, t.failures - 1)))
                   : 0.0;
    delay *= 1.0 - opts.jitter * std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    t.retry_at = now_s() + delay;
    if (t.failures == 0) {
      retries_said = 0;  // progress: the next failure starts a new count
    } else if (opts.on_wait && t.failures > retries_said) {
      // several transfers in flight fail together (a restart): one line per retry number
      retries_said = t.failures;
      const double left = std::max(0.0, opts.window_s - (now_s() - t.last_progress));
      char when[64];
      std::snprintf(when, sizeof when, "%.1f s (giving up in %.0f s", delay, left);
      opts.on_wait("waiting for " + opts.display_url + ": " + error + ", retry " +
                   std::to_string(t.failures) + " in " + when + " without progress)");
    }
  }

  // Handles one finished attempt; returns true when the transfer is complete.
  bool finished(Transfer& t, CURLcode res, FetchDone* done) {
    long code = 0;
    curl_easy_getinfo(t.easy, CURLINFO_RESPONSE_CODE, &code);
    if (!t.attempt_etag.empty() && code >= 200 && code < 300) t.etag = t.attempt_etag;
    const std::string errbuf = t.errbuf;
    long os_errno = 0;  // (a connection refused is named as the Python client names it)
    curl_easy_getinfo(t.easy, CURLINFO_OS_ERRNO, &os_errno);
    end_attempt(t);
    if (t.fatal) throw FetchError("http", t.abort_reason);
    if (t.damaged) {
      if (t.use_fallback) {  // the largest configuration verified before the damage
        fill_done(t, best_fallback(t), done);
        return true;
      }
      refetch(t, t.damage);
      return false;
    }
    if (res != CURLE_OK) {
      std::string why = !t.abort_reason.empty() ? t.abort_reason
                        : res == CURLE_OPERATION_TIMEDOUT ? "timed out"
                        : std::string(curl_easy_strerror(res)) + (errbuf.empty() ? "" : ": " + errbuf);
      if (t.abort_reason.empty() && res == CURLE_COULDNT_CONNECT) {  // the Python client's words
        why = os_errno == ECONNREFUSED ? std::string("connection refused")
                                       : "cannot connect (" + why + ")";
      }
      failed_attempt(t, why);
      return false;
    }
    if (code == 416) {  // as the Python client: permanent
      throw FetchError("http", t.req.url + " is shorter than its manifest says (416 for bytes " +
                                   std::to_string(t.req.offset) + "-" +
                                   std::to_string(t.req.offset + t.req.length - 1) + ", " +
                                   (t.content_range.empty() ? std::string("no Content-Range")
                                                            : t.content_range) +
                                   "): the published pack is truncated");
    }
    if (retry_status(code) && !permanent_code(json_string(t.error_body, "code"))) {
      const std::string msg = json_error(t.error_body);
      failed_attempt(t, "HTTP " + std::to_string(code) + (msg.empty() ? "" : ": " + msg));
      return false;
    }
    if (code < 200 || code >= 300) {
      const std::string msg = json_error(t.error_body);
      const std::string ecode = json_string(t.error_body, "code");
      if (ecode == "version_gone") {  // republished: the runtime fetches the manifest again
        throw FetchError("version_gone", t.req.url + ": HTTP " + std::to_string(code) +
                                             (msg.empty() ? "" : ": " + msg));
      }
      throw FetchError("http", t.req.url + ": HTTP " + std::to_string(code) +
                                   (msg.empty() ? "" : ": " + msg) +
                                   (permanent_code(ecode) ? " (the origin says " + ecode +
                                                                ": retrying will not help)"
                                                          : ""));
    }
    const std::string problem = verify(t);
    if (!problem.empty()) {
      refetch(t, problem);
      return false;
    }
    fill_done(t, -1, done);
    return true;
  }

  // A body that cannot be used, and no verified fallback: fetch it again from scratch, or
  // give up with the true cause once max_refetch refetches failed too.
  void refetch(Transfer& t, const std::string& problem) {
    t.refetches += 1;
    if (t.refetches > opts.max_refetch) {
      throw FetchError("integrity", t.req.url + ": not even the smallest configuration of " +
                                        "shard " + std::to_string(t.req.shard) +
                                        " verifies: " + problem + " (after " +
                                        std::to_string(t.refetches) + " fetches)");
    }
    reset_body(t);
    t.etag.clear();
    t.retry_at = now_s();
  }

  Transfer* find(int shard) {
    for (auto& t : transfers) {
      if (t.req.shard == shard) return &t;
    }
    return nullptr;
  }

  void restart_now(Transfer& t) {
    end_attempt(t);
    t.hedges += 1;
    t.fresh = true;
    begin_attempt(t);
  }
};

HttpReceiver::HttpReceiver(HttpOptions options) : impl_(std::make_unique<Impl>()) {
  global_init();
  impl_->opts = std::move(options);
  impl_->multi = curl_multi_init();
  if (impl_->multi == nullptr) throw std::runtime_error("curl_multi_init failed");
  if (impl_->opts.http_version != 1 && impl_->opts.http_version != 2) {
    throw std::invalid_argument("http_version must be 1 (HTTP/1.1) or 2 (HTTP/2)");
  }
  if (impl_->opts.http_version == 2) {
    curl_version_info_data* v = curl_version_info(CURLVERSION_NOW);
    if (v == nullptr || (v->features & CURL_VERSION_HTTP2) == 0) {
      throw FetchError("http", "HTTP/2 was asked for, but this libcurl has no HTTP/2 "
                               "(nghttp2) support");
    }
    // libcurl before 7.89.0 fails every request that reuses a prior-knowledge connection
    // ("Error in the HTTP2 framing layer", curl#10634, fixed by curl#10643): measured with
    // Debian 12's 7.88.1 against nginx 1.22, the first stream is answered and every later
    // one fails, so no transfer could be multiplexed
    if (v->version_num < 0x075900) {
      throw FetchError("http", std::string("HTTP/2 was asked for, but libcurl ") + v->version +
                                   " cannot reuse an h2c prior-knowledge connection "
                                   "(curl#10634, fixed in 7.89.0); use HTTP/1.1");
    }
    // streams of one connection, hedges on their own (begin_attempt): a cap would hold a
    // hedge pending behind connections that still carry streams
    curl_multi_setopt(impl_->multi, CURLMOPT_PIPELINING, CURLPIPE_MULTIPLEX);
  } else {
    curl_multi_setopt(impl_->multi, CURLMOPT_MAX_HOST_CONNECTIONS,
                      static_cast<long>(std::max(1, impl_->opts.max_connections)));
  }
}

HttpReceiver::~HttpReceiver() {
  for (auto& t : impl_->transfers) impl_->end_attempt(t);
  for (CURL* e : impl_->warming) {
    curl_multi_remove_handle(impl_->multi, e);
    curl_easy_cleanup(e);
  }
  if (impl_->warm_headers != nullptr) curl_slist_free_all(impl_->warm_headers);
  curl_multi_cleanup(impl_->multi);
}

namespace {
std::size_t discard(char*, std::size_t size, std::size_t n, void*) { return size * n; }
}  // namespace

void HttpReceiver::warm(const std::string& url, int n) {
  if (n <= 0) return;
  if (impl_->warm_headers == nullptr) {
    for (const auto& h : impl_->opts.headers) {
      impl_->warm_headers = curl_slist_append(impl_->warm_headers, h.c_str());
    }
    impl_->warm_headers = curl_slist_append(impl_->warm_headers, "Accept:");
  }
  for (int i = 0; i < n; ++i) {
    CURL* e = curl_easy_init();
    if (e == nullptr) throw std::runtime_error("curl_easy_init failed");
    curl_easy_setopt(e, CURLOPT_URL, url.c_str());
    curl_easy_setopt(e, CURLOPT_NOBODY, 1L);  // HEAD: the connection, no bytes
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, impl_->warm_headers);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, &discard);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, &discard);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_PROXY, "");
    curl_easy_setopt(e, CURLOPT_USERAGENT, "sakura-native");
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS,
                     static_cast<long>(std::ceil(impl_->opts.connect_timeout_s * 1000)));
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS,
                     static_cast<long>(std::ceil(impl_->opts.read_timeout_s * 1000)));
    curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(e, CURLOPT_FRESH_CONNECT, 1L);  // each its own connection
    if (impl_->opts.http_version == 2) set_http2(e);
    curl_easy_setopt(e, CURLOPT_PRIVATE, static_cast<void*>(nullptr));
    {
      std::lock_guard<std::mutex> lock(impl_->log_mu);
      std::vector<std::string> sent(impl_->opts.headers.begin(), impl_->opts.headers.end());
      impl_->log.push_back({"HEAD", url, sent, now_s()});
    }
    if (curl_multi_add_handle(impl_->multi, e) != CURLM_OK) {
      curl_easy_cleanup(e);
      throw std::runtime_error("curl_multi_add_handle failed");
    }
    impl_->warming.push_back(e);
  }
}

void HttpReceiver::start(FetchRequest request) {
  std::int64_t total = 0;
  for (const auto& u : request.units) total += u.length;
  if (!request.units.empty() && total != request.length) {
    throw FetchError("integrity", "shard " + std::to_string(request.shard) + " config " +
                                      std::to_string(request.config) +
                                      ": units do not add up to its bytes");
  }
  if (impl_->transfers.empty()) impl_->busy_since = now_s();
  impl_->transfers.emplace_back();
  Transfer& t = impl_->transfers.back();
  t.req = std::move(request);
  t.start = t.last_progress = now_s();
  t.link_last_byte = &impl_->last_byte;
  t.buf.reserve(static_cast<std::size_t>(t.req.length));
  impl_->begin_attempt(t);
}

std::vector<FetchDone> HttpReceiver::poll(double timeout_s) {
  std::vector<FetchDone> out;
  const double now = now_s();
  double wait = std::max(0.0, timeout_s);
  for (auto& t : impl_->transfers) {  // transfers waiting out a backoff
    if (t.easy == nullptr) {
      if (t.retry_at <= now) {
        impl_->begin_attempt(t);
      } else {
        wait = std::min(wait, t.retry_at - now);
      }
    }
  }
  int running = 0;
  curl_multi_perform(impl_->multi, &running);
  int left = 0;
  bool any = false;
  while (CURLMsg* msg = curl_multi_info_read(impl_->multi, &left)) {
    if (msg->msg != CURLMSG_DONE) continue;
    Transfer* t = nullptr;
    curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, reinterpret_cast<char**>(&t));
    if (t == nullptr) {  // a warm-up HEAD: its connection stays in the pool (or it failed:
      // then that connection is simply not warm)
      CURL* e = msg->easy_handle;
      curl_multi_remove_handle(impl_->multi, e);
      curl_easy_cleanup(e);
      auto& w = impl_->warming;
      w.erase(std::remove(w.begin(), w.end(), e), w.end());
      continue;
    }
    const CURLcode res = msg->data.result;
    FetchDone done;
    any = true;
    if (impl_->finished(*t, res, &done)) {
      out.push_back(std::move(done));
      impl_->transfers.remove_if([&](const Transfer& x) { return &x == t; });
    }
  }
  if (!any && out.empty()) {
    int fds = 0;
    curl_multi_poll(impl_->multi, nullptr, 0, static_cast<int>(std::ceil(wait * 1000)), &fds);
    curl_multi_perform(impl_->multi, &running);
  }
  return out;
}

void HttpReceiver::wakeup() { curl_multi_wakeup(impl_->multi); }

bool HttpReceiver::take_prefix(int shard, FetchDone* done) {
  Transfer* t = impl_->find(shard);
  if (t == nullptr) return false;
  const int fb = best_fallback(*t);
  if (fb < 0) return false;
  impl_->end_attempt(*t);
  fill_done(*t, fb, done);
  done->truncated = true;
  impl_->transfers.remove_if([&](const Transfer& x) { return &x == t; });
  return true;
}

bool HttpReceiver::failing() const {
  for (const auto& t : impl_->transfers) {
    if (t.failures > 0) return true;
  }
  return false;
}

bool HttpReceiver::cancel(int shard) {
  Transfer* t = impl_->find(shard);
  if (t == nullptr) return false;
  impl_->end_attempt(*t);
  impl_->transfers.remove_if([&](const Transfer& x) { return &x == t; });
  return true;
}

// A transfer whose body has wholly arrived is never restarted: it completes when libcurl
// reports the attempt done, and a restart would ask for an empty range, which an origin
// answers with the whole object (200). Under qemu-aarch64 that report came late enough for
// the stall watchdog to restart such transfers in one edit in three (issue 31's arm64 runs).
static bool body_complete(const std::int64_t length, const std::size_t received) {
  return static_cast<std::int64_t>(received) >= length;
}

bool HttpReceiver::restart(int shard) {
  Transfer* t = impl_->find(shard);
  if (t == nullptr || body_complete(t->req.length, t->buf.size())) return false;
  impl_->restart_now(*t);
  return true;
}

int HttpReceiver::restart_stalled(double rtt_s, double rate_bps, double floor_s) {
  const double now = now_s();
  int n = 0;
  for (auto& t : impl_->transfers) {
    if (t.easy == nullptr) continue;  // waiting out a backoff
    if (body_complete(t.req.length, t.buf.size())) continue;  // its done report is due
    const double idle = now - std::max(t.last_progress, t.attempt_start);
    const double remaining = static_cast<double>(
        std::max<std::int64_t>(0, t.req.length - static_cast<std::int64_t>(t.buf.size())));
    double limit = std::max(floor_s, 3.0 * rtt_s);
    if (rate_bps > 0) limit = std::max(limit, 2.0 * remaining * 8.0 / rate_bps);
    // each restart in a row without new bytes doubles the limit: an origin slower to
    // answer than the limit is still waited for, never restarted forever
    limit *= std::pow(2.0, std::min(t.stalled_restarts, 10));
    if (idle > limit) {
      t.stalled_restarts += 1;
      impl_->restart_now(t);
      ++n;
    }
  }
  return n;
}

double HttpReceiver::idle_s(int shard) const {
  for (const auto& t : impl_->transfers) {
    if (t.req.shard == shard) return now_s() - std::max(t.last_progress, t.attempt_start);
  }
  return std::numeric_limits<double>::quiet_NaN();
}

bool HttpReceiver::has_transfer(int shard) const {
  for (const auto& t : impl_->transfers) {
    if (t.req.shard == shard) return true;
  }
  return false;
}

double HttpReceiver::quiet_since_s() const {
  if (impl_->transfers.empty()) return std::numeric_limits<double>::quiet_NaN();
  return std::max(impl_->last_byte, impl_->busy_since);
}

int HttpReceiver::active() const { return static_cast<int>(impl_->transfers.size()); }

std::int64_t HttpReceiver::outstanding_bytes() const {
  std::int64_t n = 0;
  for (const auto& t : impl_->transfers) {
    n += std::max<std::int64_t>(0, t.req.length - static_cast<std::int64_t>(t.buf.size()));
  }
  return n;
}

std::int64_t HttpReceiver::needed_bytes(int shard) const {
  for (const auto& t : impl_->transfers) {
    if (t.req.shard != shard) continue;
    if (t.easy == nullptr) return -1;  // between attempts: not judged
    const std::int64_t smallest =
        t.req.fallbacks.empty() ? t.req.length : t.req.fallbacks.back().second;
    return std::max<std::int64_t>(0, smallest - static_cast<std::int64_t>(t.buf.size()));
  }
  return -1;
}

std::vector<RequestLogEntry> HttpReceiver::take_log() {
  std::lock_guard<std::mutex> lock(impl_->log_mu);
  std::vector<RequestLogEntry> out;
  out.swap(impl_->log);
  return out;
}

}  // namespace sakura
