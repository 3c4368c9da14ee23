"""Comparisons of symbolic sizes settled without sympy (NOTE [comparisons decided by arithmetic]
in `fulmen/tracer/sym_compare.py`): every answer checked against each size and against sympy,
and a branch on a size whose answer flips between calls still guarded (answers as eager)."""

import itertools

import pytest
import sympy
import torch

import fulmen
from fulmen.tracer import sym_ops
from fulmen.tracer.sym_compare import DEPENDS, decide

_OPS = {"eq": sympy.Eq, "ne": sympy.Ne, "gt": sympy.Gt, "ge": sympy.Ge, "lt": sympy.Lt,
        "le": sympy.Le}
_TRUTH = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "gt": lambda a, b: a > b,
          "ge": lambda a, b: a >= b, "lt": lambda a, b: a < b, "le": lambda a, b: a <= b}

S = sympy.Symbol("s", integer=True, positive=True)


def _forms():
    """`c*s + k` for a few `c`, `k` (constants included), as sympy builds them."""
    return [(c, k, c * S + k) for c, k in itertools.product((0, 1, 2, 4, -3), (-8, -4, 0, 1, 3))]


def test_each_decided_comparison_holds_for_every_size_and_matches_sympy():
    checked = {True: 0, False: 0, DEPENDS: 0}
    for (c1, k1, a), (c2, k2, b) in itertools.product(_forms(), _forms()):
        for op, relation in _OPS.items():
            answer = decide(op, a, b)
            assert answer is not None, (op, a, b)
            truths = {_TRUTH[op](c1 * s + k1, c2 * s + k2) for s in range(1, 40)}
            if answer is DEPENDS:
                assert truths == {True, False}, (op, a, b)
                # sympy, sound, leaves it unevaluated: the node we build is its node
                assert relation(a, b) == relation(a, b, evaluate=False), (op, a, b)
            else:
                assert truths == {answer}, (op, a, b, answer)
                proved = relation(a, b)
                assert proved in (sympy.true, sympy.false, relation(a, b, evaluate=False))
                if proved in (sympy.true, sympy.false):
                    assert bool(proved) is answer, (op, a, b)
            checked[answer] += 1
    assert all(checked.values()), checked  # each kind of answer was met


def test_other_expressions_are_left_to_sympy():
    t = sympy.Symbol("t", integer=True, positive=True)
    u = sympy.Symbol("u", integer=True)  # not known positive
    for a, b in [(S, t), (S * t, 4), (S**2, 1), (S / 2, 1), (u + 1, 3), (2 * S + t, 1),
                 (sympy.Rational(1, 2) * S, 1)]:
        assert decide("gt", sympy.sympify(a), sympy.sympify(b)) is None, (a, b)
    assert decide("gt", S - S + 3, sympy.Integer(2)) is True  # the symbol cancels: no assumption needed


def _branchy(x):
    if x.shape[0] * 4 > 8:  # depends on the size: a guard must hold it
        x = x + 1
    if x.shape[0] * 3 == 9:
        x = x * 2
    if x.shape[0] * 16 > 8:  # true of every size: no guard needed
        x = x - 3
    return x


@pytest.mark.parametrize("sizes", [(5, 6, 2, 3, 7), (2, 4, 3, 6, 2)])
def test_a_branch_on_a_size_that_flips_answers_as_eager(sizes, monkeypatch):
    answers = []

    def recorded(op, a, b):
        answers.append(decide(op, a, b))
        return answers[-1]

    monkeypatch.setattr(sym_ops, "decide", recorded)
    jitted = fulmen.jit(_branchy)
    for n in sizes:
        x = torch.randn(n, 3)
        torch.testing.assert_close(jitted(x), _branchy(x), msg=f"size {n}")
    assert fulmen.compile_stats(jitted).eager_calls == 0  # the compiled path answered
    # the branches were settled here, not by sympy: each kind of answer was built
    assert DEPENDS in answers and True in answers, answers
