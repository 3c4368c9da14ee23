"""How one in-place call is recorded functionally: `InplaceCalls.functionalize` routes an
in-place method, `out=` call, `inplace=True` flag, `__setitem__`, `nn.init` fill or ATen
in-place op to its out-of-place form and hands the new value to `Functionalizer.mutate`
(`fulmen.tracer.mutation`, whose tracker this mixin is part of).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types

import torch
import torch.nn.functional as F

from fulmen.core import FulmenError, NotYetSupportedError, RunsEagerly
from fulmen.core.source import user_source_location
from fulmen.ops.functionalized import apply_init, apply_inplace, apply_inplace_random, setitem
from fulmen.ops.meta import call_on_meta
from fulmen.proxies import TensorProxy
from fulmen.tracer.aten_inplace import (
    functional_variant,
    overlaps_itself,
    products_of_rounded_scalars,
    returns_nothing,
    rounds_its_scalars,
    unwritten_arguments,
    written_arguments,
)
from fulmen.tracer.batch_norm import functionalize_batch_norm
from fulmen.tracer.flag_reads import keyed_gradient
from fulmen.tracer.fresh_leaves import is_requires_grad_set, make_fresh_leaf
from fulmen.tracer.metadata_inplace import MetadataMutation, trace_metadata_change

T = torch.Tensor


@functools.cache
def signature_of(func) -> inspect.Signature | None:
    """`inspect.signature(func)`, or None for builtins without one."""
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


_DETACHES = (torch.detach, T.detach)
_GRAD_SET = T.grad.__set__


_METADATA_INPLACE = {
    "requires_grad_", "detach_", "resize_", "resize_as_", "set_", "as_strided_", "squeeze_",
    "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "share_memory_", "map_",
    "apply_", "map2_", "retain_grad", "rename_", "refine_names", "align_to", "__set__",
    "__delitem__",
}  # fmt: skip
_RANDOM_INPLACE = {
    "uniform_", "normal_", "bernoulli_", "exponential_", "random_", "geometric_", "cauchy_",
    "log_normal_",
}  # fmt: skip
_INPLACE_DUNDER_TO_OUT = {
    "__iadd__": "__add__", "__isub__": "__sub__", "__imul__": "__mul__",
    "__itruediv__": "__truediv__", "__idiv__": "__truediv__", "__ifloordiv__": "__floordiv__",
    "__imod__": "__mod__", "__ipow__": "__pow__", "__iand__": "__and__", "__ior__": "__or__",
    "__ixor__": "__xor__", "__ilshift__": "__lshift__", "__irshift__": "__rshift__",
    "__imatmul__": "__matmul__",
}  # fmt: skip


class OpWritingArguments(RunsEagerly):
    """The traced code calls an op through `torch.ops` that writes its arguments (`out=`, or a
    mutable argument of a user's `torch.library.custom_op`): the call runs eagerly."""


def _beside(func, out_name: str):
    """The out-of-place op next to the in-place function `func` that is no tensor method
    (`F.hardtanh_` is `torch._C._nn.hardtanh_`, beside `torch._C._nn.hardtanh`; `torch.selu_`
    beside `torch.selu`): ATen's pairs take the same arguments. None where there is none."""
    home = getattr(func, "__self__", None)
    if not isinstance(home, types.ModuleType):
        home = sys.modules.get(getattr(func, "__module__", None) or "")
    found = getattr(home, out_name, None) if home is not None else None
    return found if callable(found) else None


def _as_number(value):
    """A 0-d tensor given where a Python number is expected, as its number (`.item()`)."""
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        return value.item()
    return value


class InplaceCalls:
    """The routing of in-place calls, mixed into `Functionalizer` (which provides `ctx`,
    `resolve`, `resolve_tree`, `mutate` and the tracker's state)."""

    def _same_value(self, target, value) -> bool:
        """Whether `value` is `target` itself, or its detach (under no_grad, as `nn.Module.
        _apply` makes it): storing it into `target.data` changes nothing."""
        if not (isinstance(target, TensorProxy) and isinstance(value, TensorProxy)):
            return False
        target, value = self.resolve(target), self.resolve(value)
        if target is value:
            return True
        for bsym in reversed(self.ctx.bsyms[-4:]):
            if value.name in bsym.output_names:
                return bsym.sym.torch_fn in _DETACHES and bool(bsym.args) and isinstance(
                    bsym.args[0], TensorProxy) and self.resolve(bsym.args[0]) is target
        return False

    def _requires_grad_unchanged(self, args: tuple, kwargs: dict) -> bool:
        """Whether `t.requires_grad_(flag)` leaves `t` as it is: its flag is already `flag`,
        and `t` is a value of the trace, not one of its inputs. An input's flag may differ at
        the next call (a parameter of a module the function closes over is not keyed by it):
        `model.requires_grad_(True)` traced with the model trainable was dropped from calls
        made with it frozen, so it stayed frozen (the call now runs eagerly)."""
        target = args[0]
        flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
        if not isinstance(target, TensorProxy) or not isinstance(flag, bool):
            return False
        if target.name in self.inputs:  # a closed-over gradient's flag is keyed
            if not any(proxy is target for _, proxy in self.ctx.captured.values()):
                # an argument's tensor, or one inside an argument object (an optimizer's
                # `p.grad`, which its `zero_grad(set_to_none=False)` sets to False): the cache
                # key holds its flag
                return flag == target.requires_grad
            grad = keyed_gradient(self.ctx, target)
            return grad is not None and flag == grad.requires_grad
        return flag == (self.ctx.differentiable and target.name in self.ctx.requires_grad_names)

    # -- routing of one in-place call -----------------------------------------------------------

    def functionalize(self, func, args: tuple, kwargs: dict):
        """Record the in-place call `func(*args, **kwargs)` functionally; return what eager
        returns (the mutated tensor object itself, or None for `__setitem__`)."""
        ctx = self.ctx
        start = ctx.names.serial
        name = getattr(func, "__name__", "")
        label = f"Tensor.{name}" if getattr(T, name, None) is func else name
        if isinstance(func, torch._ops.OpOverload):  # `torch.ops.aten.add_.Tensor(x, y)`
            name, label = func.overloadpacket.__name__, str(func)
            if not name.endswith("_") or kwargs.get("out") is not None:
                raise OpWritingArguments(  # (a user's `torch.library.custom_op` that mutates)
                    "an op that writes its arguments (out= or a mutable argument: a custom op "
                    "with mutates_args) is called through torch.ops, which fulmen does not "
                    "record functionally", op=label, where=user_source_location(),
                    hint="call the in-place method (x.add_(y)) or the op without out=; a "
                    "custom op may return new tensors instead of writing its arguments")
        if kwargs.get("out") is not None:
            return self._out_variant(func, args, kwargs, label, start)
        if func in (F.batch_norm, torch.batch_norm):
            return self._batch_norm(func, args, kwargs, start)
        if name == "requires_grad_" and self._requires_grad_unchanged(args, kwargs):
            return args[0]  # asks for what it already has (HF gradient checkpointing's hook)
        if is_requires_grad_set(func, name) and make_fresh_leaf(self, func, args, kwargs):
            return None if name == "__set__" else args[0]  # NOTE [fresh leaves]
        if func == _GRAD_SET and len(args) == 2 and args[1] is None and isinstance(
                args[0], TensorProxy):  # `p.grad = None` (`optimizer.zero_grad()`)
            with torch._C.DisableTorchFunctionSubclass():
                args[0].grad = None
            self.grad_clears.append(args[0])
            return None
        if name == "__set__" and len(args) == 2 and self._same_value(args[0], args[1]):
            return None  # `p.data = p.to(p.dtype)` (nn.Module._apply of a no-op `.to`)
        if name in _METADATA_INPLACE and args and not kwargs.get("out"):
            new = trace_metadata_change(self, name, args, kwargs)  # NOTE [in-place metadata ...]
            if new is not None:
                return new
        if name in _METADATA_INPLACE or func is F.embedding:
            raise MetadataMutation("in-place changes of tensor metadata (and F.embedding's "
                                   "max_norm renormalisation) are not supported yet",
                                   op=label, where=user_source_location())
        if name == "__setitem__":
            target, index, value = args
            r_target, r_index, r_value = self.resolve_tree((target, index, value))
            with ctx.internal():
                new = ctx.call(setitem, r_target, r_index, r_value)
            self.mutate(target, new, label, start)
            return None
        if getattr(func, "__module__", None) == "torch.nn.init":
            return self._init(func, args, kwargs, f"nn.init.{name}", start)
        if name.startswith("_") and not name.startswith("__") and name.endswith("_"):
            return self._aten_inplace(name, args, kwargs, label, start)
        if not name.endswith("_") and name not in _INPLACE_DUNDER_TO_OUT:
            return self._inplace_flag(func, args, kwargs, label, start)
        target = args[0] if args else None
        if not isinstance(target, TensorProxy):
            raise NotYetSupportedError("in-place call on a non-tensor (or on a tensor passed by "
                                       "keyword)", op=label, where=user_source_location())
        r_args, r_kwargs = self.resolve_tree((args, kwargs))
        with ctx.internal():
            value = self._out_of_place(name, r_args, r_kwargs, label, func)
        self.mutate(target, value, label, start)
        return target

    def _init(self, func, args: tuple, kwargs: dict, label: str, start: int):
        """`nn.init.kaiming_uniform_(w, a=...)` (which hands every argument over by keyword):
        the functional fill, recorded under no_grad, as nn.init runs."""
        bound = signature_of(func).bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        target = arguments.pop(next(iter(bound.signature.parameters)))
        if not isinstance(target, TensorProxy):
            raise NotYetSupportedError("nn.init of a non-tensor", op=label,
                                       where=user_source_location())
        with torch.no_grad():
            with self.ctx.internal():
                value = self.ctx.call(apply_init, func.__name__, self.resolve(target),
                                      **arguments)
            self.mutate(target, value, label, start)
        return target

    def _aten_inplace(self, name: str, args: tuple, kwargs: dict, label: str, start: int):
        """`torch._foreach_mul_(xs, 0.9)`, `torch._fused_adamw_(params, grads, ...)`: the
        functional ATen op, then every tensor it writes takes its new value (`aten_inplace`)."""
        written = written_arguments(name)
        functional = functional_variant(name)
        if not written or functional is None:
            raise NotYetSupportedError(f"in-place op {name} has no functional form to record",
                                       op=label, where=user_source_location())
        targets = [args[position] if position < len(args) else kwargs.get(argument)
                   for position, argument in written]
        r_args, r_kwargs = self.resolve_tree((args, kwargs))
        with self.ctx.internal():
            if rounds_its_scalars(name, r_args, r_kwargs):  # NOTE [in-place foreach products ...]
                values = products_of_rounded_scalars(*r_args)
            else:
                values = functional(*r_args, **r_kwargs)
        if len(written) == 1:
            values = (values,)
        kept = unwritten_arguments(name, r_args, r_kwargs)
        for (_, argument), target, value in zip(written, targets, values, strict=True):
            many = isinstance(target, (list, tuple))
            for each, new in zip(target, value, strict=True) if many else [(target, value)]:
                if not isinstance(each, TensorProxy):
                    raise NotYetSupportedError("in-place call on a non-tensor", op=label,
                                               where=user_source_location())
                if argument in kept and overlaps_itself(each):
                    continue  # NOTE [fused optimizers write their grads only to unscale them]
                self.mutate(each, self._fit(new, each, label), label, start)
        if returns_nothing(name):
            return None
        return targets[0] if len(targets) == 1 else tuple(targets)

    def _out_of_place(self, name: str, args: tuple, kwargs: dict, label: str,
                      func=None) -> TensorProxy:
        self_value, rest = args[0], args[1:]
        if name == "copy_":
            src = rest[0] if rest else kwargs["src"]
            if not isinstance(src, torch.Tensor):
                src = torch.tensor(src)
            value = src.to(self_value.dtype) if src.dtype != self_value.dtype else src
            if tuple(value.shape) != tuple(self_value.shape):
                value = value.expand(self_value.shape).clone()
            return self._overwrite(self_value, value)
        if name == "zero_":
            return self._overwrite(self_value, torch.zeros_like(self_value))
        if name == "fill_" and isinstance(rest[0] if rest else kwargs.get("value"), (int, float, bool)):
            value = rest[0] if rest else kwargs["value"]
            return self._overwrite(self_value, torch.full_like(self_value, value))
        out_name = _INPLACE_DUNDER_TO_OUT.get(name, name[:-1])
        out_fn = getattr(T, out_name, None) or _beside(func, out_name)
        if name in _RANDOM_INPLACE and name != "bernoulli_":  # (bernoulli_ takes a tensor p)
            # their bounds and parameters are Python numbers, which eager also reads from a 0-d
            # tensor (`uniform_(-mag, mag)`, HF's NEFTune): its value, a graph break here
            rest = tuple(_as_number(value) for value in rest)
            kwargs = {key: _as_number(value) for key, value in kwargs.items()}
        if name in _RANDOM_INPLACE or out_fn is None or name == "fill_":
            sym = apply_inplace_random if name in _RANDOM_INPLACE else apply_inplace
            return self.ctx.call(sym, name, self_value, *rest, **kwargs)
        result = out_fn(self_value, *rest, **kwargs)
        return self._fit(result, self_value, label)

    def _overwrite(self, target: TensorProxy, value: TensorProxy) -> TensorProxy:
        """`value` (of `target`'s shape and dtype) replacing `target`. When `target` depends on
        an input requiring grad it stays an operand (`where(True, value, target)`), so that
        input gets zeros as its gradient, as from eager's Fill/Zero/CopyBackward, not None."""
        if target.name not in self.ctx.requires_grad_names:
            return value
        return torch.where(torch.ones_like(target, dtype=torch.bool), value, target)

    def _fit(self, result, target: TensorProxy, label: str) -> TensorProxy:
        """`result` checked and cast to the mutated tensor's shape and dtype, as eager does."""
        if not isinstance(result, TensorProxy):
            raise NotYetSupportedError("the out-of-place form does not return one tensor",
                                       op=label, where=user_source_location())
        if tuple(result.shape) != tuple(target.shape):
            raise FulmenError(f"output with shape {list(target.shape)} doesn't match the "
                              f"broadcast shape {list(result.shape)}", op=label,
                              where=user_source_location())
        if result.dtype != target.dtype:
            if not torch.can_cast(result.dtype, target.dtype):
                raise FulmenError(f"result type {result.dtype} can't be cast to the desired "
                                  f"output type {target.dtype}", op=label,
                                  where=user_source_location())
            result = result.to(target.dtype)
        return result

    def _inplace_flag(self, func, args, kwargs, label: str, start: int):
        """`F.relu(x, inplace=True)` and friends: the op with inplace=False, then the update."""
        signature = signature_of(func)
        bound = signature.bind(*args, **kwargs)
        bound.arguments["inplace"] = False
        target = next(iter(bound.arguments.values()))
        r_args, r_kwargs = self.resolve_tree((bound.args, bound.kwargs))
        with self.ctx.internal():
            value = self._fit(func(*r_args, **r_kwargs), self.resolve(target), label)
        self.mutate(target, value, label, start)
        return target

    def _out_variant(self, func, args, kwargs, label: str, start: int):
        kwargs = dict(kwargs)
        outs = kwargs.pop("out")
        r_args, r_kwargs = self.resolve_tree((args, kwargs))
        with self.ctx.internal():
            result = func(*r_args, **r_kwargs)
            targets = outs if isinstance(outs, (tuple, list)) else (outs,)
            results = result if isinstance(result, (tuple, list)) else (result,)
            if len(targets) != len(results):
                raise NotYetSupportedError("out= with this op", op=label,
                                           where=user_source_location())
            _check_out_dtypes(func, r_args, r_kwargs, results, targets, self.resolve, label)
            if any(isinstance(r, TensorProxy) and isinstance(t, TensorProxy)
                   and tuple(r.shape) != tuple(t.shape) for r, t in zip(results, targets)):
                raise MetadataMutation(  # eager resizes it (warning when it was not empty)
                    "an out= tensor of another shape than the result, which eager resizes",
                    op=label, where=user_source_location(),
                    hint="pass an out= tensor of the result's shape, or call the op without out=")
            values = [self._fit(r, self.resolve(t), label) for r, t in zip(results, targets)]
        if torch.is_grad_enabled() and any(isinstance(r, TensorProxy) and r.name in
                                           self.ctx.requires_grad_names for r in results):
            raise FulmenError(  # eager's own error: `out=` results carry no autograd history
                f"{label}(): functions with out=... arguments don't support automatic "
                "differentiation, but one of the arguments requires grad", op=label,
                where=user_source_location(), hint="call it without out=, or under torch.no_grad()")
        for target, value in zip(targets, values):
            self.mutate(target, value, label, start)
        return outs

    def _batch_norm(self, func, args, kwargs, start: int):
        """Training-mode batch norm with running statistics (`tracer/batch_norm.py`)."""
        bound = signature_of(func).bind(*args, **kwargs)
        bound.apply_defaults()
        return functionalize_batch_norm(self, func, dict(bound.arguments), start)



def _check_out_dtypes(func, args, kwargs, results, targets, resolve, label: str) -> None:
    """An `out=` tensor of another dtype than the result's is accepted where eager accepts it:
    most ops cast to it (as `_fit` does), some require the result's own dtype (`gather`,
    `index_select`). The exact op runs on meta tensors with the `out=` given to ask.

    Raises:
        FulmenError: eager's op refuses the `out=` dtype (its message, the user's line).
    """
    resolved = [resolve(t) for t in targets]
    if all(not isinstance(r, TensorProxy) or r.dtype == t.dtype for r, t in zip(results, resolved)):
        return
    outs = tuple(resolved) if len(resolved) > 1 else resolved[0]
    try:
        call_on_meta(func, args, {**kwargs, "out": outs})
    except (RuntimeError, TypeError, ValueError) as error:
        raise FulmenError(str(error).splitlines()[0], op=label,
                          where=user_source_location()) from error


__all__ = ["InplaceCalls", "signature_of"]
