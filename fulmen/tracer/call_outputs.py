"""What a traced call leaves behind besides its trace: its output flattened (dataclasses
registered as pytree nodes, a returned `torch.Size` kept one), and the epilogue stores into
argument objects and modules (`fulmen.tracer.objects`): traced module stores, `p.grad = None`
of a jitted `optimizer.zero_grad()`, output objects holding traced tensors, and the proxies
their templates hold, which the trace returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen.core import NotYetSupportedError
from fulmen.ops.host_float import FloatProxy
from fulmen.proxies import TensorProxy
from fulmen.tracer.metadata_inplace import MetadataMutation
from fulmen.tracer.module_stores import ModuleStore
from fulmen.tracer.object_inputs import ObjectInputs
from fulmen.tracer.objects import MODULE, TRACED_NUMBERS, is_plain_object, walk
from fulmen.tracer.size_trees import keep_sizes


def is_printable_spec(spec) -> bool:
    """Whether the output structure `spec` (a pytree spec) is nested tuples, lists and dicts
    with str or int keys only, which a printed trace can spell."""
    if spec.is_leaf():
        return True
    if spec.type not in (tuple, list, dict):
        return False
    if spec.type is dict and not all(isinstance(k, (str, int)) for k in spec.context):
        return False
    return all(is_printable_spec(child) for child in spec.children())


def flatten_output(out) -> tuple[list, Any]:
    """`pytree.tree_flatten(out)`, registering dataclass types met among the leaves as pytree
    nodes first (so a dataclass of tensors is rebuilt around the compiled outputs).

    Other objects holding traced tensors stay leaves; the epilogue rebuilds them per call
    (`fulmen.tracer.objects`).
    """
    while True:
        leaves, spec = pytree.tree_flatten(out)
        registered = False
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) or leaf is None:
                continue
            kind = type(leaf)
            if dataclasses.is_dataclass(leaf) and all(f.init for f in dataclasses.fields(leaf)):
                if kind not in pytree.SUPPORTED_NODES:
                    pytree.register_dataclass(kind)
                    registered = True
                continue
        if not registered:
            return leaves, keep_sizes(spec)  # a `torch.Size` returned stays one


def epilogue_values(objects: ObjectInputs, out_leaves: list) -> list[TensorProxy]:
    """Record the stores into the object arguments and the output objects holding traced
    tensors (replacing them by None in `out_leaves`); return the proxies their templates hold,
    which the trace must return."""
    objects.record_stores()
    for index, leaf in enumerate(out_leaves):
        if is_plain_object(leaf) and any(isinstance(v, TensorProxy) for _, v in walk(leaf)):
            objects.epilogue.outputs.append((index, leaf))
            out_leaves[index] = None
    templates = [store[3] for store in objects.epilogue.stores]
    templates += [store[2][1] for store in objects.epilogue.stores
                  if store[2] is not None and isinstance(store[2][1], TensorProxy)]
    templates += [template for _, template in objects.epilogue.outputs]
    found: dict[str, TensorProxy] = {}
    numbers: dict[int, Any] = {}  # traced numbers (NOTE [traced numbers in stores])
    arguments = objects.epilogue.arguments  # the call's own tensors: not returned
    for template in templates:
        values = [template] if isinstance(template, (TensorProxy, FloatProxy, *TRACED_NUMBERS)) \
            else [v for _, v in walk(template)]
        for value in values:
            if isinstance(value, FloatProxy):  # a float read at run time: its value, returned
                found.setdefault(value.name, value)
            elif isinstance(value, TensorProxy) and id(value) not in arguments:
                found.setdefault(value.name, value)
            elif isinstance(value, torch.SymFloat):
                # its expression, evaluated per call, would not round as the Python arithmetic
                # that made it (LinearLR's rate from a symbolic `last_epoch`: an ulp off)
                raise NotYetSupportedError(
                    "storing a float computed from a symbolic integer into an object",
                    op="setattr")
            elif isinstance(value, TRACED_NUMBERS):
                numbers.setdefault(id(value), value)
    objects.epilogue.names = list(found)
    objects.epilogue.numbers = list(numbers.values())
    return list(found.values())


def clear_grads_after_each_call(cleared: list[TensorProxy], objects: ObjectInputs,
                                 object_pairs: list) -> None:
    """`p.grad = None` on tensors inside argument objects (`optimizer.zero_grad()` in a jitted
    step) become epilogue stores on the call's own tensors.

    Raises:
        MetadataMutation: the tensor is not inside an argument object (a parameter reached
            through a module argument): the call runs eagerly.
    """
    if not cleared:
        return
    paths = {proxy.name: objects.tensor_paths[index]
             for index, (proxy, _) in enumerate(object_pairs)}
    for proxy in cleared:
        if proxy.name not in paths:
            raise MetadataMutation(
                f"setting the .grad of {proxy.name}, which is not inside an argument object",
                op="Tensor.grad", hint="pass the optimizer (fulmen replays its zero_grad())")
        root, path = paths[proxy.name]
        objects.epilogue.stores.append((root, path, ("attr", "grad"), None))


def traced_stores(stores: list[ModuleStore], objects: ObjectInputs) -> list[ModuleStore]:
    """Make the module stores of traced tensors epilogue stores of `objects` (the trace returns
    their tensors; with graph breaks, each path has its own epilogue); return the other
    stores."""
    traced = [store for store in stores if store.traced]
    for store in traced:
        objects.epilogue.stores.append((MODULE, store.path, ("attr", store.key), store.value))
        objects.epilogue.replaces_buffers |= store.key in store.module._buffers
    return [store for store in stores if not store.traced]
