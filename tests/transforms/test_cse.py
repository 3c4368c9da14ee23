"""transforms/cse.py: repeated statements are dropped, their readers read the first one."""

import math

import torch

import fulmen
from fulmen.transforms.cse import cse


def _body(trace) -> list[str]:
    return [line.split("  #")[0].strip() for line in str(trace).splitlines()
            if line.startswith("  ") and not line.strip().startswith("#")]


def test_cse_snapshot():
    def fn(x):
        a = torch.arange(8, device="cpu")
        b = torch.arange(8, device="cpu")
        return x.reshape(2, 4) + a.reshape(2, 4) + b.reshape(2, 4)

    jfn = fulmen.jit(fn)
    torch.testing.assert_close(jfn(torch.ones(8)), fn(torch.ones(8)))
    before = next(t for t in fulmen.last_traces(jfn) if t.provenance == "constructed by tracing")
    after = cse(before)
    assert after.provenance == "after common subexpression elimination"
    assert _body(after) == [
        "t0 = ltorch.arange(8, device='cpu')",
        "t2 = ltorch.reshape(x, 2, 4)",
        "t3 = ltorch.reshape(t0, 2, 4)",
        "t5 = ltorch.add(t2, t3)",
        "t8 = ltorch.add(t5, t3)",
        "return t8",
    ]
    assert cse(after) is after  # nothing left to do: the same trace


def test_constants_compare_with_their_type_and_sign():
    def fn(x):
        return (x + 0.0) * (x + -0.0) + (x + 0) + (x * math.nan) + (x * math.nan)

    jfn = fulmen.jit(fn)
    x = torch.tensor([-0.0, 1.0])
    torch.testing.assert_close(jfn(x), fn(x), equal_nan=True)
    after = cse(fulmen.last_traces(jfn)[0])
    body = "\n".join(_body(after))
    assert body.count("ltorch.add(x,") == 3 and body.count("ltorch.mul(x, float('nan'))") == 1


def test_random_and_returned_statements_stay():
    def fn(x):
        return torch.rand(3) + x, torch.rand(3) + x, x.exp(), x.exp()

    jfn = fulmen.jit(fn)
    out = jfn(torch.ones(3))
    assert not torch.equal(out[0], out[1])
    assert out[2] is not out[3]
    body = _body(cse(fulmen.last_traces(jfn)[0]))
    assert sum("rand" in line for line in body) == 2


def test_backward_repeats_are_merged_with_the_same_results():
    x = torch.randn(4, 6, requires_grad=True)
    w1, w2 = torch.randn(6, 5, requires_grad=True), torch.randn(6, 5, requires_grad=True)

    def fn(x, w1, w2):
        h = x.reshape(2, 2, 6)
        return ((h @ w1).sin() * (h @ w2).cos()).sum()

    jfn = fulmen.jit(fn)
    jfn(x, w1, w2)
    backward = next(t for t in fulmen.last_backward_traces(jfn)
                    if t.provenance == "constructed by autodiff")
    merged = cse(backward)

    def reshapes(trace):
        return [line.split("=", 1)[1].strip() for line in _body(trace) if "reshape(" in line]

    assert len(reshapes(merged)) == len(set(reshapes(merged))) < len(reshapes(backward))
    inputs = [torch.randn(p.shape, dtype=p.dtype) for p in backward.args]
    for a, e in zip(merged.python_callable()(*inputs), backward.python_callable()(*inputs)):
        torch.testing.assert_close(a, e)


def test_views_that_give_their_input_back_are_dropped():
    # a reshape/view/expand to the same shape, an identity permute and a full basic slice are
    # their input: readers read it (each was a torch call in the execution trace)
    def fn(x):
        a = x.view(4, 5).reshape(4, 5).expand(4, 5)[:, 0:].permute(0, 1) + 1
        return a, x.reshape(4, 5)  # a returned identity view stays: the caller gets a view

    x = torch.randn(4, 5)
    jfn = fulmen.jit(fn)
    (a, b), (want_a, _) = jfn(x), fn(x)
    assert torch.equal(a, want_a) and b is not x and b._base is x
    body = _body(cse(next(t for t in fulmen.last_traces(jfn)
                          if t.provenance == "constructed by tracing")))
    assert body == ["t5 = ltorch.add(x, 1)", "t6 = ltorch.reshape(x, 4, 5)",
                    "return (t5, t6)"], body


def test_a_bias_gradient_is_its_sum_without_a_reshape():
    x, b = torch.randn(3, 4), torch.randn(4, requires_grad=True)
    jfn = fulmen.jit(lambda x, b: (x + b).sin())
    (grad,) = torch.autograd.grad(jfn(x, b).sum(), b)
    torch.testing.assert_close(grad, torch.autograd.grad((x + b).sin().sum(), b)[0])
    backward = fulmen.last_backward_traces(jfn)[0]  # as autodiff built it
    assert not any(bsym.sym.name == "reshape" for bsym in backward.bsyms), backward


def test_a_permute_of_a_square_tensor_is_not_an_identity():
    # same shape, other order: only the permute (0, 1, ...) is its input
    x = torch.randn(4, 4, 4)
    for fn in (lambda x: x.permute(1, 0, 2) + 1, lambda x: x.permute((2, 1, 0)) + 1,
               lambda x: x.permute(0, -2, -1) + 1):
        torch.testing.assert_close(fulmen.jit(fn)(x), fn(x))
