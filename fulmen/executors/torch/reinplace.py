"""Reinplacing: a functionalized update of an input computed into the input itself (issue 21).

Tracing keeps traces SSA (`tracer/mutation.py`): an optimizer's `param.mul_(1 - lr * wd)` then
`param.addcdiv_(exp_avg, denom, value=-step_size)` is recorded out of place,

    t4 = torch.Tensor.mul(param, f3)
    t23 = torch.Tensor.addcdiv(t4, t7, t21, value=f22)
    ...
    torchex.copy_(param, t23)          # the write-back, at the end

which allocates `t4` and `t23` and copies `t23` back: an extra pass over the memory and an
allocation per tensor that eager does not make. Where it is safe, the statements computing the
written value write into the input's storage (`torch.mul(param, f3, out=param)`: the op's
`out=` form, the very kernel on the same operands) and the write-back is dropped:

    t4 = torchex.mul_into(param, param, f3)
    t23 = torchex.addcdiv_into(param, t4, t7, t21, value=f22)

NOTE [reinplacing is safe when]: the chain `S_1 ... S_k` of statements (each a torch executor
elementwise op of `INTO_FORMS`, one tensor out) computes `v_k`, the value written back into the
trace input `x`, each `S_j` (j > 1) reading `v_(j-1)`. It is rewritten when (all read from the
trace, so conservative):

- every `v_j` has `x`'s static shape, strides, dtype (not complex) and device, requires no
  grad, is not an output of
  the trace, and no value that may share its storage (a view of it, anything but the fresh
  results of the ops listed here) is an output either;
- every `v_j` with j < k is read by `S_(j+1)` alone (nothing reads it once overwritten);
  a link may also be `detach(v)` or `clone(v)` (the functional form of `x.copy_(v)`), which
  writes nothing: the clone becomes `same_tensor(v)`, `v` already being in `x`;
- no statement after `S_1` and before the write-back reads `x` or a value that may share
  storage with `x` (a view taken earlier), except `S_1` reading `x` itself (elementwise, the same
  shape: each element is read before it is written); statements after the write-back read the
  final value either way (an output that is a view of `x`);
- `x` is written back once, and no other input may share memory with it: a trace that
  mutates an input is called only when no other input overlaps it
  (`tracer/input_aliasing.check_no_input_aliasing`), so `x` is reached through no other name;
- when `x` requires grad (a parameter), nothing but the write-back reads `v_k`.

A statement whose operands require grad (a parameter's old value) runs with grad mode off, as
its write-back would (`_write_back`); the result is the input, holding eager's values.
When unsure, the copy stays.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from fulmen.core import BoundSymbol, Trace
from fulmen.executors.torch import _write_back, torch_ex
from fulmen.executors.torch.inplace import _FRESH_PRODUCTS, statement_readers
from fulmen.ops.functionalized import WRITE_BACK
from fulmen.transforms.base import transform

__all__ = ["INTO_FORMS", "reinplace"]

# elementwise torch ops whose results own fresh storage and that take `out=`: function and
# method (same positional order) -> the function with `out=`
_ELEMENTWISE = ("add", "sub", "mul", "div", "addcdiv", "addcmul", "lerp", "sqrt", "rsqrt",
                "maximum", "minimum", "neg", "abs", "exp", "clamp", "sign", "reciprocal")
_FUNCTIONS: dict = {}
for _name in _ELEMENTWISE:
    _FUNCTIONS[getattr(torch, _name)] = _name
    _FUNCTIONS[getattr(torch.Tensor, _name)] = _name


def _into(fn):
    def write_into(dst, *args, **kwargs):
        fn(*args, **kwargs, out=dst)
        return dst

    return write_into


def _into_without_grad(fn):
    def write_into_without_grad(dst, *args, **kwargs):
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            fn(*args, **kwargs, out=dst)
        finally:
            torch._C._set_grad_enabled(enabled)
        return dst

    return write_into_without_grad


def _no_meta(*args, **kwargs):
    raise AssertionError("the *_into operators are only put into traces after claiming")


# op name -> (symbol writing into `dst`, the same with grad mode off)
INTO_FORMS: dict[str, tuple] = {
    name: (torch_ex.register_operator(f"{name}_into", fn=_into(getattr(torch, name)),
                                      meta=_no_meta),
           torch_ex.register_operator(f"{name}_into_without_grad",
                                      fn=_into_without_grad(getattr(torch, name)),
                                      meta=_no_meta))
    for name in _ELEMENTWISE}


def _op_name(bsym: BoundSymbol) -> str | None:
    """The `INTO_FORMS` name of a torch executor statement with one tensor output, or None."""
    if bsym.sym.executor is not torch_ex or "out" in bsym.kwargs:
        return None
    name = _FUNCTIONS.get(bsym.sym.impl) if _hashable(bsym.sym.impl) else None
    if name is None or len(bsym.proxy_outputs) != 1:
        return None
    return name if isinstance(bsym.output, torch.Tensor) else None


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _is_detach(bsym: BoundSymbol) -> bool:
    """`t1 = detach(t0)` or `t1 = clone(t0)`: a link of a chain that writes nothing once `t0`
    is in the input (a detach is `t0`'s storage; a clone, `x.copy_(t0)`'s functional form,
    becomes `t0` itself: `same_tensor`)."""
    return bsym.sym.executor is torch_ex and bsym.sym.impl in _PASSING and len(bsym.args) == 1 \
        and not bsym.kwargs and isinstance(bsym.output, torch.Tensor)


def _same_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


SAME_TENSOR = torch_ex.register_operator("same_tensor", fn=_same_tensor, meta=_no_meta)
_PASSING = (torch.Tensor.detach, torch.detach, torch.clone, torch.Tensor.clone)
# torch callables whose results own fresh storage (the products, normalisations, losses)
_FRESH_CALLS = frozenset({*_FRESH_PRODUCTS, torch.nn.functional.layer_norm,
                          torch.nn.functional.gelu, torch.nn.functional.relu, torch.relu,
                          torch.nn.functional.silu, torch.softmax, torch.log_softmax,
                          torch.nn.functional.softmax, torch.nn.functional.log_softmax,
                          torch.nn.functional.cross_entropy, torch.sum, torch.mean,
                          torch.Tensor.sum, torch.Tensor.mean})


def _fresh(bsym: BoundSymbol) -> bool:
    """Whether every tensor `bsym` returns owns storage none of its operands has (so it is no
    view, and not an operand given back). Unknown statements are not."""
    if _op_name(bsym) is not None:
        return True
    impl = bsym.sym.impl
    plans = getattr(getattr(impl, "lowered", None), "outputs", None)  # a codegen fusion
    if plans is not None:
        return all(plan[0] in ("kernel", "rowview") for plan in plans)
    if bsym.sym.executor is not torch_ex or bsym.is_view:
        return False
    if isinstance(impl, torch._ops.OpOverload):  # its schema says which results may alias
        return all(ret.alias_info is None for ret in impl._schema.returns)
    return _hashable(impl) and impl in _FRESH_CALLS


def _sharing(bsyms, seed: str) -> set[str]:
    """Names of values that may share storage with `seed`: itself, and what any statement that
    is not `_fresh` makes from them (views, an operand given back)."""
    names = {seed}
    for bsym in bsyms:
        if bsym.is_del or _fresh(bsym):
            continue
        if any(p.name in names for p in bsym.proxy_inputs):
            names |= {p.name for p in bsym.proxy_outputs}
    return names


def _same_layout(a, b) -> bool:
    """Same static shape, strides, dtype (not complex: no conjugate views) and device."""
    layouts = [(*a.shape, *a.stride()), (*b.shape, *b.stride())]
    if not all(type(v) is int for layout in layouts for v in layout) or a.dtype.is_complex:
        return False  # (a symbolic size compared would become a guard)
    return layouts[0] == layouts[1] and (a.dtype, a.device) == (b.dtype, b.device)


def _write_backs(bsyms) -> tuple[dict[str, tuple[int, str]], set[str]]:
    """Input name -> (index, name of the value copied) of its write-back `copy_(input, value)`
    (as traced, or as claimed), and the names written back more than once."""
    backs, twice = {}, set()
    for index, bsym in enumerate(bsyms):
        if (bsym.sym is WRITE_BACK or bsym.sym.impl is _write_back) and len(bsym.args) == 2 \
                and not bsym.kwargs and all(isinstance(a, torch.Tensor) for a in bsym.args):
            name = bsym.args[0].name
            if name in backs:
                twice.add(name)
            backs[name] = (index, bsym.args[1].name)
    return backs, twice


class _Trace:
    """What the checks read of one trace: producers, readers, outputs, write-backs."""

    def __init__(self, trace: Trace) -> None:
        self.bsyms = trace.bsyms
        self.inputs = {a.name: a for a in pytree.tree_leaves(trace.args)
                       if isinstance(a, torch.Tensor)}
        self.readers = statement_readers(self.bsyms)
        self.outputs = {leaf.name for leaf in pytree.tree_leaves(trace.output)
                        if isinstance(leaf, torch.Tensor)}
        self.producer = {p.name: i for i, b in enumerate(self.bsyms) if not b.is_del
                         for p in b.proxy_outputs}
        self.backs, self.written_twice = _write_backs(self.bsyms)

    def link(self, name: str, taken: set[int]) -> int | None:
        """The index of the statement making `name` when it may be a link of a chain: an
        `INTO_FORMS` op or a detach, not yet in a chain."""
        index = self.producer.get(name)
        if index is None or index in taken:
            return None
        bsym = self.bsyms[index]
        return index if _op_name(bsym) is not None or _is_detach(bsym) else None

    def value_ok(self, value, x) -> bool:
        """`value` may live in `x`'s storage (NOTE [reinplacing is safe when], first rule)."""
        if not isinstance(value, torch.Tensor) or value.requires_grad \
                or not _same_layout(value, x):
            return False
        return not (_sharing(self.bsyms, value.name) & self.outputs)  # (`value` among them)

    def input_free_after(self, x, first: int, back: int) -> bool:
        """No statement in (`first`, `back`) reads `x` or what may share its storage, and
        statement `first` reads no view of `x` (NOTE [reinplacing is safe when])."""
        for name in _sharing(self.bsyms, x.name):
            for j in self.readers.get(name, ()):
                if first < j < back or (j == first and name != x.name):
                    return False
        return True


