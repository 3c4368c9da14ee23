"""Compile C++ kernel sources with the system compiler and load them with ctypes.

Shared objects are cached on disk in `FULMEN_CACHE_DIR` (default `~/.cache/fulmen`), under a
name made from the hash of the source, the compiler command, the compiler's version and the
CPU, so a warm cache skips the compiler. Files are written to a temporary name and renamed
(atomic), so concurrent processes never load a half-written library. Loaded libraries are
kept in memory by the same key. `CompileError` reports a missing compiler or a failed build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

CXX_FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp", "-fPIC", "-shared",
             "-fno-math-errno", "-fno-trapping-math", "-fwrapv", "-ffp-contract=off")  # fmt: skip
# -fno-math-errno only stops libm setting errno (so sqrt vectorises); -fno-trapping-math lets
# the compiler turn selects (where, maximum, clamps) into vector blends, assuming no FP trap is
# enabled (none is in torch); -fwrapv makes signed overflow wrap as torch's integer ops do.
# None changes an IEEE result; -ffp-contract=off keeps a * b + c two rounded operations (no
# FMA), as eager computes it.

_ARGTYPES = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
             ctypes.c_int64]  # fmt: skip
_loaded: dict[str, ctypes.CDLL] = {}
_lock = threading.Lock()


class CompileError(RuntimeError):
    """The C++ compiler is missing or failed on a kernel."""


def cache_dir() -> Path:
    """The kernel cache directory (`FULMEN_CACHE_DIR`, default `~/.cache/fulmen`)."""
    root = os.environ.get("FULMEN_CACHE_DIR") or os.path.join(Path.home(), ".cache", "fulmen")
    return Path(root) / "cpp"


def compiler() -> str | None:
    """The C++ compiler command (`CXX`, else `g++` or `c++` on PATH), or None."""
    return _find_compiler(os.environ.get("CXX"), os.environ.get("PATH"))


@functools.lru_cache(maxsize=16)
def _find_compiler(cxx: str | None, path: str | None) -> str | None:
    for name in [cxx] if cxx else ["g++", "c++"]:
        found = shutil.which(name, path=path)
        if found:
            return found
    return None


@functools.cache
def _toolchain_id(cxx: str) -> str:
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return f"{cxx}\n{version}\n{cpu}"


def cache_key(source: str, cxx: str) -> str:
    text = "\n".join([source, " ".join(CXX_FLAGS), _toolchain_id(cxx)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _library_path(key: str) -> Path:
    return cache_dir() / f"k_{key}.so"


def is_cached(source: str) -> bool:
    """Whether `source` is already loaded or compiled in the disk cache (no compiler runs)."""
    cxx = compiler()
    if cxx is None:
        return False
    key = cache_key(source, cxx)
    return key in _loaded or _library_path(key).exists()


def load_library(source: str) -> ctypes.CDLL:
    """The shared library of `source`, compiled (or found in the cache) and loaded.

    Raises:
        CompileError: no compiler, or the compiler failed (its stderr is in the message).
    """
    cxx = compiler()
    if cxx is None:
        raise CompileError("no C++ compiler found (set CXX or install g++)")
    key = cache_key(source, cxx)
    with _lock:
        lib = _loaded.get(key)
    if lib is None:
        path = _library_path(key)
        if not path.exists():
            _build(source, cxx, path)
        lib = ctypes.CDLL(str(path))
        with _lock:
            lib = _loaded.setdefault(key, lib)
    return lib


def load_kernel(source: str):
    """The `fulmen_kernel` function of `source` (see `load_library`).

    Raises:
        CompileError: no compiler, or the compiler failed (its stderr is in the message).
    """
    fn = load_library(source).fulmen_kernel
    fn.argtypes = _ARGTYPES
    fn.restype = None
    return fn


def _build(source: str, cxx: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(source)
        out = Path(tmp) / "kernel.so"
        try:
            result = subprocess.run([cxx, *CXX_FLAGS, str(src), "-o", str(out)],
                                    capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as error:
            raise CompileError(f"running {cxx} failed: {error}") from error
        if result.returncode != 0:
            raise CompileError(f"{cxx} failed:\n{result.stderr[-4000:]}")
        os.replace(out, path)  # atomic: readers see no file or the whole file
    src_copy = path.with_suffix(".cpp")
    if not src_copy.exists():
        tmp_src = path.with_suffix(f".cpp.{os.getpid()}.tmp")
        tmp_src.write_text(source)
        os.replace(tmp_src, src_copy)
