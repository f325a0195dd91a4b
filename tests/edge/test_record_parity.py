"""One shard record for both runtimes (issue 30 item 3): the native binding's record
(``record_dict``, native/src/python/bind_edit.cpp) has exactly the fields of the Python
:class:`~edge.pipeline.ShardRecord`, each value of the field's declared type, so a field
added on one side and not the other fails here rather than in a report that reads it."""

from __future__ import annotations

import types
import typing
from dataclasses import fields

import pytest
from sakura.edge.pipeline import ShardRecord
from sakura.edge.runtime import EditOptions

from tests.edge.helpers import TEMPLATE_ID
from tests.edge.test_edit import PROMPT, SEED
from tests.edge.test_native_runtime import serve

HINTS = typing.get_type_hints(ShardRecord)


def allowed(hint) -> tuple[type, ...]:
    """The runtime types a value of ``hint`` may have (``float`` fields take ints too)."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union,
                                                                types.UnionType) else (hint,)
    out: list[type] = []
    for a in args:
        a = typing.get_origin(a) or a
        out.append(type(None) if a is type(None) else a)
        if a is float:
            out.append(int)
    return tuple(out)


def check(record: dict, who: str) -> None:
    assert set(record) == {f.name for f in fields(ShardRecord)}, (who, set(record) ^ {
        f.name for f in fields(ShardRecord)})
    for name, value in record.items():
        ok = allowed(HINTS[name])
        # (bool is an int subclass: an int field must not carry a bool, nor the reverse)
        assert isinstance(value, ok) and (isinstance(value, bool) == (bool in ok)
                                          or value is None), (who, name, value, HINTS[name])


@pytest.mark.parametrize("policy", ["fp16", "sakura"])
def test_both_runtimes_write_the_same_record(world, runtime, native_runtime, policy):
    req = runtime.request(PROMPT, SEED)
    opts = EditOptions(local_fallback=False, initial_rate_bps=50e6)
    with serve(world) as server:
        py = runtime.edit(server.url, TEMPLATE_ID, world.template, req, policy, options=opts)
        nat = native_runtime.edit(server.url, TEMPLATE_ID, world.template, req, policy,
                                  options=opts)
    assert len(py.timeline) == len(nat.timeline) > 0
    for a, b in zip(py.timeline, nat.timeline):
        check(a, "python")
        check(b, "native")
        assert (a["shard"], a["step"], a["blocks"]) == (b["shard"], b["step"], b["blocks"])
