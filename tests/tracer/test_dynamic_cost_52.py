"""Shortcuts of a symbolic compilation that must answer as PyTorch does (session 52): a node's
expression read without sympy's number check (NOTE [a node's expression without asking sympy]
in `fulmen/tracer/sym_ops.py`) and the proxy-mode check of a kept operation. Each is compared
with PyTorch's own answer, including where the answer changes (a replacement, a proxy mode)."""

import pytest
import sympy
import torch
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    PythonKeyTracer,
    get_proxy_mode,
)
from torch.fx.experimental.sym_node import SymNode

from fulmen.tracer import sym_ops
from fulmen.tracer.symbolic import SymbolicSizes


def _pytorchs(node):
    return sym_ops._EXPR.fget(node)


def test_a_nodes_expression_is_pytorchs_before_and_after_replacements():
    """Under the switch `SymNode.expr` skips sympy's number check, yet gives PyTorch's answer
    for symbols, products, numbers and constants, and follows each replacement the ShapeEnv
    records (a node read before a replacement must not keep its old expression)."""
    sizes = SymbolicSizes()
    (s0, s1), _ = sizes.symbolize(torch.empty(6, 5), "x", dims=(0, 1))
    a, b = s0.node.expr, s1.node.expr
    env = s0.node.shape_env
    with sym_ops.memoized_symbolic_ops():
        assert SymNode.expr is not sym_ops._EXPR  # the shortcut is what is read here
        product = s0 * s1 + 3
        nodes = [s0.node, s1.node, product.node, (s0 - s0).node, s0.node.wrap_int(7)]
        assert [node.expr for node in nodes] == [_pytorchs(node) for node in nodes]
        assert product.node.expr == a * b + 3
        env._set_replacement(b, sympy.Integer(5), "test")  # as a guard `s1 == 5` would
        for _ in range(2):  # the first read keeps the new expression, the second reads it
            assert product.node.expr == 5 * a + 3 == _pytorchs(product.node)
            assert s1.node.expr == 5
        env._set_replacement(a, sympy.Integer(6), "test")
        assert product.node.expr == 33 == _pytorchs(product.node)
        assert [node.expr for node in nodes] == [_pytorchs(node) for node in nodes]
    assert SymNode.expr is sym_ops._EXPR  # switched off: PyTorch's own property


def test_the_proxy_mode_check_answers_as_pytorchs():
    """A kept operation is PyTorch's own under a proxy mode (`make_fx`, pre-dispatch or not);
    the check reads both places PyTorch's `get_proxy_mode` reads."""
    from torch._ops import mode_stack_state_for_pre_dispatch

    sizes = SymbolicSizes()
    (s0, _), _ = sizes.symbolize(torch.empty(6, 5), "x", dims=(0, 1))
    assert not sym_ops._under_proxy_mode() and get_proxy_mode() is None
    mode = ProxyTorchDispatchMode(PythonKeyTracer(), "symbolic")
    with sym_ops.memoized_symbolic_ops():
        kept = s0 * 4
        assert s0 * 4 is kept
        with mode:
            assert sym_ops._under_proxy_mode() and get_proxy_mode() is mode
            # PyTorch's own operation, which asks the tracer for `s0` (a kept answer would not)
            with pytest.raises(RuntimeError, match="not tracked"):
                s0 * 4
        assert not sym_ops._under_proxy_mode() and get_proxy_mode() is None
        stack = mode_stack_state_for_pre_dispatch()
        stack.set(0, mode)  # as a pre-dispatch trace (`make_fx(pre_dispatch=True)`) sets it
        try:
            assert sym_ops._under_proxy_mode() and get_proxy_mode() is mode
        finally:
            stack.set(0, None)
        assert not sym_ops._under_proxy_mode() and s0 * 4 is kept
