"""The package people install: one `sakura` namespace, declared dependencies and extras, and
a wheel that works outside the repository.

The wheel test builds the wheel from the working tree, installs it (not editable) into a
fresh virtual environment whose dependencies come from this environment's site-packages
(no download, no torch install), checks that the shipped catalog loads from the installed
package, and runs `sakura build` on a shipped catalog template (its installed image and mask,
at 4 steps and one profiling prompt instead of 20 and three: 12 s of CPU instead of 48 s)
and `sakura pack inspect` on the result there, from a folder outside the repository.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

from sakura import __version__
from sakura.extras import EXTRA_OF_MODULE

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("sakura", "dit", "codec", "cloud", "edge", "traces")  # what the wheel installs
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement string."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


CORE = {_name(r) for r in PYPROJECT["dependencies"]}
EXTRAS = {extra: {_name(r) for r in reqs} for extra, reqs in
          PYPROJECT["optional-dependencies"].items()}


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> files importing it (at any depth), over the installed folders."""
    own = {"sakura", "sakura_native", "__future__"}
    found: dict[str, set[str]] = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in own:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared():
    """Each third-party module the code imports comes from a distribution that the core or
    the extra ``sakura.extras`` names for it declares (so a missing one names its extra)."""
    providers = importlib.metadata.packages_distributions()
    problems = []
    for module, files in sorted(_third_party_imports().items()):
        dists = {_name(d) for d in providers.get(module, [])}
        if dists & CORE:
            continue
        extra = EXTRA_OF_MODULE.get(module)
        if extra is None or not dists & EXTRAS.get(extra, set()):
            problems.append(f"{module} (imported by {sorted(files)[0]}; distributions "
                            f"{sorted(dists)}; sakura.extras says {extra!r})")
    assert problems == []


def test_the_extras_table_matches_pyproject():
    providers = importlib.metadata.packages_distributions()
    assert set(EXTRAS) == {"model", "executorch", "qnn", "aihub", "diffusers", "s3", "ray",
                           "dev", "all"}
    for module, extra in EXTRA_OF_MODULE.items():
        dists = {_name(d) for d in providers.get(module, [])}
        assert dists & EXTRAS[extra], (module, extra)
        assert not dists & CORE, f"{module} is in the core: it needs no extra"
    # the core is the serving side: no model, no device runtime
    assert not CORE & {"torch", "safetensors", "transformers", "aiohttp", "diffusers",
                       "executorch", "boto3", "httpx"}
    assert EXTRAS["all"] == {"sakura-kv"}
    assert re.search(r"\[(.*)\]", PYPROJECT["optional-dependencies"]["all"][0]).group(1) \
        .split(",") == ["model", "executorch", "qnn", "aihub", "diffusers", "s3", "ray"]
    assert "httpx" in EXTRAS["dev"]  # used by tests only


def _source_copy(dest: Path) -> Path:
    """The working tree as a fresh clone would see it (tracked and new files, not ignored)."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], cwd=ROOT, capture_output=True,
                                check=True).stdout.decode().split("\0")
        for rel in filter(None, listed):
            src = ROOT / rel
            if src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    else:  # pragma: no cover - an exported tree without git
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "packs", "runs",
            "out", "data", ".cache"))
    return dest


def test_the_wheel_installs_and_runs_outside_the_repository(tmp_path):
    src = _source_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "--no-index", str(src), "-w", str(dist)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    (wheel,) = dist.glob("sakura_kv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # one namespace: nothing but sakura/ (the native module is a package of its own)
    assert {n.split("/")[0] for n in names} == {"sakura", f"sakura_kv-{__version__}.dist-info"}
    shipped = {f"sakura/dit/catalog/{p.name}" for p in (ROOT / "dit" / "catalog").iterdir()
               if p.suffix in (".png", ".json", ".md")}
    assert len([n for n in shipped if n.endswith(".png")]) == 16
    assert shipped <= names
    assert {"sakura/dit/weights/sakura-mmdit.safetensors", "sakura/codec/FORMAT.md",
            "sakura/codec/manifest.schema.json",
            "sakura/edge/replay/configs/default.yaml", "sakura/edge/replay/configs/paper.yaml",
            "sakura/dit/adapters/cli.py", "sakura/cli.py"} <= names

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                              "-q", "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    site = subprocess.run([str(python), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                          text=True, check=True).stdout.strip()
    # the dependencies: this environment's packages, after the wheel's own on sys.path
    (Path(site) / "sakura-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "elsewhere"  # not the repository: its top-level folders are not on sys.path
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}

    def there(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([*argv], capture_output=True, text=True, cwd=work, env=env,
                              timeout=timeout)

    probe = there(str(python), "-c", (
        "import importlib, json, sakura, sakura.dit, sakura.codec, sakura.cloud, sakura.edge, "
        "sakura.traces\n"
        "missing = []\n"
        "for m in ('dit', 'codec', 'cloud', 'edge', 'traces'):\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ModuleNotFoundError:\n"
        "        missing.append(m)\n"
        "from sakura.dit.templates import DEFAULT_CATALOG, load_catalog\n"
        "shipped = load_catalog()  # the default: the installed package's (files checked)\n"
        "print(json.dumps({'sakura': sakura.__file__, 'dit': sakura.dit.__file__, "
        "'missing': missing, 'catalog': str(DEFAULT_CATALOG), 'templates': list(shipped)}))"))
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert found["missing"] == ["dit", "codec", "cloud", "edge", "traces"]
    assert found["sakura"].startswith(site) and found["dit"].startswith(site)
    assert found["catalog"].startswith(site) and len(found["templates"]) == 8
    plain = there(str(python), "-c", "import dit")  # the check, as a user types it
    assert plain.returncode == 1 and "No module named 'dit'" in plain.stderr

    sakura = str(env_dir / "bin" / "sakura")
    version = there(sakura, "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"sakura {__version__}"
    installed = Path(found["catalog"])
    entry = json.loads(installed.read_text())["templates"]["face-technologist"]
    entry.update(steps=4, profiling_prompts=entry["profiling_prompts"][:1],
                 image=str(installed.parent / entry["image"]),
                 mask=str(installed.parent / entry["mask"]))
    catalog = work / "catalog.json"
    catalog.write_text(json.dumps({"version": 1, "templates": {"face-technologist": entry}}))
    packs, report = work / "packs", work / "build.json"
    # packs only: the device bundle is an ExecuTorch export of the shipped model (about
    # 4 min with an empty compiled cache, as on a fresh CI machine: this test took 263-289 s
    # there against 18-27 s with a warm cache); tests/edge/test_bundle.py covers the export
    built = there(sakura, "build", str(catalog), "--codecs", "fp16", "--resolution", "32",
                  "--no-bundle", "--out", str(packs), "--json", str(report), timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    assert json.loads(report.read_text())["built"] == ["face-technologist-32"]
    inspect = there(sakura, "pack", "inspect", str(packs))  # (verifies by default)
    assert inspect.returncode == 0, inspect.stderr[-3000:]
    assert "template face-technologist-32  codec fp16" in inspect.stdout
    assert "unit checksums and the file hash match" in inspect.stdout
