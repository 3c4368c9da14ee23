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

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from fulmen.core import BoundSymbol, CallSiteTag, FulmenError, NotYetSupportedError, RunsEagerly
from fulmen.core.proxy import iter_proxies, map_proxies
from fulmen.core.source import user_source_location
from fulmen.ops.functionalized import WRITE_BACK, replay, snapshot, view_of_written, view_scatter
from fulmen.proxies import TensorProxy, differentiable_value
from fulmen.tracer.fresh_leaves import check_fresh_update, mark_fresh
from fulmen.tracer.inplace_calls import InplaceCalls
from fulmen.tracer.metadata_inplace import StaleTensorProxy, stale_use
from fulmen.tracer.view_calls import _UNREPLAYABLE, VIEW_FUNCTIONS, _is_basic_index


class LeafModified(RunsEagerly):
    """An in-place update, with grad on, of a tensor the call made with `requires_grad=True`
    (`w = torch.zeros(3, requires_grad=True); w.add_(1)`), or of a view of it: eager raises (a
    leaf requiring grad), so the call runs eagerly and raises as eager does."""


class NoGradUpdate(RunsEagerly):
    """NOTE [no_grad updates of tensors requiring grad]: `with torch.no_grad(): p -= lr *
    p.grad` (a hand-written SGD step, an EMA update, `torch._foreach_lerp_`) is eager's way to
    update parameters, and a trace that computes nothing with grad compiles it: its write-back
    updates the leaf outside autograd, as eager does. So does an update with grad on through
    `p.detach()` or `p.data` of a value that needs no grad (`AveragedModel.update_parameters`):
    autograd records none of it. A trace that also computes with grad
    (a forward reading the parameter before or after the update) cannot keep eager's meaning
    (the gradient flows to the leaf as updated, or eager's version check fails): the call runs
    eagerly."""


class InputRequiringGradModified(RunsEagerly):
    """An argument that requires grad is modified in place while grad is on (`h.mul_(2)` on
    a layer's input, `nn.ReLU(inplace=True)` first in a jitted block). Eager records the
    update in the argument's own autograd history (its `grad_fn` and version change, and
    gradients flow through the update), or raises for a leaf; a compiled call returns new
    tensors instead, so the call runs eagerly and answers as eager does."""


class GradValueWrittenBack(RunsEagerly):
    """A tensor the call gets but does not differentiate (a registered buffer, an argument
    that does not require grad) is updated in place, with grad on, with a value that requires
    grad (`self.avg.mul_(0.9).add_(y.mean(0))`): eager records the update in the tensor's own
    autograd history (it then requires grad, with a grad_fn), which a compiled call's
    write-back, outside autograd, cannot, so the call runs eagerly and answers as eager does."""


class CheckpointedUpdate(RunsEagerly):
    """An argument or buffer is modified in place inside a `torch.utils.checkpoint` region
    with grad on (a BatchNorm's running statistics and `num_batches_tracked`): eager's backward
    recomputes the region and modifies it a second time, a compiled call once (its backward
    recomputes values, not updates), so the call runs eagerly and updates as eager does."""


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
    op: str = "in-place update"  # the op of the last in-place update


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


class Functionalizer(InplaceCalls):
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
        outside_autograd = self._check_grad(root, op, target, value)
        if root.proxy.name in self.inputs and torch.is_grad_enabled() \
                and CallSiteTag.CHECKPOINT in self.ctx.call_site_tags():
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
                with torch.no_grad() if outside_autograd else nullcontext():
                    root.value = self.ctx.call(view_scatter, root.value, value, view.steps)
                view.value = value
            if keeps_fresh:  # the leaf's new value (NOTE [fresh leaves])
                mark_fresh(self.ctx, value)
        root.version += 1
        root.source = user_source_location()
        root.op = op
        if view is not None:
            view.version = root.version
        self.mutated = True

    def _check_grad(self, root: _Root, op: str, target: TensorProxy, value: TensorProxy) -> bool:
        """Refuse an update autograd would record into an argument requiring grad; True for an
        update of one that autograd does not see, with grad on: through `p.detach()` or
        `p.data`, of a value that needs no grad (`AveragedModel.update_parameters`, a
        hand-written EMA or clamp), which eager makes as one under no_grad (NOTE [no_grad
        updates of tensors requiring grad])."""
        if not self.ctx.differentiable or root.proxy.name not in self.ctx.requires_grad_names:
            return False
        if root.proxy.name not in self.inputs:
            return False
        detached = target.name not in self.ctx.requires_grad_names \
            and value.name not in self.ctx.requires_grad_names
        if not torch.is_grad_enabled() or detached:
            self.no_grad_updates.append((root.proxy.name, op, user_source_location()))
            return torch.is_grad_enabled()
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
        if self.ctx.backward_in_trace:  # it runs without torch.autograd: nothing saved for a
            differentiated = set()      # backward sees the update
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
                raise GradValueWrittenBack(
                    f"{name}, which does not require grad (a buffer?), is updated in place with "
                    "a value that requires grad", op=root.op, where=root.source,
                    hint="detach the value (or update it under torch.no_grad()) to compile "
                    "the call")
        if self.ctx.differentiable and self.ctx.requires_grad_names \
                and not self.ctx.backward_in_trace:  # (such a trace is never split)
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
        in-place update of the output reaches the input. Outputs that are views of a mutated
        intermediate are taken anew from its current value by the view's own ops: eager
        returns a view of it, and `returned_views` then gives a view of that output where the
        intermediate is returned too (`z = y[:, ::2]; z.mul_(2); return z, y`: the caller's
        update of `z` reaches `y`, as in eager; the mutation's own value is no view, and was
        returned before). (The resolved value stays the output where the view's aliasing is
        unknown: reading it then raised already.)"""
        for index, leaf in enumerate(leaves):
            view = self.views.get(leaf.name) if isinstance(leaf, TensorProxy) else None
            if view is None or not view.exact:
                continue
            root = self.roots[view.root]
            if root.value is root.proxy:
                continue  # never written: the output is a view op of the root already
            with self.ctx.internal():
                resolved[index] = self.ctx.call(view_of_written, root.proxy, view.steps) \
                    if view.root in self.inputs else replay(root.value, view.steps)
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


__all__ = ["Functionalizer"]
