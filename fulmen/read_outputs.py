"""Outputs that other outputs of a compiled call are computed from, each behind an autograd node
of its own.

NOTE [outputs other outputs read]: in `h = tanh(a(x)); return b(h), h`, eager's `h` gets the
gradient of both of its uses, `b(h)`'s and the caller's: a hook on `h` sees (and may change)
the sum, `retain_grad` stores it, `torch.autograd.grad(o.sum() + h.sum(), h)` returns it. A
compiled call is one autograd node (`fulmen.autograd_bridge`), and the part through `b(h)`
would flow inside its backward, unseen at `h`. So the outputs computed from such an output
(`h`: a *read output*) leave the call through nodes of their own, one per depth (the number of
read outputs on the way from the inputs: `h1 -> h2 -> o` gives `h2` depth 1, `o` depth 2): the
node of depth k takes the fused forward's values of its outputs, the read outputs of lower
depth they are computed from, and the call's inputs they read by other ways, and gives its
outputs back (the same memory, `detach`), so autograd sees the edges `h -> o`. The forward
stays the one fused execution.

Its backward has two ways:

- passed through (the usual `loss.backward()`, nothing watching a read output): the gradients
  of its outputs go back to the fused node's own slots for them, and that node's compiled
  backward handles everything, as without these nodes;
- exact (a hook or `retain_grad` on a read output, its hook dict registered at the forward so
  a hook on a tensor dropped since counts; a backward that captures gradients,
  `torch.autograd.grad` or `backward(inputs=...)`, told by whether the engine will run the
  accumulation node of a private leaf every such node reads; `create_graph=True`): the
  statements from its read outputs (as leaves) and the inputs to its outputs run again with
  torch's ops (`Stage.statements`: one layer for an HF model's hidden state, the loss for its
  logits) and `torch.autograd.grad` gives the gradients of the read outputs and inputs, the
  VJP of that stage alone: the read outputs get eager's total before their hooks run. A read
  output dropped since the forward is recomputed (without a graph) from the inputs. It raises
  where an input or read output was updated in place since the forward, and where the stage
  cannot be run again (random draws, side effects) and a hook needs it or the call's node does
  not run (the gradient is asked at a read output); a capturing backward that runs the call's
  node passes such a stage through (`autograd.grad(loss, params)` of a model with dropout: a
  gap where a gradient is also asked at a read output).

Calls without read outputs (or whose read outputs need no gradient) have none of this.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from fulmen.core import NotYetSupportedError, Tag, Trace, any_tagged
from fulmen.core.ambient import without_autocast
from fulmen.core.interpret import bind_outputs
from fulmen.core.proxy import map_proxies
from fulmen.proxies import TensorProxy, differentiable_value
from fulmen.returned_views import replay
from fulmen.transforms.autodiff import rule_for
from fulmen.transforms.autodiff.rules import differentiable_outputs

_NOT_RECOMPUTABLE = frozenset({Tag.RANDOM, Tag.WRITE_BACK, Tag.SIDE_EFFECT})


@dataclass(frozen=True)
class Stage:
    """The outputs of one depth, given by one node: `outputs` (positions among the output
    leaves), the read outputs of lower depth they are computed from (`reads`, positions among
    the output leaves), the call's inputs they read other than through those (`inputs`,
    positions among the call's inputs) and the statements (indices into the trace) that
    compute them from those; `refused` says why they cannot run again, or None."""

    outputs: tuple[int, ...]
    reads: tuple[int, ...]
    inputs: tuple[int, ...]
    statements: tuple[int, ...]
    refused: str | None


@dataclass(frozen=True)
class ReadOutputs:
    """The read outputs of a compiled call (positions among its output leaves) and the nodes
    that give the outputs computed from them (NOTE [outputs other outputs read])."""

    trace: Trace
    read: tuple[int, ...]
    stages: tuple[Stage, ...]
    names: tuple[str | None, ...]  # the name of each output leaf's proxy


def find_read_outputs(computation: Trace, returned, differentiable: tuple[bool, ...]
                      ) -> ReadOutputs | None:
    """The read outputs of `computation` (differentiable output leaves other differentiable
    output leaves are computed from, through the statements gradients flow through: not a
    `detach`'s or an argmax's) and the stages giving the outputs computed from them; None where
    there are none. Inputs returned as they are (`returned` with an empty chain) are left out:
    the call's node reads them, so autograd sees their uses; views replayed outside
    (`returned_views`) are kept: the node giving the outputs read from them reads the view."""
    leaves = pytree.tree_leaves(computation.output)
    as_is = {entry[0] for entry in returned if not entry[3]}
    kept = [k for k, leaf in enumerate(leaves) if isinstance(leaf, TensorProxy)
            and k not in as_is and k < len(differentiable) and differentiable[k]]
    if len(kept) < 2:
        return None
    flows = _flows(computation)
    read = _read_names(computation, leaves, kept, flows)
    if not read:
        return None
    depth, deps = _depths(computation, read, flows)
    replayed = {entry[0] for entry in returned}
    first = {}
    for k in kept:
        first.setdefault(leaves[k].name, k)
    by_depth: dict[int, list[int]] = collections.defaultdict(list)
    for k in kept:
        if k not in replayed and depth.get(leaves[k].name, 0) > 0:
            by_depth[depth[leaves[k].name]].append(k)
    positions = {p.name: i for i, p in enumerate(computation.args)}
    stages = []
    for d in sorted(by_depth):
        outputs = tuple(by_depth[d])
        needs = set().union(*(deps[leaves[k].name] for k in outputs))
        statements = _closure(computation, [leaves[k].name for k in outputs],
                              needs | set(positions))
        refused = next((f"it runs {bsym.sym.name}, which " + (
            "draws random numbers" if any_tagged([bsym], {Tag.RANDOM}) else "has side effects")
            for bsym in map(computation.bsyms.__getitem__, statements)
            if any_tagged([bsym], _NOT_RECOMPUTABLE)), None)
        stages.append(Stage(outputs, tuple(sorted(first[n] for n in needs if n in read)),
                            tuple(sorted(positions[n] for n in needs if n in positions)),
                            statements, refused))
    names = tuple(leaf.name if isinstance(leaf, TensorProxy) else None for leaf in leaves)
    return ReadOutputs(computation, tuple(sorted(first[n] for n in read)), tuple(stages), names)


def _flows(computation: Trace) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """For each statement, `(read names, produced names)` of the values gradients flow from
    and to (none for a statement tagged not differentiable)."""
    flows = []
    for bsym in computation.bsyms:
        if Tag.NOT_DIFFERENTIABLE in bsym.sym.tags or bsym.is_del:
            flows.append(((), ()))
            continue
        flows.append((tuple(p.name for p in bsym.read_proxies),
                      tuple(p.name for p in bsym.proxy_outputs if differentiable_value(p))))
    return flows


def _read_names(computation: Trace, leaves, kept: list[int], flows) -> set[str]:
    """The names of the output leaves at `kept` other leaves at `kept` are computed from
    (through an opaque op without a rule: only to the outputs autograd differentiates, not
    `detach`'s, as the autodiff split asks)."""
    reached: dict[str, int] = {}  # name -> bits of the output leaves it is computed from
    for k in kept:
        reached[leaves[k].name] = reached.get(leaves[k].name, 0) | 1 << k
    for bsym, (reads, produced) in zip(computation.bsyms, flows):
        bits = 0
        for name in reads:
            bits |= reached.get(name, 0)
        if not bits:
            continue
        if produced and Tag.OPAQUE in bsym.sym.tags and rule_for(bsym.sym) is None:
            through = differentiable_outputs(bsym, {n for n in reads if n in reached})
            produced = [name for name in produced if name in through]
        for name in produced:
            reached[name] = reached.get(name, 0) | bits
    found = set()
    for k in kept:
        name = leaves[k].name
        if any(leaves[j].name != name and reached.get(leaves[j].name, 0) >> k & 1 for j in kept):
            found.add(name)
    return found


def _depths(computation: Trace, read: set[str], flows) -> tuple[dict, dict]:
    """`(depth, deps)` by name: the number of read outputs on the deepest way from the inputs,
    and the read outputs and inputs a value is computed from other than through read outputs
    (the leaves of its stage)."""
    depth: dict[str, int] = {}
    deps: dict[str, frozenset] = {p.name: frozenset({p.name}) for p in computation.args}
    for reads, produced in flows:
        level, found = 0, frozenset()
        for name in reads:
            if name in read:
                level, found = max(level, depth.get(name, 0) + 1), found | {name}
            else:
                level, found = max(level, depth.get(name, 0)), found | deps.get(name, frozenset())
        for name in produced:
            depth[name], deps[name] = level, found
    return depth, deps


def _closure(trace: Trace, targets, stop) -> tuple[int, ...]:
    """Indices of the statements of `trace` that compute `targets` from the names in `stop`."""
    producer = {}
    for index, bsym in enumerate(trace.bsyms):
        if not bsym.is_del:
            for p in bsym.proxy_outputs:
                producer.setdefault(p.name, index)
    needed, pending = set(), [t for t in targets]
    while pending:
        name = pending.pop()
        index = producer.get(name)
        if index is None or index in needed or (name in stop and name not in targets):
            continue
        needed.add(index)
        pending.extend(p.name for p in trace.bsyms[index].proxy_inputs)
    return tuple(sorted(needed))


# read by every stage node: whether the engine will run its accumulation node tells a backward
# that runs every node from one that captures gradients (`torch.autograd.grad`)
_WITNESS = torch.zeros((), requires_grad=True)


class _Call:
    """What the stage nodes of one call share: the inputs (and their versions), weak references
    to the read outputs given and their versions, and their hook dicts."""

    def __init__(self, read: ReadOutputs, inputs):
        self.read, self.inputs = read, inputs
        self.versions = [x._version if isinstance(x, torch.Tensor) and not x.is_inference()
                         else None for x in inputs]
        self.refs: dict[int, tuple] = {}
        self.hooks: list = []
        self.node = None  # the call's node

    def watch(self, outputs) -> None:
        """Keep weak references to the read outputs given and make their hook dicts now, so a
        hook registered on one dropped before the backward still counts."""
        for k in self.read.read:
            out = outputs[k]
            if not isinstance(out, torch.Tensor) or out.grad_fn is None:
                continue
            self.refs[k] = (weakref.ref(out), out._version)
            if out._backward_hooks is None:
                out._backward_hooks = collections.OrderedDict()
                out.grad_fn._register_hook_dict(out)
            self.hooks.append(out._backward_hooks)

    def exact(self, node, stage: Stage) -> bool:
        """Whether this backward needs `stage`'s own VJP (not passed through): a read output
        has a hook or retains its gradient, the backward makes a graph, or it captures
        gradients (`torch.autograd.grad`: one may be at a read output). A stage that cannot
        run again passes a capturing backward through where the call's node runs in it (the
        gradients asked for may all be past the call: `autograd.grad(loss, params)` of a
        model with dropout), a gap where one is also at a read output."""
        if torch.is_grad_enabled() or any(self.hooks) or any(
                (out := ref()) is not None and out.retains_grad for ref, _ in self.refs.values()):
            return True
        if torch._C._will_engine_execute_node(node.next_functions[-1][0]):
            return False  # (a backward running every node: nothing captured)
        return stage.refused is None or self.node is None or \
            not torch._C._will_engine_execute_node(self.node)

    def given(self, k: int):
        """The read output at `k` as the forward gave it, where it is alive and not updated in
        place since; else None."""
        ref, version = self.refs.get(k, (lambda: None, None))
        out = ref()
        return out if out is not None and out._version == version else None

    def value(self, k: int):
        """The value of the read output at `k` (no graph): its tensor where `given`, else
        computed again from the inputs."""
        out = self.given(k)
        if out is not None:
            return out.detach()
        trace, name = self.read.trace, self.read.names[k]
        alive = {self.read.names[j]: j for j in self.refs if self.given(j) is not None}
        env = dict(zip(trace.arg_names, self.inputs))
        statements = _closure(trace, [name], set(env) | set(alive))
        for j_name, j in alive.items():
            env[j_name] = self.value(j)
        with torch.no_grad():
            _run(trace, statements, env)
        return env[name]

    def vjp(self, stage: Stage, grads) -> list:
        """The gradients of the stage's read outputs and inputs (`stage.reads`, `stage.inputs`)
        from its outputs' `grads`."""
        if all(g is None for g in grads):  # (a model's caches and hidden states in training)
            return [None] * (len(stage.reads) + len(stage.inputs))
        if stage.refused is not None:
            raise NotYetSupportedError(
                "the gradient at an output of a fulmen-compiled function that other outputs are "
                "computed from, seen by a hook, retain_grad(), torch.autograd.grad or a "
                f"backward with inputs=: the outputs computed from it cannot be run again "
                f"({stage.refused})", op="torch.autograd.backward",
                hint="return the tensor without computing other outputs from it, or call the "
                "function eagerly")
        for i in stage.inputs:
            if self.versions[i] is not None and self.inputs[i]._version != self.versions[i]:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by "
                    "an inplace operation (an input of a fulmen-compiled call)")
        create = torch.is_grad_enabled()
        trace, names = self.read.trace, self.read.names
        env = dict(zip(trace.arg_names, self.inputs))  # (those read for no gradient as they are)
        for i in stage.inputs:
            x = self.inputs[i]
            env[trace.arg_names[i]] = x if create or not isinstance(x, torch.Tensor) else \
                x.detach().requires_grad_(x.requires_grad)
        for k in stage.reads:
            if not create:
                env[names[k]] = self.value(k).requires_grad_()
            elif (out := self.given(k)) is not None:  # (the graph goes on through it)
                env[names[k]] = out
            else:
                raise NotYetSupportedError(
                    "a backward with create_graph=True through an output of a fulmen-compiled "
                    "function that other outputs are computed from, dropped or updated in place "
                    "since the call", op="torch.autograd.backward",
                    hint="keep the output unchanged until the backward")
        with torch.enable_grad():
            _run(trace, stage.statements, env)
        pairs = [(env[names[k]], g) for k, g in zip(stage.outputs, grads)
                 if g is not None and env[names[k]].requires_grad]
        wrt = [env[names[k]] for k in stage.reads] + [env[trace.arg_names[i]]
                                                      for i in stage.inputs]
        wanted = [i for i, w in enumerate(wrt) if isinstance(w, torch.Tensor) and w.requires_grad]
        found = [None] * len(wrt)
        if pairs and wanted:
            got = torch.autograd.grad([o for o, _ in pairs], [wrt[i] for i in wanted],
                                      [g for _, g in pairs], allow_unused=True,
                                      create_graph=create)
            for i, g in zip(wanted, got):
                found[i] = g
        return found


