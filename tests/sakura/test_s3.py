"""sakura.s3: botocore resolves the S3 endpoint and its addressing for cloud and edge alike
(offline: presigned URLs and request URLs are made locally, nothing is sent)."""

from __future__ import annotations

import pytest

pytest.importorskip("boto3")

from sakura.s3 import endpoint_of, s3_client  # noqa: E402


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, tmp_path):
    """No profile, no endpoint variables, test credentials."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION",
                 "AWS_PROFILE", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")


class _Sent(Exception):
    pass


def request_url(client) -> str:
    """The URL of a HeadObject of packs/a/b, caught before it is sent."""
    seen: list[str] = []

    def stop(request, **_kw):
        seen.append(request.url)
        raise _Sent

    client.meta.events.register("before-send.s3.HeadObject", stop)
    with pytest.raises(_Sent):
        client.head_object(Bucket="packs", Key="a/b")
    return seen[0]


def presigned(client) -> str:
    return client.generate_presigned_url("get_object", Params={"Bucket": "packs", "Key": "a/b"})


def test_aws_own_endpoint_is_virtual_host_style():
    client = s3_client()
    assert endpoint_of(client) == "https://s3.amazonaws.com"
    assert client.meta.region_name == "us-east-1"
    assert request_url(client).startswith("https://packs.s3.amazonaws.com/a/b")
    assert presigned(client).startswith("https://packs.s3.amazonaws.com/a/b?")


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_an_endpoint_from_the_environment_is_path_style(monkeypatch, variable):
    monkeypatch.setenv(variable, "http://minio.test:9000")
    client = s3_client()
    assert endpoint_of(client) == "http://minio.test:9000"
    assert request_url(client).startswith("http://minio.test:9000/packs/a/b")
    assert presigned(client).startswith("http://minio.test:9000/packs/a/b?")


def test_the_s3_variable_wins_and_a_named_endpoint_wins_over_both(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://general.test:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3only.test:2")
    assert endpoint_of(s3_client()) == "http://s3only.test:2"
    client = s3_client("http://named.test:3")
    assert endpoint_of(client) == "http://named.test:3"
    assert request_url(client).startswith("http://named.test:3/packs/a/b")


def test_region_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert s3_client().meta.region_name == "eu-west-1"
    assert endpoint_of(s3_client()) == "https://s3.eu-west-1.amazonaws.com"
    assert s3_client(region_name="ap-south-1").meta.region_name == "ap-south-1"
