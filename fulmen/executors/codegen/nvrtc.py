"""Compile CUDA kernel sources with NVRTC (`cuda-python`), load them, launch them.

Compilation targets the device's exact architecture: a cubin for `sm_XX` when this NVRTC knows
the architecture, else PTX for the newest architecture it knows below the device's (the driver
JIT-compiles it; PTX newer than the driver cannot load, and that failure, like any other,
becomes a fallback). Images are cached on disk under `FULMEN_CACHE_DIR/cuda`, keyed by the
source, the target, the NVRTC version and the options, written atomically and verified before
use (`cache.py`); loaded functions are kept in memory per device. `cuda_fp16.h`/`cuda_bf16.h`
come from the `nvidia-cuda-runtime` wheel (found with `cuda.pathfinder`), else from a CUDA
toolkit (`CUDA_HOME`, `/usr/local/cuda`).

`CudaFusedRegion` is the implementation of a fusion symbol whose tensors live on a CUDA device:
it resolves strides like the CPU runtime, picks the layout class (`cuda.Spec` for a pointwise
kernel, `cuda_rows.plan_rows` for the normalisation schedule: block size, rows split over several
blocks, column-sum groups, a float64 workspace), compiles once per class and launches on torch's
current stream with `data_ptr()`s (a row kernel: one launch, or one per reduction stage plus one
when rows are split, then `<entry>_columns` when it has column sums). If `cuda-python` is missing,
NVRTC fails, or the driver refuses the image, the region warns once and runs its prims with the
torch executor from then on: never a crash, never a wrong result.

`cuda-python` is imported only inside the functions here, so `import fulmen` never needs it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import math
import os
import struct
import threading
import warnings
from pathlib import Path

import torch

from fulmen.core import BoundSymbol
from fulmen.executors.codegen import cache, cuda, cuda_rows
from fulmen.executors.codegen.ir import Kernel, RowKernel
from fulmen.executors.codegen.lower import LoweredRegion
from fulmen.executors.codegen.runtime import (
    RegionCallable,
    _Fallback,
    coalesce,
    region_results,
    resolve,
)

OPTIONS = ("-std=c++17", "--fmad=false")
# --fmad=false: a * b + c stays two rounded operations, as eager computes it. The remaining
# defaults are IEEE: -ftz=false -prec-div=true -prec-sqrt=true, no fast math.
MAX_PARAM_BYTES = 4096
ENTRY = "fulmen_kernel"

_KIND = "cuda"  # the cache's directory of CUDA images
_lock = threading.Lock()
_functions: dict[tuple, object] = {}
_modules: dict[tuple, object] = {}
_warned: set[str] = set()


class NvrtcError(RuntimeError):
    """cuda-python or NVRTC is missing, compilation failed, or the driver refused an image."""


def available() -> bool:
    """Whether `cuda-python`'s bindings are installed (checked without importing them)."""
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):
        return False


def fusible(bsym: BoundSymbol) -> bool:
    """Whether the codegen executor may fuse `bsym` into a CUDA region (`cuda.fusible`, and
    cuda-python is installed: without it CUDA prims are left to the other executors)."""
    return cuda.fusible(bsym) and available()


def _bindings():
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError as error:
        raise NvrtcError("cuda-python is not installed (pip install 'fulmen[cuda]')") from error
    return driver, nvrtc


def _check(result, what: str):
    """Unwrap a cuda-python result tuple `(status, *values)`, raising NvrtcError on failure."""
    status, *values = result
    if int(status) != 0:
        raise NvrtcError(f"{what} failed: {status!r}")
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """The NVRTC library's (major, minor) version."""
    _, nvrtc = _bindings()
    return _check(nvrtc.nvrtcVersion(), "nvrtcVersion")


