"""Renamed names keep importing for one minor version, each use with a DeprecationWarning that
names the new name and points at the caller's line."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("module", ["koochak.jobs", "koochak.jobs.manifest"])
def test_artifact_is_a_deprecated_alias_of_staged_file(module):
    from koochak.jobs import StagedFile

    mod = importlib.import_module(module)
    with pytest.warns(
        DeprecationWarning,
        match=rf"^{module}\.Artifact is deprecated; use koochak\.jobs\.StagedFile",
    ) as caught:
        alias = mod.Artifact
    assert alias is StagedFile
    assert caught[0].filename == __file__  # the warning points at the line that used it
    assert "Artifact" not in mod.__all__


def test_from_import_of_the_old_name_warns_too():
    with pytest.warns(DeprecationWarning, match="koochak-jobs 0.4"):
        from koochak.jobs import Artifact
    assert Artifact(path="/a", content=b"x", sha256="s").path == "/a"


def test_an_unknown_name_is_still_an_attribute_error():
    import koochak.jobs.manifest as manifest

    with pytest.raises(AttributeError, match="no attribute 'Artefact'"):
        manifest.Artefact  # noqa: B018


@pytest.mark.parametrize("name", ["PreparedRun", "prepare_run"])
def test_prepared_runs_still_import_from_the_manifest_module(name):
    import koochak.jobs
    import koochak.jobs.manifest as manifest

    with pytest.warns(
        DeprecationWarning,
        match=rf"koochak\.jobs\.manifest\.{name} is deprecated; use koochak\.jobs\.{name} ",
    ):
        old = getattr(manifest, name)
    assert old is getattr(koochak.jobs, name)
    assert old.__module__ == "koochak.jobs.prepared"


def test_the_launch_manifest_names_stay_where_they_were_without_a_warning(recwarn):
    from koochak.jobs.manifest import (  # noqa: F401
        MANIFEST_NAME,
        MANIFEST_VERSION,
        encode_manifest,
        parse_manifest,
    )

    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_a_declared_outputs_ready_manifest_path_has_a_name_that_says_so():
    from koochak.jobs import DeclaredOutput

    output = DeclaredOutput("dataset/tokens", "/runs/a/tokens.bin")
    assert output.ready_manifest_path == "/runs/a/tokens.bin.ready.json"
    with pytest.warns(DeprecationWarning, match=r"use DeclaredOutput\.ready_manifest_path") as w:
        assert output.manifest_path == output.ready_manifest_path
    assert w[0].filename == __file__
