// The receive stage's HTTP client: libcurl (multi interface) with kept-alive connections,
// several transfers in flight, Range requests, resume of a dropped body, per-unit SHA-256
// verification and retries with exponential backoff. Driven by one thread (the receive
// stage) through start() / poll(); nothing here blocks longer than poll's timeout.
//
// Semantics follow sakura/edge/client.py (the Python runtime's client):
// * a configuration is one GET of `url`, with `Range: bytes=a-b` when it is a byte range of
//   a larger object (the pack), or the whole resource otherwise;
// * a dropped connection or a read timeout resumes the body with a narrower Range and
//   `If-Range: <etag>`; a 200 to a resume restarts the body; a 416 restarts it;
// * 5xx / 408 / 429 and connection errors are retried with exponential backoff; after
//   `window_s` without progress (or `max_attempts` failed attempts in a row, when set) the
//   transfer fails (Unreachable): long enough by default to ride out a server restart;
// * another 4xx fails at once with the server's own message (HttpError);
// * units are verified as they arrive; a body whose length or any unit's SHA-256 is wrong
//   ends with the longest of its `fallbacks` (configurations that are prefixes of it) whose
//   units all verified, with `damage` naming the unit; with none, it is refetched from
//   scratch, at most `max_refetch` times (then IntegrityError);
// * deadlines: take_prefix() ends a transfer early with its longest verified fallback
//   (truncation), restart() re-requests the remaining range on a fresh connection, and
//   restart_stalled() does so for every attempt without new bytes for longer than
//   max(floor, 3 round trips, 2x the expected time of its remaining bytes) (the watchdog);
// * a ranged request answered with the whole object (an origin that ignores Range) fails at
//   once instead of downloading it (HttpError).
// Every request actually sent is logged (method, URL, headers, time) for privacy tests.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace sakura {

// Why an edit could not get its bytes; kind is "unreachable", "integrity" or "http".
class FetchError : public std::runtime_error {
 public:
  FetchError(std::string kind, const std::string& message)
      : std::runtime_error(message), kind_(std::move(kind)) {}
  const std::string& kind() const { return kind_; }

 private:
  std::string kind_;
};

struct UnitCheck {
  std::int64_t length = 0;
  std::array<std::uint8_t, 32> sha256{};
};

struct HttpOptions {
  double connect_timeout_s = 3.0;
  double read_timeout_s = 10.0;  // longest silence inside one response
  double window_s = 30.0;        // give up after this long without progress
  int max_attempts = 0;          // ... or after this many failed attempts in a row (0: no cap)
  double backoff_s = 0.1;
  double backoff_max_s = 2.0;
  // each backoff is drawn in [1 - jitter, 1] x its exponential value (RetryPolicy.jitter of
  // the Python client), so devices that lost one origin together do not return together
  double jitter = 0.5;
  // told one line per retry without progress ("waiting for URL: connection refused, retry 3
  // in 0.4 s (giving up in 29 s without progress)", the Python client's on_wait words);
  // called on the receive thread
  std::function<void(const std::string&)> on_wait;
  int max_refetch = 3;           // refetches of a body that fails verification
  int max_connections = 3;       // kept-alive connections to the origin
  bool warm_hedges = true;       // a hedge may take an idle pooled connection (false: a new one)
  int warm_connections = 0;      // connections the edit opens before its first request (warm())
  // 1: HTTP/1.1 (a connection per transfer in flight); 2: HTTP/2 over cleartext with prior
  // knowledge (h2c, no Upgrade: nginx's `listen PORT http2;`), every transfer a stream of
  // one multiplexed connection (PIPEWAIT), a hedge on a connection of its own
  // (FRESH_CONNECT: a new stream on the stalled connection would stall with it), and no
  // cap on connections (max_connections counts HTTP/1.1 connections only)
  int http_version = 1;
  std::vector<std::string> headers;  // e.g. "Authorization: Bearer ..." (never request data)
  std::string display_url;           // the server URL the user gave (for messages)
};

