"""Output memory of the CPU kernels: large buffers that return to fulmen when torch frees them.

A memory-bound kernel that writes a fresh 64 MiB output spends much of its time in the
operating system: glibc maps every allocation over 32 MiB freshly and unmaps it on free, so
each call takes a page fault per page and the kernel zeroes every page before the kernel can
write it (measured on the 2-core dev VM: `fill_` into a reused buffer 2.8 ms, into a fresh
huge-page buffer 6.1 ms, into a fresh 4 KiB-page buffer ~25 ms). `torch.add(a, b, out=c)`
pays none of this; a training step pays it for every large activation and gradient. Smaller
outputs pay it too once glibc gives their memory back between steps: `make demo`'s 2 MiB GELU
outputs and gradients faulted all 512 pages each per step (the same GELU-backward kernel took
2.05 ms in the first layer, 0.55 ms in the second), about 1,040 faults a step in all; from 1 MiB
on, none (and CPU time per step down ~5%, `benchmarks/ab.py --cases demo:train`; 512 KiB pooled
three times as many outputs and gained nothing more).

`empty(shape, dtype)` therefore takes outputs of `MIN_BYTES` and more from a pool: a small
C++ library (built once with the kernel compiler, cached on disk like a kernel) hands out
blocks as DLPack tensors whose deleter puts the block back on a free list. torch calls the
deleter when the tensor's storage dies, i.e. when no tensor, view or saved tensor uses it any
more, so a block is never reused while anything can still read it. Blocks are advised
MADV_HUGEPAGE (Linux) and are kept per size (rounded up to 2 MiB; under 2 MiB, to 4 KiB pages,
so a block holds no more memory than torch.empty's would); at most `limit` bytes of
free blocks are kept (`FULMEN_CODEGEN_POOL_BYTES`, default min(1 GiB, RAM / 16); 0 turns the
pool off), beyond that a freed block goes back to the system. `empty_cache()` releases every
free block; `pool_stats()` reports the pool's state.

The tensors are ordinary contiguous CPU tensors (no view, no base), except that their storage
cannot be resized (as for any tensor made from external memory): `out.resize_(larger)` raises.
Until the library is built (in the background, once per machine; the "eager" compile policy
waits for it, as for kernels) and wherever it cannot be, outputs come from `torch.empty` with
the huge-page hint.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import torch
from torch.utils.dlpack import from_dlpack

from fulmen import config
from fulmen.executors.codegen import cache
from fulmen.executors.codegen.build import policy, submit
from fulmen.executors.codegen.cpu import compiler
from fulmen.executors.codegen.target import header

MIN_BYTES = 1 << 20  # outputs from this size on come from the pool
CPU = torch.device("cpu")  # explicit: a default device the user set must not apply
_HUGE = 1 << 21  # bytes of a transparent huge page (x86-64, aarch64 with 4 KiB base pages)

_SOURCE = header("pool.cpp")  # the pool library

# DLPack type codes (kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6) and bits.
_DLPACK_TYPES = {
    torch.float32: (2, 32), torch.float64: (2, 64), torch.float16: (2, 16),
    torch.bfloat16: (4, 16), torch.int8: (0, 8), torch.int16: (0, 16), torch.int32: (0, 32),
    torch.int64: (0, 64), torch.uint8: (1, 8), torch.bool: (6, 8),
}  # fmt: skip


def _default_limit() -> int:
    configured = config.get("FULMEN_CODEGEN_POOL_BYTES")
    if configured is not None:
        return max(0, configured)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 << 30
    return min(1 << 30, ram // 16)


class _Pool:
    """The pool library, loaded when first wanted (built in the background if not cached)."""

    def __init__(self) -> None:
        self.lib = None
        self.future = None
        self.failed = False
        self.limit = _default_limit()
        self._lock = threading.Lock()

    def reset_after_fork(self) -> None:
        """A forked child's lock (the parent's may have been held by a thread the child lacks)."""
        self._lock = threading.Lock()

    def get(self):
        """The loaded library, or None while it builds (the "eager" compile policy waits for the
        build, as for kernels) or when it cannot be built."""
        if self.limit == 0:
            return None
        if self.lib is None and not self.failed:
            if policy.mode == "eager":
                self.wait()
            else:
                self._poll()
        return self.lib

    def wait(self) -> bool:
        """Build and load the library now if it is not loaded; whether the pool is usable."""
        self._poll()
        if self.future is not None and self.lib is None and not self.failed:
            try:
                self.future.result()
            except Exception:
                pass
            self._poll()
        return self.lib is not None and self.limit > 0

    def _poll(self) -> None:
        with self._lock:
            if self.lib is None and not self.failed:
                self._start()

    def _start(self) -> None:
        if self.future is None and compiler.is_cached(_SOURCE):
            try:
                self._load(compiler.load_library(_SOURCE))
            except compiler.CompileError:
                self.failed = True
            return
        if self.future is None or not self.future.done():  # not done: see NOTE [fork]
            self.future = submit(("pool", str(cache.requested_root()), compiler.compiler()),
                                 compiler.load_library, _SOURCE)
        if self.future.done():
            try:
                self._load(self.future.result())
            except Exception:  # no compiler, a failed build: torch.empty serves every output
                self.failed = True

    def _load(self, lib) -> None:
        lib.fulmen_pool_take.restype = ctypes.c_void_p
        lib.fulmen_pool_take.argtypes = [ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p,
                                         ctypes.c_uint8, ctypes.c_uint8]
        lib.fulmen_pool_put.argtypes = [ctypes.c_void_p]
        lib.fulmen_pool_set_limit.argtypes = [ctypes.c_int64]
        lib.fulmen_pool_release.argtypes = [ctypes.c_int64]
        lib.fulmen_pool_stats.argtypes = [ctypes.c_void_p]
        lib.fulmen_pool_set_limit(self.limit)
        self.lib = lib


_state = _Pool()
if hasattr(os, "register_at_fork"):  # POSIX only (no fork on Windows)
    os.register_at_fork(after_in_child=_state.reset_after_fork)
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        _madvise = None


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor like `torch.empty(shape, dtype=dtype)`; from
    `MIN_BYTES` on its memory comes from the pool (see the module docstring) or, until the
    pool library is ready, from torch with its whole 2 MiB pages advised MADV_HUGEPAGE."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * dtype.itemsize
    if nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype, device=CPU)
    lib = _state.get()
    code_bits = _DLPACK_TYPES.get(dtype)
    if lib is not None and code_bits is not None and len(shape) <= 16:
        c_shape = (ctypes.c_int64 * max(1, len(shape)))(*shape)
        managed = lib.fulmen_pool_take(nbytes, len(shape), c_shape, *code_bits)
        if managed:
            try:
                return from_dlpack(_capsule_new(managed, b"dltensor", None))
            except Exception:
                lib.fulmen_pool_put(managed)
                raise
    out = torch.empty(shape, dtype=dtype, device=CPU)
    if _madvise is not None:
        start = -(-out.data_ptr() // _HUGE) * _HUGE
        end = (out.data_ptr() + nbytes) // _HUGE * _HUGE
        if end > start:
            _madvise(start, end - start, 14)  # MADV_HUGEPAGE; failure only loses the hint
    return out


def ready() -> bool:
    """Wait until the pool library is built and loaded; whether the pool serves outputs (False
    without a compiler, or with the pool turned off)."""
    return _state.wait()


def pool_stats() -> dict[str, int]:
    """The pool's state: `cached` (bytes of free blocks kept), `in_use` (bytes of blocks held
    by live tensors), `limit` (bytes), `hits`/`misses` (takes served from / not from the free
    blocks). All zero while the pool library is not loaded."""
    names = ("cached", "in_use", "limit", "hits", "misses")
    lib = _state.lib
    if lib is None:
        return dict.fromkeys(names, 0)
    out = (ctypes.c_int64 * 5)()
    lib.fulmen_pool_stats(out)
    return dict(zip(names, out))


def empty_cache() -> None:
    """Return every free block of the pool to the system (live tensors are not affected)."""
    if _state.lib is not None:
        _state.lib.fulmen_pool_release(0)


def set_pool_limit(nbytes: int) -> int:
    """Keep at most `nbytes` of free blocks (0 turns the pool off for new outputs); returns the
    previous limit. Free blocks above the new limit are released."""
    previous, _state.limit = _state.limit, max(0, int(nbytes))
    if _state.lib is not None:
        _state.lib.fulmen_pool_set_limit(_state.limit)
        _state.lib.fulmen_pool_release(_state.limit)
    return previous
