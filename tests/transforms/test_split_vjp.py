"""The VJP of `split`, `split_with_sizes` and `chunk` (rules_composite.py): the concatenation
of the pieces' cotangents, zeros for an unused piece, as eager's `split_backward`."""

import pytest
import torch

import fulmen

CASES = {
    "split": lambda x: [p * (i + 1) for i, p in enumerate(x.split(2, dim=1))],
    "split uneven, last dim": lambda x: [p.sin() for p in torch.split(x, 3, dim=-1)],
    "split sizes with an empty piece": lambda x: [p * 2 for p in x.split([1, 4, 0], dim=1)],
    "split_with_sizes": lambda x: [p.cos() for p in x.split_with_sizes([2, 3], 1)],
    "chunk": lambda x: [p * 3 for p in x.chunk(3, dim=0)],
    "chunk, one piece used": lambda x: [x.chunk(2, dim=1)[1].exp()],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_split_backward_is_a_cat_of_the_pieces_cotangents(name):
    fn = CASES[name]
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    jfn = fulmen.jit(fn)
    expected, actual = fn(x), jfn(x)
    cotangents = [torch.randn_like(e) for e in expected]
    (want,) = torch.autograd.grad(expected, x, cotangents)
    (got,) = torch.autograd.grad(actual, x, cotangents)
    assert torch.equal(got, want)
    backward = str(fulmen.last_backward_traces(jfn)[-1])
    # each piece's slice transposed to a zero-padded full-size tensor, the pads then added
    assert "prims.cat(" in backward and "prims.pad(" not in backward, backward