@functools.cache
def supported_archs() -> tuple[int, ...]:
    """The `sm_XX` numbers this NVRTC compiles for (e.g. 75, 80, 86, 89, 90, ...)."""
    _, nvrtc = _bindings()
    return tuple(int(a) for a in _check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


@functools.cache
def include_dirs() -> tuple[str, ...]:
    """The directory holding `cuda_fp16.h` (the nvidia-cuda-runtime wheel first, then a
    toolkit), or none."""
    found = []
    try:
        from cuda import pathfinder

        located = pathfinder.find_nvidia_header_directory("cudart")
        if located:
            found.append(str(located))
    except Exception:  # an old pathfinder, or none: look for a toolkit below
        pass
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_fp16.h").exists():
            found.append(str(Path(root) / "include"))
    found = [d for d in found if (Path(d) / "cuda_fp16.h").exists()]
    return tuple(found[:1])  # one set of headers: never a mix of two versions


def target_for(capability: tuple[int, int]) -> tuple[int, str]:
    """(architecture, "cubin" or "ptx") to compile for a device of `capability`: a cubin for
    the exact `sm_XX` when NVRTC supports it, else PTX for the newest architecture below it.

    Raises:
        NvrtcError: if NVRTC supports no architecture at or below the device's.
    """
    arch = capability[0] * 10 + capability[1]
    archs = supported_archs()
    if arch in archs:
        return arch, "cubin"
    older = [a for a in archs if a < arch]
    if not older:
        raise NvrtcError(f"NVRTC {nvrtc_version()} cannot compile for sm_{arch}")
    return max(older), "ptx"


def options(arch: int, kind: str) -> list[str]:
    """NVRTC options for `arch` ("cubin": real `sm_XX` code, "ptx": `compute_XX`)."""
    target = f"sm_{arch}" if kind == "cubin" else f"compute_{arch}"
    return [f"--gpu-architecture={target}", *OPTIONS, *[f"-I{d}" for d in include_dirs()]]


def compile_source(source: str, arch: int, kind: str = "cubin") -> tuple[bytes, str]:
    """Compile `source` with NVRTC; returns (cubin or PTX bytes, NVRTC's log — warnings).

    Raises:
        NvrtcError: cuda-python missing, or compilation failed (the log is in the message).
    """
    _, nvrtc = _bindings()
    program = _check(nvrtc.nvrtcCreateProgram(source.encode(), b"fulmen.cu", 0, [], []),
                     "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options(arch, kind)]
        (status,) = nvrtc.nvrtcCompileProgram(program, len(opts), opts)
        size = _check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
        log = b" " * size
        _check((nvrtc.nvrtcGetProgramLog(program, log)[0], None), "nvrtcGetProgramLog")
        log_text = log.rstrip(b"\x00 ").decode(errors="replace").strip()
        if int(status) != 0:
            raise NvrtcError(f"NVRTC failed for sm_{arch}:\n{log_text[-4000:]}")
        if kind == "cubin":
            size = _check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
            image = b" " * size
            _check((nvrtc.nvrtcGetCUBIN(program, image)[0], None), "nvrtcGetCUBIN")
        else:
            size = _check(nvrtc.nvrtcGetPTXSize(program), "nvrtcGetPTXSize")
            image = b" " * size
            _check((nvrtc.nvrtcGetPTX(program, image)[0], None), "nvrtcGetPTX")
        return image, log_text
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def cache_dir() -> Path:
    """Where compiled CUDA images live (`FULMEN_CACHE_DIR/cuda`; see `cache.py`)."""
    return cache.kind_dir(_KIND)


def cache_key(source: str, arch: int, kind: str) -> str:
    text = "\n".join([source, f"{kind}:{arch}", repr(nvrtc_version()), *options(arch, kind)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def compile_cached(source: str, arch: int, kind: str = "cubin") -> bytes:
    """`compile_source`, through the on-disk cache (entries written atomically and verified
    before use: NOTE [kernel cache trust] in `cache.py`); a cache that cannot be read or
    written only costs the compile."""
    key, name = cache_key(source, arch, kind), f"kernel.{kind}"
    try:
        path = cache.lookup(_KIND, key, name)
        if path is not None:
            return path.read_bytes()
    except OSError:
        pass
    image, _ = compile_source(source, arch, kind)
    try:
        with cache.workspace(_KIND) as tmp:
            (tmp / name).write_bytes(image)
            (tmp / "kernel.cu").write_text(source)
            cache.publish(_KIND, key, tmp, name)
    except OSError:
        pass
    return image


def _make_context_current(driver, index: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    _check(driver.cuInit(0), "cuInit")
    device = _check(driver.cuDeviceGet(index), "cuDeviceGet")
    context = _check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    _check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")


def load_function(source: str, device: torch.device, entry: str = ENTRY):
    """The function `entry` of `source` compiled for `device` and loaded there (cached: one
    module per source and device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch, kind = target_for(torch.cuda.get_device_capability(index))
    key = (cache_key(source, arch, kind), index)
    with _lock:
        function = _functions.get(key + (entry,))
        module = _modules.get(key)
    if function is None:
        driver, _ = _bindings()
        with torch.cuda.device(index):
            _make_context_current(driver, index)
            if module is None:
                image = compile_cached(source, arch, kind)
                if kind == "ptx":
                    image += b"\x00"
                module = _check(driver.cuModuleLoadData(image),
                                f"loading the {kind} for sm_{arch}")
                with _lock:
                    _modules[key] = module
            function = _check(driver.cuModuleGetFunction(module, entry.encode()),
                              "cuModuleGetFunction")
        with _lock:
            _functions[key + (entry,)] = function
    return function


def launch(function, device: torch.device, grid: int, params: bytes,
           block: int = cuda.BLOCK) -> None:
    """Launch `function` on `grid` blocks of `block` threads, on torch's current stream of
    `device`, with the packed argument struct `params`."""
    driver, _ = _bindings()
    buffer = ctypes.create_string_buffer(params, len(params))
    pointers = (ctypes.c_void_p * 1)(ctypes.addressof(buffer))
    stream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
    _check((driver.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, 0, stream,
                                  ctypes.addressof(pointers), 0)[0], None), "cuLaunchKernel")


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _contiguous(sizes) -> list[int]:
    strides, acc = [], 1
    for size in reversed(sizes):
        strides.append(acc)
        acc *= size
    return strides[::-1]


def plan(kernel, sizes: list[int], rows: list[list[int]], addresses: list[int]) -> cuda.Spec:
    """The layout class (`cuda.Spec`) of a call: coalesced `sizes`, each pointer's element
    `rows` of strides and byte `addresses` (vectorised only when every contiguous pointer is
    aligned to its vector)."""
    contiguous = _contiguous(sizes)
    classes = tuple(0 if not any(row) else 1 if row == contiguous else 2 for row in rows)
    vec = cuda.vector_width(kernel, classes)
    if vec > 1:
        dtypes = list(kernel.access_dtypes) + list(kernel.output_dtypes)
        if any(c == 1 and address % (vec * d.itemsize) for c, d, address
               in zip(classes, dtypes, addresses)):
            vec = 1
    numel = math.prod(sizes)
    reach = max(sum((s - 1) * abs(st) for s, st in zip(sizes, row)) for row in rows)
    small = numel + 2**26 < 2**31 and reach < 2**31
    return cuda.Spec(len(sizes), classes, vec, "int" if small else "long long")


def pack(sizes: list[int], rows: list[list[int]], addresses: list[int]) -> bytes:
    """The argument struct of a kernel (see `cuda.py`): numel, sizes, strides, pointers."""
    flat = [s for row in rows for s in row]
    return struct.pack(f"<{1 + len(sizes) + len(flat)}q{len(addresses)}Q", math.prod(sizes),
                       *sizes, *flat, *addresses)


class CudaFusedRegion(RegionCallable):
    """The callable behind one fusion symbol on CUDA tensors (see the module docstring)."""

    def __init__(self, name: str, lowered: LoweredRegion, fallback_trace) -> None:
        super().__init__(name, lowered, fallback_trace)
        self.sources: dict[cuda.Spec | cuda_rows.RowSpec, str] = {}
        if not isinstance(self.kernel, (Kernel, RowKernel)):  # a schedule the renderer lacks
            self.failed = True

    def source_for(self, spec: cuda.Spec | cuda_rows.RowSpec) -> str:
        """The CUDA source of this region's kernel for layout class `spec`."""
        source = self.sources.get(spec)
        if source is None:
            if isinstance(spec, cuda_rows.RowSpec):
                source = cuda_rows.render_rows(self.kernel, spec, ENTRY)
            else:
                source = cuda.render(self.kernel, spec, ENTRY)
            self.sources[spec] = source
        return source

    def __call__(self, *inputs):
        if self.failed or not self.accepts(inputs):
            return self._run_fallback(inputs)
        try:
            return self._run(inputs)
        except _Fallback:
            return self._run_fallback(inputs)
        except (NvrtcError, cuda.Unsupported) as error:
            self.failed = True
            message = f"fulmen codegen: CUDA fusions run on the torch executor: {error}"
            if message not in _warned:
                _warned.add(message)
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            return self._run_fallback(inputs)

    def _run(self, inputs):
        if isinstance(self.kernel, RowKernel):
            return self._run_rows(inputs)
        lowered, kernel = self.lowered, self.kernel
        shape = lowered.shape
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        outs = [torch.empty(shape, dtype=dtype, device=device) for dtype in kernel.output_dtypes]
        if math.prod(shape):
            bases, addresses, rows = [], [], []
            for access in kernel.accesses:
                base, offset, sizes, strides = resolve(inputs[access.input], access)
                if tuple(sizes) != shape:
                    raise _Fallback
                bases.append(base)
                addresses.append(base.data_ptr() + offset * base.element_size())
                rows.append(strides)
            for out in outs:
                addresses.append(out.data_ptr())
                rows.append(list(out.stride()))
            sizes, rows = coalesce(shape, rows)
            params = pack(sizes, rows, addresses)
            if len(params) > MAX_PARAM_BYTES:
                raise _Fallback
            spec = plan(kernel, sizes, rows, addresses)
            function = load_function(self.source_for(spec), device)
            work = math.prod(sizes) // spec.vec if spec.vec > 1 else math.prod(sizes)
            index = device.index if device.index is not None else torch.cuda.current_device()
            grid = max(1, min(-(-work // cuda.BLOCK), _sm_count(index) * 8))
            launch(function, device, grid, params)
        return region_results(lowered, inputs, outs)

    def _run_rows(self, inputs):
        """Call a `RowKernel`: strides over (kept axes, reduced axes), each part coalesced (as
        the CPU runtime), then the launches of `cuda_rows.plan_rows`."""
        lowered, kernel = self.lowered, self.kernel
        shape, reduced = lowered.shape, lowered.reduced
        kept = [d for d in range(len(shape)) if d not in reduced]
        kept_shape = tuple(shape[d] for d in kept)
        column_shape = tuple(shape[d] for d in reduced)
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        outs = [torch.empty(column_shape if column else kept_shape if row else shape, dtype=dtype,
                            device=device)
                for dtype, row, column in zip(kernel.output_dtypes, kernel.output_rows,
                                              kernel.output_columns)]
        if math.prod(kept_shape):
            bases, addresses, rows = [], [], []

            def full(strides, row, column=False):
                it = iter(strides)
                if column:
                    return [next(it) if d in reduced else 0 for d in range(len(shape))]
                if not row:
                    return list(strides)
                return [0 if d in reduced else next(it) for d in range(len(shape))]

            for access, row in zip(kernel.accesses, kernel.access_rows):
                base, offset, sizes, strides = resolve(inputs[access.input], access)
                if tuple(sizes) != (kept_shape if row else shape):
                    raise _Fallback
                bases.append(base)  # keeps a copied base alive until the launches are queued
                addresses.append(base.data_ptr() + offset * base.element_size())
                rows.append(full(strides, row))
            for out, row, column in zip(outs, kernel.output_rows, kernel.output_columns):
                addresses.append(out.data_ptr())
                rows.append(full(list(out.stride()), row, column))
            outer, outer_rows = coalesce(kept_shape, [[r[d] for d in kept] for r in rows])
            inner, inner_rows = coalesce(column_shape, [[r[d] for d in reduced] for r in rows])
            sizes = outer + inner
            rows = [o + i for o, i in zip(outer_rows, inner_rows)]
            try:
                how = cuda_rows.plan_rows(kernel, sizes, len(outer), rows)
            except cuda_rows.NoPlan:
                raise _Fallback from None
            if len(cuda_rows.pack_rows(how, sizes, rows, addresses, 0, 0)) > MAX_PARAM_BYTES:
                raise _Fallback
            source = self.source_for(how.spec)
            function = load_function(source, device)
            columns = load_function(source, device, ENTRY + "_columns") if how.groups else None
            work = torch.empty(how.work // 8, dtype=torch.float64, device=device) \
                if how.work else None
            work_address = work.data_ptr() if work is not None else 0
            for phase in range(how.phases):
                params = cuda_rows.pack_rows(how, sizes, rows, addresses, work_address, phase)
                launch(function, device, how.grid, params, how.spec.block)
            if columns is not None:
                launch(columns, device, how.column_grid, params, cuda_rows.FINISH_BLOCK)
        else:
            for out, column in zip(outs, kernel.output_columns):
                if column:
                    out.zero_()  # a sum over no rows
        return region_results(lowered, inputs, outs)
