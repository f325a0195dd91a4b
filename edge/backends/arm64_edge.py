"""``sakura-edge`` built for arm64 and run under qemu-aarch64 (issue 31 item 3).

The same CMake target as on x86 (``-DSAKURA_EDGE=ON``: ``native/src/edge/`` over the
``sakura_edit`` core the Python module links) is cross-compiled with Debian's
``g++-aarch64-linux-gnu`` through ``native/cmake/aarch64-linux-gnu.cmake``, against:

* the ``executorch`` wheel for ``manylinux_2_28_aarch64`` (same version as the host's),
  downloaded with pip and unpacked under ``~/.cache/sakura/arm64`` (``SAKURA_ARM64_CACHE``),
  never inside the repository: its ``_portable_lib`` (runtime, portable kernels, XNNPACK) and
  its headers;
* the ``torch`` wheel for the same platform (same version as the host's), of which only the
  libraries the portable lib needs at load time are unpacked: on aarch64 it takes
  pthreadpool, cpuinfo and KleidiAI from ``libtorch_cpu.so`` (they are not inside it as on
  x86), plus ``libc10.so``. PyPI's aarch64 torch is the CUDA build: the two CUDA libraries
  ``libtorch_cpu.so`` names (``libcudart.so.13``, ``libcupti.so.13``, profiler hooks) are
  replaced by generated stubs returning errors, and ``libtorch.so`` / ``libtorch_python.so``
  (which only pull in CUDA and Python bindings) by stubs whose functions abort with a
  ``sakura-edge: error:`` line if ever called (:func:`make_stubs`);
* Debian's arm64 multiarch packages (``libcurl4-openssl-dev:arm64 libssl-dev:arm64
  libpng-dev:arm64 libutf8proc-dev:arm64 libpython3.11:arm64``; ``scripts/_env.sh``): libpython
  is linked as on x86 because the portable lib, a Python extension, references its symbols;
  nothing calls into it (measured: :func:`interpreter_check`).

The binary runs on this x86 host under ``qemu-aarch64`` with the multiarch arm64 runtime
(:func:`sakura.edge.backends.arm64.qemu_prefix`). Emulated
timings say nothing about a phone and are never reported as such.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

from sakura.edge.backends.arm64 import (
    QEMU,
    TRIPLE,
    cache_root,
    machine,
    native_dir,
    qemu_prefix,
    toolchain_file,
)
from sakura.edge.backends.errors import BackendError, BackendUnavailable

PLATFORM = "manylinux_2_28_aarch64"
MULTIARCH = Path("/usr/lib") / TRIPLE
PYTHON_LIB = MULTIARCH / "libpython3.11.so.1.0"
APT_ARM64 = ("libcurl4-openssl-dev:arm64 libssl-dev:arm64 libpng-dev:arm64 "
             "libutf8proc-dev:arm64 libpython3.11:arm64 libstdc++6:arm64")
# what the set-up must have installed for the cross build: header or library per package
ARM64_FILES = {"libcurl4-openssl-dev:arm64": MULTIARCH / "libcurl.so",
               "libssl-dev:arm64": MULTIARCH / "libcrypto.so",
               "libpng-dev:arm64": MULTIARCH / "libpng.so",
               "libutf8proc-dev:arm64": MULTIARCH / "libutf8proc.so",
               "libpython3.11:arm64": PYTHON_LIB,
               "libstdc++6:arm64": MULTIARCH / "libstdc++.so.6",
               "libc6:arm64": Path("/lib/ld-linux-aarch64.so.1")}
# torch/lib files of the aarch64 wheel that libtorch_cpu.so and libc10.so need (the rest is
# CUDA, or replaced by stubs)
TORCH_LIBS = ("libc10.so", "libtorch_cpu.so", "libgomp.so.1", "libarm_compute.so",
              "libarm_compute_graph.so", "libnvpl_blas_core.so.0",
              "libnvpl_blas_lp64_gomp.so.0", "libnvpl_lapack_core.so.0",
              "libnvpl_lapack_lp64_gomp.so.0", "libgfortran.so.5")
STUBBED = ("libcudart.so.13", "libcupti.so.13", "libtorch.so", "libtorch_python.so")


def _base_version(dist: str) -> str:
    return version(dist).split("+")[0]


def check_prerequisites() -> None:
    """:class:`BackendUnavailable` naming what is missing for the arm64 ``sakura-edge``."""
    tools = [t for t in (f"{TRIPLE}-g++", f"{TRIPLE}-gcc", f"{TRIPLE}-readelf", QEMU, "cmake")
             if shutil.which(t) is None]
    if tools:
        raise BackendUnavailable(f"the arm64 sakura-edge needs {', '.join(tools)} (Debian: "
                                 "apt-get install g++-aarch64-linux-gnu qemu-user cmake)")
    missing = [pkg for pkg, f in ARM64_FILES.items() if not f.exists()]
    if missing:
        raise BackendUnavailable(
            f"the arm64 sakura-edge needs Debian's arm64 packages {' '.join(missing)} "
            f"(dpkg --add-architecture arm64 && apt-get update && apt-get install "
            f"{APT_ARM64}; scripts/_env.sh does it as root)")


def _run(cmd: list[str], timeout: float, what: str, **kw) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as exc:
        raise BackendError(f"{what} did not finish in {timeout:.0f} s") from exc
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise BackendError(f"{what} failed:\n" + "\n".join(tail))
    return done


def _download(spec: str, wheels: Path) -> Path:
    name = spec.split("==")[0]
    found = sorted(wheels.glob(f"{name}-{spec.split('==')[1]}-*{PLATFORM}.whl"))
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
          "--platform", PLATFORM, "--python-version", "3.11", spec, "-d", str(wheels)],
         1800, f"pip download {spec} ({PLATFORM})")
    found = sorted(wheels.glob(f"{name}-*{PLATFORM}.whl"))
    if not found:
        raise BackendError(f"pip download {spec} wrote no {PLATFORM} wheel into {wheels}")
    return found[0]


def fetch_runtime(root: Path | None = None) -> Path:
    """The aarch64 ExecuTorch runtime, fetched once and cached: returns a site folder with
    ``executorch/`` (headers, ``_portable_lib``) and ``torch/lib/`` (the libraries above
    and the stubs), laid out as the wheels install them so the portable lib's own RUNPATH
    (``$ORIGIN/../../../torch/lib``) finds its dependencies."""
    check_prerequisites()
    root = Path(root) if root is not None else cache_root()
    et, tv = _base_version("executorch"), _base_version("torch")
    site = root / f"site-executorch{et}-torch{tv}"
    stamp = site / ".complete"
    if stamp.exists():
        return site
    wheels = root / "wheels"
    et_whl = _download(f"executorch=={et}", wheels)
    torch_whl = _download(f"torch=={tv}", wheels)
    tmp = site.with_name(site.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(et_whl) as z:
        for n in z.namelist():
            if n.startswith("executorch/include/") or re.match(
                    r"executorch/extension/pybindings/_portable_lib\..*\.so$", n):
                z.extract(n, tmp)
    with zipfile.ZipFile(torch_whl) as z:
        for lib in TORCH_LIBS:
            z.extract(f"torch/lib/{lib}", tmp)
    make_stubs(tmp / "torch" / "lib", portable_lib(tmp))
    shutil.rmtree(site, ignore_errors=True)  # an earlier, unfinished one
    tmp.rename(site)
    stamp.write_text(f"{et_whl.name}\n{torch_whl.name}\n")
    return site


def portable_lib(site: Path) -> Path:
    found = sorted((Path(site) / "executorch/extension/pybindings").glob("_portable_lib.*.so"))
    if not found:
        raise BackendError(f"no _portable_lib in {site}")
    return found[0]


def _dyn_symbols(lib: Path) -> list[tuple[str, str, str, str]]:
    """(type, bind, ndx, name) of ``lib``'s dynamic symbols (``readelf --dyn-syms``)."""
    out = _run([f"{TRIPLE}-readelf", "-W", "--dyn-syms", str(lib)], 120,
               f"readelf {lib.name}").stdout
    rows = []
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 8 and f[0].endswith(":"):
            rows.append((f[3], f[4], f[6], f[7]))
    return rows


