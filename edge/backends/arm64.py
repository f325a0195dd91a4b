"""The native runtime built for arm64 and run under emulation: the phone's CPU side, here.

``native/`` (``sakura_core`` and the standalone ``sakura-native`` tool, no Python) is
cross-compiled with Debian's ``g++-aarch64-linux-gnu`` through the CMake toolchain file
``native/cmake/aarch64-linux-gnu.cmake`` (the same CMake targets the Android NDK toolchain
builds); the product kernel is the generic one, whose 4-float vectors are NEON registers on
arm64 (the tool reports ``kernel: "neon"``). The binary runs on this x86 host under
``qemu-aarch64`` (qemu-user): ``sakura-native selftest`` (pipeline semantics) and
``sakura-native run DIR`` on shards exported by the host (``sakura.edge.native_bench``:
configuration bytes + the x86 Python decoder's float32 tensors), which checks every
reconstructed tensor against the Python decoder's within the tool's bound (max abs error
<= 1e-5 of the tensor's max abs value). Emulated timings say nothing about a phone's
speed and are not reported as such.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sakura.edge.backends.errors import BackendError, BackendUnavailable

TRIPLE = "aarch64-linux-gnu"
SYSROOT = Path("/usr") / TRIPLE
QEMU = "qemu-aarch64"
APT_PACKAGES = "g++-aarch64-linux-gnu qemu-user cmake ninja-build"
REL_BOUND = 1e-5  # native/src/tools/sakura_native.cpp: a shard mismatches above this


MULTIARCH_LOADER = Path("/lib/ld-linux-aarch64.so.1")  # Debian's libc6:arm64


def cache_root() -> Path:
    """Where the arm64 runtime and the qemu prefix are kept (never in the repository)."""
    env = os.environ.get("SAKURA_ARM64_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sakura" / "arm64"


def native_dir() -> Path:
    """The repository's ``native/`` folder (the sources are built from there)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "native" / "CMakeLists.txt").is_file():
            return parent / "native"
    raise BackendUnavailable("the arm64 build needs the repository's native/ sources "
                             "(an editable install of sakura-kv)")


def toolchain_file() -> Path:
    return native_dir() / "cmake" / f"{TRIPLE}.cmake"


def check_tools() -> None:
    """:class:`BackendUnavailable` naming what to install when a tool is missing."""
    missing = [t for t in (f"{TRIPLE}-g++", QEMU, "cmake") if shutil.which(t) is None]
    if missing:
        raise BackendUnavailable(f"the arm64 build needs {', '.join(missing)} (Debian: "
                                 f"apt-get install {APT_PACKAGES})")


