"""dit's error classes live in ``dit/errors.py`` (the adapters' family in
``dit/adapters/errors.py``): a new error class defined elsewhere in dit fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import sakura.dit.errors as errors

from sakura.errors import SakuraError

DIT = Path(__file__).resolve().parents[2] / "dit"
HOMES = {"errors.py", "adapters/errors.py"}


def test_error_classes_are_defined_in_errors_py_only():
    strays = []
    for path in DIT.rglob("*.py"):
        rel = str(path.relative_to(DIT))
        if rel in HOMES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and b.id.endswith("Error") for b in node.bases):
                strays.append(f"{rel}:{node.name}")
    assert strays == []


def test_every_class_there_is_a_sakura_error():
    classes = [v for v in vars(errors).values() if isinstance(v, type) and v.__module__ ==
               errors.__name__]
    assert len(classes) == 6 and all(issubclass(c, SakuraError) for c in classes)