def _defined(lib: Path) -> set[str]:
    return {n.split("@")[0] for _t, _b, ndx, n in _dyn_symbols(lib) if ndx != "UND"}


STUB_HEADER = """\
#include <stdio.h>
#include <stdlib.h>
/* generated by sakura.edge.backends.arm64_edge.make_stubs: {what} */
static void sakura_stub_called(const char* n) {{
  fprintf(stderr, "sakura-edge: error: %s was called: a stub of the arm64 build ({what})\\n", n);
  abort();
}}
"""


def _compile_stub(out_dir: Path, soname: str, source: str, version_node: str | None,
                  needed: list[str] = ()) -> None:
    src = out_dir / f".{soname}.c"
    src.write_text(source)
    cmd = [f"{TRIPLE}-gcc", "-shared", "-fPIC", "-O1", "-o", str(out_dir / soname), str(src),
           f"-Wl,-soname,{soname}"]
    if version_node:
        vs = out_dir / f".{soname}.map"
        vs.write_text(f"{version_node} {{ global: *; }};\n")
        cmd.append(f"-Wl,--version-script={vs}")
    if needed:
        cmd += [f"-L{out_dir}", "-Wl,--no-as-needed", *[f"-l:{n}" for n in needed]]
    _run(cmd, 120, f"compiling the {soname} stub")