struct FetchRequest {
  int shard = 0;
  int config = 0;
  std::string url;
  std::int64_t offset = -1;  // >= 0: bytes [offset, offset + length) of the resource at url
  std::int64_t length = 0;   // expected body length
  std::int64_t pack_bytes = -1;  // >= 0: the manifest's size of the whole resource, checked
                                 // against every 206's Content-Range total
  std::vector<UnitCheck> units;  // the body, unit after unit (lengths add up to `length`)
  // (config, length): configurations whose bytes are the first units of this body, longest
  // first, that the edit may use instead (truncation at the deadline, a damaged unit)
  std::vector<std::pair<int, std::int64_t>> fallbacks;
};

struct FetchDone {
  int shard = 0;
  int config = 0;
  std::vector<std::uint8_t> data;
  double start = 0, first_byte = 0, end = 0;  // steady clock, seconds
  int attempts = 0, resumes = 0, refetches = 0;
  double connect_s = 0;    // of start..first_byte, the time spent opening a new connection
  int requested = 0;       // the configuration requested (config differs: a fallback)
  int hedges = 0;          // re-requests on a fresh connection (stall watchdog, deadline)
  bool truncated = false;  // ended at the deadline with a verified prefix
  std::string damage;      // a unit that failed its checksum (the prefix before it is used)
};

struct RequestLogEntry {
  std::string method;
  std::string url;
  std::vector<std::string> headers;
  double time = 0;
};

// Seconds on the steady clock (CLOCK_MONOTONIC: the same clock as Python's time.monotonic()).
double now_s();

// SHA-256 of a byte range (OpenSSL).
std::array<std::uint8_t, 32> sha256(const std::uint8_t* data, std::size_t size);

class HttpReceiver {
 public:
  explicit HttpReceiver(HttpOptions options);
  ~HttpReceiver();
  HttpReceiver(const HttpReceiver&) = delete;
  HttpReceiver& operator=(const HttpReceiver&) = delete;

  void start(FetchRequest request);
  // Opens n connections to url's origin now, each with a HEAD of url (public: the pack's
  // URL, no range), so the shards' requests and hedges find them kept alive in the pool
  // instead of handshaking through a congested downlink. Failures are ignored.
  void warm(const std::string& url, int n);
  // Runs the transfers for at most timeout_s (less when one finishes or wakeup() is called)
  // and returns the verified bodies that completed. Throws FetchError.
  std::vector<FetchDone> poll(double timeout_s);
  // Thread-safe: makes a poll() in progress return early.
  void wakeup();

  // Ends shard's transfer with its longest verified fallback (truncated); false when it has
  // none yet (or no transfer of that shard is active).
  bool take_prefix(int shard, FetchDone* done);
  // Re-requests shard's remaining range on a fresh connection (a hedge); false: none active.
  bool restart(int shard);
  // Drops shard's transfer (its step no longer needs it); false: none active.
  bool cancel(int shard);
  // The stall watchdog: restarts every attempt without new bytes for longer than
  // max(floor_s, 3 rtt_s, 2x its remaining bytes at rate_bps); returns how many.
  int restart_stalled(double rtt_s, double rate_bps, double floor_s);
  // Seconds since shard's transfer last received bytes (NaN: no such transfer).
  double idle_s(int shard) const;
  bool has_transfer(int shard) const;
  // Since when the link has carried no body byte while requests were out: the later of the
  // last byte any transfer received and the moment transfers became active; NaN: none active.
  // (A new request does not restart it: it says nothing about the link.)
  double quiet_since_s() const;

  int active() const;                     // transfers started and not yet done
  // Some transfer's last attempt failed (refused, reset, a retried status) and it has made
  // no progress since: the origin is unreachable, not slow.
  bool failing() const;
  std::int64_t outstanding_bytes() const; // bytes the active transfers still expect
  // bytes the shard's transfer still needs before its smallest fallback (else the whole
  // configuration) is in; -1 with no transfer for it or between attempts (a backoff)
  std::int64_t needed_bytes(int shard) const;
  std::vector<RequestLogEntry> take_log();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sakura
