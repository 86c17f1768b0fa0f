"""Modules split out of store.py and artifact.py: every old import path still works.

The names are listed here rather than read from ``__all__``, so dropping a re-export (or one
from ``__all__``) fails this test instead of changing what it checks.
"""

from __future__ import annotations

import importlib

import pytest

STORE = {
    "ObjectInfo": "koochak.storage.protocol",
    "Store": "koochak.storage.protocol",
    "LocalStore": "koochak.storage.local_store",
    "ObjectCollision": "koochak.storage.local_store",
    "SETTLING_ERRNOS": "koochak.storage.local_store",
    "PUBLISH_MODES": "koochak.storage.keys",
    "TEMP_PREFIX": "koochak.storage.keys",
    "validate_key": "koochak.storage.keys",
    "check_put_expectations": "koochak.storage.protocol",
    "StoreCapabilities": "koochak.storage.protocol",
    "capabilities_of": "koochak.storage.protocol",
    "exists": "koochak.storage.protocol",
    "list_shallow": "koochak.storage.protocol",
    "open_store": "koochak.storage.store",
    "register_store": "koochak.storage.store",
    "ENTRY_POINT_GROUP": "koochak.storage.store",
}
ARTIFACT = {
    "READY_SUFFIX": "koochak.storage.ready_manifest",
    "MANIFEST_VERSION": "koochak.storage.ready_manifest",
    "InvalidArtifact": "koochak.storage.ready_manifest",
    "Publication": "koochak.storage.publication",
    "publish": "koochak.storage.publication",
    "claimed": "koochak.storage.publication",
    "unpublish": "koochak.storage.publication",
    "read_manifest": "koochak.storage.publication",
    "read_verified": "koochak.storage.publication",
    "published_candidates": "koochak.storage.publication",
    "highest_valid": "koochak.storage.publication",
    "numbered_pattern": "koochak.storage.publication",
    "prune_keep_last_k": "koochak.storage.publication",
    "write_ready_manifest": "koochak.storage.local_ready",
    "read_ready_manifest": "koochak.storage.local_ready",
    "verify_ready": "koochak.storage.local_ready",
}


@pytest.mark.parametrize(
    ("old", "names"), [("koochak.storage.store", STORE), ("koochak.storage.artifact", ARTIFACT)]
)
def test_every_name_of_the_old_module_is_the_object_in_its_new_home(old, names):
    module = importlib.import_module(old)
    for name, home in names.items():
        assert getattr(module, name) is getattr(importlib.import_module(home), name), name
    assert set(module.__all__) == set(names) - {"ENTRY_POINT_GROUP"}


def test_the_storage_package_exports_the_same_objects():
    import koochak.storage as storage

    for name in ("LocalStore", "ObjectInfo", "Store", "open_store", "register_store"):
        assert getattr(storage, name) is getattr(importlib.import_module(STORE[name]), name)
    for name in ("READY_SUFFIX", "InvalidArtifact", "Publication", "publish", "highest_valid"):
        assert getattr(storage, name) is getattr(importlib.import_module(ARTIFACT[name]), name)


def test_every_public_name_of_the_package_resolves_on_first_use():
    # koochak.storage imports its names lazily (PEP 562): each must still be its module's object.
    import koochak.storage as storage

    assert set(storage._EXPORTS) == set(storage.__all__)
    for name in storage.__all__:
        home = importlib.import_module(f"koochak.storage.{storage._EXPORTS[name]}")
        assert getattr(storage, name) is getattr(home, name), name
        assert name in dir(storage)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        storage.nope  # noqa: B018


def test_the_contract_module_imports_nothing_from_koochak():
    # A backend's author reads protocol.py alone; it must not pull LocalStore or the registry in.
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(importlib.import_module(STORE["Store"]).__file__).read_text())
    imported = [
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    ]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [name for name in imported if name.startswith("koochak")], imported
