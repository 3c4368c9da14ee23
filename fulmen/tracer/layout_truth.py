"""Eager's strides on the proxies a decomposition made (NOTE [layout truth]): the `LayoutTruth`
mixin of `TracerCtx` (`fulmen.tracer.dispatch`) replaces each new output proxy by one that
reports eager's layout, from a rule (`fulmen.tracer.layout`) or PyTorch's meta kernel."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from fulmen.core import FulmenError, NotYetSupportedError
from fulmen.core.proxy import iter_proxies
from fulmen.core.source import is_internal, user_source_location
from fulmen.ops.meta import call_on_meta, eager_layouts, with_strides
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import known_same_shape, strides_of
from fulmen.tracer.call_kinds import _func_name
from fulmen.tracer.layout import rule_layouts
from fulmen.tracer.stand_in_layouts import stand_in_layouts

T = torch.Tensor


class LayoutTruth:
    """The layout methods of `TracerCtx` (which provides `names`, `scopes`, `mutation` and
    `undecided_layouts`)."""

    def _eager_layout(self, func, args, kwargs, out, start: int, whole: bool = False):
        """`out` (a decomposition's result) with eager's strides on the proxies it created.

        NOTE [layout truth]: a decomposition gives the right shapes and values, but the strides
        of the proxies its prims create are the prims' (mostly contiguous), while eager's output
        of `func` may be a transposed view, keep a channels_last input's layout, or be an expand.
        User code reads them (`x.stride()`, `is_contiguous(memory_format=...)`, `view`, which
        fails or succeeds on eager's strides), so each new output proxy is replaced by one that
        reports eager's strides: by a rule where one is cheap and certain (`fulmen.tracer.layout`),
        else from PyTorch's meta kernel for `func` on the same arguments (`eager_layouts`).
        It is marked exact (`_fulmen_exact_strides`) when every tensor argument was. When
        neither can describe the call, the decomposition's strides are kept, unmarked.

        With symbolic sizes the same rules and meta kernels run on fake tensors of the trace's
        ShapeEnv (`fulmen.ops.meta`), so strides are SymInt expressions (`12*s0`), and each
        decision PyTorch's layout code takes about sizes (a stride order, a size-1 dim) is
        recorded as a shape guard: the entry serves only sizes that eager lays out alike.

        An op recorded `whole` (an opaque symbol, laid out by its meta kernel) is corrected only
        where the meta and CPU kernels disagree (`stand_in_layouts`).
        """
        leaves, spec = pytree.tree_flatten(out)
        serial_of = self.names.serial_of
        fresh = [leaf for leaf in leaves
                 if isinstance(leaf, TensorProxy) and serial_of(leaf.name) >= start]
        if not fresh:
            return out  # nothing new (an identity such as `x.float()` on a float tensor)
        scope = self.scopes[-1]
        bsym = scope[-1] if scope and scope[-1].output is out else None
        if whole:
            layouts = stand_in_layouts(func, args, kwargs, leaves)
            if layouts is None:
                return out
        else:
            layouts = rule_layouts(func, bsym, args, kwargs, leaves)
        if layouts is None:
            layouts = eager_layouts(func, args, kwargs)
        if layouts is None and func in _STRIDED_VIEWS:
            self._check_view(func, args, kwargs, bsym)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if layouts is None or len(layouts) != len(tensors):
            return out
        replaced: dict[str, TensorProxy] = {}
        exact = all(p.name in self.mutation.inputs or getattr(p, "_fulmen_exact_strides", False)
                    for p in iter_proxies((args, kwargs)) if isinstance(p, TensorProxy))
        for i, (shape, strides) in zip(tensors, layouts):
            leaf = leaves[i]
            if (not isinstance(leaf, TensorProxy) or serial_of(leaf.name) < start
                    or not _same_shape(leaf.shape, shape)):
                continue
            if leaf.name in replaced:  # one proxy returned twice: keep the first layout
                leaves[i] = replaced[leaf.name]
            elif not known_same_shape(strides_of(leaf), strides):  # no guard: see its docstring
                leaves[i] = replaced[leaf.name] = with_strides(leaf, strides, exact)
            elif exact:
                leaf._fulmen_exact_strides = True
        if not replaced:
            return out
        new_out = pytree.tree_unflatten(leaves, spec)
        if bsym is not None:  # the statement the decomposition recorded
            scope[-1] = bsym.replace(output=new_out)
        return new_out

    def _check_view(self, func, args, kwargs, bsym) -> None:
        """Raise eager's error for a `view` its input's strides cannot give (the decomposition,
        a reshape, does not look at strides), when those strides are known to be eager's."""
        source = args[0] if args else None
        if not isinstance(source, TensorProxy) or not (
                source.name in self.mutation.inputs
                or getattr(source, "_fulmen_exact_strides", False)):
            return
        try:
            call_on_meta(func, args, kwargs)  # symbolic sizes: guards what eager decides
        except (RuntimeError, ValueError) as error:
            # eager's C++ check, or the same check in PyTorch's fake kernel (symbolic sizes)
            if not any(text in str(error) for text in _VIEW_ERRORS):
                return
            if bsym is not None and self.scopes[-1] and self.scopes[-1][-1] is bsym:
                self.scopes[-1].pop()
            message = str(error).splitlines()[0]
            if _VIEW_ERRORS[0] not in message:  # eager's wording for the fake kernel's
                message = ("view size is not compatible with input tensor's size and stride "
                           f"({message})")
            raise FulmenError(message, op=_func_name(func), where=user_source_location()) from None

    def check_layout_read(self, proxy, what: str, caller) -> None:
        """Raise when user code (`caller` is a frame outside fulmen and torch) reads the strides
        or storage offset of a proxy computed from a `contiguous()` whose aliasing eager
        decides at run time: the strides of its size-1 dimensions and its offset are those of
        the copy (NOTE [contiguous of a batch of 1] in `fulmen.ops.opaque`). The symbolic
        trace then fails and is retraced with the size of 1 specialised."""
        if proxy.name not in self.undecided_layouts or is_internal(caller.f_code.co_filename):
            return
        raise NotYetSupportedError(
            f"{what} of a tensor made by contiguous() of a tensor that is contiguous only for a "
            "batch of 1: eager's answer depends on that size", op=f"Tensor.{what}",
            where=user_source_location())


_STRIDED_VIEWS = frozenset({T.view, T.view_as})
_VIEW_ERRORS = ("view size is not compatible", "Cannot view a tensor with shape")


def _same_shape(ours, eagers) -> bool:
    """Whether the decomposition's shape is eager's: decided without a guard where the sizes
    settle it (`known_same_shape`); two symbolic spellings of one size that PyTorch's engine
    cannot prove equal (`-(-s0 // 5)` and `(s0 + 4) // 5`) but that agree at this call's sizes
    are compared with a guard, so the entry is used only where they agree."""
    if known_same_shape(ours, eagers):
        return True
    if len(ours) != len(eagers) or [_hint(a) for a in ours] != [_hint(b) for b in eagers]:
        return False
    return all(bool(a == b) for a, b in zip(ours, eagers))


def _hint(size):
    return size.node.hint if isinstance(size, torch.SymInt) else size


__all__ = ["LayoutTruth"]
