"""Arithmetic and comparisons of fulmen's symbolic sizes, each built once per ShapeEnv.

NOTE [symbolic arithmetic kept by the ShapeEnv]: every operation on a `torch.SymInt` (`s0 * 32`,
`s1 - 1`, `s0 == s1`) builds a new sympy expression and a new `SymNode`, tens of microseconds
each (sympy simplifies and asks its assumptions as it builds). A trace with symbolic sizes and
the passes after it ask the same few hundred operations thousands of times: each new proxy's
row-major strides, each shape compared with another, each view's sizes (tiny HF Llama's
training step: about 4,800 operations, 380 distinct, a third of its symbolic compile's time).
The result of one is a function of its operands' expressions and Python types alone (no guard
is recorded by building an expression; a guard is recorded only when a `SymBool` is made a
Python bool, which is not kept here): while `memoized_symbolic_ops()` is on, an operation of
two nodes of one of fulmen's ShapeEnvs (`keep_symbolic_ops`) returns the node the first such
operation built, kept in a dict on that ShapeEnv (which lives as long as the trace and its
entry). Other ShapeEnvs (torch.compile's), operations under a proxy mode (`make_fx`), and
ShapeEnvs that validate translations get PyTorch's own.

NOTE [symbolic arithmetic kept at the SymInt]: the node a `SymInt` operation builds is kept as
above, but `torch.SymInt.__mul__` and its siblings still wrap a plain int operand in a new
constant `SymNode` (a sympy Integer), promote, check constants and wrap the result in a new
`SymInt` around the kept node: about two thirds of an operation's cost once its node is kept.
So the `SymInt` methods whose node operation is kept (`+ - *`, their reflections, and the six
comparisons) keep their result too, in the same dict, keyed by the method, the `SymInt`'s
expression and summation flag, and the operand: a plain `int` by type and value (never a
`bool` or `float`, which PyTorch promotes differently), or a `SymInt` of the same ShapeEnv by
its expression and flag (`2` and `2.0` are equal keys: a float must never look one up).
Anything else, and any call outside the switch, is PyTorch's own.

NOTE [a node's expression without asking sympy]: `SymNode.expr` (read for every key above, by
every lowering comparison and by PyTorch's own arithmetic: about 11,000 times in tiny HF Llama's
symbolic forward compile) first asks sympy whether the node's expression is a number
(`Expr.is_number` walks the expression's arguments, uncached), and only then uses the node's
answer kept per ShapeEnv replacement version. Both branches return the same expression: the
stored one when the ShapeEnv has no replacement (version 0), else the one kept for this version
(kept only for a non-number, so a number never reaches it). While the switch is on, `expr`
reads those two first and asks PyTorch's own property otherwise: the same answer for every node,
without the walk.

A comparison of two int nodes with hints that `sym_compare.decide` settles (NOTE [comparisons
decided by arithmetic]) is built without asking sympy, as the node PyTorch would build: the
constant `sympy.true` or `sympy.false`, or the relational unevaluated.
"""

from __future__ import annotations

import functools

import sympy
import torch
from torch._ops import mode_stack_state_for_pre_dispatch
from torch.fx.experimental.sym_node import SymNode, method_to_operator

from fulmen.tracer.process_switch import ProcessSwitch
from fulmen.tracer.sym_compare import DEPENDS, decide

__all__ = ["keep_symbolic_ops", "memoized_symbolic_ops"]

_MEMO = "_fulmen_symbolic_ops"  # the attribute holding a ShapeEnv's built operations

_PROXY = torch._C._TorchDispatchModeKey.PROXY
_dispatch_mode = torch._C._get_dispatch_mode


def _under_proxy_mode() -> bool:
    """`get_proxy_mode() is not None` (a `make_fx` trace records SymInt operations: they are
    PyTorch's own there), asked without PyTorch's enum lookups and the check that the two
    modes are not both set: a third of a kept operation's cost (NOTE [symbolic arithmetic
    kept at the SymInt])."""
    return _dispatch_mode(_PROXY) is not None \
        or mode_stack_state_for_pre_dispatch().get(0) is not None

# `SymNode` methods whose result depends only on the operands (`mod` is not one: it picks
# `Mod` or `PythonMod` by the value ranges, which guards narrow)
_PURE = ("add", "sub", "mul", "int_floordiv", "sym_max", "sym_min", "and_", "or_",
         "eq", "ne", "lt", "le", "gt", "ge")

_RELATIONS = {"eq": sympy.Eq, "ne": sympy.Ne, "lt": sympy.Lt, "le": sympy.Le, "gt": sympy.Gt,
              "ge": sympy.Ge}

_ORIGINALS = {name: getattr(SymNode, name) for name in _PURE}

