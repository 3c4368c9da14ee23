"""Run PyTorch's OpInfo samples through fulmen.jit and compare with eager.

Each registered torch callable with a fulmen decomposition is matched to the OpInfos whose
function variant is that callable. A sample is run three ways: eager; jit with the torch executor
(the op runs whole); jit with `decompose_to_prims` (the decomposition runs, prim by prim).
"""

from __future__ import annotations

import functools

import torch
import torch.utils._pytree as pytree
from torch.testing._internal.common_methods_invocations import op_db

import fulmen
from fulmen.ops.torch import registered_torch_callables
from fulmen.transforms import decompose_to_prims

MODES = {
    "whole": {},
    "decomposed": {"transforms": [decompose_to_prims]},
}


@functools.cache
def matched_opinfos() -> list:
    """OpInfos whose function (or method) variant fulmen decomposes."""
    registered = registered_torch_callables()
    matched = []
    for info in op_db:
        variants = [info.op, getattr(info, "method_variant", None)]
        if any(v is not None and _safe_in(v, registered) for v in variants):
            matched.append(info)
    return matched


def _safe_in(fn, table) -> bool:
    try:
        return fn in table
    except TypeError:
        return False


def pick_dtype(info) -> torch.dtype:
    supported = info.supported_dtypes("cpu")
    for dtype in (torch.float32, torch.int64, torch.bool):
        if dtype in supported:
            return dtype
    return next(iter(supported))


def samples(info, limit: int | None, dtype=None):
    dtype = dtype or pick_dtype(info)
    out = []
    for sample in info.sample_inputs("cpu", dtype, requires_grad=False):
        out.append(sample)
        if limit is not None and len(out) >= limit:
            break
    return out


def run_sample(info, sample, mode: str, seed: int | None = None):
    """Return (eager, jit, jfn) for one sample; exceptions propagate. With `seed`, torch's
    generator is seeded before the eager and before the jitted call (random ops then agree)."""
    op = info.op
    kwargs = sample.kwargs

    def fn(input, *args):
        return op(input, *args, **kwargs)

    with torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        expected = fn(sample.input, *sample.args)
        jfn = fulmen.jit(fn, **MODES[mode])
        if seed is not None:
            torch.manual_seed(seed)
        actual = jfn(sample.input, *sample.args)
    return expected, actual, jfn


# Ops whose values are unspecified (uninitialised memory) or random: only metadata is compared.
VALUES_UNSPECIFIED = {
    "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
    "rand_like", "randn_like", "randint_like", "randint", "bernoulli", "normal", "multinomial",
    "nn.functional.dropout", "uniform", "exponential", "geometric", "cauchy", "log_normal",
}  # fmt: skip


def assert_same(expected, actual, info, unspecified=VALUES_UNSPECIFIED) -> None:
    """Same structure, shapes, dtypes and values (values not compared for `unspecified` ops)."""
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    act_leaves, act_spec = pytree.tree_flatten(actual)
    assert len(exp_leaves) == len(act_leaves), f"{info.name}: output structure differs"
    for e, a in zip(exp_leaves, act_leaves):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{info.name}: expected a tensor, got {a!r}"
            assert e.shape == a.shape, f"{info.name}: shape {a.shape} != eager {e.shape}"
            assert e.dtype == a.dtype, f"{info.name}: dtype {a.dtype} != eager {e.dtype}"
            if info.name in unspecified:
                continue
            torch.testing.assert_close(a, e, equal_nan=True, atol=1e-5, rtol=1.3e-6,
                                       msg=lambda m: f"{info.name}: {m}")
        else:
            assert e == a or (e != e and a != a), f"{info.name}: {a!r} != eager {e!r}"


def grad_samples(info, limit: int | None):
    """Float32 samples whose inputs require grad (for ops that support autograd)."""
    out = []
    for sample in info.sample_inputs("cpu", torch.float32, requires_grad=True):
        out.append(sample)
        if limit is not None and len(out) >= limit:
            break
    return out


def _grad_inputs(sample) -> list[torch.Tensor]:
    leaves = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    seen, inputs = set(), []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and id(leaf) not in seen:
            seen.add(id(leaf))
            inputs.append(leaf)
    return inputs


class EagerError(Exception):
    """Eager PyTorch itself fails on a sample (the sample is unusable, not a fulmen failure)."""


def run_grad_sample(info, sample, mode: str = "whole", seed: int | None = None, jfn=None):
    """Return (eager_grads, jit_grads) of `sum(out * cotangent)` w.r.t. the sample's inputs
    (None when nothing is differentiable). `seed` seeds torch before each forward call.
    `jfn`: a jitted `fn(input, *args, **kwargs)` of the op to call (one for several samples),
    instead of one made for this sample by `mode`. Raises `EagerError` when eager's own forward
    or backward fails on the sample."""
    op, kwargs = info.op, sample.kwargs

    def fn(input, *args):
        return op(input, *args, **kwargs)

    inputs = _grad_inputs(sample)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        expected_out = fn(sample.input, *sample.args)
    except Exception as error:
        raise EagerError(f"eager forward fails: {error}") from error
    outs = [o for o in pytree.tree_leaves(expected_out)
            if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs or not inputs:
        return None
    generator = torch.Generator().manual_seed(0)
    cotangents = [torch.randn(o.shape, generator=generator, dtype=o.dtype) for o in outs]
    try:
        expected = torch.autograd.grad(outs, inputs, cotangents, allow_unused=True)
    except Exception as error:
        raise EagerError(f"eager backward fails: {error}") from error

    if jfn is None:
        jfn = functools.partial(fulmen.jit(fn, **MODES[mode]))
    else:
        jfn = functools.partial(jfn, **kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    actual_out = jfn(sample.input, *sample.args)
    jit_outs = [o for o in pytree.tree_leaves(actual_out)
                if isinstance(o, torch.Tensor) and o.requires_grad]
    assert len(jit_outs) == len(outs), f"{info.name}: {len(jit_outs)} differentiable outputs, " \
                                       f"eager has {len(outs)}"
    actual = torch.autograd.grad(jit_outs, inputs, cotangents, allow_unused=True)
    return expected, actual


def assert_same_grads(expected, actual, info) -> None:
    for index, (e, a) in enumerate(zip(expected, actual)):
        if e is None or a is None:
            zero_e = e is None or not e.any()
            zero_a = a is None or not a.any()
            assert zero_e and zero_a, f"{info.name}: gradient {index} is {a} but eager has {e}"
            continue
        torch.testing.assert_close(a, e, equal_nan=True, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, index=index: f"{info.name} grad {index}: {m}")


def assert_traced_like_eager(fn, x: torch.Tensor, transforms=()) -> None:
    """`fulmen.jit(fn, transforms=...)(x)` equals `fn(x)`, its gradient for one random cotangent
    equals eager's, and the first trace calls no opaque op (the op was decomposed)."""
    jfn = fulmen.jit(fn, transforms=list(transforms))
    expected, actual = fn(x), jfn(x)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(actual, x, cotangent)[0],
                               torch.autograd.grad(expected, x, cotangent)[0])
    assert "opaque" not in str(fulmen.last_traces(jfn)[0])
