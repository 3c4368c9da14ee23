"""The CUDA row kernels (`codegen/cuda/rows.py`) run on the CPU, to check their logic without a GPU:
the normalisation patterns forward and backward, dtypes, layouts, zero sizes, rows split over
blocks (thresholds lowered so that few emulated threads suffice) and column sums in groups,
each against eager, through `CudaFusedRegion` with its real planning, packing and launches.

The emulator compiles the generated CUDA source as C++20 with a small shim: every CUDA thread
of a block is an OS thread, `__syncthreads` a barrier of the block, `__shfl_xor_sync`/
`__shfl_sync` an exchange through memory between two barriers of the warp, `__shared__` a static
(blocks run one after another), `__half` is `_Float16` and `__nv_bfloat16` 16 bits rounded as
torch rounds. Each launch checks that the packed arguments have exactly the size of the kernel's
argument struct. What this cannot show: speed, the memory model of a real GPU (all writes are
visible at every barrier here), warp-synchronous behaviour, and the CUDA math library's last
ulps; the `cuda`-marked tests of test_cuda_nvrtc.py check those on a GPU.
"""


from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.executors.codegen.cuda import CUDA, nvrtc
from fulmen.executors.codegen.cuda import rows as cuda_rows
from fulmen.executors.codegen.cuda import runtime as cuda_runtime
from fulmen.transforms.autodiff import rules_composite