# `torch.SymInt` methods whose `SymNode` operation is one of `_PURE` (NOTE [symbolic arithmetic
# kept at the SymInt]); `__floordiv__` is not (`SymNode.floordiv` is not `int_floordiv`)
_SYMINT_METHODS = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                   "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__")

_SYMINT_ORIGINALS = {name: torch.SymInt.__dict__[name] for name in _SYMINT_METHODS}


def keep_symbolic_ops(env) -> None:
    """Let the operations on `env`'s symbolic sizes be kept (NOTE [symbolic arithmetic kept by
    the ShapeEnv]); not for a ShapeEnv that validates translations (each operation there
    records a node of its own)."""
    if not env._translation_validation_enabled:
        env.__dict__[_MEMO] = {}


def _kept(name: str, original):
    @functools.wraps(original)
    def operation(self: SymNode, other: SymNode) -> SymNode:
        env = self.shape_env
        memo = getattr(env, _MEMO, None)
        if memo is None or type(other) is not SymNode or other.shape_env is not env \
                or _under_proxy_mode():
            return original(self, other)
        key = (name, self.expr, other.expr, self.pytype, other.pytype,
               self._optimized_summation, other._optimized_summation)
        node = memo.get(key)
        if node is None:
            node = memo[key] = _decided(name, self, other) or original(self, other)
        return node

    return operation


def _decided(name: str, a: SymNode, b: SymNode) -> SymNode | None:
    """The node of comparison `name` of int nodes `a` and `b` when `decide` settles it (built as
    `binary_magic_impl` builds one, its expression the answer or the unevaluated relational),
    else None."""
    if name not in _RELATIONS or a.pytype is not int or b.pytype is not int \
            or a.hint is None or b.hint is None:
        return None
    answer = decide(name, a.expr, b.expr)
    if answer is None:
        return None
    op = method_to_operator(name)
    if answer is DEPENDS:
        expr = _RELATIONS[name](a.expr, b.expr, evaluate=False)
    else:
        expr = sympy.true if answer else sympy.false
    fx_node, _ = a.shape_env._create_fx_call_function(op, (a.fx_node, b.fx_node))
    return SymNode(expr, a.shape_env, bool, bool(op(a.hint, b.hint)), fx_node=fx_node)


_KEPT = {name: _kept(name, original) for name, original in _ORIGINALS.items()}

_EXPR = SymNode.__dict__["expr"]  # PyTorch's property
_EXPR_GET = _EXPR.fget


def _node_expr(self: SymNode):
    """`SymNode.expr` without the number check where it cannot change the answer (NOTE [a
    node's expression without asking sympy])."""
    env = self.shape_env
    if env is not None:
        version = env._replacements_version_counter
        if version == 0:
            return self._expr
        if self._expr_cache is not None and version == self._expr_ver:
            return self._expr_cache
    return _EXPR_GET(self)


# PyTorch's fields the fast `expr` reads: without them (another version), PyTorch's own
_FAST_EXPR = property(_node_expr) if all(
    field in SymNode.__init__.__code__.co_names for field in ("_expr_cache", "_expr_ver")) \
    else _EXPR


def _kept_at_symint(name: str, original):
    @functools.wraps(original)
    def method(self, other):
        node = self.node
        memo = getattr(node.shape_env, _MEMO, None)
        if memo is None:
            return original(self, other)
        kind = type(other)
        if kind is int:
            operand = other
        elif kind is torch.SymInt and other.node.shape_env is node.shape_env:
            operand = (other.node.expr, other.node._optimized_summation)
        else:  # a float or bool operand (PyTorch promotes them: `s0 * 2.0` is a SymFloat)
            return original(self, other)
        if _under_proxy_mode():
            return original(self, other)
        key = (name, node.expr, node._optimized_summation, operand)
        if key in memo:
            return memo[key]
        result = memo[key] = original(self, other)
        return result

    return method


_KEPT_AT_SYMINT = {name: _kept_at_symint(name, original)
                   for name, original in _SYMINT_ORIGINALS.items()}


def _install() -> None:
    for name, operation in _KEPT.items():
        setattr(SymNode, name, operation)
    SymNode.expr = _FAST_EXPR
    for name, method in _KEPT_AT_SYMINT.items():
        setattr(torch.SymInt, name, method)


def _uninstall() -> None:
    for name, original in _ORIGINALS.items():
        setattr(SymNode, name, original)
    SymNode.expr = _EXPR
    for name, original in _SYMINT_ORIGINALS.items():
        setattr(torch.SymInt, name, original)


_SWITCH = ProcessSwitch(_install, _uninstall)


def memoized_symbolic_ops() -> ProcessSwitch:
    """The context manager under which operations on the symbolic sizes of fulmen's ShapeEnvs
    are built once per ShapeEnv (NOTE [symbolic arithmetic kept by the ShapeEnv]); reentrant,
    and process-wide like `fulmen.tracer.int_answers`."""
    return _SWITCH
