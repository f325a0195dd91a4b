"""``sakura serve DIR`` in a child process, as a real server runs: what the benches and the
replay stream from (an inherited 127.0.0.1 socket, optionally pinned to the network's CPUs)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from sakura.edge.errors import EdgeError
from sakura.traces.linkproc import pin


class ServerProcess:
    """``sakura serve DIR`` in a child process on an inherited 127.0.0.1 socket, pinned to
    ``cpus`` when given (the device runtime runs on the others)."""

    def __init__(self, catalog_dir: Path, cpus: set[int] | None = None) -> None:
        self.catalog_dir = Path(catalog_dir)
        self.cpus = cpus
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> ServerProcess:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.port = int(sock.getsockname()[1])
        cmd = [sys.executable, "-m", "sakura.cli", "serve", str(self.catalog_dir),
               "--fd", str(sock.fileno()), "--log-level", "warning", "--no-access-log"]
        self.proc = subprocess.Popen(cmd, pass_fds=(sock.fileno(),),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        sock.close()
        if self.cpus:
            pin(self.proc.pid, self.cpus)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise EdgeError(f"sakura serve exited ({self.proc.returncode}): {err[-500:]}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise EdgeError("sakura serve did not come up in time")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
