"""Export is create-only (issue 27, defect 9): it never replaces what it did not write."""

from __future__ import annotations

import pytest
import torch
from koochak.loop.checkpoint import save
from koochak.loop.checkpoint.export import ExportExists, export_weights, main
from koochak.storage import artifact
from koochak.storage.store import LocalStore


@pytest.fixture
def run(tmp_path, make_ckpt):
    location = tmp_path / "run"
    for step in (0, 3):
        save(make_ckpt(step), location)
    return location


def test_a_plain_file_in_the_destination_is_never_replaced(run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pt").write_bytes(b"the user's own weights")
    with pytest.raises(ExportExists, match="model.pt exists and is a file without a ready"):
        export_weights(run, out)
    assert main([str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--replace" in err
    assert (out / "model.pt").read_bytes() == b"the user's own weights"
    assert not (out / "model.pt.ready.json").exists()
    assert main([str(run), str(out), "--replace"]) == 0  # asked for: replaced
    assert set(torch.load(out / "model.pt", weights_only=True)) == {"0.weight", "0.bias",
                                                                     "1.weight", "1.bias"}


def test_a_committed_export_of_another_step_is_never_replaced(run, tmp_path, make_ckpt):
    out = tmp_path / "out"
    step3 = export_weights(run, out)  # the highest valid: step 3
    with pytest.raises(ExportExists, match=r"was committed as weights of .*step000000003\.pt"):
        export_weights(run, out, step=0)
    committed, data = artifact.read_verified(LocalStore(out), "model.pt")
    assert committed.sha256 == step3.sha256  # still step 3's, still committed
    weights = torch.load(out / "model.pt", weights_only=True)
    assert torch.equal(weights["0.weight"], make_ckpt(3)["model"]["0.weight"])
    replaced = export_weights(run, out, step=0, replace=True)
    assert replaced.sha256 != step3.sha256
    weights = torch.load(out / "model.pt", weights_only=True)
    assert torch.equal(weights["0.weight"], make_ckpt(0)["model"]["0.weight"])


def test_the_same_export_again_is_a_no_op_and_other_options_are_another_export(run, tmp_path):
    out = tmp_path / "out"
    first = export_weights(run, out, step=3)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = export_weights(run, out)  # the highest valid is step 3 too: the same export
    assert again.sha256 == first.sha256
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(ExportExists):
        export_weights(run, out, step=3, dtype="bf16")  # other bytes under the same name
    export_weights(run, out, step=3, dtype="bf16", name="model-bf16.pt")  # beside it: fine
