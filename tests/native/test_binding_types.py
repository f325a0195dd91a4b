"""The binding's typed inputs and results (issue 30 item 3): what crosses into and out of
``sakura_native`` is a class made with keyword arguments, not a dict read key by key, so a
missing or misspelt field fails where the value is made, with the field's name."""

from __future__ import annotations

import numpy as np
import pytest


def _inputs(**over):
    f = np.zeros(4, np.float32)
    kw = dict(steps=2, x=f, txt=f, vec_txt=f, vec_img=f, cos=f, sin=f, dt=f[:2], guidance=1.0)
    kw.update(over)
    return kw


def test_edit_inputs_take_named_fields_only(native):
    inputs = native.EditInputs(**_inputs())
    assert inputs.steps == 2 and not inputs.full
    with pytest.raises(TypeError):  # a misspelt field
        native.EditInputs(**_inputs(vec_text=np.zeros(4, np.float32)))
    with pytest.raises(TypeError):  # a missing one
        native.EditInputs(**{k: v for k, v in _inputs().items() if k != "dt"})
    with pytest.raises(ValueError, match="pin_x0"):  # pinned tokens without their rows
        native.EditInputs(**_inputs(pinned=[0, 1]))
    full = native.EditInputs(**_inputs(pinned=[0], pin_x0=np.zeros(2, np.float32),
                                       pin_noise=np.zeros(2, np.float32),
                                       t=np.zeros(2, np.float32)))
    assert full.full


def test_http_options_default_to_the_receive_stages_and_check_the_version(native):
    http = native.HttpOptions()
    assert http.http_version == 1 and http.warm_connections == 0
    assert native.HttpOptions(http_version="2").http_version == 2
    with pytest.raises(ValueError, match="http_version"):
        native.HttpOptions(http_version="3")
    with pytest.raises(TypeError):
        native.HttpOptions(max_conections=2)


def test_a_stream_spec_names_its_decoder(native):
    table = native.StreamTable([{"step": 0, "blocks": [0], "configs": [
        {"id": 0, "url": "http://127.0.0.1:9/p.pack", "offset": 0, "length": 4,
         "units": [(4, "0" * 64)]}]}])
    spec = native.StreamSpec(shards=table, http=native.HttpOptions(), decode="fp16",
                             matrix_floats=4, max_inflight=2)
    assert spec.shards == 1 and spec.max_inflight == 2 and spec.reconstruct == "cpu"
    with pytest.raises(ValueError, match="callback"):
        native.StreamSpec(shards=table, http=native.HttpOptions(), decode="callback",
                          matrix_floats=4)
    with pytest.raises(ValueError, match="decode must be"):
        native.StreamSpec(shards=table, http=native.HttpOptions(), decode="zstd",
                          matrix_floats=4)


def test_results_are_typed_with_a_dict_view(native):
    stats = native.pipeline_overhead(10)
    assert stats.executed == 10 and not stats.cancelled
    assert stats.to_dict()["executed"] == 10
    assert list(stats.to_dict()) == ["received", "reconstructed", "executed",
                                     "max_received_depth", "max_ready_depth", "cancelled",
                                     "wall_s"]
