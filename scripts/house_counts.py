"""The house counts of issue 30, from the code's AST: what a reader of the tree meets.

    python scripts/house_counts.py [--root DIR] [--json PATH]

Over every ``.py`` file of the folders that install as the ``sakura`` namespace (pyproject's
``[tool.setuptools.package-dir]``: sakura/, codec/, dit/, traces/, cloud/, edge/):

* ``files_over_600``: files longer than 600 lines (``len(text.splitlines())``);
* ``functions_over_100``: functions and methods longer than 100 lines
  (``end_lineno - lineno + 1`` of each ``FunctionDef`` / ``AsyncFunctionDef``, decorators not
  counted);
* ``imports_in_functions``: imports of our own modules (``sakura.*``, relative ones resolved)
  that sit inside a function, over all such imports; counted once per (importing module,
  imported module, in a function or not), as the previous sessions' notes did, and also per
  imported name;
* ``lazy_reasons``: of the import statements of our own modules inside functions, how many
  say why with a ``# lazy: <reason>`` comment, by the rule of ``tests/test_lazy_imports.py``
  (which fails on one that does not, outside its short list of files not fixed yet).

Copied runs over 8 lines are counted by the workplace's ``duplicates`` tool
(``duplicates --min-lines 9``), not here: see docs/house.md.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import tomllib
from pathlib import Path


def package_dirs(root: Path) -> dict[str, str]:
    cfg = tomllib.loads((root / "pyproject.toml").read_text())
    return {folder: pkg for pkg, folder in cfg["tool"]["setuptools"]["package-dir"].items()}


def module_name(root: Path, folder: str, pkg: str, path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root / folder).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join([pkg, *parts]), is_pkg


def own_imports(tree: ast.AST, name: str, is_pkg: bool) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function, names imported) for every import of sakura.*."""
    out: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, in_fn: bool) -> None:
        for child in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name == "sakura" or a.name.startswith("sakura."):
                        out.append((a.name, fn, 1))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    here = name.split(".") if is_pkg else name.split(".")[:-1]
                    up = here[: len(here) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                if base == "sakura" or base.startswith("sakura."):
                    out.append((base, fn, len(child.names)))
            visit(child, fn)

    visit(tree, False)
    return out


def lazy_rule(root: Path):
    """``lazy_imports(source, name, is_pkg)`` of tests/test_lazy_imports.py: (line, has a
    reason) of every in-function import of our own modules; the test owns the rule."""
    spec = importlib.util.spec_from_file_location(
        "_sakura_lazy_rule", root / "tests" / "test_lazy_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.lazy_imports


def counts(root: Path) -> dict[str, object]:
    long_files, long_fns = [], []
    pairs: set[tuple[str, str, bool]] = set()
    per_name = [0, 0]  # in functions, all
    lazy_imports = lazy_rule(root)
    reasons = [0, 0]  # in-function import statements with a reason, all
    nfiles = 0
    for folder, pkg in package_dirs(root).items():
        for path in sorted((root / folder).rglob("*.py")):
            nfiles += 1
            text = path.read_text()
            rel = str(path.relative_to(root))
            n = len(text.splitlines())
            if n > 600:
                long_files.append((rel, n))
            tree = ast.parse(text)
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    size = node.end_lineno - node.lineno + 1
                    if size > 100:
                        long_fns.append((f"{rel}:{node.name}", size))
            name, is_pkg = module_name(root, folder, pkg, path)
            for imported, in_fn, names in own_imports(tree, name, is_pkg):
                pairs.add((name, imported, in_fn))
                per_name[1] += names
                per_name[0] += names if in_fn else 0
            found = lazy_imports(text, name, is_pkg)
            reasons[0] += sum(ok for _, ok in found)
            reasons[1] += len(found)
    in_fn = sum(1 for p in pairs if p[2])
    return {
        "files": nfiles,
        "files_over_600": sorted(long_files, key=lambda x: -x[1]),
        "functions_over_100": sorted(long_fns, key=lambda x: -x[1]),
        "imports_in_functions": {"modules": [in_fn, len(pairs)],
                                 "share": round(in_fn / max(1, len(pairs)), 3),
                                 "names": per_name,
                                 "share_names": round(per_name[0] / max(1, per_name[1]), 3)},
        "lazy_reasons": reasons,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    got = counts(args.root)
    imp = got["imports_in_functions"]
    print(f"{got['files']} files; {len(got['files_over_600'])} over 600 lines; "
          f"{len(got['functions_over_100'])} functions over 100 lines; imports of our own "
          f"modules inside functions: {imp['modules'][0]} of {imp['modules'][1]} "
          f"({100 * imp['share']:.1f}%), per name {imp['names'][0]} of {imp['names'][1]} "
          f"({100 * imp['share_names']:.1f}%); in-function import statements of our own "
          f"modules with a '# lazy:' reason: {got['lazy_reasons'][0]} of "
          f"{got['lazy_reasons'][1]}")
    for f, n in got["files_over_600"]:
        print(f"  file {n:5d}  {f}")
    for f, n in got["functions_over_100"]:
        print(f"  func {n:5d}  {f}")
    if args.json:
        args.json.write_text(json.dumps(got, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # (| head)
        sys.exit(0)