def _run(cmd: list[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise BackendError(f"{what} did not finish in {timeout:.0f} s") from exc
    return done


def build(build_dir: Path, jobs: int = 2, timeout: float = 900) -> Path:
    """Configure and build ``sakura-native`` for arm64 (Release, SAKURA_PYTHON=OFF);
    returns the binary. Incremental: an existing build folder is reused."""
    check_tools()
    build_dir = Path(build_dir)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", str(native_dir()), "-B", str(build_dir), *gen,
                 f"-DCMAKE_TOOLCHAIN_FILE={toolchain_file()}", "-DCMAKE_BUILD_TYPE=Release",
                 "-DSAKURA_PYTHON=OFF", "-DSAKURA_TOOL=ON"]
    for cmd, what in ((configure, "cmake configure (arm64)"),
                      (["cmake", "--build", str(build_dir), "-j", str(jobs)],
                       "cmake build (arm64)")):
        done = _run(cmd, timeout, what)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
            raise BackendError(f"{what} failed:\n" + "\n".join(tail))
    binary = build_dir / "sakura-native"
    if not binary.is_file():
        raise BackendError(f"the arm64 build wrote no {binary}")
    return binary


def machine(binary: Path) -> str:
    """The ELF machine of ``binary`` (``"aarch64"`` for an arm64 build)."""
    head = Path(binary).read_bytes()[:20]
    if head[:4] != b"\x7fELF":
        return "not ELF"
    e_machine = int.from_bytes(head[18:20], "little")
    return {0xB7: "aarch64", 0x3E: "x86_64", 0x28: "arm"}.get(e_machine, hex(e_machine))


def emulate(binary: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run an arm64 binary under qemu-user with Debian's arm64 runtime libraries
    (:func:`qemu_prefix`)."""
    check_tools()
    return _run([QEMU, "-L", str(qemu_prefix()), str(binary), *args], timeout,
                f"{QEMU} {Path(binary).name} {' '.join(args)}")


def neon_instructions(build_dir: Path) -> int:
    """``fmla vN.4s`` (NEON fused multiply-add) instructions in the product kernel object."""
    objs = list(Path(build_dir).rglob("sakura_product_generic.dir/**/product.cpp.o"))
    tool = shutil.which(f"{TRIPLE}-objdump")
    if not objs or tool is None:
        return 0
    text = subprocess.run([tool, "-d", str(objs[0])], capture_output=True, text=True).stdout
    return sum(1 for line in text.splitlines() if "fmla" in line and ".4s" in line)


# What an arm64 Linux kernel shows of its CPUs, for qemu-user 7.2, which passes the x86
# host's /proc/cpuinfo through: cpuinfo (XNNPACK's, inside libtorch_cpu.so) finds no ARM
# processor there and libtorch_cpu's start-up dereferences its empty tables (SIGSEGV).
# A Neoverse-N1 (MIDR 0x413fd0c1), whose features qemu's default CPU has.
CPUINFO = ("processor\t: {i}\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull "
           "sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\n"
           "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\n"
           "CPU part\t: 0xd0c\nCPU revision\t: 1\n\n")
MIDR = "0x00000000413fd0c1\n"


def qemu_root(root: Path | None = None) -> Path:
    """The ``-L`` prefix qemu-user runs the binary in: an arm64 ``/proc/cpuinfo`` and the
    per-CPU MIDR_EL1 files, nothing else. qemu looks every absolute path up under the prefix
    first and falls back to the host's, so the loader (``/lib/ld-linux-aarch64.so.1``) and
    every library come from Debian's arm64 multiarch packages (libc6:arm64,
    libstdc++6:arm64, ...). Not the cross toolchain's ``/usr/aarch64-linux-gnu``: its glibc
    is another build than libc6:arm64's, and the binary's libraries (libcurl, libpython)
    pull in the multiarch libc.so.6; a loader of one build with the libc of the other
    hangs in ``pthread_create``."""
    root = (Path(root) if root is not None else cache_root()) / "qemu-root"
    lib = root / "usr" / "lib" / TRIPLE
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    possible = Path("/sys/devices/system/cpu/possible")
    if possible.exists():
        last = possible.read_text().strip().split(",")[-1].split("-")[-1]
        cpus = int(last) + 1 if last.isdigit() else cpus
    (root / "proc").mkdir(parents=True, exist_ok=True)
    # the C++ runtime when libstdc++6:arm64 is not installed: the cross toolchain's (the same
    # GCC; it does not depend on the glibc build)
    for name in ("libstdc++.so.6", "libgcc_s.so.1"):
        if not (Path("/usr/lib") / TRIPLE / name).exists() and not (lib / name).exists():
            lib.mkdir(parents=True, exist_ok=True)
            (lib / name).symlink_to(SYSROOT / "lib" / name)
    (root / "proc" / "cpuinfo").write_text("".join(CPUINFO.format(i=i) for i in range(cpus)))
    for i in range(cpus):
        d = root / f"sys/devices/system/cpu/cpu{i}/regs/identification"
        d.mkdir(parents=True, exist_ok=True)
        (d / "midr_el1").write_text(MIDR)
    return root


def qemu_prefix() -> Path:
    """The ``-L`` prefix of qemu-aarch64: :func:`qemu_root` once Debian's arm64 libc is
    installed (multiarch; any multiarch library the binary links pulls it in), else the cross
    toolchain's sysroot."""
    return qemu_root() if MULTIARCH_LOADER.exists() else SYSROOT


@dataclass
class Arm64Result:
    """What ``sakura bench backends`` reports under ``arm64``."""

    built: bool
    machine: str
    selftest: str             # "ok" or the failing output
    kernel: str               # what the arm64 tool reports: "neon" (or "generic")
    shards: int
    mismatches: int
    max_rel_err: float        # vs the x86 Python decoder's tensors (bound REL_BOUND)
    neon_fmla: int            # fmla v.4s instructions in the product kernel object

    def to_dict(self) -> dict[str, Any]:
        return {"built": self.built, "machine": self.machine, "selftest": self.selftest,
                "kernel": self.kernel, "shards": self.shards, "mismatches": self.mismatches,
                "max_rel_err": self.max_rel_err, "bound": REL_BOUND,
                "neon_fmla": self.neon_fmla, "emulator": QEMU}


def check(build_dir: Path, shards_dir: Path, jobs: int = 2) -> Arm64Result:
    """Build for arm64, run the selftest and ``run shards_dir`` under emulation."""
    binary = build(build_dir, jobs)
    st = emulate(binary, "selftest", timeout=300)
    selftest = "ok" if st.returncode == 0 and "selftest passed" in st.stdout else (
        (st.stdout + st.stderr).strip()[-500:] or f"exit {st.returncode}")
    run = emulate(binary, "run", str(shards_dir))
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise BackendError(f"sakura-native run (arm64) printed no result: "
                           f"{(run.stdout + run.stderr).strip()[-500:]}")
    doc = json.loads(lines[-1])
    return Arm64Result(True, machine(binary), selftest, str(doc["kernel"]), int(doc["shards"]),
                       int(doc["mismatches"]), float(doc["max_rel_err"]),
                       neon_instructions(build_dir))
