"""A compiled region called with inputs of another dtype or device than its kernel was built for
runs its torch fallback (eager's answer): a kernel reads raw memory and must never reinterpret
bytes."""

import pytest
import torch

import fulmen
from fulmen.executors import get_executor
from fulmen.executors.claim import claim_executors
from fulmen.executors.codegen.cpu import runtime
from fulmen.executors.codegen.cuda import nvrtc
from fulmen.executors.codegen.cuda.runtime import CudaFusedRegion
from fulmen.proxies import TensorProxy
from fulmen.tracer import trace_program
from fulmen.transforms import dce

EXECUTORS = ["codegen", "torch"]


def pointwise(x, y):
    return torch.tanh(x * y + 1.5) - y


def softmax(x):
    return torch.softmax(x, dim=-1) * 2.0


def _region(jfn):
    trace = fulmen.last_traces(jfn)[-1]
    (region,) = [b.sym.impl for b in trace.bsyms if isinstance(b.sym.impl, runtime.FusedRegion)]
    return region


def _count_calls(region, method, monkeypatch):
    """Count the calls of `region.<method>` (`_run`: the kernel; `_run_fallback`: torch)."""
    calls = []
    real = getattr(region, method)

    def spy(inputs):
        calls.append(1)
        return real(inputs)

    monkeypatch.setattr(region, method, spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_a_pointwise_region_given_another_dtype_gives_eagers_answer(codegen_eager, dtype):
    x, y = torch.randn(64, 33), torch.randn(64, 33)
    jfn = fulmen.jit(pointwise, executors=EXECUTORS)
    torch.testing.assert_close(jfn(x, y), pointwise(x, y))
    region = _region(jfn)
    assert region.ready() and not region.failed
    region(x, y)  # the call plan for these shapes and strides is cached
    other = (x * 4).to(dtype)
    result = region(other, y)
    expected = pointwise(other, y)
    assert result.dtype == expected.dtype
    torch.testing.assert_close(result, expected)
    torch.testing.assert_close(region(x, y), pointwise(x, y))  # the kernel still serves f32


def test_a_row_region_given_another_dtype_gives_eagers_answer(codegen_eager):
    x = torch.randn(16, 40)
    jfn = fulmen.jit(softmax, executors=EXECUTORS)
    torch.testing.assert_close(jfn(x), softmax(x))
    region = _region(jfn)
    region(x)
    other = x.double()
    result = region(other)
    assert result.dtype == torch.float64
    torch.testing.assert_close(result, softmax(other))


def test_matching_inputs_run_the_kernel(codegen_eager, monkeypatch):
    x, y = torch.randn(8, 5), torch.randn(8, 5)
    jfn = fulmen.jit(pointwise, executors=EXECUTORS)
    jfn(x, y)
    region = _region(jfn)
    assert region.accepts((x, y))
    assert not region.accepts((x.double(), y))
    assert not region.accepts((x,))
    assert not region.accepts((x, torch.empty(8, 5, device="meta")))
    calls = _count_calls(region, "_run", monkeypatch)
    fallbacks = _count_calls(region, "_run_fallback", monkeypatch)
    torch.testing.assert_close(region(x, y), pointwise(x, y))
    assert calls == [1] and fallbacks == []



def test_a_region_given_a_tensor_with_its_negative_bit_set_gives_eagers_answer(codegen_eager):
    # `z.conj().imag` is a view whose negative bit is set: torch negates its values when it reads
    # them, the raw memory holds them unnegated, so a kernel must not read it (it did, as a
    # call's argument and as the imaginary part of a conjugate taken inside the function)
    z, y = torch.randn(16, 24, dtype=torch.complex64), torch.randn(16, 24)
    jfn = fulmen.jit(pointwise, executors=EXECUTORS)
    for x in (z.imag, z.conj().imag, z.imag, z.conj().imag):  # the plan of z.imag is kept
        torch.testing.assert_close(jfn(x, y), pointwise(x, y))
    region = _region(jfn)
    assert region.accepts((z.imag, y)) and not region.accepts((z.conj().imag, y))

    def inside(z, y):
        return pointwise(z.conj().imag, y)

    jinside = fulmen.jit(inside, executors=EXECUTORS)
    for _ in range(2):
        torch.testing.assert_close(jinside(z, y), inside(z, y))
    assert isinstance(_region(jinside), runtime.FusedRegion)  # the region is fused

@pytest.mark.skipif(not nvrtc.available(), reason="cuda-python is not installed")
def test_a_cuda_region_given_cpu_tensors_never_launches(monkeypatch):
    """CPU pointers must never reach a GPU kernel: the region runs its torch fallback."""
    a, c = (TensorProxy(None, (8, 4), torch.float32, "cuda") for _ in range(2))
    program = trace_program(pointwise, (a, c), {})
    trace = claim_executors(dce(program.trace), [get_executor("codegen"), get_executor("torch")])
    (region,) = [b.sym.impl for b in trace.bsyms if isinstance(b.sym.impl, CudaFusedRegion)]

    def no_launch(*args, **kwargs):
        raise AssertionError("a CUDA kernel was loaded for CPU tensors")

    monkeypatch.setattr(nvrtc, "load_function", no_launch)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    torch.testing.assert_close(region(x, y), pointwise(x, y))
    assert not region.failed
