"""Creation ops beyond OpInfo: size spellings, dtype inference and defaults, devices, the
`*_like` and `new_*` families, `torch.tensor`, fallbacks, and RNG factories that follow torch's
generator exactly.

Each case runs eagerly and through `fulmen.jit`, with the op run whole by the torch executor
and decomposed into prims.
"""

import pytest
import torch

import fulmen
from fulmen.transforms import decompose_to_prims

MODES = {"whole": {}, "decomposed": {"transforms": [decompose_to_prims]}}


def check(fn, *args, mode="decomposed", values=True):
    """Run `fn` eagerly and jitted; assert equal outputs; return the jitted function."""
    expected = fn(*args)
    jfn = fulmen.jit(fn, **MODES[mode])
    actual = jfn(*args)
    flat_e, spec_e = torch.utils._pytree.tree_flatten(expected)
    flat_a, spec_a = torch.utils._pytree.tree_flatten(actual)
    assert spec_e == spec_a
    for e, a in zip(flat_e, flat_a):
        assert a.shape == e.shape and a.dtype == e.dtype and a.device == e.device
        assert not a.requires_grad
        if values:
            torch.testing.assert_close(a, e, rtol=0, atol=0)
    return jfn


def decomposed_ops(jfn) -> list[str]:
    """Qualified names of the symbols left after `decompose_to_prims`."""
    trace = next(t for t in fulmen.last_traces(jfn) if "decomposition" in t.provenance)
    return [bsym.sym.id for bsym in trace.bsyms]


def ops_of(jfn) -> list[str]:
    """Qualified names of the top-level symbols of the first (traced) trace."""
    return [bsym.sym.id for bsym in fulmen.last_traces(jfn)[0].bsyms]


x23 = torch.randn(2, 3)

CASES = {
    # sizes: varargs, tuple, list, torch.Size, keyword, empty
    "zeros varargs": lambda x: torch.zeros(2, 3) + x,
    "zeros tuple": lambda x: torch.zeros((2, 3)),
    "zeros list": lambda x: torch.zeros([4]),
    "zeros torch.Size": lambda x: torch.zeros(x.shape),
    "zeros size keyword": lambda x: torch.zeros(size=(1, 2)),
    "zeros 0-d": lambda x: torch.zeros(()),
    "zeros no elements": lambda x: torch.zeros(0, 3),
    "ones dtype": lambda x: torch.ones(2, dtype=torch.int32),
    "ones device": lambda x: torch.ones(2, device="cpu"),
    "ones bool": lambda x: torch.ones(3, dtype=torch.bool),
    # full: dtype inferred from the fill value
    "full float": lambda x: torch.full((2, 3), 1.5),
    "full int": lambda x: torch.full([2], 7),
    "full bool": lambda x: torch.full((2,), True),
    "full complex": lambda x: torch.full((2,), 1 + 2j),
    "full dtype": lambda x: torch.full(x.shape, 2.7, dtype=torch.int64),
    "full inf": lambda x: torch.full((2,), float("-inf")),
    # *_like and new_*
    "zeros_like": lambda x: torch.zeros_like(x),
    "ones_like dtype": lambda x: torch.ones_like(x, dtype=torch.float64),
    "full_like": lambda x: torch.full_like(x, 3),
    "full_like int": lambda x: torch.full_like(x.long(), 2.9),
    "new_zeros varargs": lambda x: x.new_zeros(2, 3),
    "new_zeros tuple": lambda x: x.new_zeros((4,)),
    "new_ones dtype": lambda x: x.new_ones([2], dtype=torch.int8),
    "new_full": lambda x: x.new_full((2, 2), 5),
    "new_full dtype": lambda x: x.new_full((2,), 5, dtype=torch.int64),
    # torch.tensor of a scalar
    "tensor float": lambda x: torch.tensor(3.5) * x,
    "tensor int": lambda x: torch.tensor(3),
    "tensor bool": lambda x: torch.tensor(False),
    "tensor complex": lambda x: torch.tensor(1j),
    "tensor dtype": lambda x: torch.tensor(2, dtype=torch.float16),
    # arange, all forms
    "arange end": lambda x: torch.arange(5),
    "arange end keyword": lambda x: torch.arange(end=4),
    "arange start end": lambda x: torch.arange(-2, 3),
    "arange step": lambda x: torch.arange(1, 10, 3),
    "arange negative step": lambda x: torch.arange(10, -3, -3),
    "arange negative step, end not reached": lambda x: torch.arange(10, 1, -3),
    "arange float end": lambda x: torch.arange(4.5),
    "arange float step": lambda x: torch.arange(0, 1, 0.1),
    "arange float negative": lambda x: torch.arange(1.0, -1.0, -0.25),
    "arange float64": lambda x: torch.arange(0.5, 7, 1.5, dtype=torch.float64),
    "arange int bounds float dtype": lambda x: torch.arange(3, dtype=torch.float32),
    "arange int32": lambda x: torch.arange(7, 1, -2, dtype=torch.int32),
    "arange empty": lambda x: torch.arange(3, 3),
    "arange float bounds int dtype": lambda x: torch.arange(0.5, 5, dtype=torch.int64),
    # linspace
    "linspace": lambda x: torch.linspace(0, 1, 5),
    "linspace one step": lambda x: torch.linspace(2, 3, 1),
    "linspace no steps": lambda x: torch.linspace(2, 3, 0),
    "linspace float64": lambda x: torch.linspace(-3.5, 11, steps=9, dtype=torch.float64),
    # fallbacks to the torch op
    "tensor list": lambda x: torch.tensor([1.0, 2.0, 3.0]) * x[0],
    "zeros requires_grad": lambda x: torch.zeros(3, requires_grad=True).detach(),
    "linspace int dtype": lambda x: torch.linspace(0, 10, 4, dtype=torch.int64),
}

