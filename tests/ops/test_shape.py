"""Shape ops beyond OpInfo: argument spellings, methods and properties, basic indexing, identity
results, fallbacks to the exact torch op, printed decompositions and errors.

Each case runs eagerly and through `fulmen.jit` twice: with the op run whole by the torch
executor, and decomposed into prims.
"""

import expecttest
import pytest
import torch

import fulmen
from fulmen.transforms import decompose_to_prims

MODES = {"whole": {}, "decomposed": {"transforms": [decompose_to_prims]}}


def check(fn, *args, mode="decomposed"):
    """Run `fn` eagerly and jitted; assert equal outputs; return the jitted function."""
    expected = fn(*args)
    jfn = fulmen.jit(fn, **MODES[mode])
    actual = jfn(*args)
    flat_e, spec_e = torch.utils._pytree.tree_flatten(expected)
    flat_a, spec_a = torch.utils._pytree.tree_flatten(actual)
    assert spec_e == spec_a
    for e, a in zip(flat_e, flat_a):
        assert a.shape == e.shape and a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    return jfn


def decomposed_ops(jfn) -> list[str]:
    """Qualified names of the symbols left after `decompose_to_prims`."""
    trace = next(t for t in fulmen.last_traces(jfn) if "decomposition" in t.provenance)
    return [bsym.sym.id for bsym in trace.bsyms]


def ops_of(jfn) -> list[str]:
    """Qualified names of the top-level symbols of the first (traced) trace."""
    return [bsym.sym.id for bsym in fulmen.last_traces(jfn)[0].bsyms]


x234 = torch.arange(24.0).reshape(2, 3, 4)
x34 = torch.arange(12.0).reshape(3, 4)

