"""One shard record for both runtimes (issue 30 item 3).

The native binding's record, the class ``sakura_native.ShardRecord``
(native/src/python/bind_edit.cpp: one table makes its properties, ``to_dict()`` and
``field_types``), has the fields of the Python :class:`~edge.shard_records.ShardRecord`, in the
same order, each declared with the same type; the one field only one side has is listed in
:data:`PYTHON_ONLY` with the reason. A real edit in each runtime then writes timeline
records with exactly the dataclass's fields, each value of the field's declared type, so a
field added on one side and not the other fails here rather than in a report that reads it.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields

import pytest
from sakura.edge.native_runtime import NativeEngine
from sakura.edge.native_status import native_module
from sakura.edge.pipeline import ShardRecord
from sakura.edge.runtime import EditOptions

from tests.edge.helpers import TEMPLATE_ID
from tests.edge.test_edit import PROMPT, SEED
from tests.edge.test_native_runtime import serve

HINTS = typing.get_type_hints(ShardRecord)
NAMES = [f.name for f in fields(ShardRecord)]

# Fields of the Python record the native record does not have, and why.
PYTHON_ONLY = {
    # the description of the configuration received (rank, bits...): the native loop knows
    # only the configuration's id; NativeRunner.stream (edge/runner.py) adds it to each
    # timeline record from the manifest, {} where no configuration was received
    "params": "added by NativeRunner.stream from the manifest",
}
# Fields of the native record the Python one does not have (none).
NATIVE_ONLY: dict[str, str] = {}


def native_types() -> dict[str, object]:
    """``sakura_native.ShardRecord.field_types`` with each type evaluated (``"int | None"``
    -> ``int | None``)."""
    return {
        name: eval(hint, {})  # the binding's own type strings
        for name, hint in native_module().ShardRecord.field_types.items()
    }


def allowed(hint) -> tuple[type, ...]:
    """The runtime types a value of ``hint`` may have (``float`` fields take ints too)."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = typing.get_args(hint) if union else (hint,)
    out: list[type] = []
    for a in args:
        a = typing.get_origin(a) or a
        out.append(type(None) if a is type(None) else a)
        if a is float:
            out.append(int)
    return tuple(out)


def check_value(name: str, value: object, who: str) -> None:
    ok = allowed(HINTS[name])
    # (bool is an int subclass: an int field must not carry a bool, nor the reverse)
    assert isinstance(value, ok) and (isinstance(value, bool) == (bool in ok) or value is None), (
        who,
        name,
        value,
        HINTS[name],
    )


def check(record: dict, who: str) -> None:
    assert set(record) == set(NAMES), (who, set(record) ^ set(NAMES))
    for name, value in record.items():
        check_value(name, value, who)


def test_the_native_record_class_declares_the_python_fields():
    native = native_types()
    assert not set(NATIVE_ONLY) & set(NAMES) and not set(PYTHON_ONLY) & set(native)
    # the same fields in the same order (the timeline's keys), but the documented ones
    python_names = [n for n in NAMES if n not in PYTHON_ONLY]
    native_names = [n for n in native if n not in NATIVE_ONLY]
    assert python_names == native_names, (
        "fields on one side only (add them to both, or to PYTHON_ONLY / NATIVE_ONLY): "
        f"{sorted(set(python_names) ^ set(native_names))}; python order {python_names}, "
        f"native order {native_names}"
    )
    for name, hint in native.items():
        if name not in NATIVE_ONLY:
            assert hint == HINTS[name], (name, hint, HINTS[name])
    # every field is a read-only property of the class
    cls = native_module().ShardRecord
    for name in native:
        assert isinstance(getattr(cls, name), property) and getattr(cls, name).fset is None, name


def test_the_native_record_class_is_not_built_in_python():
    with pytest.raises(TypeError):
        native_module().ShardRecord()


@pytest.mark.parametrize("policy", ["fp16", "sakura"])
def test_both_runtimes_write_the_same_record(world, runtime, native_runtime, policy, monkeypatch):
    seen: list = []
    streamed_edit = NativeEngine.streamed_edit

    def keep(self, *args, **kwargs):  # the typed records the native loop returned
        out = streamed_edit(self, *args, **kwargs)
        seen.append(out[1])
        return out

    monkeypatch.setattr(NativeEngine, "streamed_edit", keep)
    req = runtime.request(PROMPT, SEED)
    opts = EditOptions(local_fallback=False, initial_rate_bps=50e6)
    with serve(world) as server:
        py = runtime.edit(server.url, TEMPLATE_ID, world.template, req, policy, options=opts)
        nat = native_runtime.edit(
            server.url, TEMPLATE_ID, world.template, req, policy, options=opts
        )
    assert len(py.timeline) == len(nat.timeline) > 0
    for a, b in zip(py.timeline, nat.timeline, strict=True):
        check(a, "python")
        check(b, "native")
        assert (a["shard"], a["step"], a["blocks"]) == (b["shard"], b["step"], b["blocks"])

    # the records that crossed the binding: typed, every property the value to_dict() gives,
    # and the timeline record is to_dict() with the Python-only fields added
    assert len(seen) == 1
    (records,) = seen
    assert len(records) == len(nat.timeline)
    cls = native_module().ShardRecord
    for r, row in zip(records, nat.timeline, strict=True):
        assert type(r) is cls
        d = r.to_dict()
        assert list(d) == list(cls.field_types)
        for name, value in d.items():
            assert getattr(r, name) == value, name
            if name not in NATIVE_ONLY:
                check_value(name, value, "native record")
        assert {k: v for k, v in row.items() if k not in PYTHON_ONLY} == d
        assert set(row) - set(d) == set(PYTHON_ONLY)
