"""The package layering, checked on the source with ``ast`` (issue 30, item 4).

Every ``.py`` file of the folders that install as the ``sakura`` namespace (pyproject's
``[tool.setuptools.package-dir]``) is parsed; its imports of ``sakura.*`` are collected at
module level and inside functions, relative imports resolved to absolute names, and
``importlib.import_module("sakura...")`` with a literal name counted too. The rules:

(a) ``codec``, ``dit`` and ``traces`` import nothing of ``sakura.cloud``, ``sakura.edge``
    or a CLI module (any ``cli.py`` / ``sakura.cli*``, and the app modules of ``sakura/``);
    they may use the shared ground (``sakura.errors``, ``sakura.output``,
    ``sakura.argtypes``, ``sakura.extras``, the ``sakura`` package itself).
(b) no cycle between the top-level groups (codec, dit, traces, cloud, edge, the shared
    ground, the app modules of ``sakura/``).
(c) ``codec`` imports nothing of ``dit``: the model describes itself to the codec as data
    (e.g. ``sakura.dit.rope.rope_option`` builds the codecs' ``rope`` option).

``KNOWN_VIOLATIONS`` lists the edges not fixed yet, each with its reason; the test fails on
a new violation and on a listed one that no longer exists, so the list can only shrink.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHARED = {"sakura", "sakura.errors", "sakura.output", "sakura.argtypes", "sakura.extras",
          "sakura.cachedir", "sakura.atomic", "sakura.ids", "sakura.s3", "sakura.digest"}
"""The shared ground: errors, output, argument types, the extras table (which imports
only sakura.errors), the cache-directory rule, the atomic write, the template-id rule, a
file's SHA-256 and
the S3 client rule (cloud's storage and edge's s3:// origin; edge imports cloud, so cloud
may not import edge); everything else directly under sakura/ is the app (CLI) layer."""

LOWER = ("codec", "dit", "traces")

# (importer, imported): reason it is still there. Empty since the codec bench moved to the app
# layer (sakura/codec_bench.py, sakura/codec_bench_cli.py) and the synthetic caches to
# dit/synthetic.py; the mechanism stays: a new edge fails the test unless listed here.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    in_function: bool


def _package_dirs() -> dict[str, str]:
    """Top-level folder -> package name, from pyproject's package-dir table."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {folder: pkg for pkg, folder in cfg["tool"]["setuptools"]["package-dir"].items()}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package __init__)."""
    out = {}
    for folder, pkg in _package_dirs().items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join([pkg, *(parts[:-1] if is_pkg else parts)])] = (path, is_pkg)
    return out


def _scan(modules: dict[str, tuple[Path, bool]]) -> list[Edge]:
    edges: list[Edge] = []
    for name, (path, is_pkg) in modules.items():
        package = name if is_pkg else name.rpartition(".")[0]

        def add(target: str, node: ast.AST, in_fn: bool, _name: str = name) -> None:
            if target == "sakura" or target.startswith("sakura."):
                edges.append(Edge(_name, target, node.lineno, in_fn))

        def visit(node: ast.AST, in_fn: bool, _package: str = package) -> None:
            for child in ast.iter_child_nodes(node):
                fn = in_fn or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef |
                                         ast.Lambda)
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        add(alias.name, child, fn)
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = _package.split(".")[: len(_package.split(".")) - child.level + 1]
                        module = ".".join(base + ([child.module] if child.module else []))
                    else:
                        module = child.module or ""
                    # `from sakura import errors` names a module; one edge per target
                    targets = {f"{module}.{a.name}" if f"{module}.{a.name}" in modules
                               else module for a in child.names}
                    for target in sorted(targets):
                        add(target, child, fn)
                elif (isinstance(child, ast.Call) and child.args
                      and isinstance(child.func, ast.Attribute | ast.Name)
                      and getattr(child.func, "attr", getattr(child.func, "id", None))
                      == "import_module"
                      and isinstance(child.args[0], ast.Constant)
                      and isinstance(child.args[0].value, str)):
                    add(child.args[0].value, child, fn)
                visit(child, fn)

        visit(ast.parse(path.read_text(), filename=str(path)), False)
    return edges