CASES = {
    # view / reshape spellings
    "view varargs": (lambda x: x.view(4, 6), x234),
    "view tuple -1": (lambda x: x.view((-1, 4)), x234),
    "view size kw": (lambda x: x.view(size=(6, 4)), x234),
    "view torch.Size": (lambda x: x.view(torch.Size([24])), x234),
    "reshape method": (lambda x: x.reshape(3, -1), x234),
    "reshape list": (lambda x: x.reshape([4, 3, 2]), x234),
    "torch.reshape": (lambda x: torch.reshape(x, (-1,)), x234),
    "torch.reshape shape kw": (lambda x: torch.reshape(x, shape=(6, -1)), x234),
    "reshape 0-d": (lambda x: x.sum().reshape(1, 1), x234),
    "reshape to 0-d": (lambda x: x[:1, :1, :1].reshape(()), x234),
    "view_as": (lambda x: x.view_as(torch.empty(4, 6)), x234),
    "reshape_as": (lambda x, y: x.reshape_as(y), x234, torch.empty(6, 4)),
    "flatten": (lambda x: x.flatten(), x234),
    "flatten range": (lambda x: torch.flatten(x, start_dim=1), x234),
    "flatten negative": (lambda x: x.flatten(0, -2), x234),
    "flatten 0-d": (lambda x: x.sum().flatten(), x234),
    "unflatten": (lambda x: x.unflatten(2, (2, -1)), x234),
    "torch.unflatten": (lambda x: torch.unflatten(x, -1, (1, 4, 1)), x234),
    # permutations
    "permute varargs": (lambda x: x.permute(2, 0, 1), x234),
    "permute tuple negative": (lambda x: x.permute((-1, -3, -2)), x234),
    "torch.permute": (lambda x: torch.permute(x, [1, 2, 0]), x234),
    "transpose": (lambda x: x.transpose(0, -1), x234),
    "torch.transpose kw": (lambda x: torch.transpose(x, dim0=1, dim1=2), x234),
    "swapaxes": (lambda x: x.swapaxes(0, 1), x234),
    "swapdims": (lambda x: torch.swapdims(x, 2, 1), x234),
    "t": (lambda x: x.t(), x34),
    "t 1-d": (lambda x: x[0].t(), x34),
    "T": (lambda x: x.T, x34),
    "mT": (lambda x: x.mT, x234),
    "mH": (lambda x: x.mH, x234),
    "movedim": (lambda x: x.movedim(0, -1), x234),
    "movedim tuples": (lambda x: torch.movedim(x, (0, 1), (2, 0)), x234),
    "moveaxis": (lambda x: torch.moveaxis(x, -1, 0), x234),
    "movedim keywords": (lambda x: torch.movedim(x, source=0, destination=1), x234),
    # expand and repeat
    "expand varargs": (lambda x: x[:, :1].expand(3, 5), x34),
    "expand -1 and new dims": (lambda x: x[:, :1].expand(2, -1, 4), x34),
    "expand tuple": (lambda x: x.expand((2, 3, 4)), x34),
    "expand_as": (lambda x, y: x[:1].expand_as(y), x34, x34),
    "broadcast_to": (lambda x: torch.broadcast_to(x[0], (3, 4)), x34),
    "repeat": (lambda x: x.repeat(2, 1, 3), x34),
    "repeat tuple": (lambda x: x.repeat((1, 2)), x34),
    "tile short": (lambda x: x.tile((2,)), x34),
    "repeat_interleave dim": (lambda x: x.repeat_interleave(2, dim=1), x234),
    "repeat_interleave flat": (lambda x: torch.repeat_interleave(x, 3), x34),
    "repeat_interleave once": (lambda x: x.repeat_interleave(1, -1), x34),
    "repeat_interleave size-1 dim": (lambda x: x[:, :1].repeat_interleave(3, dim=1), x34),
    "repeat_interleave transposed": (lambda x: x.t().repeat_interleave(repeats=2, dim=0), x34),
    # squeeze / unsqueeze
    "squeeze all": (lambda x: x.reshape(1, 3, 1, 4).squeeze(), x34),
    "squeeze dim": (lambda x: x.reshape(1, 3, 1, 4).squeeze(2), x34),
    "squeeze non-unit dim": (lambda x: x.squeeze(0), x34),
    "squeeze tuple": (lambda x: torch.squeeze(x.reshape(1, 3, 1, 4), (0, -2)), x34),
    "squeeze 0-d": (lambda x: x.sum().squeeze(0), x34),
    "unsqueeze": (lambda x: x.unsqueeze(1), x34),
    "unsqueeze last": (lambda x: torch.unsqueeze(x, -1), x34),
    # joins
    "cat": (lambda x, y: torch.cat([x, y], dim=1), x34, x34),
    "cat promotes": (lambda x, y: torch.cat((x, y)), x34, x34.long()),
    "cat skips 1-d empty": (lambda x: torch.cat([x, torch.zeros(0)]), x34),
    "cat with captured tensor": (lambda x: torch.cat([x, x34]), x34),
    "concat": (lambda x: torch.concat([x, x], -1), x34),
    "concatenate": (lambda x: torch.concatenate([x, x], axis=0), x34),
    "stack": (lambda x, y: torch.stack([x, y], -1), x34, x34),
    "stack dim 0 promotes": (lambda x, y: torch.stack((x, y)), x34, x34.double()),
    # splits
    "split int": (lambda x: x.split(3, dim=2), x234),
    "split keyword": (lambda x: x.split(split_size=2), x234),
    "split uneven": (lambda x: torch.split(x, 2, 1), x234),
    "split list": (lambda x: torch.split(x, [1, 3], -1), x234),
    "split_with_sizes": (lambda x: x.split_with_sizes([2, 1], 1), x234),
    "chunk": (lambda x: x.chunk(3, -1), x234),
    "chunk fewer": (lambda x: torch.chunk(x, 4, 1), x234),
    "tensor_split sections": (lambda x: x.tensor_split(3, dim=2), x234),
    "tensor_split indices": (lambda x: torch.tensor_split(x, [1, -1, 10], 2), x234),
    "unbind": (lambda x: x.unbind(1), x234),
    "iterate": (lambda x: tuple(row * 2 for row in x), x34),
    "narrow": (lambda x: x.narrow(2, 1, 2), x234),
    "narrow negative start": (lambda x: torch.narrow(x, -1, -3, 3), x234),
    "select": (lambda x: x.select(1, -1), x234),
    # flips
    "flip varargs": (lambda x: x.flip(0, 2), x234),
    "torch.flip": (lambda x: torch.flip(x, dims=[-1]), x234),
    "fliplr": (lambda x: x.fliplr(), x34),
    "flipud": (lambda x: torch.flipud(x), x34),
    # basic indexing
    "index int": (lambda x: x[1], x234),
    "index negative int": (lambda x: x[-1, -2], x234),
    "index slice": (lambda x: x[:, 1:], x234),
    "index slice step": (lambda x: x[..., ::3], x234),
    "index slice clamps": (lambda x: x[-10:10, 2:1], x234),
    "index none": (lambda x: x[None], x234),
    "index ellipsis middle": (lambda x: x[0, ..., 1], x234),
    "index combination": (lambda x: x[None, -1, ..., None, 1::2], x234),
    "index everything": (lambda x: x[1, 2, 3], x234),
    "index empty tuple": (lambda x: x[()], x234),
    "index 0-d": (lambda x: x.sum()[None, ...], x234),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_eager(case, mode):
    fn, *args = CASES[case]
    check(fn, *args, mode=mode)


@pytest.mark.parametrize("case", ["view varargs", "permute varargs", "index combination",
                                  "split list", "repeat", "cat promotes", "T", "flip varargs"])
def test_decomposes_into_prims(case):
    fn, *args = CASES[case]
    jfn = check(fn, *args)
    assert all(name.startswith("prims.") for name in decomposed_ops(jfn))


@pytest.mark.parametrize("case", ["repeat_interleave dim", "repeat_interleave flat",
                                  "repeat_interleave once", "repeat_interleave size-1 dim",
                                  "repeat_interleave transposed"])
def test_repeat_interleave_by_an_int_decomposes_like_eager(case):
    """An int count decomposes (it ran opaque under torch.autograd: litgpt's grouped-query
    attention paid 0.67 ms a tiny training step for it); the result is a new contiguous tensor
    with eager's strides, and its gradient (a sum over the repeats) equals eager's."""
    fn, x = CASES[case]
    x = x.clone().requires_grad_(True)
    jfn = fulmen.jit(fn)
    expected, actual = fn(x), jfn(x)
    assert actual.stride() == expected.stride() and actual.data_ptr() != x.data_ptr()
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    cotangent = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(actual, x, cotangent)[0],
                               torch.autograd.grad(expected, x, cotangent)[0])
    assert not any(name.startswith("opaque.") for name in ops_of(jfn))


