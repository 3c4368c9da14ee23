"""Compile CUDA kernel sources with NVRTC (`cuda-python`), load them, launch them.

Compilation targets the device's exact architecture: a cubin for `sm_XX` when this NVRTC knows
the architecture, else PTX for the newest architecture it knows below the device's (the driver
JIT-compiles it; PTX newer than the driver cannot load, and that failure, like any other,
becomes a fallback). Images are cached on disk under `FULMEN_CACHE_DIR/cuda`, keyed by the
source, the target, the NVRTC version and the options, written atomically and verified before
use (`cache.py`); loaded functions are kept in memory per device. `cuda_fp16.h`/`cuda_bf16.h`
come from the `nvidia-cuda-runtime` wheel (found with `cuda.pathfinder`), else from a CUDA
toolkit (`CUDA_HOME`, `/usr/local/cuda`).

`runtime.py` (`CudaFusedRegion`) plans, renders and launches kernels through these functions.

`cuda-python` is imported only inside the functions here, so `import fulmen` never needs it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import threading
from pathlib import Path

import torch

from fulmen.executors.codegen import cache
from fulmen.executors.codegen.build import digest

OPTIONS = ("-std=c++17", "--fmad=false")
# --fmad=false: a * b + c stays two rounded operations, as eager computes it. The remaining
# defaults are IEEE: -ftz=false -prec-div=true -prec-sqrt=true, no fast math.
MAX_PARAM_BYTES = 4096
ENTRY = "fulmen_kernel"

_KIND = "cuda"  # the cache's directory of CUDA images
_lock = threading.Lock()
_functions: dict[tuple, object] = {}
_modules: dict[tuple, object] = {}


class NvrtcError(RuntimeError):
    """cuda-python or NVRTC is missing, compilation failed, or the driver refused an image."""


def available() -> bool:
    """Whether `cuda-python`'s bindings are installed (checked without importing them)."""
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):
        return False


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
    """The cache entry name of `source` compiled for `arch` as `kind` by this NVRTC."""
    return digest(source, f"{kind}:{arch}", repr(nvrtc_version()), *options(arch, kind))


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


def launch(function, device: torch.device, grid: int, params: bytes, block: int) -> None:
    """Launch `function` on `grid` blocks of `block` threads, on torch's current stream of
    `device`, with the packed argument struct `params`."""
    driver, _ = _bindings()
    buffer = ctypes.create_string_buffer(params, len(params))
    pointers = (ctypes.c_void_p * 1)(ctypes.addressof(buffer))
    stream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
    _check((driver.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, 0, stream,
                                  ctypes.addressof(pointers), 0)[0], None), "cuLaunchKernel")
