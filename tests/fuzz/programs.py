"""Random straight-line programs over the op library, for differential fuzzing against eager.

A program is a list of steps; each step applies one op to values already computed (inputs
first) and appends its result. Shapes are chosen so broadcasting, reductions, views and
non-contiguous inputs all occur. A program is plain data, so hypothesis shrinks it and a failure
prints as a readable list of steps.

Inputs are normal samples, or (`VALUES`) small integers with signed zeros, so ties at 0, at clamp
bounds and between operands occur, or samples of magnitude ~100, where exp-based activations
overflow and in-kernel casts to integers go out of range. A binary step takes the same value
twice now and then (`maximum(x, x)`, `hypot(x, x)`: one gradient per tensor).

`programs(calls=True)` also draws `Program.calls`: more calls of the same jitted function at
other sizes (each a `Resize` of the sizes in `SHAPES`: 0, 1, sizes made equal, a broadcast 1
made larger, the first sizes again; now and then the inputs' layouts flipped), so a symbolic
trace and its guards are reused across shapes (`test_fuzz.check_program`; issue 16's "no wrong cache hit").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from hypothesis import strategies as st


def _stride_read(a):
    """`a` scaled by numbers Python reads from a permuted view of a contiguous copy: its
    strides and contiguity must be eager's (a contiguous copy's layout is unambiguous)."""
    if a.ndim < 2:
        return a
    view = a.contiguous().transpose(0, -1)
    return a * (1.0 + 0.01 * view.stride(0)) + (0.0 if view.is_contiguous() else 1.0)


UNARY = {
    "exp": lambda a: torch.exp(a.clamp(max=8)),
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "neg": lambda a: -a,
    "abs": torch.abs,
    "sin": torch.sin,
    "relu": torch.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "square": lambda a: a * a,
    "sqrt_abs": lambda a: torch.sqrt(a.abs() + 1),
    "log_abs": lambda a: torch.log(a.abs() + 1),
    "softmax": lambda a: torch.softmax(a, -1),
    "log_softmax": lambda a: F.log_softmax(a, dim=-1),
    "sum_last": lambda a: a.sum(-1, keepdim=True),
    "mean_first": lambda a: a.mean(0),
    "amax_last": lambda a: a.amax(-1, keepdim=True),
    "var_last": lambda a: a.var(-1, keepdim=True) if a.ndim and a.shape[-1] > 1 else a,
    "transpose": lambda a: a.transpose(0, -1) if a.ndim > 1 else a,
    "flip_reshape": lambda a: a.reshape(-1).flip(0).reshape(a.shape),
    "slice": lambda a: a[..., ::2] if a.ndim and a.shape[-1] > 1 else a,
    "slice_tail": lambda a: a[..., 1:] * 2 if a.ndim and a.shape[-1] > 1 else a,
    "slice_odd": lambda a: a[1::2] + 1 if a.ndim and a.shape[0] > 1 else a,
    "chunk_last": lambda a: a.chunk(2, -1)[-1] * 3 if a.ndim else a,
    "layer_norm": lambda a: F.layer_norm(a, a.shape[-1:]),
    "scale": lambda a: a * 0.5 + 1.0,
    "to_double_back": lambda a: a.double().sin().to(a.dtype),
    "softplus": F.softplus,
    "elu": F.elu,
    "mish": F.mish,
    "hardtanh": F.hardtanh,
    "clamp_min0": lambda a: a.clamp(min=0),
    "clamp_bounds": lambda a: a.clamp(-1, 1),
    "std_last": lambda a: a.std(-1, keepdim=True, correction=0) if a.ndim else a,
    "int8_cast": lambda a: (a * 50).to(torch.int8).to(a.dtype) + a,
    "uint8_cast": lambda a: (a * 3).to(torch.uint8).to(a.dtype) * a,
    "fake_quant": lambda a: (a / 0.1).round().to(torch.int8).to(a.dtype) * 0.1,
    "stride_read": _stride_read,  # Python reads the layout of a permuted view
    "bool_cast": lambda a: a.to(torch.bool).to(a.dtype) + a,  # negatives are True too
    "bf16_round": lambda a: a.to(torch.bfloat16).to(a.dtype) * 2,  # rounding to nearest even
    "fp16_round": lambda a: a.to(torch.float16).to(a.dtype) - a,
    # sizes read as numbers, factories and views sized by them (symbolic under dynamic=True)
    "size_scale": lambda a: a * (a.shape[-1] if a.ndim else 1) / (a.numel() + 1),
    "arange_add": lambda a: a + torch.arange(a.shape[-1], dtype=a.dtype) if a.ndim else a,
    "new_full": lambda a: a - a.new_full(a.shape[-1:], a.shape[0] if a.ndim else 2),
    "last_row": lambda a: a[..., a.shape[-1] - 1:] * a if a.ndim else a,
    "expand_sum": lambda a: a.sum(-1, keepdim=True).expand(a.shape) * a if a.ndim else a,
    "rows_view": lambda a: a.reshape(a.shape[0], -1).sum(-1).view(-1, *[1] * (a.ndim - 1)) + a
    if a.ndim else a,  # eager rejects -1 beside a 0: fulmen must raise too
    "cumsum_last": lambda a: a.cumsum(-1) if a.ndim else a,
    "cat_shifted": lambda a: torch.cat([a, F.pad(a, (1, 0))[..., :-1]], -1) if a.ndim else a,
}

BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": lambda a, b: a / (b.abs() + 1),
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "where": lambda a, b: torch.where(a > b, a, b * 2),
    "atan2": torch.atan2,
    "pow": lambda a, b: (a.abs() + 0.5) ** b.clamp(-2, 2),
    "hypot_like": lambda a, b: torch.sqrt(a * a + b * b + 1e-3),
    "hypot": torch.hypot,
    "logaddexp": torch.logaddexp,
    "fmax": torch.fmax,
    "clamp_by": lambda a, b: torch.clamp(a, min=b),
}

SHAPES = [(4, 5), (1, 5), (4, 1), (5,), (3, 4, 5), (1,), ()]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
VALUES = ["normal", "normal", "ties", "large"]  # how input values are drawn (see make_inputs)


def _sample(shape, values: str, generator) -> torch.Tensor:
    """float32 values of `shape`: normal, small integers with signed zeros, or magnitude ~100."""
    if values == "ties":
        sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1.0
        return torch.randint(-2, 3, shape, generator=generator) * sign
    scale = 100.0 if values == "large" else 1.0
    return torch.randn(shape, generator=generator) * scale


RESIZABLE = (1, 3, 4, 5)  # every size in SHAPES: a `Resize` maps each to another


@dataclass(frozen=True)
class Resize:
    """New sizes for one call: every dim of size 1, 3, 4, 5 in the program's input shapes
    becomes `one`, `three`, `four`, `five` (sizes drawn from a small set, so equal sizes, 0
    and 1 occur; a broadcast 1 made larger may not broadcast: eager and fulmen must both raise)."""

    one: int = 1
    three: int = 3
    four: int = 4
    five: int = 5
    flip_layout: bool = False  # transposed inputs contiguous, contiguous ones transposed

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        sizes = dict(zip(RESIZABLE, (self.one, self.three, self.four, self.five)))
        return tuple(sizes[size] for size in shape)


@dataclass(frozen=True)
class Step:
    op: str
    operands: tuple[int, ...]


@dataclass(frozen=True)
class Program:
    input_shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    transposed: tuple[bool, ...]
    steps: tuple[Step, ...]
    values: str = "normal"
    calls: tuple[Resize, ...] = ()  # later calls of the same jitted function, at other sizes

    def resized(self, resize: Resize) -> Program:
        """The program at `resize`'s sizes (the same steps, inputs of the new shapes)."""
        shapes = tuple(resize.shape(shape) for shape in self.input_shapes)
        transposed = tuple(t != resize.flip_layout for t in self.transposed)
        return replace(self, input_shapes=shapes, transposed=transposed, calls=())

    def run(self, *inputs):
        values = list(inputs)
        for step in self.steps:
            args = [values[i] for i in step.operands]
            fn = UNARY.get(step.op) or BINARY[step.op]
            values.append(fn(*args))
        return values[-1], values[len(inputs)]

    def make_inputs(self, seed: int, requires_grad: bool):
        generator = torch.Generator().manual_seed(seed)
        inputs = []
        for shape, transposed in zip(self.input_shapes, self.transposed):
            if transposed and len(shape) >= 2:
                base = _sample(shape[::-1], self.values, generator).to(self.dtype)
                tensor = base.transpose(0, -1) if len(shape) == 2 else base.permute(2, 1, 0)
            else:
                tensor = _sample(shape, self.values, generator).to(self.dtype)
            inputs.append(tensor.requires_grad_(requires_grad))
        return inputs


