"""The kernel cache's checks, entry by entry, in this process (NOTE [kernel cache trust] in
`fulmen/executors/codegen/cache.py`): an object is loaded only from its own entry, as a regular
file, and only from a directory and with a key file nobody else can touch. The end-to-end
scenarios (a second process must stay right) are in `test_kernel_cache.py`."""

import os
import shutil
import warnings

import pytest

from fulmen.executors.codegen import cache


@pytest.fixture
def requested(tmp_path, monkeypatch):
    """A fresh requested cache root (this process checks and sets it up anew)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("FULMEN_CACHE_DIR", str(path))
    cache._forget()
    yield path
    cache._forget()


def _publish(key: str, payload: bytes = b"object bytes") -> cache.Path:
    with cache.workspace("test") as built:
        (built / "k.so").write_bytes(payload)
        return cache.publish("test", key, built, "k.so")


def _refused(key: str) -> bool:
    """Whether the lookup of entry `key` refuses it (its warning shows once per process)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return cache.lookup("test", key, "k.so") is None


def test_an_object_moved_under_another_entry_is_not_loaded(requested):
    """The MAC covers the entry's key: a valid object of one kernel copied into another
    kernel's entry (same name, its own MAC beside it) would run the wrong kernel."""
    obj = _publish("a" * 32)
    assert cache.lookup("test", "a" * 32, "k.so") == obj
    shutil.copytree(obj.parent, obj.parent.with_name("k_" + "b" * 32))
    assert _refused("b" * 32)


def test_an_object_that_is_a_link_is_not_loaded(requested, tmp_path):
    """Only a regular file is loaded: a link could be pointed elsewhere between the check and
    the load, even one to identical bytes."""
    obj = _publish("c" * 32)
    elsewhere = tmp_path / "elsewhere.so"
    shutil.copyfile(obj, elsewhere)
    obj.unlink()
    obj.symlink_to(elsewhere)
    assert _refused("c" * 32)


def test_a_directory_its_group_can_write_is_not_used(requested):
    requested.mkdir(mode=0o700)
    requested.chmod(0o770)
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        assert cache.root() != requested


def test_a_key_file_others_can_read_is_not_used(requested):
    assert cache.root() == requested
    os.chmod(requested / "key", 0o640)  # anyone who reads it can sign a planted object
    cache._forget()
    with pytest.warns(RuntimeWarning, match="not a private key file"):
        assert cache.root() != requested