def _chain(info: _Trace, x, back: int, value_name: str, taken: set[int]) -> list[int] | None:
    """The indices of the statements `S_1 ... S_k` that may compute into `x` (NOTE
    [reinplacing is safe when]), in order, or None."""
    end = info.link(value_name, taken)
    if end is None or not info.value_ok(info.bsyms[end].output, x):
        return None
    if x.requires_grad and any(j != back for j in info.readers.get(value_name, ())):
        return None
    if not info.input_free_after(x, end, back):
        return None
    chain = [end]
    while True:  # extend backwards while the longer chain stays safe
        link = info.bsyms[chain[0]]
        operands = link.args[:1] if _is_detach(link) else link.proxy_inputs
        extended = None
        for arg in operands:
            start = info.link(arg.name, taken)
            if start is None or info.readers.get(arg.name) != [chain[0]] \
                    or not info.value_ok(arg, x) or not info.input_free_after(x, start, back):
                continue
            extended = start
            break
        if extended is None:
            break
        chain.insert(0, extended)
    while chain and _is_detach(info.bsyms[chain[0]]):
        chain.pop(0)  # (a detach of a value not in `x`: that value is not `x`'s to write)
    return chain or None


@transform("reinplacing")
def reinplace(trace: Trace) -> Trace:
    """Compute a written-back input's new value into the input itself where safe, and drop its
    write-back (module docstring)."""
    info = _Trace(trace)
    changed, dropped, taken = list(trace.bsyms), set(), set()
    for name, (back, value_name) in info.backs.items():
        x = info.inputs.get(name)
        if x is None or name in info.written_twice:
            continue
        chain = _chain(info, x, back, value_name, taken)
        if chain is None:
            continue
        holder = x
        for index in chain:
            bsym = trace.bsyms[index]
            if _is_detach(bsym) and bsym.sym.impl in (torch.clone, torch.Tensor.clone):
                changed[index] = bsym.replace(sym=SAME_TENSOR, subsymbols=())
            elif not _is_detach(bsym):
                plain, without_grad = INTO_FORMS[_op_name(bsym)]
                grad = x.requires_grad or any(isinstance(p, torch.Tensor) and p.requires_grad
                                              for p in bsym.proxy_inputs)
                changed[index] = bsym.replace(sym=without_grad if grad else plain,
                                              args=(holder, *bsym.args), subsymbols=())
            holder = bsym.output
        taken |= set(chain)
        dropped.add(back)
    if not dropped:
        return trace
    return trace.replace(bsyms=tuple(b for j, b in enumerate(changed) if j not in dropped))