_SIZES = st.sampled_from([0, 1, 2, 3, 4, 5, 7])
_resizes = st.builds(Resize, one=st.sampled_from([1, 1, 1, 0, 2, 3]), three=_SIZES,
                     four=_SIZES, five=_SIZES,
                     flip_layout=st.sampled_from([False, False, False, True]))


@st.composite
def programs(draw, max_steps: int = 6, calls: bool = False) -> Program:
    """A random program; `calls`: with 1-4 later calls at other sizes (`Program.calls`), the
    first sizes (`Resize()`) among them now and then, so calls alternate."""
    count = draw(st.integers(1, 3))
    shapes = tuple(draw(st.sampled_from(SHAPES)) for _ in range(count))
    transposed = tuple(draw(st.booleans()) for _ in range(count))
    dtype = draw(st.sampled_from(DTYPES))
    values = draw(st.sampled_from(VALUES))
    steps = []
    for index in range(draw(st.integers(1, max_steps))):
        available = count + index
        if draw(st.booleans()):
            op = draw(st.sampled_from(sorted(UNARY)))
            operands = (draw(st.integers(0, available - 1)),)
        else:
            op = draw(st.sampled_from(sorted(BINARY)))
            first = draw(st.integers(0, available - 1))
            same = draw(st.integers(0, 3)) == 0  # the same tensor in both arguments
            operands = (first, first if same else draw(st.integers(0, available - 1)))
        steps.append(Step(op, operands))
    later = ()
    if calls:
        later = tuple(draw(st.lists(st.one_of(_resizes, _resizes, st.just(Resize())),
                                    min_size=1, max_size=4)))
    return Program(shapes, dtype, transposed, tuple(steps), values, later)
