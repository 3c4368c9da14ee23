"""linalg.py against eager, whole and decomposed, with gradients."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.transforms import decompose_to_prims

B = torch.randn(2, 4, 5)
C = torch.randn(5, 6)
W1 = torch.randn(6, 3, 2)
W2 = torch.randn(6, 1, 2, 2)
BIAS = torch.randn(3)
ZERO = torch.zeros(2, 3, 5)
W4, W6, B6 = torch.randn(4), torch.randn(6), torch.randn(6)

CASES = [
    lambda x: torch.addmm(BIAS, x[0], C[:4, :3], beta=0.5, alpha=2),
    lambda x: torch.addmm(torch.full((3,), float("nan")), x[0], C[:4, :3], beta=0),  # NaN unread
    lambda x: torch.linalg.vector_norm(x, float("inf"), dim=1),
    lambda x: torch.linalg.vector_norm(x * (x > 0), 0, dim=2) + x[..., 0],  # counts nonzeros
    lambda x: F.rms_norm(x, (3, 4)),  # over two dims
    lambda x: torch.baddbmm(ZERO, x, B, alpha=0.5),
    lambda x: torch.outer(x[0, 0], x[1, 1]),
    lambda x: torch.einsum("bij,bjk,kl->bil", x, B, C),
    lambda x: torch.einsum("bij->j", x),
    lambda x: torch.einsum("bij,bij", x, x),
    lambda x: F.conv1d(x.transpose(0, 1).reshape(3, 2, 4).repeat(1, 3, 1)[:, :3], W1, padding=1),
    lambda x: F.conv2d(x.reshape(1, 6, 2, 2), W2, groups=6, stride=1, padding=(1, 0)),
    lambda x: torch.linalg.vector_norm(x, 3.0, dim=(0, 2)),
    lambda x: x.norm(dim=-1, keepdim=True),
    lambda x: F.normalize(x, dim=1),
    lambda x: F.rms_norm(x, (4,), W4),
    lambda x: F.group_norm(x.reshape(2, 6, 2), 3, W6, B6),
    # batch dims broadcast against each other (1 against 2 both ways): (2, 2, 3, 5)
    lambda x: torch.matmul(x.reshape(2, 1, 3, 4), B.reshape(1, 2, 4, 5)).mean(1),
]


@pytest.mark.parametrize("mode", [[], [decompose_to_prims]])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_linalg(index, mode):
    fn = CASES[index]
    x = torch.randn(2, 3, 4, requires_grad=True)
    jfn = fulmen.jit(fn, transforms=mode)
    expected, actual = fn(x), jfn(x)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(actual, x, cotangent)[0],
                               torch.autograd.grad(expected, x, cotangent)[0])
    first = str(fulmen.last_traces(jfn)[0])
    assert "opaque" not in first


@pytest.mark.parametrize("shape", [(2, 3), (3,)], ids=["2d", "1d"])
def test_two_norm_gradient_at_zero_matches_eager(shape):
    # the 2-norm's own rule (0 where the norm is 0); negative dims and keepdim on a vector too
    x = torch.zeros(shape)
    x[-1] = torch.randn(shape[1:] or ())
    x.requires_grad_()
    for fn in (lambda x: F.normalize(x, dim=-1), lambda x: torch.linalg.vector_norm(x, dim=-1),
               lambda x: x.norm(dim=-1, keepdim=True) * x, lambda x: torch.linalg.vector_norm(x),
               lambda x: F.normalize(x, dim=0)):
        cotangent = torch.randn_like(fn(x))
        (expected,) = torch.autograd.grad(fn(x), x, cotangent)
        (actual,) = torch.autograd.grad(fulmen.jit(fn)(x), x, cotangent)
        torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("layout", ["2d-3d", "3d-2d", "2d-2d", "3d-3d"])
def test_grouped_mm_float32_on_cpu(layout):
    # HF's MoE experts call torch._grouped_mm on float32; PyTorch's meta kernel accepts only
    # bfloat16 (CUDA's rule), the CPU kernel any floating dtype: traced as an opaque op
    offs = torch.tensor([4, 4, 12], dtype=torch.int32)  # one empty group
    shapes = {"2d-3d": ((12, 8), (3, 8, 4)), "3d-2d": ((3, 4, 12), (12, 8)),
              "2d-2d": ((4, 12), (12, 8)), "3d-3d": ((3, 4, 8), (3, 8, 4))}[layout]
    a, b = (torch.randn(shape, requires_grad=True) for shape in shapes)
    if layout == "3d-3d":
        offs = None

    def fn(a, b):
        return torch._grouped_mm(a, b, offs=offs).tanh()

    jfn = fulmen.jit(fn)
    expected, actual = fn(a, b), jfn(a, b)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(actual, (a, b), cotangent),
                               torch.autograd.grad(expected, (a, b), cotangent))
    traced = str(fulmen.last_traces(jfn)[0])
    assert "opaque.grouped_mm" in traced
    assert "graph break" not in traced  # described by its meta, not run to learn its shape
