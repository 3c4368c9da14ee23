"""indexing.py against eager, whole and decomposed, with gradients where differentiable."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.transforms import decompose_to_prims
from tests.ops.opinfo_harness import assert_traced_like_eager

IDX = torch.tensor([[0, 2, 1], [1, 1, 0]])
MASK = torch.tensor([True, False, True, False, False])
ROWS = torch.tensor([4, 0, 0])
FILL = torch.tensor(2.0)
SRC = torch.ones(3, 4)

CASES = [
    lambda x: x.masked_fill(MASK, -1.5),
    lambda x: torch.masked_fill(x, MASK, FILL),
    lambda x: torch.tril(x, -1),
    lambda x: x.triu(1),
    lambda x: torch.gather(x, 1, IDX),
    lambda x: x.index_select(1, ROWS),
    lambda x: torch.scatter_add(x, 1, IDX, SRC),
    lambda x: torch.roll(x, (1, -2), (0, 1)),
    lambda x: torch.roll(x, 3),
    lambda x: F.pad(x, (1, 2, -1, 0), value=0.5),
]


@pytest.mark.parametrize("mode", [[], [decompose_to_prims]])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_indexing(index, mode):
    fn = CASES[index]
    x = torch.randn(3, 5, requires_grad=True)
    assert_traced_like_eager(fn, x, mode)


def test_scatter_add_of_a_larger_src_adds_and_differentiates_its_leading_block():
    """Only the leading `index.shape` block of a larger `src` is added (eager's rule), and only
    that block gets gradients. Eager's own backward rejects this call (ScatterAddBackward0
    returns an index-shaped gradient for the larger src), so the gradient is compared with
    eager's for the explicitly sliced src."""
    x = torch.randn(3, 5, requires_grad=True)
    jfn = fulmen.jit(lambda t: torch.scatter_add(t, 1, IDX, t[:, :4] * 3))
    out = jfn(x)
    weights = torch.randn(3, 5)
    (grad,) = torch.autograd.grad((out * weights).sum(), x)
    sliced = lambda t: torch.scatter_add(t, 1, IDX, (t[:, :4] * 3)[:2, :3])  # noqa: E731
    torch.testing.assert_close(out, sliced(x))
    (expected,) = torch.autograd.grad((sliced(x) * weights).sum(), x)
    torch.testing.assert_close(grad, expected)


def test_one_hot():
    labels = torch.tensor([[0, 3], [2, 1]])
    jfn = fulmen.jit(lambda t: F.one_hot(t, 5), transforms=[decompose_to_prims])
    torch.testing.assert_close(jfn(labels), F.one_hot(labels, 5))


def test_one_hot_without_num_classes_raises():
    with pytest.raises(fulmen.FulmenError, match="num_classes"):
        fulmen.jit(lambda t: F.one_hot(t))(torch.tensor([0, 1]))
