"""The functional forms of mutations: the symbols that traces functionalized by
`fulmen.tracer.mutation` record and printed traces call (`functionalized.view_scatter`,
`functionalized.setitem`, ...), and the write-back `torch.Tensor.copy_` ending a trace that
mutates its inputs. They live with the ops so that running a printed trace needs no tracer.
Each runs on a copy and returns it (no input is modified), except the write-back.
"""

from __future__ import annotations

import torch

from fulmen.core import FulmenError, Symbol
from fulmen.core.source import user_source_location
from fulmen.core.symbol import Namespace
from fulmen.ops.meta import run_meta

T = torch.Tensor
FUNCTIONALIZED = Namespace("functionalized", "fulmen.ops.functionalized",
                           "from fulmen.ops import functionalized")
_TORCH = Namespace("torch", torch, "import torch")
# Replaying a view on a value the tracer computed: `view` needs strides we do not track, while
# `reshape` gives the same elements and is a view wherever `view` would have succeeded.
_REPLAY_AS = {"view": "reshape", "view_as": "reshape_as"}


def _write_back_meta(dst, src):
    if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
        raise FulmenError(f"write-back of {src.type_string()} into {dst.type_string()}",
                          op="copy_")


# `dst.copy_(src)`: the explicit side effect ending a trace that mutates its inputs.
WRITE_BACK = Symbol("copy_", _write_back_meta, namespace=_TORCH, python_name="torch.Tensor.copy_",
                    impl=T.copy_, torch_fn=T.copy_, tags={"side_effect", "write_back"})


def replay(view: T, steps) -> T:
    """Apply recorded view steps (`(kind, name, args, kwargs, index)`) to `view`."""
    for kind, name, args, kwargs, index in steps:
        if kind == "attr":
            view = getattr(view, name)
        elif name == "view" and args and isinstance(args[0], torch.dtype):
            view = T.view(view, *args)  # a reinterpretation, not a reshape
        else:
            name = _REPLAY_AS.get(name, name)  # `torch.view_as_real` has no method
            view = (getattr(T, name, None) or getattr(torch, name))(view, *args, **kwargs)
        if index is not None:
            view = view[index]
    return view


def view_scatter_impl(base: T, value: T, steps: tuple) -> T:
    """A copy of `base` whose view `steps` is overwritten with `value` (same shape and dtype).

    The copy keeps `base`'s layout (dense in its order of strides): eager's views of `base`
    are then views of it too (`x.t().view(-1)` of a transposed `x`: a row-major copy raised
    "does not alias"), and what reads it is laid out as eager's (`x + 1` after `x[0].mul_(2)`
    of a transposed `x` came back row-major)."""
    out = base.clone(memory_format=torch.preserve_format)
    view = replay(out, steps)
    # never expected; storages compared by identity (a fake tensor's data_ptr warns)
    if view.untyped_storage()._cdata != out.untyped_storage()._cdata:
        raise FulmenError("the view of a mutation does not alias its base", op="view_scatter")
    view.copy_(value)
    return out


def setitem_impl(base: T, index, value) -> T:
    """`base` with `base[index] = value` applied to a copy (basic or advanced index)."""
    out = base.clone()
    out[index] = value
    return out


def apply_inplace_impl(method: str, self: T, *args, **kwargs) -> T:
    """A copy of `self` after the in-place method `method` (e.g. `"uniform_"`) ran on it."""
    out = self.clone()
    getattr(out, method)(*args, **kwargs)
    return out


def apply_init_impl(name: str, self: T, *args, **kwargs) -> T:
    """A copy of `self` after `torch.nn.init.<name>` (e.g. `"kaiming_uniform_"`) filled it."""
    out = self.clone()
    getattr(torch.nn.init, name)(out, *args, **kwargs)
    return out


def _opaque_meta(impl):
    def meta(*args, **kwargs):
        try:
            return run_meta(impl, *args, **kwargs)
        except FulmenError:
            raise
        except Exception as error:  # eager's own error message (shape mismatch, bad cast, ...)
            raise FulmenError(str(error), op=impl.__name__.removesuffix("_impl"),
                              where=user_source_location()) from error

    return meta


def _functional_symbol(name: str, impl, tags=()) -> Symbol:
    return Symbol(name, _opaque_meta(impl), namespace=FUNCTIONALIZED, impl=impl, torch_fn=impl,
                  tags={"opaque", "functionalized", *tags})


def snapshot_impl(a: T) -> T:
    """A copy of `a` taken before the trace mutates it (see NOTE [mutation and autodiff])."""
    return a.clone()


def view_of_written_impl(base: T, steps: tuple) -> T:
    """The view `steps` of `base`, taken after the trace wrote `base` back: an output that is a
    view of a mutated input is a view of the input itself, as in eager (an in-place update of
    the output reaches the input)."""
    return replay(base, steps)


view_scatter = _functional_symbol("view_scatter", view_scatter_impl)
view_of_written = _functional_symbol("view_of_written", view_of_written_impl)
# opaque on purpose: rematerialization never recomputes it from the (since mutated) input
snapshot = _functional_symbol("snapshot", snapshot_impl)
setitem = _functional_symbol("setitem", setitem_impl)
apply_inplace = _functional_symbol("apply_inplace", apply_inplace_impl)
apply_inplace_random = _functional_symbol("apply_inplace_random", apply_inplace_impl, {"random"})
# random: most initialisers draw from the global generator (in eager's order at run time)
apply_init = _functional_symbol("apply_init", apply_init_impl, {"random"})


def is_functionalized(sym: Symbol) -> bool:
    """Whether `sym` is one of the functional forms of a mutation (or its write-back)."""
    return "functionalized" in sym.tags or "write_back" in sym.tags


__all__ = ["FUNCTIONALIZED", "WRITE_BACK", "apply_init", "apply_inplace", "apply_inplace_random",
           "is_functionalized", "replay", "setitem", "snapshot", "view_of_written",
           "view_scatter"]
