"""koochak.storage.redact: URL user info, signature parameters and credential values removed."""

from __future__ import annotations

import json
import urllib.parse

from koochak.storage.redact import has_user_info, redact_text, redact_url


def test_user_info_is_removed_from_urls_in_text_even_with_an_at_in_the_password():
    text = 'Could not connect to "http://alice:p@ss:w0rd@s3.example.org:9000/bkt/k" (https://bob@h/)'
    out = redact_text(text)
    assert "p@ss" not in out and "alice" not in out and "bob" not in out
    assert "http://***@s3.example.org:9000/bkt/k" in out and "https://***@h/" in out


def test_signature_parameters_are_masked():
    text = (
        "GET https://h/k?X-Amz-Credential=AKID%2F2026&X-Amz-Signature=deadbeef&x=1 "
        "Authorization: AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20261201/us-east-1/s3, "
        "Signature=abc123"
    )
    out = redact_text(text)
    assert "AKID" not in out and "deadbeef" not in out and "abc123" not in out
    assert "x=1" in out


def test_credential_values_from_the_environment_and_given_ones_are_masked(monkeypatch):
    secret = 'se"cret/value+1'
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")  # too short to be real: left alone
    text = " ".join(
        [secret, urllib.parse.quote(secret, safe=""), json.dumps(secret), "tests/ok", "given-v4lue"]
    )
    out = redact_text(text, [("AWS_SESSION_TOKEN", "given-v4lue")])
    assert "cret" not in out
    assert out.count("[masked AWS_SECRET_ACCESS_KEY]") == 3
    assert "[masked AWS_SESSION_TOKEN]" in out and "tests/ok" in out


def test_redact_url_and_has_user_info():
    assert redact_url("http://u:pw@h:1/p?X-Amz-Signature=s#f") == "http://***@h:1/p"
    assert redact_url("https://h/p") == "https://h/p"
    assert has_user_info("http://u:pw@h") and has_user_info("http://:pw@h")
    assert not has_user_info("http://h:1/p@x")
