"""Function-level imports of our own modules say why they are lazy (issue 30, item 4).

An import of ``sakura.*`` (relative ones too) inside a function or lambda is allowed only
where importing at module level would pull a heavy stack onto a light path, load more at
``sakura --help``, or close an import cycle; it says which, as a comment of the form
``# lazy: <reason>``, e.g. ``# lazy: torch``, ``# lazy: web stack``, ``# lazy: aiohttp``,
``# lazy: CLI --help stays fast``, ``# lazy: cycle with sakura.x``. The comment sits on one
of the statement's lines (``from x import (  # lazy: torch`` for a wrapped one) or alone on
the line just above it; an import right below a covered one in the same block shares its
reason. Every other import of our own modules belongs at the top of the file.

``python scripts/house_counts.py`` prints how many in-function imports carry a reason.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

REASON = re.compile(r"#\s*lazy:\s*\S")

# Files whose in-function imports have not been given their reasons yet (none left; the
# test fails once a listed file complies, so the list can only shrink).
UNEXPLAINED_ALLOWED: set[str] = set()


def _files() -> list[tuple[Path, str, bool]]:
    """(file, module name, is a package __init__) of every module of the sakura namespace."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    out = []
    for pkg, folder in cfg["tool"]["setuptools"]["package-dir"].items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out.append((path, ".".join([pkg, *(parts[:-1] if is_pkg else parts)]), is_pkg))
    return out


def _own(node: ast.Import | ast.ImportFrom, name: str, is_pkg: bool) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name == "sakura" or a.name.startswith("sakura.") for a in node.names)
    if node.level:
        return True  # relative: one of ours
    module = node.module or ""
    return module == "sakura" or module.startswith("sakura.")


def lazy_imports(source: str, name: str, is_pkg: bool) -> list[tuple[int, bool]]:
    """(line, has a reason) of every import of our own modules inside a function."""
    lines = source.splitlines()
    out: list[tuple[int, bool]] = []

    def commented(first: int, last: int) -> bool:
        return any(REASON.search(lines[i - 1]) for i in range(first, last + 1))

    def above(node: ast.stmt) -> bool:
        prev = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
        return prev.startswith("#") and bool(REASON.search(prev))

    def visit(body_owner: ast.AST, in_fn: bool) -> None:
        covered_prev: ast.stmt | None = None  # the last covered import of this block
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(body_owner, field, None)
            if not isinstance(block, list):
                continue
            covered_prev = None
            for stmt in block:
                if (
                    isinstance(stmt, ast.Import | ast.ImportFrom)
                    and in_fn
                    and _own(stmt, name, is_pkg)
                ):
                    ok = (
                        commented(stmt.lineno, stmt.end_lineno)
                        or above(stmt)
                        or (covered_prev is not None and covered_prev.end_lineno == stmt.lineno - 1)
                    )
                    out.append((stmt.lineno, ok))
                    covered_prev = stmt if ok else None
                else:
                    covered_prev = None
        for child in ast.iter_child_nodes(body_owner):
            if isinstance(child, ast.stmt | ast.excepthandler | ast.Lambda):
                visit(
                    child,
                    in_fn or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda),
                )

    visit(ast.parse(source), False)
    return out


def _unexplained() -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for path, name, is_pkg in _files():
        bad = [line for line, ok in lazy_imports(path.read_text(), name, is_pkg) if not ok]
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_every_function_level_import_of_our_modules_says_why_it_is_lazy():
    found = _unexplained()
    new = {f: lines for f, lines in found.items() if f not in UNEXPLAINED_ALLOWED}
    fixed = sorted(UNEXPLAINED_ALLOWED - set(found))
    assert not new, (
        "imports of our own modules inside functions without a '# lazy: <reason>' "
        f"comment (move them to the top of the file, or say why not): {new}"
    )
    assert not fixed, f"these comply now, remove them from UNEXPLAINED_ALLOWED: {fixed}"


def test_the_rule_reads_same_line_wrapped_above_and_grouped_reasons():
    src = """\
from sakura.codec import base


def f():
    from sakura.dit import model  # lazy: torch
    from sakura.cloud.server import (  # lazy: web stack
        create_app,
    )
    # lazy: aiohttp
    from sakura.edge.client import PackClient
    from sakura.edge.client import RetryPolicy
    import json
    from sakura.edge import netem
    from . import sibling
    g = lambda: __import__("os")
    return model, create_app, PackClient, RetryPolicy, json, netem, sibling, g


class C:
    def m(self):
        if True:
            import sakura.errors
        try:
            pass
        except ImportError:
            from sakura.extras import install_hint  # lazy: CLI --help stays fast
"""
    got = lazy_imports(src, "sakura.codec.x", False)
    assert got == [
        (5, True),
        (6, True),
        (10, True),
        (11, True),
        (13, False),
        (14, False),
        (22, False),
        (26, True),
    ]
