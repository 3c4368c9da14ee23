"""Large float32 `F.linear` on CPU through oneDNN (issue 21: pythia-14m's lm_head).

Eager's float32 `F.linear` on CPU is a BLAS sgemm (MKL in the stock wheels). PyTorch's oneDNN
linear, `torch.ops.mkldnn._linear_pointwise(input, weight, bias, "none", [], "")`, computes
the same product and is faster on large products but slower on small ones (it pays ~20 µs
per call to set up). Measured on the 2-core AMD EPYC (AVX-512) development machine, 1 thread,
in the same run (milliseconds; `M x K` input, `N x K` weight):

| M, K, N | multiply-adds | F.linear | oneDNN |
| --- | ---: | ---: | ---: |
| 4, 16, 16 | 2^10 | 0.004 | 0.023 |
| 128, 64, 256 | 2^21 | 0.055 | 0.065 |
| 128, 64, 1024 | 2^23 | 0.185 | 0.187 |
| 64, 64, 4096 | 2^24 | 0.463 | 0.450 |
| 128, 128, 4096 | 2^26 | 1.54 | 1.36 |
| 128, 128, 50304 (pythia-14m's lm_head) | 2^29 | 23.6 | 19.4 |
| 4, 768, 50304 | 2^27 | 28.2 | 15.6 |
| 1024, 1024, 1024 | 2^30 | 26.2 | 20.7 |

(2 threads: 0.33-0.89 of F.linear's time from 2^25 up.) So a statement
`t1 = torch.nn.functional.linear(x, w, b)` of the torch executor whose operands are float32 CPU
tensors with static sizes and at least `MIN_MULTIPLY_ADDS` (2^24) multiply-adds runs as
`t1 = torchex.onednn_linear(x, w, b)`: a fixed threshold, so the choice is the same on every
run (no timing at plan build), and small products keep eager's call and its per-call cost.

Values: both accumulate in float32; only the order of the sums may differ. On the development
machine the results are bitwise eager's for `K <= 192` and more than one row (pythia's
lm_head), and within float32 rounding otherwise (the float64 accuracy rule,
`fulmen.tools.accuracy`). The matrix products of the backward stay eager's: there oneDNN was
slower (weight gradient 38 vs 21 ms for pythia's lm_head).

`_linear_pointwise` has no autograd formula (backpropagating through it silently gives no
gradient), so at run time the call falls back to `F.linear` whenever grad mode is on and an
operand requires grad (a graph-break segment running in the caller's grad mode), when oneDNN is
unavailable or disabled (`torch.backends.mkldnn.enabled = False`), or when an operand is not
contiguous (where oneDNN would first copy it). The forward of a training step runs outside
autograd (`fulmen.autograd_bridge`) and takes the oneDNN call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fulmen.core import BoundSymbol, Trace
from fulmen.executors.torch import torch_ex
from fulmen.transforms.base import transform

__all__ = ["MIN_MULTIPLY_ADDS", "ONEDNN_LINEAR", "onednn_linear"]

MIN_MULTIPLY_ADDS = 1 << 24
_LINEARS = (F.linear, torch._C._nn.linear)


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear(input, weight, bias)`, computed by oneDNN where that is safe (module
    docstring), else by `F.linear` itself."""
    if (not torch._C._get_mkldnn_enabled()
            or not input.is_contiguous() or not weight.is_contiguous()
            or (bias is not None and not bias.is_contiguous())
            or (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad)))):
        return F.linear(input, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(input, weight, bias, "none", [], "")


ONEDNN_LINEAR = torch_ex.register_operator("onednn_linear", fn=_linear, like=F.linear)


def _static_float32_cpu(value) -> bool:
    return (isinstance(value, torch.Tensor) and value.dtype == torch.float32
            and value.device.type == "cpu" and all(isinstance(s, int) for s in value.shape))


def _operands(bsym: BoundSymbol):
    """`(input, weight, bias)` of a torch executor `F.linear` statement, or None."""
    if bsym.sym.executor is not torch_ex or bsym.sym.impl not in _LINEARS:
        return None
    if len(bsym.args) + len(bsym.kwargs) > 3 or set(bsym.kwargs) - {"bias"}:
        return None
    input, weight, *rest = (*bsym.args, *bsym.kwargs.values())
    return input, weight, rest[0] if rest else None


def _takes_onednn(bsym: BoundSymbol) -> bool:
    operands = _operands(bsym)
    if operands is None:
        return False
    input, weight, bias = operands
    if not (_static_float32_cpu(input) and _static_float32_cpu(weight)) or input.dim() < 2 \
            or weight.dim() != 2:
        return False
    if bias is not None and not (_static_float32_cpu(bias) and bias.dim() == 1):
        return False
    rows = math.prod(input.shape[:-1])
    return rows * weight.shape[0] * weight.shape[1] >= MIN_MULTIPLY_ADDS


@transform("oneDNN linear")
def onednn_linear(trace: Trace) -> Trace:
    """Run the large float32 CPU `F.linear` statements of the torch executor as
    `torchex.onednn_linear` (module docstring); a trace without one is returned as is."""
    if not torch.backends.mkldnn.is_available():
        return trace
    changed = [bsym.replace(sym=ONEDNN_LINEAR, subsymbols=()) if _takes_onednn(bsym) else bsym
               for bsym in trace.bsyms]
    if all(new is old for new, old in zip(changed, trace.bsyms)):
        return trace
    return trace.replace(bsyms=tuple(changed))
