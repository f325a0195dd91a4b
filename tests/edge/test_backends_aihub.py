"""``sakura backends aihub compile|profile`` against a stub of ``qai_hub.Client`` whose every
method is bound to the real client's signature (``tests/edge/aihub_stub.py``)."""

from __future__ import annotations

import json

import pytest
import qai_hub
from sakura.edge.backends.errors import AIHubError
from sakura.edge.backends.qnn_backend import QnnBackend
from sakura.edge.backends.shard import ShardGeometry, ShardModule, example_inputs

from sakura.cli import main
from tests.edge.aihub_stub import REAL_CLIENT, StubHub
from tests.edge.helpers import tiny_model

PROMPT = "a private prompt that must stay on the device"


@pytest.fixture(scope="module")
def shard_onnx(tmp_path_factory):
    """The ONNX export of a shard graph of the tiny model (what the qnn backend keeps)."""
    model = tiny_model()
    geometry = ShardGeometry(batch=2, txt=5, img=10, cached=20)
    qnn = QnnBackend()
    module = ShardModule(model, (0, 1), geometry, qnn.explicit_rms).eval()
    path = tmp_path_factory.mktemp("aihub") / "onnx" / "shard.onnx"
    path.parent.mkdir()
    return qnn.export_onnx(module, example_inputs(model, (0, 1), geometry), path)


@pytest.fixture
def token(monkeypatch, tmp_path):
    monkeypatch.setenv("QAI_HUB_API_TOKEN", "test-token")
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(tmp_path / "absent.ini"))


def _errors(err: str) -> list[str]:
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("sakura: error:")]


def test_the_stub_rejects_what_the_real_client_rejects():
    """The stub can fail: arguments the real qai_hub.Client would not take are refused."""
    hub = StubHub()
    client = hub.client_class(config=qai_hub.ClientConfig(api_token="t"))
    device = qai_hub.Device("Snapdragon 8 Elite QRD")
    with pytest.raises(TypeError):
        client.submit_compile_job(model=__file__, devices=device)   # misspelt keyword
    with pytest.raises(TypeError):
        client.submit_compile_job(model=__file__)                   # no device
    with pytest.raises(AssertionError):
        client.submit_compile_job(model=__file__, device="Snapdragon 8 Elite QRD")
    with pytest.raises(AttributeError):  # deprecated in 0.56: the product must not use it
        client.submit_profile_job  # noqa: B018
    with pytest.raises(TypeError):
        hub.client_class(api_token="t")  # the token goes in a ClientConfig
    assert hub.kinds() == ["Client"]
    # the stub's methods exist on the real client
    for name in ("submit_compile_job", "submit_inference_job", "get_job", "get_model"):
        assert callable(getattr(REAL_CLIENT, name))