# eager's vectorised CPU kernels round some elements differently (by an ulp) than a plain
# `start + i * step`, depending on the machine's vector width
INEXACT = {"linspace", "linspace float64", "arange float step", "arange float negative",
           "arange float64"}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_eager(case, mode):
    if case in INEXACT:
        fn = CASES[case]
        torch.testing.assert_close(fulmen.jit(fn, **MODES[mode])(x23), fn(x23))
        return
    check(CASES[case], x23, mode=mode)


@pytest.mark.parametrize("case", ["zeros varargs", "full bool", "new_full", "arange step",
                                  "arange float step", "tensor float", "linspace"])
def test_decomposes_into_prims(case):
    jfn = fulmen.jit(CASES[case], transforms=[decompose_to_prims])
    jfn(x23)
    assert all(name.startswith("prims.") for name in decomposed_ops(jfn))


def test_arange_and_zeros_print_their_prims():
    jfn = fulmen.jit(lambda x: torch.arange(2, 8, 2) + torch.zeros(3, dtype=torch.int64))
    jfn(x23)
    source = str(fulmen.last_traces(jfn)[0])
    assert "ltorch.arange(2, 8, 2)" in source
    assert "prims.iota(3, 2, 2, torch.int64, torch.device('cpu'))" in source
    assert "ltorch.zeros(3, dtype=torch.int64)" in source
    assert "prims.full((3,), 0, torch.int64, torch.device('cpu'))" in source


@pytest.mark.parametrize("case", ["tensor list", "zeros requires_grad", "linspace int dtype",
                                  "arange float bounds int dtype"])
def test_unsupported_arguments_run_the_torch_op(case):
    jfn = check(CASES[case], x23)
    assert any(name.startswith("opaque.") for name in ops_of(jfn))


def test_like_ops_on_a_captured_tensor_make_it_an_input():
    captured = torch.ones(3)
    jfn = fulmen.jit(lambda x: x + torch.full_like(captured, 2) + captured.new_zeros(3))
    assert torch.equal(jfn(torch.ones(3)), torch.full((3,), 3.0))
    assert fulmen.last_traces(jfn)[0].arg_names == ("x", "captured0")


