"""Compile C++ kernel sources of the CPU target with the system compiler, load them with ctypes.

Shared objects are cached on disk (`cache.py`: `FULMEN_CACHE_DIR`, else
`$XDG_CACHE_HOME/fulmen`, else `~/.cache/fulmen`), in entries keyed by the hash of the source,
the compiler command, the compiler's version and the CPU's feature line, so a warm cache skips
the compiler. Entries are written atomically and authenticated before they are loaded (NOTE
[kernel cache trust] in `cache.py`): a truncated, corrupt or planted object is rebuilt, never
loaded. Loaded libraries are kept in memory by the same key. `CompileError` reports a missing
compiler, a failed build, or a cache that cannot be used at all.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

from fulmen.executors.codegen import cache
from fulmen.executors.codegen.build import digest

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
KIND = "cpp"  # the cache's directory of C++ kernels
_OBJECT = "kernel.so"
_FEATURE_LINES = ("flags", "features", "isa")


class CompileError(RuntimeError):
    """The C++ compiler is missing or failed on a kernel."""


def cache_dir() -> Path:
    """The directory of the C++ kernel cache (`cache.root() / "cpp"`, created private; in a
    private temporary directory when the configured one cannot be used safely)."""
    return cache.kind_dir(KIND)


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
            cpu += cpu_features(f.read())
    except OSError:
        pass
    return f"{cxx}\n{version}\n{cpu}"


def cpu_features(cpuinfo: str) -> str:
    """The CPU feature line of `/proc/cpuinfo` text (x86 names it `flags`, aarch64 `Features`,
    RISC-V `isa`), which `-march=native` compiles for; "" when there is none.

    Example:
        >>> cpu_features("processor : 0\nFeatures : fp asimd sve\n")
        'Features : fp asimd sve'
    """
    for line in cpuinfo.splitlines():
        name = line.split(":", 1)[0].strip().lower()
        if name in _FEATURE_LINES:
            return line.strip()
    return ""


def cache_key(source: str, cxx: str) -> str:
    """The cache entry name of `source` built by `cxx` with `CXX_FLAGS` on this CPU."""
    return digest(source, " ".join(CXX_FLAGS), _toolchain_id(cxx))


def is_cached(source: str) -> bool:
    """Whether `source` is already loaded or compiled in the disk cache (no compiler runs)."""
    cxx = compiler()
    if cxx is None:
        return False
    key = cache_key(source, cxx)
    try:
        return key in _loaded or cache.contains(KIND, key, _OBJECT)
    except OSError:
        return False


def load_library(source: str) -> ctypes.CDLL:
    """The shared library of `source`, compiled (or found verified in the cache) and loaded.

    Raises:
        CompileError: no compiler, the compiler failed (its stderr is in the message), or no
            cache directory, not even a temporary one, can be written.
    """
    cxx = compiler()
    if cxx is None:
        raise CompileError("no C++ compiler found (set CXX or install g++)")
    key = cache_key(source, cxx)
    with _lock:
        lib = _loaded.get(key)
    if lib is None:
        try:
            path = cache.lookup(KIND, key, _OBJECT) or _build(source, cxx, key)
            lib = ctypes.CDLL(str(path))
        except OSError as error:
            raise CompileError(f"the kernel cache failed: {error}") from error
        with _lock:
            lib = _loaded.setdefault(key, lib)
    return lib


# NOTE [one-argument entry] A ctypes call converts each argument from Python: six arguments
# cost about 1 µs a call, more than a small kernel computes. Each kernel is built with
# `fulmen_call`, which takes one block of int64s: [ndim, block or nouter, nthreads, index of
# the first pointer, sizes[ndim], strides[ndim * pointers], pointers...]; a call plan fills
# everything but the pointers once, and each call writes only those (`runtime.py`).
ENTRY = """
extern "C" void fulmen_call(const int64_t* a) {
  fulmen_kernel(a[0], a + 4, a + 4 + a[0], (char* const*)(a + a[3]), a[1], a[2]);
}
"""


def with_entry(source: str) -> str:
    """The text built for kernel `source`: the source and its one-argument entry point."""
    return source + ENTRY


def is_kernel_cached(source: str) -> bool:
    """Whether the kernel `source` (with its entry) is loaded or in the disk cache."""
    return is_cached(with_entry(source))


def load_kernel(source: str):
    """The `fulmen_kernel` function of `source` (see `load_library`), taking its six
    arguments.

    Raises:
        CompileError: no compiler, or the compiler failed (its stderr is in the message).
    """
    fn = load_library(with_entry(source)).fulmen_kernel
    fn.argtypes = _ARGTYPES
    fn.restype = None
    return fn


def load_entry(source: str):
    """The `fulmen_call` entry of kernel `source` (NOTE [one-argument entry]): called with one
    ctypes int64 array, the block, passed as a pointer with no conversion of its own.

    Raises:
        CompileError: no compiler, or the compiler failed (its stderr is in the message).
    """
    fn = load_library(with_entry(source)).fulmen_call
    fn.restype = None
    return fn


def load_cached_entry(source: str):
    """The `fulmen_call` entry of kernel `source` (as `load_entry`) when its library is loaded
    already or its disk cache entry verifies; None otherwise: this never runs the compiler.

    Raises:
        CompileError: the verified library could not be loaded.
    """
    cxx = compiler()
    if cxx is None:
        return None
    source = with_entry(source)
    key = cache_key(source, cxx)
    with _lock:
        lib = _loaded.get(key)
    if lib is None:
        try:
            path = cache.lookup(KIND, key, _OBJECT)
            if path is None:
                return None
            lib = ctypes.CDLL(str(path))
        except OSError as error:
            raise CompileError(f"the kernel cache failed: {error}") from error
        with _lock:
            lib = _loaded.setdefault(key, lib)
    fn = lib.fulmen_call
    fn.restype = None
    return fn


def _build(source: str, cxx: str, key: str) -> Path:
    """Compile `source` into the cache entry `key`; its object's path. When the cache
    directory fails while in use, the build is redone in a private temporary one."""
    try:
        return _build_in_cache(source, cxx, key)
    except OSError as error:
        if not cache.give_up(error):
            raise
    return _build_in_cache(source, cxx, key)


def _build_in_cache(source: str, cxx: str, key: str) -> Path:
    with cache.workspace(KIND) as tmp:
        src = tmp / "kernel.cpp"
        src.write_text(source)
        out = tmp / _OBJECT
        try:
            result = subprocess.run([cxx, *CXX_FLAGS, str(src), "-o", str(out)],
                                    capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as error:
            raise CompileError(f"running {cxx} failed: {error}") from error
        if result.returncode != 0:
            raise CompileError(f"{cxx} failed:\n{result.stderr[-4000:]}")
        return cache.publish(KIND, key, tmp, _OBJECT)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX only (no fork on Windows)
    os.register_at_fork(after_in_child=_after_fork_in_child)
