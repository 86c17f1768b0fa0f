"""Secret values are masked in every form foreign text quotes them in, before anything is cut."""

from __future__ import annotations

import json
import urllib.parse

import pytest
from koochak.events import (
    SECRET_NAMES_VARIABLE,
    ArtifactAckTimeout,
    make_event_hooks,
    mask_secrets,
    mask_strings,
    secrets_from_environment,
)

TOKEN = 'tok-"quoted"\\back/slash-é-9Zq'
SECRETS = {"TRACKING_TOKEN": TOKEN}


@pytest.mark.parametrize(
    "form",
    [
        TOKEN,
        json.dumps(TOKEN)[1:-1],
        json.dumps(TOKEN, ensure_ascii=False)[1:-1],
        json.dumps(json.dumps(TOKEN)[1:-1])[1:-1],
        repr(TOKEN)[1:-1],
        urllib.parse.quote(TOKEN, safe=""),
    ],
)
def test_every_quoted_form_of_a_value_is_masked(form):
    text = f"error: login failed with {form} (exit 1)"
    masked = mask_secrets(text, SECRETS)
    assert masked == "error: login failed with [masked TRACKING_TOKEN] (exit 1)"


def test_a_value_inside_another_is_masked_whole_and_names_stay():
    secrets = {"SHORT": "abc", "LONG": "xxabcxx"}
    assert mask_secrets("xxabcxx and abc", secrets) == "[masked LONG] and [masked SHORT]"
    assert mask_secrets("nothing here", secrets) == "nothing here"


def test_short_and_empty_values():
    # A one-character secret is still masked (the text gets harder to read, never leaks it);
    # an empty one matches nothing rather than everything.
    assert mask_secrets("exit 1: 1 error", {"PIN": "1"}) == "exit [masked PIN]: [masked PIN] error"
    assert mask_secrets("exit 1", {"EMPTY": ""}) == "exit 1"


def test_mask_strings_masks_keys_and_values_and_keeps_other_types():
    doc = {"error": f"saw {TOKEN}", TOKEN: [1, 2.5, None, True, f"x{TOKEN}"]}
    masked = mask_strings(doc, SECRETS)
    assert masked == {
        "error": "saw [masked TRACKING_TOKEN]",
        "[masked TRACKING_TOKEN]": [1, 2.5, None, True, "x[masked TRACKING_TOKEN]"],
    }
    assert TOKEN not in json.dumps(masked) and json.dumps(TOKEN)[1:-1] not in json.dumps(masked)


def test_secrets_come_from_the_names_variable():
    env = {
        SECRET_NAMES_VARIABLE: "TRACKING_TOKEN, OTHER,bad name,UNSET",
        "TRACKING_TOKEN": TOKEN,
        "OTHER": "other-value",
        "NOT_NAMED": "public",
    }
    assert secrets_from_environment(env) == {"TRACKING_TOKEN": TOKEN, "OTHER": "other-value"}
    assert secrets_from_environment({"TRACKING_TOKEN": TOKEN}) == {}


def test_a_failure_event_masks_the_message_before_it_is_cut(publisher, train_start, monkeypatch):
    monkeypatch.setenv(SECRET_NAMES_VARIABLE, "TRACKING_TOKEN")
    monkeypatch.setenv("TRACKING_TOKEN", TOKEN)
    hooks = make_event_hooks(publisher)
    for fn in hooks["on_train_start"]:
        fn(train_start())
    # The value straddles the 512-character cut of the upstream table's `message`.
    error = RuntimeError("x" * 500 + f"server said {TOKEN!r}")
    error.reason = f"denied:{TOKEN}"
    for fn in hooks["on_exception"]:
        fn({"step": 3, "exception": error})
    failed = publisher.of("workload.phase")[-1]
    text = failed.to_json()
    for fragment in (TOKEN, TOKEN[:8], TOKEN[-8:], json.dumps(TOKEN)[1:9]):
        assert fragment not in text
    assert "[masked TRACKING_TOKEN]" in failed.payload["error"]
    assert failed.payload["reason"] == "denied:[masked TRACKING_TOKEN]"


def test_publisher_warnings_and_exit_lines_are_masked(publisher, train_start, monkeypatch):
    monkeypatch.setenv(SECRET_NAMES_VARIABLE, "TRACKING_TOKEN")
    monkeypatch.setenv("TRACKING_TOKEN", TOKEN)
    hooks = make_event_hooks(publisher)
    publisher.fail_with = OSError(f"spool at /x?token={TOKEN} is full")
    with pytest.warns(RuntimeWarning) as record:
        for fn in hooks["on_train_start"]:
            fn(train_start())
    assert TOKEN not in str(record[0].message) and "[masked TRACKING_TOKEN]" in str(
        record[0].message
    )
    line = ArtifactAckTimeout("late", detail=f"TimeoutError: {TOKEN}").exit_line()
    assert TOKEN not in line and json.loads(line)["detail"] == (
        "TimeoutError: [masked TRACKING_TOKEN]"
    )


def test_url_passwords_and_aws_credentials_are_masked_without_named_secrets(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI-K7MDENG-EXAMPLEKEY")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "tiny")  # under 8 characters: left alone
    text = ("cannot reach https://trainer:Pw-url-marker@minio:9000/b?X-Amz-Signature=abc123 "
            "with wJalrXUtnFEMI-K7MDENG-EXAMPLEKEY, a tiny session")  # fmt: skip
    masked = mask_secrets(text, {})
    assert masked == ("cannot reach https://***@minio:9000/b?X-Amz-Signature=*** with "
                      "[masked AWS_SECRET_ACCESS_KEY], a tiny session")  # fmt: skip
    assert mask_strings({"e": [text]}, {}) == {"e": [masked]}
    assert mask_secrets("ordinary text, bob@example.org", {}) == "ordinary text, bob@example.org"


def test_a_failure_event_masks_a_url_password_with_no_named_secrets(publisher, train_start):
    hooks = make_event_hooks(publisher)
    for fn in hooks["on_train_start"]:
        fn(train_start())
    error = ConnectionError("cannot reach s3://key:Pw-url-marker@bucket/run: refused")
    for fn in hooks["on_exception"]:
        fn({"step": 3, "exception": error})
    failed = publisher.of("workload.phase")[-1]
    assert "Pw-url-marker" not in failed.to_json()
    assert "s3://***@bucket/run" in failed.payload["error"]
