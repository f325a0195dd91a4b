"""One failure contract for both runtimes (issue 29): the same broken origins, the same error
class and the same numbers in the message, each reported at once (no retry window).

Origins: ``sakura serve`` on a pack with one flipped byte (it answers 500 with
``code: pack_damaged``), a static origin whose ``Content-Range`` total is not the manifest's
``pack_bytes`` (a truncated or replaced pack), one answering 416, one ignoring Range."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from sakura.cloud.server import create_app
from sakura.cloud.storage import LocalStorage
from sakura.edge.client import RetryPolicy
from sakura.edge.errors import OriginError
from sakura.edge.runtime import EditOptions

from tests.edge.helpers import TEMPLATE_ID, Server
from tests.edge.test_edit import PROMPT, SEED

# a retry window long enough that a retried permanent error would show in the request count:
# retried within the 20 s window at <= 0.2 s backoff, one range is asked for >= 100 times
# local_fallback off: with it, the tiny model's whole edit can run on the device (one local
# step is the 50 ms stall floor) before the origin's error answer arrives, and whether it
# does depends on the machine's load (a clean-clone CI run under load saw the native edit
# finish locally on a damaged pack); what is compared here is the streaming path's errors
PATIENT = EditOptions(retry=RetryPolicy(window_s=20.0, backoff_s=0.05, backoff_max_s=0.2),
                      local_fallback=False)


# ...while a transfer that has no answer yet may be restarted on a fresh connection (the
# native runtime's stall restart, not a retry: no answer was read) when a loaded host's
# in-process origin answers later than 50 ms, each restart in a row doubling its limit:
# at most log2(20 s / 50 ms) + 1 = 10 requests of one range within the window (a clean-clone
# CI run saw 12 requests for 6 ranges, each restarted once)
MAX_ASKS_PER_RANGE = 10


class Counting:
    """ASGI wrapper counting pack requests (``hits``) and how often each byte range was
    asked for (``asks``); ``rewrite(status, headers)`` may change the answer's start."""

    def __init__(self, app, rewrite=None):
        self.app, self.rewrite, self.hits = app, rewrite, 0
        self.asks: dict[bytes, int] = {}

    @property
    def most_asks(self) -> int:
        """The most requests of one range: 1 where nothing was asked twice."""
        return max(self.asks.values(), default=0)

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or not scope["path"].endswith(".pack")
                or scope["method"] != "GET"):  # (the native runtime's warm-up HEADs)
            await self.app(scope, receive, send)
            return
        self.hits += 1
        rng = dict(scope["headers"]).get(b"range", b"")
        self.asks[rng] = self.asks.get(rng, 0) + 1

        async def start(message):
            if message["type"] == "http.response.start" and self.rewrite is not None:
                message = {**message, **self.rewrite(message["status"],
                                                      list(message["headers"]))}
            await send(message)
        await self.app(scope, receive, start)


def wrong_total(status, headers):
    out = []
    for k, v in headers:
        if k.lower() == b"content-range":
            m = re.match(rb"bytes (\d+)-(\d+)/(\d+)", v)
            v = b"bytes %s-%s/%d" % (m.group(1), m.group(2), int(m.group(3)) - 1000)
        out.append((k, v))
    return {"headers": out}


def answers_416(status, headers):
    return {"status": 416, "headers": [(k, v) for k, v in headers
                                       if k.lower() != b"content-range"]}


def both(world, runtime, native_runtime, app_factory, policy="sakura"):
    """The error each runtime raises against a fresh origin, and the most requests of one
    range it took (a permanent answer is not retried: at most the stall restarts of a
    transfer still waiting for its answer)."""
    out = {}
    req = runtime.request(PROMPT, SEED)
    for name, rt in (("python", runtime), ("native", native_runtime)):
        app = app_factory()
        rt.manifests.clear()  # each runtime starts from its own manifest fetch
        with Server(app) as server, pytest.raises(OriginError) as err:
            rt.edit(server.url, TEMPLATE_ID, world.template, req, policy, options=PATIENT)
        out[name] = (str(err.value), app.most_asks)
    return out


def numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\b\d{3,}\b", text.split(": ", 1)[-1])]


def test_a_damaged_pack_is_reported_at_once_with_the_servers_reason(world, runtime,
                                                                     native_runtime,
                                                                     tmp_path):
    root = tmp_path / "catalog"
    shutil.copytree(world.catalog_dir, root)
    folder = root / "templates" / TEMPLATE_ID / "sakura"
    manifest = json.loads((folder / "manifest.json").read_text())
    pack = folder / manifest["pack_file"]
    # one flipped byte in shard 0's first unit: every edit requests it (every configuration
    # of a shard is a prefix of one range)
    (offset, _), = manifest["shards"][0]["configs"][0]["ranges"]
    data = bytearray(pack.read_bytes())
    data[int(offset)] ^= 0xFF
    pack.write_bytes(bytes(data))
    got = both(world, runtime, native_runtime,
               lambda: Counting(create_app(LocalStorage(root))))
    units = {}
    for name, (msg, hits) in got.items():
        assert "pack_damaged" in msg and "retrying will not help" in msg, (name, msg)
        assert "cannot reach" not in msg
        m = re.search(r"unit (\d+)", msg)
        assert m, msg
        units[name] = int(m.group(1))
        # no retry of a permanent answer
        assert 1 <= hits <= MAX_ASKS_PER_RANGE, (name, hits)
    assert units["python"] == units["native"]