RUNTIME = r"""
#include <barrier>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
struct FmDim3 { unsigned x, y, z; };
thread_local FmDim3 threadIdx, blockIdx;
FmDim3 blockDim, gridDim;
static std::barrier<>* fm_block;
static std::vector<std::unique_ptr<std::barrier<>>> fm_warps;
static unsigned long long fm_slots[1024];
void __syncthreads() { fm_block->arrive_and_wait(); }
void fm_exchange(unsigned long long* value, int lane) {
  const int t = threadIdx.x, w = t / 32;
  fm_slots[t] = *value;
  fm_warps[w]->arrive_and_wait();
  *value = fm_slots[w * 32 + lane];
  fm_warps[w]->arrive_and_wait();
}
void fm_run(int grid, int block, void (*body)(const void*), const void* args) {
  blockDim = {(unsigned)block, 1, 1};
  gridDim = {(unsigned)grid, 1, 1};
  for (int b = 0; b < grid; ++b) {
    std::barrier<> whole(block);
    fm_block = &whole;
    fm_warps.clear();
    for (int w = 0; w < (block + 31) / 32; ++w) fm_warps.emplace_back(new std::barrier<>(32));
    std::vector<std::thread> threads;
    for (int t = 0; t < block; ++t)
      threads.emplace_back([=] { threadIdx = {(unsigned)t, 0, 0}; blockIdx = {(unsigned)b, 0, 0};
                                 body(args); });
    for (auto& thread : threads) thread.join();
  }
}
"""
SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
#define __align__(n) alignas(n)
struct FmDim3 { unsigned x, y, z; };
extern thread_local FmDim3 threadIdx, blockIdx;
extern FmDim3 blockDim, gridDim;
void __syncthreads();
void fm_exchange(unsigned long long* value, int lane);
void fm_run(int grid, int block, void (*body)(const void*), const void* args);
template <typename T> T fm_shuffle(T v, int lane) {
  unsigned long long slot = 0;
  std::memcpy(&slot, &v, sizeof(T));
  fm_exchange(&slot, lane);
  std::memcpy(&v, &slot, sizeof(T));
  return v;
}
template <typename T> T __shfl_xor_sync(unsigned, T v, int o) {
  return fm_shuffle(v, (int)(threadIdx.x & 31) ^ o);
}
template <typename T> T __shfl_sync(unsigned, T v, int lane) { return fm_shuffle(v, lane); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline double __longlong_as_double(long long i) { double f; std::memcpy(&f, &i, 8); return f; }
inline long long __double_as_longlong(double f) { long long i; std::memcpy(&i, &f, 8); return i; }
typedef _Float16 __half;
inline float __half2float(__half h) { return (float)h; }
inline __half __float2half_rn(float f) { return (__half)f; }
struct __nv_bfloat16 { uint16_t x; };
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = (uint32_t)b.x << 16; float f; std::memcpy(&f, &u, 4); return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {(uint16_t)(u >> 16)};
}
"""
_ENTRY = re.compile(r'extern "C" __global__ void __launch_bounds__\((\d+)\) (\w+)\(const (\w+) args\)')
_libraries: dict[str, ctypes.CDLL] = {}


def _g_plus_plus(text: str, *flags: str) -> Path:
    directory = Path(tempfile.mkdtemp(prefix="fulmen-emu-"))
    (directory / "k.cpp").write_text(text)
    subprocess.run(["g++", "-O1", "-std=c++20", "-pthread", "-fPIC", "-shared", "-w", *flags,
                    "-o", str(directory / "k.so"), str(directory / "k.cpp")],
                   check=True, capture_output=True)
    return directory / "k.so"


@functools.cache
def _runtime() -> ctypes.CDLL:
    return ctypes.CDLL(str(_g_plus_plus(RUNTIME)), mode=ctypes.RTLD_GLOBAL)


def compile_emulated(source: str) -> ctypes.CDLL:
    """The CUDA `source` compiled for the CPU, with `emu_<entry>(grid, block, params, nbytes)`
    per entry point (returns -1 when nbytes is not the size of the entry's argument struct)."""
    _runtime()  # its symbols resolve the kernel's
    source = re.sub(r"#include <cuda_(fp16|bf16)\.h>", "", source)
    wrappers = [f"static void body_{name}(const void* a) {{ {name}(*(const {args}*)a); }}\n"
                f'extern "C" int emu_{name}(int grid, int block, const void* p, long n) {{\n'
                f"  if (n != (long)sizeof({args})) return -1;\n"
                f"  {args} a; std::memcpy(&a, p, sizeof(a));\n"
                f"  fm_run(grid, block, body_{name}, &a);\n  return 0;\n}}"
                for _, name, args in _ENTRY.findall(source)]
    text = SHIM + source + "\n".join(wrappers) + "\n"
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    if key not in _libraries:
        _libraries[key] = ctypes.CDLL(str(_g_plus_plus(text)))
    return _libraries[key]


class Launches(list):
    """The launches made while emulating: (entry, grid, block) each."""


@contextlib.contextmanager
def emulated(monkeypatch):
    """Within: `CudaFusedRegion`s run their kernels on CPU tensors through this emulator."""
    launches = Launches()

    def load_function(source, device, entry=nvrtc.ENTRY):
        return compile_emulated(source), entry

    def launch(function, device, grid, params, block=256):
        library, entry = function
        launches.append((entry, grid, block))
        fn = getattr(library, f"emu_{entry}")
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_long]
        assert fn(grid, block, params, len(params)) == 0, "argument struct size mismatch"

    monkeypatch.setattr(nvrtc, "load_function", load_function)
    monkeypatch.setattr(nvrtc, "launch", launch)
    monkeypatch.setattr(cuda_runtime, "_sm_count", lambda index: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    yield launches


# --- the tests ------------------------------------------------------------------------------

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


@pytest.fixture
def emulate(monkeypatch):
    """CUDA regions built for CPU tensors and run by the emulator; yields the launches."""
    import fulmen.executors.codegen as codegen

    class Emulated(cuda_runtime.CudaFusedRegion):  # a CPU region's place, as the tools see it
        def ready(self) -> bool:
            return True

        def wait(self) -> None:
            pass

    # CPU tensors are fused as the CUDA target fuses and run as CUDA regions, and get CUDA's
    # gradient rules (layer_norm's composite backward, which the row kernels fuse)
    monkeypatch.setitem(codegen.TARGETS, "cpu", (CUDA, Emulated))
    monkeypatch.setattr(rules_composite, "EAGER_LAYER_NORM_BACKWARD_DEVICES", ())
    with emulated(monkeypatch) as launches:
        yield launches


def _emulated(fn, *args, grad=False, **tol):
    """fn through the CUDA path (emulated) against eager, with gradients when `grad`."""
    jfn = fulmen.jit(fn, executors=["codegen", "torch"])
    inputs = [a.clone().requires_grad_(grad and a.is_floating_point()) for a in args]
    eager = [a.clone().requires_grad_(grad and a.is_floating_point()) for a in args]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        actual, expected = jfn(*inputs), fn(*eager)
    torch.testing.assert_close(actual, expected, equal_nan=True, **tol)
    traces = [fulmen.last_traces(jfn)[-1]]
    if grad:
        cotangent = torch.randn_like(expected)
        (actual * cotangent).sum().backward()
        (expected * cotangent).sum().backward()
        for a, e in zip(inputs, eager):
            if a.requires_grad:
                torch.testing.assert_close(a.grad, e.grad, **tol)
        traces.append(fulmen.last_backward_traces(jfn)[-1])
    for trace in traces:
        impls = [b.sym.impl for b in trace.bsyms if "fusion" in b.sym.tags]
        assert impls and all(isinstance(i, cuda_runtime.CudaFusedRegion) and not i.failed
                             for i in impls)
        assert "torchex.sum" not in str(trace) and "torchex.amax" not in str(trace)


def test_cuda_rows_emulated_normalisations(emulate):
    n = 96
    x, w, b = torch.randn(12, n), torch.randn(n), torch.randn(n)
    _emulated(lambda a: F.softmax(a, -1), x, grad=True)
    _emulated(lambda a, t: F.cross_entropy(a * 2, t), x, torch.randint(0, n, (12,)), grad=True)
    _emulated(lambda a, w, b: F.layer_norm(a, (n,), w, b), x, w, b, grad=True, atol=1e-5,
              rtol=1e-5)
    assert ("fulmen_kernel_columns", 1, cuda_rows.FINISH_BLOCK) in emulate  # dweight, dbias
    xn = torch.randn(4, 1000)  # several warps per block
    xn[0, 3], xn[1, 600], xn[2, 5], xn[2, 6] = float("nan"), float("inf"), float("inf"), -1e38
    _emulated(lambda a: (a.amax(-1), a.amin(-1), a.sum(-1), a.softmax(-1), a.var(-1)), xn)
    assert ("fulmen_kernel", 4, 256) in emulate


def test_cuda_rows_emulated_dtypes_layouts_and_sizes(emulate):
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(12, 96).to(dtype)
        _emulated(lambda a: (F.softmax(a, -1), (a * 2).sum(-1), a.amax(-1), (a * 2).sum(0)), x)
    _emulated(lambda a, c: (a.t() * c).softmax(-1), torch.randn(30, 50), torch.randn(30))
    _emulated(lambda a: ((a + 1).sum((0, 2)), a.std((1, 2), correction=0)),
              torch.randn(6, 5, 40)[:, :, ::2])
    _emulated(lambda a: ((a * 3).sum(-1), a.amax(-1), (a % 3 + 1).prod(-1)),
              torch.randint(-50, 50, (7, 33)).to(torch.int32))
    _emulated(lambda a: ((a + 1).sum(-1), (a * 2).prod(-1)), torch.randn(4, 0))
    _emulated(lambda a: (a + 1).sum(0), torch.randn(0, 5))


def test_cuda_rows_emulated_split_rows_and_column_groups(emulate, monkeypatch):
    monkeypatch.setattr(cuda_rows, "LONG_ROW", 1000)  # small thresholds: few emulated threads
    monkeypatch.setattr(cuda_rows, "MIN_CHUNK", 256)
    monkeypatch.setattr(cuda_rows, "TARGET_BLOCKS", 8)
    monkeypatch.setattr(cuda_rows, "COLUMN_GROUPS", 3)
    _emulated(lambda a: (F.softmax(a, -1), a.var(-1)), torch.randn(2, 1500) * 4)
    assert [launch[1:] for launch in emulate] == [(8, 512)] * 3  # 2 rows x 4 chunks, 3 phases
    _emulated(lambda a: ((a * 3).sum(-1), a.amax(-1)), torch.randint(-50, 50, (2, 1300)))
    emulate.clear()
    _emulated(lambda a, w, b: F.layer_norm(a, (300,), w, b), torch.randn(10, 300),
              torch.randn(300), torch.randn(300), grad=True, atol=1e-5, rtol=1e-5)
    assert ("fulmen_kernel", 3, 128) in emulate  # the backward: 3 groups of rows


@pytest.mark.slow
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "layer_norm", "rms_norm",
                                  "cross_entropy", "logsumexp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_rows_emulated_every_pattern(emulate, name, dtype):
    n = 96
    w, b = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
    target = torch.randint(0, n, (12,))
    fn = {"softmax": lambda x: F.softmax(x, -1),
          "log_softmax": lambda x: F.log_softmax(x * 2, -1),
          "layer_norm": lambda x: F.layer_norm(x, (n,), w, b),
          "rms_norm": lambda x: F.rms_norm(x, (n,), w, eps=1e-6),
          "cross_entropy": lambda x: F.cross_entropy(x.float() * 2, target),
          "logsumexp": lambda x: torch.logsumexp(x, -1)}[name]
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    _emulated(fn, torch.randn(12, n).to(dtype), grad=True, **tol)
