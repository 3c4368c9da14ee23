"""The `torch_op` decorator and the registry from torch callables to fulmen symbols.

A torch-level op is declared once, as a decomposition into prims (and other torch-level ops),
and registered under every torch callable that means it: `torch.add`, `Tensor.add`,
`Tensor.__add__`. The symbol's arguments follow the first callable's signature, so the torch
executor can run the op whole by calling that callable with the recorded arguments.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from fulmen.core import NotYetSupportedError, Symbol
from fulmen.core.symbol import Namespace

LTORCH_NAMESPACE = Namespace("ltorch", "fulmen.ops.torch", "from fulmen.ops import ltorch")

_BY_TORCH_FN: dict[Callable, Symbol] = {}
_BY_NAME: dict[str, Symbol] = {}


def torch_op(
    torch_fn: Callable,
    *aliases: Callable,
    methods: Sequence[str] = (),
    name: str | None = None,
    tags: Sequence[str] = (),
) -> Callable[[Callable], Symbol]:
    """Declare a torch-level op whose decomposition is the decorated function.

    `torch_fn` is the canonical torch callable (what the torch executor runs); `aliases` and
    `methods` (names of `torch.Tensor` methods) are other spellings of the same op.

    Example:
        @torch_op(torch.mul, methods=("mul", "__mul__", "__rmul__"))
        def mul(a, b):
            return elementwise(prims.mul, a, b)
    """

    def declare(decomposition: Callable) -> Symbol:
        sym_name = name or decomposition.__name__
        if sym_name in _BY_NAME:
            raise ValueError(f"torch-level op {sym_name!r} is declared twice")
        sym = Symbol(
            sym_name,
            _binding_checked(decomposition),
            namespace=LTORCH_NAMESPACE,
            impl=torch_fn,
            torch_fn=torch_fn,
            tags=set(tags),
        )
        spellings = [torch_fn, *aliases]
        spellings += [getattr(torch.Tensor, method) for method in methods]
        for spelling in spellings:
            if _BY_TORCH_FN.get(spelling, sym) is not sym:
                raise ValueError(f"{spelling} is already registered as "
                                 f"{_BY_TORCH_FN[spelling].id}")
            _BY_TORCH_FN[spelling] = sym
        _BY_NAME[sym_name] = sym
        return sym

    return declare


def _binding_checked(decomposition: Callable) -> Callable:
    """`decomposition`, raising `NotYetSupportedError` for a call whose arguments do not bind to
    its signature (an alias spelling such as numpy's `axis=` for `dim=`, which torch accepts):
    the tracer then records the exact torch op instead of failing with a TypeError."""
    signature = inspect.signature(decomposition)

    @functools.wraps(decomposition)
    def checked(*args, **kwargs):
        try:
            signature.bind(*args, **kwargs)
        except TypeError as error:
            raise NotYetSupportedError(f"unsupported arguments: {error}",
                                       op=decomposition.__name__) from None
        return decomposition(*args, **kwargs)

    return checked


def symbol_for(torch_fn: Callable) -> Symbol | None:
    """The torch-level symbol registered for a torch callable, or None."""
    try:
        return _BY_TORCH_FN.get(torch_fn)
    except TypeError:  # unhashable callable
        return None


def all_torch_ops() -> dict[str, Symbol]:
    """Every declared torch-level op, by name."""
    return dict(_BY_NAME)


def registered_torch_callables() -> dict[Callable, Symbol]:
    """Every torch callable fulmen decomposes, with its symbol."""
    return dict(_BY_TORCH_FN)


# id -> (callable, name): the callable is kept so that an id reused by a later object (some
# attributes, such as `torch.Tensor.__init_subclass__`, are made anew at each lookup) never
# names that object
_QUALNAMES: dict[int, tuple[Callable, str]] | None = None


def torch_qualname(fn: Callable) -> str | None:
    """The public dotted name of a torch callable (`'torch.nn.functional.gelu'`), or None."""
    global _QUALNAMES
    if _QUALNAMES is None:
        _QUALNAMES = {}
        spaces = [
            ("torch.Tensor", torch.Tensor),
            ("torch.special", torch.special),
            ("torch.linalg", torch.linalg),
            ("torch.fft", torch.fft),
            ("torch.nn.functional", F),
            ("torch", torch),
        ]
        for prefix, space in spaces:
            # vars() of a module, not getattr: torch's lazy submodules must not be imported
            items = vars(space).items() if prefix != "torch.Tensor" else (
                (attr, getattr(space, attr)) for attr in dir(space))
            for attr, value in list(items):
                if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
                    continue
                if callable(value) and not isinstance(value, type):
                    _QUALNAMES.setdefault(id(value), (value, f"{prefix}.{attr}"))
    known, name = _QUALNAMES.get(id(fn), (None, None))
    if known is not fn:
        name = None
    if name is None and getattr(fn, "__name__", None) == "__get__":  # a Tensor property getter
        owner = getattr(fn, "__self__", None)
        prop = getattr(owner, "__name__", None)
        if prop is not None and getattr(torch.Tensor, prop, None) is owner:
            return f"torch.Tensor.{prop}.__get__"
    return name