def test_default_dtype_is_respected():
    fns = [lambda: torch.zeros(2), lambda: torch.full((2,), 1.5), lambda: torch.arange(0.0, 2.0),
           lambda: torch.tensor(1.5), lambda: torch.tensor(1j), lambda: torch.linspace(0, 1, 3),
           lambda: torch.empty(2), lambda: torch.ones(1, 2)]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for fn in fns:
            out = fulmen.jit(fn, transforms=[decompose_to_prims])()
            assert out.dtype == fn().dtype
    finally:
        torch.set_default_dtype(previous)


def test_empty_decomposes_to_zeros():
    # NOTE [empty] in fulmen.ops.torch.creation: eager's content is undefined, ours is zero
    for fn in (lambda x: torch.empty(2, 3), lambda x: torch.empty_like(x),
               lambda x: x.new_empty((3,), dtype=torch.int32)):
        for mode in MODES:
            jfn = check(fn, x23, mode=mode, values=False)
        assert torch.equal(jfn(x23), torch.zeros_like(fn(x23)))


@pytest.mark.parametrize("fn", [
    lambda x: torch.zeros(-1),
    lambda x: torch.arange(0, 1, 0),
    lambda x: torch.arange(0, -1),
    lambda x: torch.linspace(0, 1, -2),
])
def test_errors_match_eager(fn):
    with pytest.raises(RuntimeError):
        fn(x23)
    with pytest.raises(RuntimeError):
        fulmen.jit(fn)(x23)


# RNG factories run as the torch op, so they draw from torch's global generator like eager.

def _random(x):
    return (x + torch.rand(2, 3), torch.randn(3), torch.randint(0, 10, (4,)),
            torch.randint(5, (2,)), torch.randn_like(x), torch.rand_like(x),
            torch.randperm(5), torch.normal(0.0, 1.0, (2,)), torch.randint_like(x, 3))


def _assert_same_stream(jfn, seed):
    torch.manual_seed(seed)
    expected = _random(x23)
    torch.manual_seed(seed)
    actual = jfn(x23)
    for e, a in zip(expected, actual):
        assert e.dtype == a.dtype
        assert torch.equal(e, a)


@pytest.mark.parametrize("mode", list(MODES))
def test_random_factories_follow_torch_generator(mode):
    jfn = fulmen.jit(_random, **MODES[mode])
    jfn(x23)  # compile
    assert all(name.startswith(("opaque.", "ltorch.add")) for name in ops_of(jfn))
    for seed in (0, 1):
        _assert_same_stream(jfn, seed)


def test_random_factories_on_the_first_call():
    _assert_same_stream(fulmen.jit(_random), 0)



@pytest.mark.parametrize("executors", [None, ["codegen", "torch"]], ids=["torch", "codegen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bounds", [(0, 1, 5), (-3.5, 11, 9), (1e-3, 7.7, 17), (5, -2.25, 33),
                                    (0.1, 0.7, 7), (-1.3, 2.9, 12)], ids=str)
def test_linspace_ends_exactly_at_its_bounds(bounds, dtype, executors):
    """linspace's decomposition is eager's two-sided formula (the second half counts back from
    `end`), so, as eager's, it starts exactly at `start` and ends exactly at `end`, fused or
    not; a one-sided `start + i * step` misses `end` in the last bits. (The values in between
    may differ from eager's by an ulp: eager's CPU kernel rounds `start + step * i` as one
    fused multiply-add.)"""
    start, end, steps = bounds
    zero = torch.zeros((), dtype=dtype)

    def fn(x):
        return torch.linspace(start, end, steps, dtype=dtype) + x

    out = fulmen.jit(fn, transforms=[decompose_to_prims], executors=executors)(zero)
    expected = fn(zero)
    assert out[0] == expected[0] and out[-1] == expected[-1]
    torch.testing.assert_close(out, expected)