def test_compile_and_profile_from_the_cli(shard_onnx, token, monkeypatch, tmp_path, capsys):
    hub = StubHub().install(monkeypatch)
    out = tmp_path / "jobs.json"
    code = main(["backends", "aihub", "compile", "--onnx", str(shard_onnx), "--profile",
                 "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    assert hub.kinds() == ["Client", "submit_compile_job", "get_target_model", "Client",
                           "submit_inference_job"]
    init, compile_kw = hub.calls[0][1], hub.calls[1][1]
    assert init["config"].api_token == "test-token"
    assert compile_kw["device"].name == "Snapdragon 8 Elite QRD"
    assert "--target_runtime qnn_context_binary" in compile_kw["options"]
    assert compile_kw["model"] in (str(shard_onnx), str(shard_onnx.parent))
    infer = hub.calls[4][1]
    assert infer["inputs"] is None and infer["profile"] is True
    assert infer["model"].model_id == "m1"
    doc = json.loads(out.read_text())
    assert doc["compile_job"]["id"] == "jc1" and doc["profile_job"]["id"] == "jp2"
    assert doc["device"] == "Snapdragon 8 Elite QRD"
    assert all(name.startswith("shard.onnx") for name in doc["uploaded"])
    stdout = capsys.readouterr().out
    assert "compile job jc1: https://" in stdout and "profile job jp2" in stdout
    assert PROMPT not in repr(hub.calls)


def test_profile_of_a_compile_job_and_of_a_model(shard_onnx, token, monkeypatch, capsys):
    hub = StubHub().install(monkeypatch)
    assert main(["backends", "aihub", "compile", "--onnx", str(shard_onnx),
                 "--device", "Samsung Galaxy S25", "--options=--quantize_io"]) == 0
    assert hub.calls[1][1]["device"].name == "Samsung Galaxy S25"
    assert hub.calls[1][1]["options"] == "--quantize_io"
    assert main(["backends", "aihub", "profile", "--compile-job", "jc1"]) == 0
    assert hub.kinds()[2:] == ["Client", "get_job", "get_target_model", "Client",
                               "submit_inference_job"]
    assert hub.calls[3][1]["job_id"] == "jc1"
    assert main(["backends", "aihub", "profile", "--model", "mabc"]) == 0
    assert hub.kinds()[-2:] == ["get_model", "submit_inference_job"]
    assert hub.calls[-2][1]["model_id"] == "mabc"
    capsys.readouterr()
    # an unknown job and a failed compile are one error line each
    assert main(["backends", "aihub", "profile", "--compile-job", "nope"]) == 1
    assert _errors(capsys.readouterr().err)[0].startswith("sakura: error: AI Hub has no job")
    failing = StubHub(compile_fails=True).install(monkeypatch)
    assert main(["backends", "aihub", "compile", "--onnx", str(shard_onnx), "--profile"]) == 1
    err = _errors(capsys.readouterr().err)
    assert len(err) == 1 and "compile job jc1 failed" in err[0]
    assert "submit_inference_job" not in failing.kinds()


def test_the_token_can_come_from_qai_hubs_config_file(shard_onnx, monkeypatch, tmp_path):
    ini = tmp_path / "client.ini"
    ini.write_text("[api]\napi_token = from-file\n")
    monkeypatch.delenv("QAI_HUB_API_TOKEN", raising=False)
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(ini))
    hub = StubHub().install(monkeypatch)
    assert main(["backends", "aihub", "compile", "--onnx", str(shard_onnx)]) == 0
    # no ClientConfig: the real client reads QAIHUB_CLIENT_INI itself
    assert hub.calls[0] == ("Client", {"config": None, "profile": None,
                                       "default_project_id": None, "client_mode": "library"})


def test_without_a_token_one_error_line_and_nothing_exported(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("QAI_HUB_API_TOKEN", raising=False)
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(tmp_path / "absent.ini"))
    hub = StubHub().install(monkeypatch)
    import sakura.dit.weights as weights

    def no_model(*a, **k):  # the check comes before any export
        raise AssertionError("the model was loaded without a token")

    monkeypatch.setattr(weights, "load_model", no_model)
    for argv in (["compile", "--template", "face-technologist", "--out", str(tmp_path / "x")],
                 ["profile", "--compile-job", "jc1"]):
        assert main(["backends", "aihub", *argv]) == 1
        err = _errors(capsys.readouterr().err)
        assert len(err) == 1 and "QAI_HUB_API_TOKEN" in err[0] and "qai-hub configure" in err[0]
    assert hub.calls == [] and not (tmp_path / "x").exists()


def test_bad_arguments(token, monkeypatch, tmp_path, capsys):
    StubHub().install(monkeypatch)
    assert main(["backends", "aihub", "compile", "--onnx", str(tmp_path / "no.onnx")]) == 1
    err = _errors(capsys.readouterr().err)
    assert len(err) == 1 and "no shard graph at" in err[0]
    assert main(["backends", "aihub", "compile", "--template", "no-such-template"]) == 1
    assert "not in the catalog" in _errors(capsys.readouterr().err)[0]
    with pytest.raises(SystemExit) as exc:  # neither --onnx nor --template: usage, exit 2
        main(["backends", "aihub", "compile"])
    assert exc.value.code == 2
    with pytest.raises(AIHubError, match="no shard graph"):
        from sakura.edge.backends.aihub import upload_path

        upload_path(tmp_path / "missing.onnx")


@pytest.mark.slow
def test_compile_exports_a_catalog_templates_shard_graph(token, monkeypatch, tmp_path):
    """--template: the shipped model's block group exported and uploaded (~20-40 s)."""
    import onnx

    hub = StubHub().install(monkeypatch)
    out = tmp_path / "export"
    assert main(["backends", "aihub", "compile", "--template", "face-technologist",
                 "--group", "1", "--out", str(out)]) == 0
    graphs = list(out.rglob("shard.onnx"))
    assert len(graphs) == 1 and "b4-7" in graphs[0].parent.name
    uploaded = hub.calls[1][1]["model"]
    assert uploaded in (str(graphs[0]), str(graphs[0].parent))
    names = [i.name for i in onnx.load(str(graphs[0]), load_external_data=False).graph.input]
    assert names[:6] == ["txt", "img", "vec_txt", "vec_img", "cos", "sin"]
    assert len(names) == 6 + 2 * 4