@without_autocast
def _run(trace: Trace, statements, env: dict) -> None:
    """Run the statements of `trace` at `statements` with their torch implementations, reading
    and binding names in `env`."""
    for index in statements:
        bsym = trace.bsyms[index]
        args, kwargs = map_proxies(lambda p: env[p.name], (bsym.args, bsym.kwargs))
        bind_outputs(bsym.output, bsym.sym.impl(*args, **kwargs), env)


class _StageNode(torch.autograd.Function):
    """The node giving one stage's outputs (NOTE [outputs other outputs read])."""

    @staticmethod
    def forward(ctx, call: _Call, stage: Stage, *tensors):
        ctx.call, ctx.stage = call, stage
        ctx.set_materialize_grads(False)  # (an unused output's None reaches the call's node)
        return tuple(t.detach() for t in tensors[:len(stage.outputs)])

    @staticmethod
    def backward(ctx, *grads):
        stage, count = ctx.stage, len(ctx.stage.outputs)
        rest = len(stage.reads) + len(stage.inputs) + 1
        if not ctx.call.exact(ctx, stage):  # to the call node's own slots for them
            return (None, None, *grads, *[None] * rest)
        return (None, None, *[None] * count, *ctx.call.vjp(stage, grads), None)


# the C++ apply under `Function.apply` (its Python wrapper only adds functorch handling)
_plain_apply = super(torch.autograd.Function, _StageNode).apply


