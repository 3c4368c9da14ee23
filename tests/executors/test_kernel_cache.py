"""The disk kernel cache trusts nothing (NOTE [kernel cache trust] in
`fulmen/executors/codegen/cache.py`): corrupt, truncated, planted, unwritable, foreign and
half-written caches each give eager's answer with at most one warning, and a planted library's
code never runs.

Each scenario runs fulmen in a fresh Python process (a loaded library stays loaded in a process,
and a truncated one used to kill it with SIGBUS): a first process fills the cache, the test
damages it, a second process must still be right.
"""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fulmen.executors.codegen.cpu import compiler as build

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="needs a C++ compiler")

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, warnings
import torch
import fulmen
from fulmen.executors.codegen import set_compile_policy
from fulmen.executors.codegen.cpu import runtime

def fn(x, y):
    return torch.tanh(x * y + 1.5) - y

set_compile_policy("eager")
torch.manual_seed(0)
x, y = torch.randn(16, 8), torch.randn(16, 8)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jfn = fulmen.jit(fn, executors=["codegen", "torch"])
    results = [jfn(x, y) for _ in range(3)]
regions = [b.sym.impl for b in fulmen.last_traces(jfn)[-1].bsyms
           if isinstance(b.sym.impl, runtime.FusedRegion)]
print(json.dumps({
    "right": all(torch.allclose(r, fn(x, y), rtol=1.3e-6, atol=1e-5) for r in results),
    "kernel": bool(regions) and all(r.ready() and not r.failed for r in regions),
    "warnings": [str(w.message) for w in caught if str(w.message).startswith("fulmen")],
}))
"""

PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen(getenv("FULMEN_TEST_MARKER"), "w");
  if (f) { fputs("planted code ran", f); fclose(f); }
}
void fulmen_kernel(void) {}
"""


def _child(cache: Path, **env) -> dict:
    """Run CHILD with `FULMEN_CACHE_DIR=cache`; its report (the test fails if it crashed)."""
    full_env = {**os.environ, "FULMEN_CACHE_DIR": str(cache), **env}
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_eager_with_at_most_one_warning(report: dict) -> None:
    assert report["right"]
    assert len(report["warnings"]) <= 1, report["warnings"]


def _objects(cache: Path) -> list[Path]:
    """The compiled shared objects in the cache (whatever its layout)."""
    objects = sorted(cache.rglob("*.so"))
    assert objects, f"nothing was cached in {cache}"
    return objects


def test_a_corrupt_object_is_rebuilt_not_loaded(tmp_path):
    cache = tmp_path / "cache"
    assert _child(cache)["kernel"]
    for obj in _objects(cache):
        obj.write_bytes(b"\x7fELF not really a shared object" * 64)
    report = _child(cache)
    _assert_eager_with_at_most_one_warning(report)
    assert report["kernel"]  # rebuilt
    repaired = _child(cache)
    assert repaired["right"] and repaired["kernel"] and repaired["warnings"] == []


def test_a_truncated_object_is_rebuilt_not_loaded(tmp_path):
    cache = tmp_path / "cache"
    _child(cache)
    for obj in _objects(cache):
        os.truncate(obj, obj.stat().st_size // 2)  # used to kill the process with SIGBUS
    report = _child(cache)
    _assert_eager_with_at_most_one_warning(report)
    assert report["kernel"]


def test_a_planted_library_never_runs(tmp_path):
    cache = tmp_path / "cache"
    _child(cache)
    source = tmp_path / "planted.c"
    source.write_text(PLANTED)
    planted = tmp_path / "planted.so"
    subprocess.run([build.compiler(), "-shared", "-fPIC", "-x", "c", str(source), "-o",
                    str(planted)], check=True, capture_output=True)
    for obj in _objects(cache):
        shutil.copyfile(planted, obj)
    marker = tmp_path / "marker"
    report = _child(cache, FULMEN_TEST_MARKER=str(marker))
    assert not marker.exists(), "the planted library's constructor ran"
    _assert_eager_with_at_most_one_warning(report)


def test_an_unusable_cache_directory_falls_back_to_a_private_one(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    report = _child(blocker / "cache")  # cannot be created: its parent is a file
    _assert_eager_with_at_most_one_warning(report)
    assert report["kernel"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any directory")
def test_a_read_only_cache_directory_falls_back_to_a_private_one(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o500)
    report = _child(cache)
    _assert_eager_with_at_most_one_warning(report)
    assert list(cache.iterdir()) == []


def test_a_directory_others_can_write_is_not_used(tmp_path):
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)
    report = _child(cache)
    _assert_eager_with_at_most_one_warning(report)
    assert report["kernel"]
    assert list(cache.iterdir()) == []  # nothing written where others could plant a library


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_directory_of_another_user_is_not_used(tmp_path):
    cache = tmp_path / "theirs"
    cache.mkdir(mode=0o700)
    os.chown(cache, 4242, 4242)
    report = _child(cache)
    _assert_eager_with_at_most_one_warning(report)
    assert list(cache.iterdir()) == []


def test_the_workspace_of_a_killed_compile_is_cleaned_up(tmp_path):
    cache = tmp_path / "cache"
    hanging = tmp_path / "hanging-cxx"
    hanging.write_text("#!/bin/sh\nexec sleep 600\n")  # `--version` answers, a build hangs
    hanging.chmod(0o755)
    env = {**os.environ, "FULMEN_CACHE_DIR": str(cache), "CXX": str(hanging)}
    victim = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        leftovers = _wait_for_workspace(cache, victim)
    finally:
        os.killpg(victim.pid, signal.SIGKILL)  # killed mid-compile, compiler and all
        victim.wait()
    assert leftovers
    report = _child(cache)
    _assert_eager_with_at_most_one_warning(report)
    assert report["kernel"]
    assert not any(path.exists() for path in leftovers)


def _wait_for_workspace(cache: Path, process: subprocess.Popen) -> list[Path]:
    """The build directories (anything but finished entries) once the process has made one."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        found = [p for p in cache.rglob("*") if p.is_dir() and p.name != "cpp"
                 and not p.name.startswith("k_")]
        if found:
            return found
        time.sleep(0.1)
    return []


def test_cache_directories_are_created_private(tmp_path, monkeypatch):
    monkeypatch.setenv("FULMEN_CACHE_DIR", str(tmp_path / "new" / "cache"))
    kernels = build.cache_dir()
    for directory in (kernels, kernels.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_xdg_cache_home_is_honoured(tmp_path, monkeypatch):
    monkeypatch.delenv("FULMEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_dir().parent == tmp_path / "xdg" / "fulmen"


def test_the_cpu_feature_line_of_every_architecture_is_in_the_key():
    x86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2\n"
    aarch64 = "processor\t: 0\nFeatures\t: fp asimd sve\nCPU part\t: 0xd0c\n"
    assert "avx2" in build.cpu_features(x86)
    assert "sve" in build.cpu_features(aarch64)
    assert build.cpu_features("processor\t: 0\n") == ""
