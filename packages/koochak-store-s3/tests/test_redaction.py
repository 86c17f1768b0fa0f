"""Credentials never appear in any output: a marker value in every credential input (the AWS
credential variables, a credentials file, an endpoint URL's password) and none of them in any
error, log record, repr, stream or file that the store's operations and koochak-probe produce.

Operations run against two loopback servers: a closed port (every request fails to connect and
is retried) and a small server that answers every request with a 500 whose text echoes the
request's Authorization header, a URL with a password and a presigned signature — foreign text
of the kind a server or proxy sends back."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import socket
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from koochak.s3 import RetryPolicy, S3Config, S3Store, open_s3_store

TAG = uuid.uuid4().hex[:12].upper()
ACCESS = f"AKIAMARK{TAG}"
SECRET = f"secretmark/{TAG}+x"
TOKEN = f"tokenmark{TAG}=="
PASSWORD = f"pwmark{TAG}"
FILE_ACCESS = f"AKIAFILE{TAG}"
FILE_SECRET = f"filesecret{TAG}"
MARKERS = (ACCESS, SECRET, TOKEN, PASSWORD, FILE_ACCESS, FILE_SECRET, TAG)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Echo:
    """Answers everything with 500 InternalError echoing credentials back in its message."""

    def __init__(self, secret: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                auth = self.headers.get("Authorization", "")
                token = self.headers.get("X-Amz-Security-Token", "")
                text = (
                    f"echo {auth} token {token} secret {secret} from "
                    f"http://user:{PASSWORD}@127.0.0.1/x?X-Amz-Signature=abc{TAG}"
                )
                body = (
                    "<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
                    f"<Message>{text}</Message></Error>"
                ).encode()
                self.send_response(500)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def leaky(tmp_path, monkeypatch):
    """Marker credentials in every input; the working directory is where outputs land."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "credentials").write_text(
        f"[filecreds]\naws_access_key_id = {FILE_ACCESS}\naws_secret_access_key = {FILE_SECRET}\n"
    )
    closed = _free_port()
    (inputs / "config").write_text(
        f"[profile leaky]\nregion = us-east-1\nendpoint_url = http://me:{PASSWORD}@127.0.0.1:{closed}\n"
        "[profile filecreds]\nregion = us-east-1\n"
    )
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(inputs / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(inputs / "credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(out)
    monkeypatch.setenv("HOME", str(out))
    return {"inputs": inputs, "out": out, "closed": closed}


def _clean(text: str, what: str) -> None:
    for marker in MARKERS:
        assert marker not in text, f"{what} holds a credential marker: {text[:400]}"


def _fail(call) -> str:
    with pytest.raises((OSError, ValueError)) as caught:
        call()
    return f"{caught.value!s} {caught.value!r}"


def test_an_endpoint_with_a_password_is_refused_on_every_route_redacted(leaky, monkeypatch):
    url = f"http://me:{PASSWORD}@127.0.0.1:{leaky['closed']}"
    messages = []
    for variable in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.setenv(variable, url)
        messages.append(_fail(lambda: S3Store(S3Config(bucket="bkt", path_style=True))))
        monkeypatch.delenv(variable)
    monkeypatch.setenv("AWS_PROFILE", "leaky")  # a profile's endpoint_url
    messages.append(_fail(lambda: S3Store(S3Config(bucket="bkt", path_style=True))))
    monkeypatch.delenv("AWS_PROFILE")
    messages.append(_fail(lambda: open_s3_store("p", options={"bucket": "bkt", "endpoint": url})))
    stores = leaky["inputs"] / "stores.yaml"
    stores.write_text(
        f"version: 1\nstores:\n  ckpt:\n    backend: s3\n    options:\n      bucket: bkt\n"
        f"      endpoint: {url}\n"
    )
    monkeypatch.setenv("KOOCHAK_STORES", str(stores))
    from koochak.storage.store import open_store

    messages.append(_fail(lambda: open_store("ckpt://exp0")))
    for message in messages:
        _clean(message, "the refusal")
        assert "user or password" in message or "secret" in message, message
    for message in messages[:4]:
        assert "***@127.0.0.1" in message, message  # the URL is shown, redacted
    assert "AWS_ENDPOINT_URL_S3" in messages[1] and "profile leaky" in messages[2]


def _drive(store: S3Store) -> list[str]:
    """stat/get/put/list/delete/open on ``store``, each expected to fail; their messages."""
    messages = [
        _fail(lambda: store.stat("k")),
        _fail(lambda: store.get("k")),
        _fail(lambda: store.get("k", -50, None)),
        _fail(lambda: store.put("k", b"data")),
        _fail(lambda: store.list()),
        _fail(lambda: store.delete("k")),
        _fail(lambda: store.open("k")),
        repr(store),
        store.endpoint,
    ]
    return messages


@pytest.mark.parametrize("credentials", ["environment", "file"])
def test_no_credential_appears_in_errors_logs_streams_or_files(
    leaky, monkeypatch, caplog, capfd, credentials
):
    if credentials == "file":
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(name)
        monkeypatch.setenv("AWS_PROFILE", "filecreds")
    caplog.set_level(logging.DEBUG, logger="koochak")
    retry = RetryPolicy(attempts=3, sleep=lambda _s: None)
    # The server echoes the secret key in use, as if it quoted the client's configuration.
    echo = _Echo(FILE_SECRET if credentials == "file" else SECRET)
    messages: list[str] = []
    try:
        for endpoint in (f"http://127.0.0.1:{leaky['closed']}", echo.endpoint):
            config = S3Config(bucket="bkt", endpoint=endpoint, region="us-east-1", path_style=True)
            messages += _drive(S3Store(config, retry=retry))
        # koochak-probe on an s3:// location (endpoint from the environment): its report
        # and its error line.
        from koochak.storage.probe import main as probe_main

        monkeypatch.setenv("AWS_ENDPOINT_URL", echo.endpoint)
        code = probe_main(["s3://bkt/probe", "--json", "--small-objects", "2",
                           "--read-bytes", "64K", "--streams", "1"])  # fmt: skip
        assert code != 0
    finally:
        echo.close()
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert retries, "the failures were not retried: the test would prove nothing about logs"
    echoed = [m for m in messages if "echo" in m]
    assert echoed, "the echo server's text did not reach the errors"
    assert all("[masked AWS_SECRET_ACCESS_KEY]" in m for m in echoed)
    for message in messages:
        _clean(message, "an error, repr or endpoint")
    for record in caplog.records:
        _clean(record.getMessage(), f"log record {record.name}")
    captured = capfd.readouterr()
    _clean(captured.out, "stdout")
    _clean(captured.err, "stderr")
    for path in pathlib.Path(leaky["out"]).rglob("*"):
        if path.is_file():
            _clean(path.read_bytes().decode("utf-8", "replace"), f"file {path}")


def test_a_probe_report_on_a_working_server_holds_no_credential(
    leaky, monkeypatch, local_s3, capfd
):
    """A whole koochak-probe run on moto with marker credentials (moto does not check them)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", local_s3.endpoint)
    from koochak.storage.probe import main as probe_main

    code = probe_main([f"s3://{local_s3.native_bucket}/tests/{uuid.uuid4().hex}", "--json",
                       "--small-objects", "2", "--read-bytes", "1M", "--streams", "1",
                       "--checkpoint-bytes", "6M", "--checkpoint-parts", "1",
                       "--dataset-shards", "2", "--shard-bytes", "64K", "--readers", "1",
                       "--rounds", "1"])  # fmt: skip
    captured = capfd.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report  # a real report came out
    _clean(captured.out, "the probe report")
    _clean(captured.err, "the probe's stderr")
    for path in pathlib.Path(leaky["out"]).rglob("*"):
        if path.is_file():
            _clean(path.read_bytes().decode("utf-8", "replace"), f"file {path}")
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == SECRET  # the markers were the inputs


def test_the_sdks_debug_log_holds_no_credential(leaky, monkeypatch, local_s3, caplog):
    """A user debugging uploads turns on DEBUG for everything: botocore then logs each request
    with its Authorization header (access key, signature) and each signature it computes."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", local_s3.endpoint)
    caplog.set_level(logging.DEBUG)  # the root: every logger, the SDK's included
    store = S3Store(S3Config(bucket=local_s3.native_bucket, prefix=f"tests/{uuid.uuid4().hex}/",
                             region="us-east-1", path_style=True))  # fmt: skip
    store.put("k", b"data")
    assert store.get("k") == b"data"
    store.delete("k")
    sent = [r for r in caplog.records if r.name.startswith("botocore") and "Authorization" in r.getMessage()]
    assert sent, "botocore logged no request: the test would prove nothing"
    signed = [r for r in caplog.records if r.getMessage().startswith("Signature:")]
    assert signed and all(r.getMessage().split()[-1] == "***" for r in signed)
    for record in caplog.records:
        _clean(record.getMessage(), f"log record {record.name}")
        assert "Signature=" not in record.getMessage() or "Signature=***" in record.getMessage()