def _stage_apply(*args):
    if torch._C._are_functorch_transforms_active():
        return _StageNode.apply(*args)
    return _plain_apply(*args)


def give_outputs(read: ReadOutputs, outputs, inputs, returned) -> list:
    """The fused node's `outputs` with the outputs of each stage given by its own node, and the
    views replayed outside (`returned_views`) made once what they view is given."""
    call = _Call(read, inputs)
    outputs = list(outputs)
    call.node = next((out.grad_fn for out in outputs if isinstance(out, torch.Tensor)
                      and type(out.grad_fn).__name__ == "FulmenAutogradFunctionBackward"), None)
    ready = set(range(len(outputs))) - {k for s in read.stages for k in s.outputs} - {
        entry[0] for entry in returned}
    pending = _replayed(list(returned), inputs, outputs, ready)
    for stage in read.stages:
        tensors = [outputs[k] for k in stage.outputs] + [outputs[k] for k in stage.reads] + [
            inputs[i] for i in stage.inputs] + [_WITNESS]
        for k, out in zip(stage.outputs, _stage_apply(call, stage, *tensors)):
            outputs[k] = out
        ready.update(stage.outputs)
        pending = _replayed(pending, inputs, outputs, ready)
    call.watch(outputs)
    return outputs


def _replayed(pending: list, inputs, outputs: list, ready: set[int]) -> list:
    """Replay the entries of `pending` (`returned_views`) whose source is ready, in order, each
    making its own output ready; the others."""
    left = []
    for entry in pending:
        if entry[2] and entry[1] not in ready:
            left.append(entry)
            continue
        outputs[:] = replay((entry,), inputs, outputs)
        ready.add(entry[0])
    return left


__all__ = ["ReadOutputs", "Stage", "find_read_outputs", "give_outputs"]