def test_identity_results_are_the_input():
    # eager returns the very same tensor here, so the trace records nothing
    for fn in (lambda x: x.flatten(1, 1), lambda x: x.contiguous(), lambda x: x[0].flatten()):
        x = torch.randn(3, 4)
        jfn = fulmen.jit(fn)
        assert (jfn(x) is x) == (fn(x) is x)
    x = torch.randn(3, 4)
    jfn = fulmen.jit(lambda x: x.flatten(1, 1))
    assert jfn(x) is x
    assert ops_of(jfn) == []


def test_views_that_change_nothing_are_new_tensors():
    x = torch.randn(3, 4)
    for fn in (lambda x: x.reshape(3, 4), lambda x: x[...], lambda x: x.permute(0, 1),
               lambda x: x.squeeze()):
        jfn = fulmen.jit(fn)
        out = jfn(x)
        assert out is not x and torch.equal(out, x)
        assert len(ops_of(jfn)) == 1


def test_contiguous_of_a_non_contiguous_input_copies():
    x = torch.randn(4, 3).t()
    jfn = fulmen.jit(lambda x: x.contiguous())
    out = jfn(x)
    assert out.is_contiguous() and torch.equal(out, x)
    assert ops_of(jfn) == ["opaque.Tensor_contiguous"]


@pytest.mark.parametrize("fn", [
    lambda x: x[[0, 2]],
    lambda x: x[torch.tensor([1, 0])],
    lambda x: x[x > 0.5],
    lambda x: x[0, [1, 2]],
    lambda x: x[True],
    lambda x: x[..., 0, ...],
    lambda x: x.view(torch.int32),
    lambda x: torch.cat([x, x], axis=1),
    lambda x: x.squeeze(axis=0),
    lambda x: x.repeat_interleave(torch.tensor([1, 2, 1]), dim=0),
    lambda x: x.repeat_interleave(2, dim=0, output_size=6),
], ids=["list", "tensor", "mask", "int-and-list", "bool", "two-ellipses", "view-dtype",
        "cat-axis", "squeeze-axis", "repeat_interleave-tensor", "repeat_interleave-output_size"])
def test_unsupported_forms_run_the_torch_op(fn):
    x = torch.rand(3, 4)
    try:
        jfn = check(fn, x)
    except fulmen.FulmenError as error:  # a data-dependent shape (boolean mask)
        assert "cannot describe" in str(error)
        return
    assert any(name.startswith("opaque.") for name in ops_of(jfn))


def test_getitem_on_a_dimension_of_size_zero():
    check(lambda x: x[:, 1:3], torch.zeros(0, 4))
    check(lambda x: x.split(2), torch.zeros(0, 4))
    check(lambda x: x.chunk(2), torch.zeros(0, 4))


