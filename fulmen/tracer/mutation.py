"""Functionalization of in-place operations while tracing.

Traces are SSA: a name is assigned once and never changes value. User code mutates tensors
(`x.add_(1)`, `x[..., :n] = y`, `F.relu(x, inplace=True)`, BatchNorm's running statistics), so
the tracer rewrites each mutation as it records it:

- the in-place op becomes its out-of-place form (`t3 = ltorch.add(t2, 1)`), cast back to the
  mutated tensor's dtype and checked against its shape, as eager does;
- the tensor object the user holds keeps standing for the tensor: later reads of it (and of any
  view of it the tracer has seen) read the newest SSA value (`Functionalizer.resolve`);
- a mutation through a view writes into the view's *base* with `functionalized.view_scatter`
  (the functional forms are ops: `fulmen/ops/functionalized.py`)
  (a fresh copy of the base with the view overwritten), and views of the base are recomputed
  lazily when read after their base changed;
- at the end of the trace, every mutated trace input (argument, module parameter/buffer,
  captured tensor) gets an explicit write-back statement, `torch.Tensor.copy_(x, t7)`, tagged
  `side_effect` so dead code elimination keeps it. The caller sees eager's side effects.

NOTE [aliasing the tracer cannot decide]: whether `reshape`/`flatten` return a view depends on
strides that are only known for trace inputs. A maybe-view of anything else is recorded as
such; mutating it, or reading it after its base was mutated, raises `NotYetSupportedError`
naming the op and line: never a dropped or misdirected mutation.

NOTE [writes through a tensor that may alias]: mutating a maybe-view raises only when the
answer matters. Longformer writes into `attn.transpose(0, 1).reshape(s, b, e).contiguous()`,
which is a fresh tensor or a view of `attn` depending on strides; either way the written
tensor then holds the written values. So the written tensor becomes a root of its own, and its
possible base is *poisoned*: reading it (or a view of it) afterwards, mutating it, or returning
it raises, since its value depends on the aliasing. A base that is a trace input (whose write-
back would depend on it) raises at once.

NOTE [mutation and autodiff]: a trace input that requires grad must not be mutated in a trace
that may be differentiated (eager raises for leaves; for the rest the functional form would
hide the mutation from autograd), nor be updated with a value that requires grad: both raise.
In a trace that will be differentiated, reads of a mutated input read a snapshot taken at the
start (`functionalized.snapshot`), since the backward may save, or recompute from, any forward
value and the input holds the new value once the forward has run. Mutating intermediates is
plain SSA and differentiates like any other op.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from fulmen.core import BoundSymbol, FulmenError, NotYetSupportedError, RunsEagerly
from fulmen.core.proxy import iter_proxies, map_proxies
from fulmen.core.source import user_source_location
from fulmen.ops.functionalized import (
    WRITE_BACK,
    apply_init,
    apply_inplace,
    apply_inplace_random,
    replay,
    setitem,
    snapshot,
    view_of_written,
    view_scatter,
)
from fulmen.proxies import TensorProxy, differentiable_value
from fulmen.tracer.aten_inplace import functional_variant, returns_nothing, written_arguments
from fulmen.tracer.batch_norm import functionalize_batch_norm
from fulmen.tracer.fresh_leaves import (
    check_fresh_update,
    is_requires_grad_set,
    make_fresh_leaf,
    mark_fresh,
)
from fulmen.tracer.metadata_inplace import (
    MetadataMutation,
    StaleTensorProxy,
    stale_use,
    trace_metadata_change,
)

T = torch.Tensor


@functools.cache
def signature_of(func) -> inspect.Signature | None:
    """`inspect.signature(func)`, or None for builtins without one."""
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# Which calls are views
# ---------------------------------------------------------------------------------------------

_VIEW_METHODS = (
    "view", "view_as", "__getitem__", "select", "narrow", "transpose", "t", "permute", "squeeze",
    "unsqueeze", "expand", "expand_as", "unflatten", "movedim", "moveaxis", "swapaxes",
    "swapdims", "diagonal", "unfold", "unbind", "split", "split_with_sizes", "chunk",
    "tensor_split", "hsplit", "vsplit", "dsplit", "detach", "broadcast_to", "adjoint", "alias",
    "view_as_real", "view_as_complex", "conj", "resolve_conj", "resolve_neg", "atleast_1d",
    "atleast_2d", "atleast_3d",
)  # fmt: skip
_MAYBE_VIEW_METHODS = ("reshape", "reshape_as", "flatten", "ravel")
_VIEW_ATTRS = ("T", "mT", "H", "mH", "real", "imag", "data")
# Views whose element mapping depends on strides (or that mutating is an error for): reading
# them after their base changed, or mutating them, raises.
_UNREPLAYABLE = ("as_strided", "expand", "expand_as", "broadcast_to", "unfold")


def _view_table() -> dict:
    table: dict = {}
    for names, maybe in ((_VIEW_METHODS, False), (_MAYBE_VIEW_METHODS, True)):
        for name in names:
            for space in (T, torch, torch.functional):
                fn = getattr(space, name, None)
                if callable(fn):
                    table.setdefault(fn, ("method", name, maybe))
    for name in _VIEW_ATTRS:
        table[getattr(T, name).__get__] = ("attr", name, False)
    table[T.as_strided] = table[torch.as_strided] = ("method", "as_strided", False)
    return table


VIEW_FUNCTIONS = _view_table()

_DETACHES = (torch.detach, T.detach)
_GRAD_SET = T.grad.__set__


class LeafModified(RunsEagerly):
    """An in-place update, with grad on, of a tensor the call made with `requires_grad=True`
    (`w = torch.zeros(3, requires_grad=True); w.add_(1)`), or of a view of it: eager raises (a
    leaf requiring grad), so the call runs eagerly and raises as eager does."""


class NoGradUpdate(RunsEagerly):
    """NOTE [no_grad updates of tensors requiring grad]: `with torch.no_grad(): p -= lr *
    p.grad` (a hand-written SGD step, an EMA update, `torch._foreach_lerp_`) is eager's way to
    update parameters, and a trace that computes nothing with grad compiles it: its write-back
    updates the leaf outside autograd, as eager does. A trace that also computes with grad
    (a forward reading the parameter before or after the update) cannot keep eager's meaning
    (the gradient flows to the leaf as updated, or eager's version check fails): the call runs
    eagerly."""


class InputRequiringGradModified(RunsEagerly):
    """An argument that requires grad is modified in place while grad is on (`h.mul_(2)` on
    a layer's input, `nn.ReLU(inplace=True)` first in a jitted block). Eager records the
    update in the argument's own autograd history (its `grad_fn` and version change, and
    gradients flow through the update), or raises for a leaf; a compiled call returns new
    tensors instead, so the call runs eagerly and answers as eager does."""


class CheckpointedUpdate(RunsEagerly):
    """An argument or buffer is modified in place inside a `torch.utils.checkpoint` region
    with grad on (a BatchNorm's running statistics and `num_batches_tracked`): eager's backward
    recomputes the region and modifies it a second time, a compiled call once (its backward
    recomputes values, not updates), so the call runs eagerly and updates as eager does."""


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



def _as_number(value):
    """A 0-d tensor given where a Python number is expected, as its number (`.item()`)."""
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        return value.item()
    return value

def _is_basic_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(item is None or item is Ellipsis or isinstance(item, (int, slice))
               and not isinstance(item, bool) for item in items)


# ---------------------------------------------------------------------------------------------
# The tracker
# ---------------------------------------------------------------------------------------------


@dataclass
class _Root:
    """A tensor that is not a view of another one the tracer knows: its current value."""

    proxy: TensorProxy
    value: TensorProxy
    version: int = 0
    source: object = None  # the line of the last in-place update


@dataclass
class _View:
    """A view of root `root` obtained by `steps`; `value` is current as of root `version`.

    `exact` is False when some step's aliasing or element mapping is unknown (see NOTE [aliasing
    the tracer cannot decide]); `blame` names that step for the error. `undecided` says that
    only aliasing is unknown (a reshape or contiguous that eager decides at run time): every
    step maps elements as a view would (NOTE [writes through a tensor that may alias])."""

    root: str
    steps: tuple
    version: int
    value: TensorProxy
    exact: bool = True
    blame: tuple = field(default=("", None))
    undecided: bool = False


class Functionalizer:
    """Per-trace state of functionalization (see the module docstring)."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.roots: dict[str, _Root] = {}
        self.views: dict[str, _View] = {}
        self.inputs: dict[str, TensorProxy] = {}
        self.mutated = False
        # inputs requiring grad updated under no_grad: (name, op, source), checked by `finish`
        self.no_grad_updates: list[tuple] = []
        # tensors whose `.grad` the code set to None (`optimizer.zero_grad()`), in order: the
        # tracer makes them epilogue stores (`fulmen.tracer.objects`)
        self.grad_clears: list[TensorProxy] = []
        self.fresh_roots: set[str] = set()  # roots of the fresh leaves (NOTE [fresh leaves])
        # tensors made by a factory called with requires_grad=True: autograd leaves in eager
        self.grad_leaves: set[str] = set()
        # roots whose value is unknown: a tensor that may alias them was modified in place
        # (NOTE [writes through a tensor that may alias]); name -> that tensor's view record
        self.poisoned: dict[str, _View] = {}

    # -- inputs and reads ---------------------------------------------------------------------

    def add_input(self, proxy: TensorProxy) -> None:
        self.inputs[proxy.name] = proxy

    def _root(self, proxy: TensorProxy) -> _Root:
        root = self.roots.get(proxy.name)
        if root is None:
            root = self.roots[proxy.name] = _Root(proxy, proxy)
        return root

    def resolve(self, proxy: TensorProxy) -> TensorProxy:
        """The current value of the tensor the user holds as `proxy`."""
        if type(proxy) is StaleTensorProxy:  # NOTE [in-place metadata changes]
            raise stale_use(proxy, "read")
        view = self.views.get(proxy.name)
        if view is None:
            if self.poisoned and proxy.name in self.poisoned:
                self._undecidable(self.poisoned[proxy.name], "read after a tensor that may "
                                  "alias it was modified in place")
            root = self.roots.get(proxy.name)
            return proxy if root is None else root.value
        if self.poisoned and view.root in self.poisoned:
            self._undecidable(self.poisoned[view.root], "read after a tensor that may alias "
                              "its base was modified in place")
        root = self.roots[view.root]
        if view.version != root.version:
            if not view.exact:
                self._undecidable(view, "read after its base was modified in place")
            with self.ctx.internal():
                view.value = replay(root.value, view.steps)
            view.version = root.version
        return view.value

    def refuse_grad_reads(self, tree, out) -> None:
        """NOTE [no_grad updates of tensors requiring grad]: an op that reads, with grad on,
        an argument requiring grad after the code updated it under no_grad (`with no_grad():
        p.copy_(w)` then `p * 2`) computes with grad from the leaf in eager; the trace holds the
        update's value, which carries no grad, so the call runs eagerly.

        Raises:
            NoGradUpdate: such a read made a floating-point tensor.
        """
        if not self.no_grad_updates or not torch.is_grad_enabled():
            return
        if not any(map(differentiable_value, iter_proxies(out))):
            return
        updated = {name: (op, where) for name, op, where in self.no_grad_updates}
        for proxy in iter_proxies(tree):
            view = self.views.get(proxy.name)
            name = view.root if view is not None else proxy.name
            if name in updated:
                op, where = updated[name]
                raise NoGradUpdate(
                    f"{name}, which requires grad, is updated in place under torch.no_grad() "
                    "and then read with grad on", op=op, where=where,
                    hint="compile the update and the computation that reads it separately")

    def resolve_tree(self, tree):
        if not self.mutated:
            return tree
        return pytree.tree_map(
            lambda leaf: self.resolve(leaf) if isinstance(leaf, TensorProxy) else leaf, tree)

    def _undecidable(self, view: _View, what: str):
        op, where = view.blame
        raise NotYetSupportedError(
            f"a tensor that may or may not alias another one (made by {op}) is {what}; fulmen "
            "cannot tell whether eager would share memory here",
            op=op, where=where or user_source_location(),
            hint="add .clone() (no aliasing) or use a view op such as .view() (aliasing)")

    # -- views ----------------------------------------------------------------------------------

    def record_view(self, func, user_args: tuple, kwargs: dict, out) -> None:
        """Register the outputs of view op `func` as views of its first argument's root."""
        kind, name, maybe = VIEW_FUNCTIONS[func]
        if not user_args or not isinstance(user_args[0], TensorProxy):
            source, step, exact, maps_elements = None, None, False, False
            for leaf in pytree.tree_leaves((user_args, kwargs)):
                if isinstance(leaf, TensorProxy):
                    source = leaf
                    break
            if source is None:
                return
        else:
            source, rest = user_args[0], user_args[1:]
            exact = True
            if name == "__getitem__":
                exact = _is_basic_index(rest[0])
                if not exact:
                    return  # advanced indexing copies
            if name in ("view_as", "reshape_as", "expand_as"):
                name = {"view_as": "view", "reshape_as": "reshape", "expand_as": "expand"}[name]
                rest = (tuple(rest[0].shape),)
            elif (name in ("view", "reshape") and isinstance(out, TensorProxy)
                  and any(True for _ in iter_proxies(rest))):
                # sizes given as tensors (Longformer's `view(b, h, n.max(), s)`): the result's
                # shape is the step (a dtype view has no tensor argument)
                rest, kwargs = (tuple(out.shape),), {}
            if any(True for _ in iter_proxies((rest, kwargs))) or name in _UNREPLAYABLE:
                exact = False
            maps_elements = exact
            if maybe and exact:
                decided = self._reshape_is_view(source, out)
                if decided is False:
                    return  # eager copies: the result aliases nothing
                exact = bool(decided)
            step = (kind, name, tuple(rest), dict(kwargs))
        parent = self.views.get(source.name)
        root_name = parent.root if parent is not None else self._root(source).proxy.name
        root = self.roots[root_name]
        steps = parent.steps if parent is not None else ()
        undecided = step is not None and maps_elements and (
            parent is None or parent.exact or parent.undecided) and (
            not exact or parent is not None and parent.undecided)
        exact = exact and (parent is None or parent.exact)
        if parent is not None and not parent.exact:
            blame = parent.blame
        elif not exact:  # the stack walk only where an error may need it
            blame = (name if step is not None else getattr(func, "__name__", "view"),
                     user_source_location())
        else:
            blame = ("", None)
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for index, leaf in enumerate(outputs):
            if not isinstance(leaf, TensorProxy) or leaf is source or leaf.name in self.views:
                continue
            this = None if step is None else (
                *step, index if isinstance(out, (tuple, list)) else None)
            self.views[leaf.name] = _View(root_name, (*steps, this), root.version, leaf,
                                          exact and this is not None, blame, undecided)

    def record_maybe_alias(self, source: TensorProxy, out: TensorProxy, op: str) -> None:
        """Register `out` as a tensor that may share `source`'s memory (which one eager
        returns is decided at run time): mutating it, or reading it after `source` changed,
        raises (see NOTE [aliasing the tracer cannot decide])."""
        parent = self.views.get(source.name)
        root_name = parent.root if parent is not None else self._root(source).proxy.name
        steps = parent.steps if parent is not None else ()
        blame = parent.blame if parent is not None and not parent.exact else (
            op, user_source_location())
        undecided = parent is None or parent.exact or parent.undecided
        self.views[out.name] = _View(root_name, (*steps, None), self.roots[root_name].version,
                                     out, False, blame, undecided)

    def _reshape_is_view(self, source: TensorProxy, out) -> bool | None:
        """Whether eager's reshape/flatten of `source` returns a view (True), a copy (False),
        or None when the tracer cannot tell (see NOTE [aliasing the tracer cannot decide]).

        A same-shape result is a view; otherwise the answer needs `source`'s real strides,
        known for trace inputs and for outputs of PyTorch's meta kernels: eager returns a view
        exactly when `view` would succeed on those strides.
        """
        if not isinstance(out, TensorProxy):
            return None
        if tuple(out.shape) == tuple(source.shape):
            return True
        if source.name not in self.inputs and not getattr(source, "_fulmen_exact_strides", False):
            return None
        layout = torch.empty_strided(tuple(source.shape), source.stride(), dtype=source.dtype,
                                     device="meta")
        try:
            with torch._C.DisableTorchFunction():
                layout.view(tuple(out.shape))
        except RuntimeError:
            return False
        return True

    # -- mutation -------------------------------------------------------------------------------

    def mutate(self, target: TensorProxy, value: TensorProxy, op: str, start: int) -> None:
        """Make `value` (same shape and dtype) the new value of the tensor the user holds as
        `target`; `start` is the name serial before the op, to tell new values from old ones."""
        if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
            raise FulmenError(f"in-place result {value.type_string()} does not fit the mutated "
                              f"tensor {target.type_string()}", op=op, where=user_source_location())
        view = self.views.get(target.name)
        poisoned = self.poisoned.get(target.name if view is None else view.root)
        if poisoned is not None:
            self._undecidable(poisoned, "modified in place after a tensor that may alias it was")
        if view is not None and view.undecided and view.root not in self.inputs:
            # NOTE [writes through a tensor that may alias]
            self.poisoned[view.root] = view
            del self.views[target.name]
            view = None
        root = self.roots[view.root] if view is not None else self._root(target)
        if self.grad_leaves and root.proxy.name in self.grad_leaves and torch.is_grad_enabled():
            raise LeafModified(f"{root.proxy.name}, made with requires_grad=True, (or a view of "
                               "it) is modified in place", op=op, where=user_source_location())
        self._check_grad(root, op)
        if root.proxy.name in self.inputs and torch.is_grad_enabled() \
                and "checkpoint" in self.ctx.call_site_tags():
            raise CheckpointedUpdate(f"{root.proxy.name} is modified in place inside a "
                                     "torch.utils.checkpoint region, which eager's backward "
                                     "runs again", op=op, where=user_source_location())
        keeps_fresh = check_fresh_update(self, root.proxy.name, target, value, op)
        with self.ctx.internal():
            if view is None:
                if self.ctx.names.serial_of(value.name) < start:
                    value = torch.clone(value)  # never let two tensors share one SSA value
                root.value = value
            else:
                if not view.exact:
                    self._undecidable(view, "modified in place")
                root.value = self.ctx.call(view_scatter, root.value, value, view.steps)
                view.value = value
            if keeps_fresh:  # the leaf's new value (NOTE [fresh leaves])
                mark_fresh(self.ctx, value)
        root.version += 1
        root.source = user_source_location()
        if view is not None:
            view.version = root.version
        self.mutated = True

    def _check_grad(self, root: _Root, op: str) -> None:
        if not self.ctx.differentiable or root.proxy.name not in self.ctx.requires_grad_names:
            return
        if root.proxy.name not in self.inputs:
            return
        if not torch.is_grad_enabled():  # NOTE [no_grad updates of tensors requiring grad]
            self.no_grad_updates.append((root.proxy.name, op, user_source_location()))
            return
        raise InputRequiringGradModified(
            f"an argument that requires grad (or a view of one), {root.proxy.name}, is modified "
            "in place", op=op, where=user_source_location(),
            hint="modify a copy (x = x.clone()), or call the compiled function under "
            "torch.no_grad()")

    # -- the end of the trace -------------------------------------------------------------------

    def finish(self, out_leaves: list) -> list:
        """Resolve the output leaves to current values and record the write-backs."""
        if not self.mutated:
            return out_leaves
        differentiated = set(self.ctx.requires_grad_names) - set(self.inputs)
        if self.no_grad_updates and self.ctx.differentiable and differentiated:
            name, op, where = self.no_grad_updates[0]
            raise NoGradUpdate(
                f"{name}, which requires grad, is updated in place under torch.no_grad() in a "
                "function that also computes with grad", op=op, where=where,
                hint="compile the update (an optimizer or EMA step) and the forward separately")
        resolved = []
        for leaf in out_leaves:
            root = self.roots.get(leaf.name) if isinstance(leaf, TensorProxy) else None
            if root is not None and leaf.name in self.inputs and root.version:
                resolved.append(leaf)  # eager returns the (mutated) input itself
            elif isinstance(leaf, TensorProxy):
                resolved.append(self.resolve(leaf))
            else:
                resolved.append(leaf)
        for name, root in self.roots.items():
            if name not in self.inputs or root.value is root.proxy:
                continue
            if self.ctx.differentiable and root.value.name in self.ctx.requires_grad_names:
                raise NotYetSupportedError(
                    f"{name} is updated in place with a value that requires grad",
                    op="in-place update", where=root.source,
                    hint="detach the value, or run under torch.no_grad()")
        if self.ctx.differentiable and self.ctx.requires_grad_names:
            self._snapshot_mutated_inputs()
        for name, root in self.roots.items():
            if name not in self.inputs or root.value is root.proxy:
                continue
            self.ctx.bsyms.append(BoundSymbol(WRITE_BACK, (root.proxy, root.value), {}, None,
                                              (), root.source))
        return self._views_of_written_inputs(out_leaves, resolved)

    def _views_of_written_inputs(self, leaves: list, resolved: list) -> list:
        """Outputs that are views of a mutated input become views of the input itself, taken
        after the write-backs (`functionalized.view_of_written`): eager returns the view, so an
        in-place update of the output reaches the input. (The resolved value stays the output
        where the view's aliasing is unknown: reading it then raised already.)"""
        for index, leaf in enumerate(leaves):
            view = self.views.get(leaf.name) if isinstance(leaf, TensorProxy) else None
            if view is None or not view.exact or view.root not in self.inputs:
                continue
            root = self.roots[view.root]
            if root.value is root.proxy:
                continue  # never written: the output is a view op of the input already
            with self.ctx.internal():
                resolved[index] = self.ctx.call(view_of_written, root.proxy, view.steps)
        return resolved

    def _snapshot_mutated_inputs(self) -> None:
        """In a trace autodiff will split, make every read of a mutated input read a snapshot
        taken first: the backward may read (save or recompute from) any forward value, and
        the input itself holds the new value once the forward has run."""
        mapping: dict[str, TensorProxy] = {}
        snapshots = []
        for name, root in self.roots.items():
            if name in self.inputs and root.value is not root.proxy:
                proxy = root.proxy
                copy = TensorProxy(self.ctx.names.named(f"{name}_before"), proxy.shape,
                                   proxy.dtype, proxy.device, strides=proxy.stride())
                mapping[name] = copy
                snapshots.append(BoundSymbol(snapshot, (proxy,), {}, copy, (), root.source))
        if not mapping:
            return

        def rename(bsym: BoundSymbol) -> BoundSymbol:
            swap = lambda p: mapping.get(p.name, p)  # noqa: E731
            return bsym.replace(args=map_proxies(swap, bsym.args),
                                kwargs=map_proxies(swap, bsym.kwargs),
                                subsymbols=tuple(rename(sub) for sub in bsym.subsymbols))

        body = self.ctx.scopes[0]
        body[:] = [*snapshots, *(rename(bsym) for bsym in body)]

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
        """Whether `t.requires_grad_(flag)` leaves `t` as it is: its flag is already `flag`."""
        target = args[0]
        flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
        if not isinstance(target, TensorProxy) or not isinstance(flag, bool):
            return False
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
                raise NotYetSupportedError(
                    "an ATen op that writes its arguments (out= or a mutable argument), called "
                    "through torch.ops", op=label, where=user_source_location(),
                    hint="call the in-place method (x.add_(y)) or the op without out=")
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
            value = self._out_of_place(name, r_args, r_kwargs, label)
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
            values = functional(*r_args, **r_kwargs)
        if len(written) == 1:
            values = (values,)
        for target, value in zip(targets, values, strict=True):
            many = isinstance(target, (list, tuple))
            for each, new in zip(target, value, strict=True) if many else [(target, value)]:
                if not isinstance(each, TensorProxy):
                    raise NotYetSupportedError("in-place call on a non-tensor", op=label,
                                               where=user_source_location())
                self.mutate(each, self._fit(new, each, label), label, start)
        if returns_nothing(name):
            return None
        return targets[0] if len(targets) == 1 else tuple(targets)

    def _out_of_place(self, name: str, args: tuple, kwargs: dict, label: str) -> TensorProxy:
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
        out_fn = getattr(T, out_name, None)
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


__all__ = ["Functionalizer", "VIEW_FUNCTIONS", "signature_of"]