def test_a_content_range_total_that_is_not_the_manifests_is_one_clear_error(
        world, runtime, native_runtime):
    got = both(world, runtime, native_runtime,
               lambda: Counting(create_app(LocalStorage(world.catalog_dir)), wrong_total))
    for name, (msg, hits) in got.items():
        assert re.search(r"has \d+ bytes, its manifest says \d+: the published pack is "
                         r"truncated or was replaced", msg), (name, msg)
        assert 1 <= hits <= MAX_ASKS_PER_RANGE, (name, hits)
    sizes = {name: re.search(r"has (\d+) bytes, its manifest says (\d+)", msg).groups()
             for name, (msg, _) in got.items()}
    assert sizes["python"] == sizes["native"]
    total, manifest = map(int, sizes["native"])
    assert manifest - total == 1000


def test_a_416_is_a_truncated_pack_in_both_runtimes(world, runtime, native_runtime):
    got = both(world, runtime, native_runtime,
               lambda: Counting(create_app(LocalStorage(world.catalog_dir)), answers_416))
    for name, (msg, hits) in got.items():
        assert "shorter than its manifest says (416" in msg, (name, msg)
        assert "the published pack is truncated" in msg
        assert 1 <= hits <= MAX_ASKS_PER_RANGE, (name, hits)
    # the origin's Content-Range (here none) quoted by both (the range is each runtime's
    # own choice of configuration)
    said = {name: re.search(r"\(416 for bytes \d+-\d+, ([^)]*)\)", msg).group(1)
            for name, (msg, _) in got.items()}
    assert said["python"] == said["native"] == "no Content-Range", said


class GoneOnce:
    """The first pack GET answers 404 ``version_gone`` (the pack was republished and the old
    version collected mid-edit); the manifest is fetched again and the edit runs."""

    def __init__(self, app):
        self.app, self.gone, self.manifests = app, 1, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].endswith("manifest.json"):
            self.manifests += 1
        if (scope["type"] == "http" and scope["method"] == "GET"
                and scope["path"].endswith(".pack") and self.gone > 0):
            self.gone -= 1
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body",
                        "body": b'{"error": "pack version superseded", "code": "version_gone"}'})
            return
        await self.app(scope, receive, send)


@pytest.mark.parametrize("which", ["python", "native"])
def test_a_superseded_pack_version_refetches_the_manifest(world, runtime, native_runtime,
                                                          which):
    rt = runtime if which == "python" else native_runtime
    req = runtime.request(PROMPT, SEED)
    app = GoneOnce(create_app(LocalStorage(world.catalog_dir)))
    rt.manifests.clear()
    with Server(app) as server:
        res = rt.edit(server.url, TEMPLATE_ID, world.template, req, "sakura",
                      options=EditOptions(local_fallback=False))
    assert app.gone == 0 and app.manifests >= 2
    assert any("republished" in w for w in res.warnings), res.warnings
    assert res.bytes > 0


def test_an_origin_that_ignores_range_is_the_same_error_in_both_runtimes(world, runtime,
                                                                         native_runtime):
    from tests.edge.test_native_runtime import IgnoresRange

    got = both(world, runtime, native_runtime,
               lambda: Counting(IgnoresRange(create_app(LocalStorage(world.catalog_dir)))))
    reasons = {}
    for name, (msg, hits) in got.items():
        assert "the origin ignored the Range request (HTTP 200 with the whole object)" in msg
        assert 1 <= hits <= MAX_ASKS_PER_RANGE, (name, hits)
        reasons[name] = msg.split(".pack: ", 1)[1]  # after the URL (python: base URL: key)
    assert reasons["python"] == reasons["native"]


class Unavailable:
    """ASGI wrapper: every pack GET answers 503 for ``down_s`` after the first one (an
    origin overloaded or restarting behind a proxy), then the app answers as usual."""

    def __init__(self, app, down_s):
        self.app, self.down_s, self.since = app, down_s, None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].endswith(".pack") \
                and scope["method"] == "GET":
            import time as _time

            now = _time.monotonic()
            self.since = now if self.since is None else self.since
            if now - self.since < self.down_s:
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"busy"})
                return
        await self.app(scope, receive, send)


def test_both_runtimes_say_what_they_wait_for_in_the_same_words(world, runtime,
                                                                 native_runtime):
    """A transient answer mid-edit (503 for 0.5 s) is retried with jittered backoff, and
    both runtimes tell the edit's ``on_wait`` one line per retry in the Python client's
    words; the edit then finishes on the exact image."""
    req = runtime.request(PROMPT, SEED)
    pattern = (r"waiting for {url}: HTTP 503(: busy)?, retry (\d+) in \d+\.\d s "
               r"\(giving up in \d+ s without progress\)")
    for name, rt in (("python", runtime), ("native", native_runtime)):
        lines: list[str] = []
        with Server(Unavailable(create_app(LocalStorage(world.catalog_dir)), 0.5)) as server:
            res = rt.edit(server.url, TEMPLATE_ID, world.template, req, "fp16",
                          options=EditOptions(retry=PATIENT.retry, local_fallback=False,
                                              on_wait=lines.append))
        assert lines, name
        for line in lines:
            assert re.fullmatch(pattern.format(url=re.escape(server.url)), line), (name, line)
        assert sum(r["attempts"] for r in res.timeline) > len(res.timeline), name
        assert res.image is not None and res.bytes > 0