def make_stubs(lib_dir: Path, portable: Path) -> list[str]:
    """Write the stub libraries of :data:`STUBBED` into ``lib_dir`` (next to the real
    ``libtorch_cpu.so`` and ``libc10.so``); returns their names."""
    lib_dir = Path(lib_dir)
    cpu = lib_dir / "libtorch_cpu.so"
    # CUDA runtime and CUPTI: what libtorch_cpu.so's (profiler) code imports, versioned;
    # every function reports an error (no device), none is called by an edit
    for soname, err in (("libcudart.so.13", 100), ("libcupti.so.13", 1)):
        names = sorted({n.split("@")[0] for t, _b, ndx, n in _dyn_symbols(cpu)
                        if ndx == "UND" and n.endswith(f"@{soname}")})
        body = [f"/* {soname}: no CUDA on this build; every call fails */",
                'static const char sakura_no_cuda[] = "no CUDA (sakura arm64 stub)";']
        for n in names:
            if n == "cudaGetErrorString":
                body.append(f"const char* {n}(int e) {{ (void)e; return sakura_no_cuda; }}")
            else:
                body.append(f"int {n}(void) {{ return {err}; }}")
        _compile_stub(lib_dir, soname, "\n".join(body) + "\n", soname)
    # libtorch.so: torch's umbrella library (it only adds libtorch_cuda.so)
    _compile_stub(lib_dir, "libtorch.so", "/* torch's umbrella library, CPU only */\n",
                  None, ["libtorch_cpu.so"])
    # libtorch_python.so: what the portable lib imports that neither libtorch_cpu, libc10
    # nor libpython defines (the pybind11 casters of at::Tensor): abort if ever called
    have = _defined(cpu) | _defined(lib_dir / "libc10.so") | _defined(PYTHON_LIB)
    wanted = sorted({(t, n) for t, b, ndx, n in _dyn_symbols(portable)
                     if ndx == "UND" and "@" not in n and b != "WEAK" and n not in have})
    what = "torch's Python bindings are not part of it"
    src = [STUB_HEADER.format(what=what)]
    for i, (t, n) in enumerate(wanted):
        if t == "OBJECT":
            src.append(f'char sakura_obj{i}[4096] __asm__("{n}");')
        else:
            src.append(f'void sakura_fn{i}(void) __asm__("{n}");\n'
                       f'void sakura_fn{i}(void) {{ sakura_stub_called("{n}"); }}')
    _compile_stub(lib_dir, "libtorch_python.so", "\n".join(src) + "\n", None)
    return list(STUBBED)


def configure_args(site: Path, build_dir: Path) -> list[str]:
    """The CMake configure command of the arm64 ``sakura-edge``."""
    import torch  # lazy: torch (the host's headers are the arch-independent c10 headers)

    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    return ["cmake", "-S", str(native_dir()), "-B", str(build_dir), *gen,
            f"-DCMAKE_TOOLCHAIN_FILE={toolchain_file()}", "-DCMAKE_BUILD_TYPE=Release",
            "-DSAKURA_PYTHON=OFF", "-DSAKURA_TOOL=OFF", "-DSAKURA_EDGE=ON",
            "-DSAKURA_OPENCL=OFF", f"-DPython_EXECUTABLE={sys.executable}",
            f"-DSAKURA_EXECUTORCH_DIR={site / 'executorch'}",
            f"-DSAKURA_TORCH_DIR={Path(torch.__file__).parent}",
            f"-DSAKURA_EXECUTORCH_VERSION={_base_version('executorch')}",
            f"-DSAKURA_PYTHON_LIBRARY={PYTHON_LIB}",
            f"-DSAKURA_EDGE_RPATH={site / 'torch' / 'lib'}"]


def build(build_dir: Path, jobs: int = 2, timeout: float = 1800,
          site: Path | None = None) -> Path:
    """Fetch the runtime (cached), configure (once) and build ``sakura-edge`` for arm64;
    returns the binary (an aarch64 ELF)."""
    site = fetch_runtime() if site is None else Path(site)
    build_dir = Path(build_dir)
    if not (build_dir / "CMakeCache.txt").exists():
        build_dir.mkdir(parents=True, exist_ok=True)
        _run(configure_args(site, build_dir), timeout, "cmake configure (sakura-edge, arm64)")
    _run(["nice", "-n", "10", "cmake", "--build", str(build_dir), "-j", str(jobs),
          "--target", "sakura-edge"], timeout, "cmake build (sakura-edge, arm64)")
    binary = build_dir / "sakura-edge"
    if machine(binary) != "aarch64":
        raise BackendError(f"{binary} is not an aarch64 executable ({machine(binary)})")
    return binary


def qemu_command(binary: Path, strace: bool = False) -> list[str]:
    """How the arm64 binary runs here: qemu-user in :func:`~sakura.edge.backends.arm64.qemu_prefix`
    (``-strace``: every system call of the emulated program, to stderr)."""
    return [QEMU, "-L", str(qemu_prefix()), *(["-strace"] if strace else []), str(binary)]