@pytest.mark.parametrize("fn, error", [
    (lambda x: x[3], IndexError),
    (lambda x: x[0, 0, 0], IndexError),
    (lambda x: x[::-1], ValueError),
    (lambda x: x[:, ::0], ValueError),
    (lambda x: x.view(5, -1), RuntimeError),
    (lambda x: x.view(-1, -1), RuntimeError),
    (lambda x: x.permute(0, 0), RuntimeError),
    (lambda x: x.transpose(0, 2), IndexError),
    (lambda x: x.expand(2, 3), RuntimeError),
    (lambda x: x.expand(5, 4), RuntimeError),
    (lambda x: x.split([1, 1]), RuntimeError),
    (lambda x: x.select(0, 3), IndexError),
    (lambda x: x.narrow(1, 2, 3), RuntimeError),
    (lambda x: x.flatten(1, 0), RuntimeError),
    (lambda x: x.flip(0, -2), RuntimeError),
    (lambda x: x.repeat(2), RuntimeError),
    (lambda x: x.mT.sum(0).mT, RuntimeError),
    (lambda x: torch.stack([x, x[:1]]), RuntimeError),
    (lambda x: torch.cat([x, x[:, :1]]), RuntimeError),
])
def test_errors_match_eager(fn, error):
    x = torch.randn(3, 4)
    with pytest.raises(error):
        fn(x)
    with pytest.raises(error):
        fulmen.jit(fn)(x)


def printed(jfn) -> str:
    """The traced program from its `def` line, without source-line comments."""
    source = str(fulmen.last_traces(jfn)[0])
    lines = source[source.index("def "):].splitlines()
    return "\n".join(line for line in lines if ".py:" not in line) + "\n"


class TestPrintedDecompositions(expecttest.TestCase):
    def test_indexing_and_repeat(self):
        def fn(x):
            return x[None, 1:, ::2].repeat(2, 1, 1, 1)

        jfn = fulmen.jit(fn)
        jfn(torch.randn(3, 4))
        self.assertExpectedInline(
            printed(jfn),
            """\
def computation(x):
  # x: "cpu f32[3, 4]"

  t1 = ltorch.getitem(x, (None, slice(1, None, None), slice(None, None, 2)))  # t1: "cpu f32[1, 2, 2]"
    # t0 = prims.slice(x, (1, 0), (3, 4), (1, 2))
    # t1 = prims.reshape(t0, (1, 2, 2))
  t4 = ltorch.repeat(t1, 2, 1, 1, 1)  # t4: "cpu f32[2, 1, 2, 2]"
    # t2 = prims.reshape(t1, (1, 1, 2, 2))
    # t3 = prims.broadcast_in_dim(t2, (2, 1, 1, 1, 1, 2, 1, 2), (1, 3, 5, 7))
    # t4 = prims.reshape(t3, (2, 1, 2, 2))
  return t4
""",
        )

    def test_split_and_cat(self):
        def fn(x, y):
            a, b = x.split([1, 3], dim=1)
            return torch.cat([b, a, y], 1)

        jfn = fulmen.jit(fn)
        jfn(torch.randn(2, 4), torch.ones(2, 1, dtype=torch.int64))
        self.assertExpectedInline(
            printed(jfn),
            """\
def computation(x, y):
  # x: "cpu f32[2, 4]"
  # y: "cpu i64[2, 1]"

  (t0, t1) = ltorch.split(x, [1, 3], dim=1)  # t0: "cpu f32[2, 1]", t1: "cpu f32[2, 3]"
    # t0 = prims.slice(x, (0, 0), (2, 1), (1, 1))
    # t1 = prims.slice(x, (0, 1), (2, 4), (1, 1))
  t3 = ltorch.cat([t1, t0, y], 1)  # t3: "cpu f32[2, 5]"
    # t2 = prims.convert_element_type(y, torch.float32)
    # t3 = prims.cat([t1, t0, t2], 1)
  return t3
""",
        )


def test_permuted_proxies_report_eager_strides():
    # HF GPT-J/DeBERTa/Swin merge heads by `x.permute(...).contiguous().view(...)`: the permuted
    # proxy must not claim contiguity, or `.contiguous()` is dropped and the view fails at run time
    def fn(x):
        y = x.permute(0, 2, 1, 3)
        flags = (y.is_contiguous(), y.stride(), y.transpose(0, 1).stride())
        return y.contiguous().view(2, 4, 12), flags

    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    jfn = fulmen.jit(fn)
    (expected, expected_flags), (actual, actual_flags) = fn(x), jfn(x)
    assert actual_flags == expected_flags
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(actual, x, cotangent),
                               torch.autograd.grad(expected, x, cotangent))


def test_elementwise_results_keep_their_operands_layout():
    # eager's elementwise kernels keep a transposed operand's layout, so the user's
    # `.contiguous()` before a `.view` must stay a copy (the torch executor runs the map on the
    # transposed tensor itself)
    def fn(x):
        y = (x.transpose(1, 2) * 2).sin()
        z = y.to(torch.float64)
        return y.contiguous().view(2, 12), y.stride(), z.stride(), y.is_contiguous()

    x = torch.randn(2, 3, 4)
    expected = fn(x)
    for executors in (["torch"], None):
        actual = fulmen.jit(fn, executors=executors)(x)
        assert actual[1:] == expected[1:]
        torch.testing.assert_close(actual[0], expected[0])
