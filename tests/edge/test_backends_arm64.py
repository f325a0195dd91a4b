"""The native runtime cross-compiled for arm64 (g++-aarch64-linux-gnu, CMake toolchain file
native/cmake/aarch64-linux-gnu.cmake) and run under qemu-aarch64: selftest, and every
reconstructed tensor of a pack's shards against the x86 Python decoder (~1 min: the build
is ~10 s of compiler time, the emulated runs a few seconds)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from sakura.codec.pack import Manifest
from sakura.edge.backends import arm64
from sakura.edge.native_bench import NativeBenchConfig, export_shards

TOOLS = ("aarch64-linux-gnu-g++", "qemu-aarch64", "cmake")
pytestmark = pytest.mark.skipif(
    any(shutil.which(t) is None for t in TOOLS),
    reason=f"needs {', '.join(TOOLS)} (scripts/_env.sh installs them: {arm64.APT_PACKAGES})")


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    build = tmp_path_factory.mktemp("arm64-build")
    return build, arm64.build(build)


@pytest.fixture(scope="module")
def shards(world, tmp_path_factory):
    """Configurations of the world's sakura pack and the Python decoder's tensors."""
    manifests = [p for p in world.catalog_dir.rglob("*manifest.json")
                 if Manifest.load(p).codec == "sakura"]
    assert manifests, sorted(world.catalog_dir.rglob("*"))
    out = tmp_path_factory.mktemp("arm64-shards")
    m = Manifest.load(manifests[0])
    info = export_shards(NativeBenchConfig(pack_dir=manifests[0].parent,
                                           template=m.template_id, shards=3,
                                           configs_per_shard=4), out)
    assert info["shards"] >= 6
    return out


def test_the_build_is_an_arm64_binary_with_a_neon_kernel(binary):
    build, exe = binary
    assert arm64.machine(exe) == "aarch64"
    assert arm64.neon_instructions(build) > 0  # the generic kernel's vectors: fmla v.4s
    st = arm64.emulate(exe, "selftest")
    assert st.returncode == 0 and "selftest passed" in st.stdout, st.stdout + st.stderr
    assert "FAIL" not in st.stdout


def test_arm64_reconstruction_matches_the_python_decoder(binary, shards):
    build, _exe = binary
    got = arm64.check(build, shards)
    assert got.built and got.machine == "aarch64" and got.selftest == "ok"
    assert got.kernel == "neon"
    assert got.mismatches == 0 and got.max_rel_err <= arm64.REL_BOUND  # measured 0
    assert got.shards == len([ln for ln in (shards / "shards.txt").read_text().splitlines()
                              if ln.startswith("shard ")])


def test_a_wrong_tensor_is_reported(binary, shards, tmp_path):
    """The emulated check can fail: one expected value off by 1e-3 of the tensor's scale."""
    _build, exe = binary
    bad = tmp_path / "shards"
    shutil.copytree(shards, bad)
    target = sorted(bad.glob("expected*.f32"))[0]
    want = np.fromfile(target, dtype=np.float32)
    want[len(want) // 2] += 1e-3 * float(np.abs(want).max())
    want.tofile(target)
    run = arm64.emulate(exe, "run", str(bad))
    assert run.returncode == 1
    assert '"mismatches": 1' in run.stdout


def test_bench_opencl_key_on_the_pack(world):
    """`sakura bench backends`'s opencl key on the same pack (pocl here)."""
    native = pytest.importorskip("sakura_native")
    if not native.opencl_available()[0]:
        pytest.skip(native.opencl_available()[1])
    from sakura.edge.backends.phone_bench import bench_opencl

    path = next(p for p in world.catalog_dir.rglob("*manifest.json")
                if Manifest.load(p).codec == "sakura")
    doc = bench_opencl(path.parent, Manifest.load(path).template_id, shards=2, configs=3,
                       repeats=1)
    assert doc["configs"] == 6 and doc["device"]
    assert doc["max_abs_err_vs_cpu"] <= 1e-5 * doc["max_abs_value"]  # measured 0
    assert doc["gbps"] > 0 and doc["cpu_gbps"] > 0
    assert doc["work_groups"]["dequantize"] >= 1 and len(doc["work_groups"]["product"]) == 2
