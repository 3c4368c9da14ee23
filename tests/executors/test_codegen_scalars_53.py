"""Run-time floats as codegen kernel arguments (NOTE [run-time floats as kernel arguments] in
`fulmen/executors/codegen/lower.py`): `t * lr`, `t / lr`, `t + lr`, `t - lr` and
`addcdiv(..., value=lr)` of float32/float64 CPU tensors, with `lr` a float read at run time,
fuse into one kernel whose float is an argument: values bit for bit eager's, no compile when
the value changes (`set_scalar_arguments(True)`, off by default)."""

from __future__ import annotations

import math

import pytest
import torch

import fulmen
from fulmen.executors.codegen import set_compile_policy
from fulmen.executors.codegen.ops import set_scalar_arguments


@pytest.fixture(autouse=True)
def _eager_kernels():
    set_compile_policy("eager")
    previous = set_scalar_arguments(True)
    yield
    set_scalar_arguments(previous)
    set_compile_policy("lazy")


class _Box:
    lr = 0.1


def _ops(t, u, v, s):
    return (t * s) * u, (t / s) - u, t.addcdiv(u, v, value=s).abs(), (t + s) * u, (t - s) * v


def _same(got, want) -> bool:
    return got.dtype == want.dtype and torch.equal(torch.isnan(got), torch.isnan(want)) and \
        torch.equal(got.nan_to_num(), want.nan_to_num())


def _statement_names(jfn) -> list[str]:
    return [bsym.sym.name for bsym in fulmen.last_traces(jfn)[-1].bsyms]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_run_time_float_ops_fuse_and_match_eager(dtype):
    box = _Box()

    def f(t, u, v):
        return _ops(t, u, v, box.lr)

    jf = fulmen.jit(f)
    torch.manual_seed(0)
    x, y, z = (torch.randn(33, 65, dtype=dtype) for _ in range(3))
    # 0.123456789 is not a float32: a kernel reading it as float64 in a float32 region, or
    # rounding it to float32 in a float64 one, gives other values
    for lr in (0.1, 0.37, 0.123456789, 1e-40, 3.0e38, 1e-3, math.inf, 0.5):
        box.lr = lr
        got = jf(x, y, z)
        for g, w in zip(got, _ops(x, y, z, lr)):
            assert _same(g, w), (lr, (g - w).abs().max())
    names = _statement_names(jf)
    assert not {"Tensor_mul", "Tensor_div", "Tensor_add", "Tensor_sub", "Tensor_addcdiv"} & set(names)
    assert sum(name.startswith("fusion") for name in names) == 1, names
    stats = fulmen.compile_stats(jf)
    assert stats.cache_misses == 2 and stats.eager_calls == 0  # constant, then read at run time


@pytest.mark.parametrize("special", [math.nan, 0.0, -0.0, -2.5, -math.inf])
def test_nan_zero_and_negative_floats_match_eager(special):
    box = _Box()

    def f(t, u, v):
        return _ops(t, u, v, box.lr)

    jf = fulmen.jit(f)
    torch.manual_seed(1)
    x, y, z = (torch.randn(8, 16) for _ in range(3))
    for lr in (0.1, 0.2, special, 0.3, special):
        box.lr = lr
        for g, w in zip(jf(x, y, z), _ops(x, y, z, lr)):
            assert _same(g, w), (lr, (g - w).abs().max())
    assert fulmen.compile_stats(jf).eager_calls == 0


def test_addcdiv_float32_value_past_its_range_raises_as_eager():
    box = _Box()

    def f(t, u, v):
        return t.addcdiv(u, v, value=box.lr) * u

    jf = fulmen.jit(f)
    x, y, z = (torch.randn(4, 8) for _ in range(3))
    for lr in (0.1, 0.2, 0.3):
        box.lr = lr
        assert torch.equal(jf(x, y, z), f(x, y, z))
    assert any(name.startswith("fusion") for name in _statement_names(jf))
    box.lr = 1e300
    with pytest.raises(RuntimeError, match="overflow"):
        f(x, y, z)
    with pytest.raises(RuntimeError, match="overflow"):
        jf(x, y, z)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16])
def test_promoting_and_reduced_dtypes_stay_eager(dtype):
    """int * float promotes to float32; bfloat16 * float is computed in float32 by eager: both
    stay torch calls, with eager's values and dtypes."""
    box = _Box()

    def f(t):
        return (t * box.lr) + (t / box.lr)

    jf = fulmen.jit(f)
    x = (torch.arange(24).reshape(4, 6) - 7).to(dtype)
    for lr in (0.1, 0.37, 0.123456789):
        box.lr = lr
        got, want = jf(x), f(x)
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_optimizer_steps_with_a_scheduler_match_eager(kind, dtype):
    params = {}
    for name in ("eager", "fulmen"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 4)).to(dtype)
        if kind == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        elif kind == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
        step = fulmen.jit(opt.step) if name == "fulmen" else opt.step
        x = torch.randn(8, 16, dtype=dtype)
        for _ in range(5):
            opt.zero_grad()
            model(x).square().sum().backward()
            step()
            sched.step()
        params[name] = [p.detach().clone() for p in model.parameters()]
        if name == "fulmen":
            assert fulmen.compile_stats(step).eager_calls == 0
            if kind != "sgd":
                names = _statement_names(step)
                assert "Tensor_addcdiv" not in names and "Tensor_div" not in names, names
    # the scalar ops are eager's bit for bit (above); the fused lerp/addcmul/sqrt next to them
    # are within an ulp or two of eager's (NOTE [run-time floats as kernel arguments])
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    for got, want in zip(params["fulmen"], params["eager"]):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_off_by_default_a_step_stays_eagers_bit_for_bit():
    set_scalar_arguments(False)
    box = _Box()

    def f(t, u, v):
        return _ops(t, u, v, box.lr)

    jf = fulmen.jit(f)
    x, y, z = (torch.randn(8, 16) for _ in range(3))
    for lr in (0.1, 0.2, 0.3):
        box.lr = lr
        jf(x, y, z)
    assert "Tensor_addcdiv" in _statement_names(jf)


def test_lazy_policy_fallback_then_kernel_match_eager():
    """Under the default (lazy) policy a region runs its torch fallback, with the float as
    an argument of the opaque op, until its kernel is built; both equal eager."""
    set_compile_policy("lazy")
    box = _Box()

    def f(t, u, v):
        return _ops(t, u, v, box.lr)

    jf = fulmen.jit(f)
    torch.manual_seed(2)
    x, y, z = (torch.randn(40, 48) for _ in range(3))
    for i in range(10):
        box.lr = 0.1 + 0.0123456789 * i
        if i == 6:
            fulmen.executors.codegen.wait_for_kernels(*fulmen.last_traces(jf))
        for g, w in zip(jf(x, y, z), _ops(x, y, z, box.lr)):
            assert _same(g, w), (i, (g - w).abs().max())
    assert any(name.startswith("fusion") for name in _statement_names(jf))
