"""The native runtime over HTTP/2 (issue 28 item 3): nginx's h2c listener (`listen PORT
http2;`, prior knowledge) serves the same image as its HTTP/1.1 listener, the pack ranges
really travel as HTTP/2 streams of one connection (nginx's access log says so), and the
option is validated where users set it. libcurl before 7.89.0 (Debian 12 ships 7.88.1)
cannot reuse a prior-knowledge connection (curl#10634): there the edit must fail at once
with one clear line instead."""

from __future__ import annotations

import ctypes
import ctypes.util
import re

import pytest
from sakura.cloud.origins import NginxOrigin, nginx_binary
from sakura.edge.errors import EdgeError
from sakura.edge.runtime import EditOptions

from tests.edge.helpers import TEMPLATE_ID

pytestmark = pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed")


def libcurl_version() -> tuple[int, ...]:
    lib = ctypes.CDLL(ctypes.util.find_library("curl") or "libcurl.so.4")
    lib.curl_version.restype = ctypes.c_char_p
    m = re.match(r"libcurl/(\d+)\.(\d+)\.(\d+)", lib.curl_version().decode())
    assert m, "unrecognised curl_version()"
    return tuple(int(x) for x in m.groups())


H2C_REUSE_BROKEN = libcurl_version() < (7, 89, 0)

@pytest.fixture(scope="module")
def nginx_h2(world):
    origin = NginxOrigin(world.catalog_dir, http2=True, access_log=True)
    with origin:
        yield origin

@pytest.mark.skipif(not H2C_REUSE_BROKEN, reason="this libcurl reuses h2c connections")
def test_http2_on_a_libcurl_that_cannot_reuse_h2c_fails_with_one_clear_line(
        world, native_runtime, nginx_h2):
    req = native_runtime.request("a private prompt", 7)
    opts = EditOptions(budget_rate_bps=20e6, http_version="2", pack_origin=nginx_h2.h2_url)
    with pytest.raises(EdgeError, match=r"curl#10634.*use HTTP/1\.1") as err:
        native_runtime.edit(nginx_h2.url, TEMPLATE_ID, world.template, req,
                            "sakura-fixed-config", options=opts)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(H2C_REUSE_BROKEN, reason="libcurl < 7.89.0 cannot reuse h2c (curl#10634)")
def test_an_http2_edit_gives_the_http11_image_over_streams_of_one_connection(
        world, native_runtime, nginx_h2):
    import torch

    req = native_runtime.request("a private prompt", 7)
    results = {}
    for version in ("1.1", "2"):
        before = len(nginx_h2.access_log_lines())
        opts = EditOptions(budget_rate_bps=20e6, http_version=version,
                           pack_origin=nginx_h2.h2_url if version == "2" else None)
        res = native_runtime.edit(nginx_h2.url, TEMPLATE_ID, world.template, req,
                                  "sakura-fixed-config", options=opts)
        # nginx writes a line when a request ends: the edit's are all in once it returns
        lines = [x.split() for x in nginx_h2.access_log_lines()[before:]]
        ranges = [x for x in lines if x[2] == "GET" and x[4] == "206"]
        assert len(ranges) == len(res.timeline) > 1, version
        results[version] = (res, ranges, lines)
    (r1, ranges1, _), (r2, ranges2, lines2) = results["1.1"], results["2"]
    assert r2.configs == r1.configs
    assert torch.equal(r2.image, r1.image)
    assert {x[0] for x in ranges1} == {"HTTP/1.1"}
    assert {x[0] for x in ranges2} == {"HTTP/2.0"}
    # the warm-up HEAD and every range on one connection, multiplexed (no hedge here)
    h2 = [x for x in lines2 if x[0] == "HTTP/2.0"]
    assert len({x[1] for x in h2}) == 1
    # the manifest still came over HTTP/1.1 (the Python client) from the server URL
    assert any(x[0] == "HTTP/1.1" and "manifest" in x[3] for x in lines2)

def test_http_version_is_checked():
    with pytest.raises(EdgeError, match="http_version must be one of 1.1, 2"):
        EditOptions(http_version="3")
    with pytest.raises(EdgeError, match="http_version"):
        EditOptions(http_version="1.0")

def test_the_python_runtime_refuses_http2(world, runtime, nginx_h2):
    req = runtime.request("a private prompt", 7)
    with pytest.raises(EdgeError, match="python runtime speaks HTTP/1.1"):
        runtime.edit(nginx_h2.url, TEMPLATE_ID, world.template, req, "sakura-fixed-config",
                     options=EditOptions(budget_rate_bps=20e6, http_version="2",
                                         pack_origin=nginx_h2.h2_url))