def _group(module: str) -> str:
    if module in SHARED:
        return "shared"
    parts = module.split(".")
    return parts[1] if parts[1] in (*LOWER, "cloud", "edge") else "app"


def _is_cli(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return last == "cli" or _group(module) == "app"


def _violations(edges: list[Edge]) -> dict[tuple[str, str], list[Edge]]:
    out: dict[tuple[str, str], list[Edge]] = defaultdict(list)
    for e in edges:
        src, dst = _group(e.importer), _group(e.imported)
        if src not in LOWER:
            continue
        if dst in ("cloud", "edge") or _is_cli(e.imported) or (src == "codec" and dst == "dit"):
            out[(e.importer, e.imported)].append(e)
    return out


def _cycles(edges: list[Edge]) -> list[list[str]]:
    """Group-level cycles: for each group edge a -> b, a path b -> ... -> a if one exists."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        a, b = _group(e.importer), _group(e.imported)
        if a != b:
            graph[a].add(b)
    found = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            stack, seen = [[b]], {b}
            while stack:
                path = stack.pop()
                if path[-1] == a:
                    found.append([a, *path])
                    break
                for nxt in sorted(graph[path[-1]] - seen):
                    seen.add(nxt)
                    stack.append([*path, nxt])
    return found


def _edges() -> list[Edge]:
    return _scan(_modules())


def test_the_scanner_sees_module_level_function_level_and_from_imports():
    modules = _modules()
    edges = _scan(modules)
    by_pair = {(e.importer, e.imported): e for e in edges}
    # module level: the low-rank codec's own modules; inside a function: the CLI's lazy load
    assert by_pair[("sakura.codec.lowrank", "sakura.codec.base")].in_function is False
    assert by_pair[("sakura.codec_bench_cli", "sakura.codec_bench")].in_function is True
    # every folder of the namespace was parsed, __init__ files as their package
    assert {_group(m) for m in modules} == {*LOWER, "cloud", "edge", "shared", "app"}
    assert "sakura.dit.adapters" in modules and "sakura.dit.adapters.__init__" not in modules
    inside = sum(e.in_function for e in edges)
    print(f"\ninternal imports: {len(edges)}, inside functions: {inside} "
          f"({inside / len(edges):.1%})")
    assert 0 < inside < len(edges)


def test_relative_imports_resolve_to_absolute_names(tmp_path):
    src = ("from . import base\nfrom .quant import x\nfrom .. import errors\n"
           "def f():\n    from ..dit import cache\n")
    (tmp_path / "m.py").write_text(src)
    (tmp_path / "empty.py").write_text("")
    edges = _scan({"sakura.codec.m": (tmp_path / "m.py", False),
                   "sakura.codec.base": (tmp_path / "empty.py", False),
                   "sakura.errors": (tmp_path / "empty.py", False)})
    got = [(e.imported, e.in_function) for e in edges]
    assert got == [("sakura.codec.base", False), ("sakura.codec.quant", False),
                   ("sakura.errors", False), ("sakura.dit", True)]


def test_codec_dit_traces_import_no_cloud_edge_cli_and_codec_no_dit():
    found = _violations(_edges())
    new = {k: [f"{e.importer}:{e.line}" for e in v] for k, v in found.items()
           if k not in KNOWN_VIOLATIONS}
    gone = sorted(set(KNOWN_VIOLATIONS) - set(found))
    assert not new, f"new layering violations (importer, imported): {new}"
    assert not gone, f"fixed, remove from KNOWN_VIOLATIONS: {gone}"


def test_no_cycles_between_top_level_groups():
    assert _cycles(_edges()) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    planted = [Edge("sakura.codec.a", "sakura.dit.b", 1, False),
               Edge("sakura.dit.b", "sakura.traces.c", 1, False),
               Edge("sakura.traces.c", "sakura.codec.a", 1, True)]
    assert ["codec", "dit", "traces", "codec"] in _cycles(planted)
