"""Real origins on loopback for tests and benchmarks: nginx and an S3 endpoint.

A published catalog is plain files, so any static server is an origin. :class:`NginxOrigin`
runs the distribution's nginx (Debian's ``nginx-light``; ``scripts/_env.sh`` installs it)
in the foreground in a child process, on an ephemeral 127.0.0.1 port, with a server block
that includes the repository's own locations file (``cloud/deploy/nginx/
sakura-packs.locations``, the one operators install) and its ``root`` at the catalog.
:class:`MotoS3` runs the ``moto`` S3 server (the dev extras) in a child process; the
catalog is uploaded with :func:`sakura.cloud.publish.mirror_to_storage`. Both stop (and
leave nothing behind) when their ``with`` block ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from sakura.cloud.errors import CloudError

DEPLOY = Path(__file__).resolve().parent / "deploy"
NGINX_LOCATIONS = DEPLOY / "nginx" / "sakura-packs.locations"
NGINX_SITE = DEPLOY / "nginx" / "sakura-packs.conf"


def nginx_binary() -> str | None:
    """The nginx executable (PATH, then /usr/sbin), or None when it is not installed."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(proc: subprocess.Popen[bytes], url: str, what: str, timeout_s: float = 20.0,
               log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            detail = log.read_text(errors="replace")[-1500:] if log and log.exists() else ""
            raise CloudError(f"{what} exited at start ({proc.returncode}): {detail}")
        try:
            with urllib.request.urlopen(url, timeout=1.0):
                return
        except urllib.error.HTTPError:
            return  # it answers (404 for an absent path is fine)
        except OSError:
            time.sleep(0.05)
    raise CloudError(f"{what} did not answer at {url} within {timeout_s:.0f}s")


def _stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - a stuck child
        proc.kill()
        proc.wait()


class NginxOrigin:
    """``with NginxOrigin(catalog_dir) as url:`` nginx serving the catalog on 127.0.0.1."""

    def __init__(self, root: str | os.PathLike[str], port: int | None = None,
                 workers: int = 1, http2: bool = False, access_log: bool = False) -> None:
        self.root = Path(root).resolve()
        self.port = port or free_port()
        self.workers = workers
        # a second listener with the same site speaking HTTP/2 over cleartext with prior
        # knowledge only (`listen PORT http2;`: nginx 1.22 has no h2c upgrade and no
        # HTTP/1.1 on that port), at h2_url
        self.h2_port = free_port() if http2 else None
        # log each request's protocol and connection (read with access_log_lines())
        self.access_log = access_log
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def h2_url(self) -> str:
        """The HTTP/2 (h2c, prior knowledge) listener's URL (``http2=True``)."""
        if self.h2_port is None:
            raise CloudError("this nginx origin has no HTTP/2 listener (http2=True)")
        return f"http://127.0.0.1:{self.h2_port}"

    def access_log_lines(self) -> list[str]:
        """The access log so far, one ``PROTOCOL CONNECTION METHOD URI STATUS`` line a
        request (``access_log=True``; nginx writes each line when its request ends)."""
        if self._dir is None or not self.access_log:
            return []
        path = Path(self._dir.name) / "access.log"
        return path.read_text().splitlines() if path.exists() else []

    def config(self, prefix: Path) -> str:
        user = "user root;\n" if os.geteuid() == 0 else ""  # workers must read the catalog
        temp = "\n".join(f"    {name}_temp_path {prefix}/{name};"
                         for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        log = (f"    log_format proto '$server_protocol $connection $request_method $uri "
               f"$status';\n    access_log {prefix}/access.log proto;"
               if self.access_log else "    access_log off;")
        h2 = ("" if self.h2_port is None else
              f"    server {{\n        listen 127.0.0.1:{self.h2_port} http2;\n"
              f"        root {self.root};\n        include {NGINX_LOCATIONS};\n    }}\n")
        return f"""{user}daemon off;
worker_processes {self.workers};
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 1024; }}
http {{
{log}
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
{temp}
    server {{
        listen 127.0.0.1:{self.port};
        root {self.root};
        include {NGINX_LOCATIONS};
    }}
{h2}}}
"""

    def start(self) -> str:
        binary = nginx_binary()
        if binary is None:
            raise CloudError("nginx is not installed (Debian: apt-get install nginx-light; "
                             "scripts/_env.sh does it)")
        self._dir = tempfile.TemporaryDirectory(prefix="sakura-nginx-")
        prefix = Path(self._dir.name)
        conf = prefix / "nginx.conf"
        conf.write_text(self.config(prefix))
        check = subprocess.run([binary, "-t", "-q", "-p", str(prefix), "-c", str(conf)],
                               capture_output=True, text=True)
        if check.returncode != 0:
            self.stop()
            raise CloudError(f"nginx rejects the configuration: {check.stderr.strip()[-1500:]}")
        self._proc = subprocess.Popen([binary, "-p", str(prefix), "-c", str(conf)],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        try:
            _wait_http(self._proc, self.url + "/catalog.json", "nginx", log=prefix / "error.log")
        except BaseException:
            self.stop()
            raise
        return self.url

    def stop(self) -> None:
        _stop(self._proc, signal.SIGQUIT)  # graceful: workers finish their requests
        self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class MotoS3:
    """``with MotoS3() as endpoint:`` an S3-compatible endpoint (moto) on 127.0.0.1.

    Sets nothing globally; use :meth:`env` for the AWS environment a client needs."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Standard AWS variables pointing at this endpoint (moto accepts any key)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self) -> str:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from moto.server import main; main()",
             "-H", "127.0.0.1", "-p", str(self.port)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_http(self._proc, self.endpoint + "/", "the moto S3 server", timeout_s=60.0)
        except BaseException:
            self.stop()
            raise
        return self.endpoint

    def create_bucket(self, name: str) -> None:
        import boto3

        env = self.env()
        boto3.client("s3", endpoint_url=self.endpoint, region_name=env["AWS_DEFAULT_REGION"],
                     aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]).create_bucket(
                         Bucket=name)

    def stop(self) -> None:
        _stop(self._proc)
        self._proc = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
