"""Comparisons of linear symbolic sizes decided without sympy's assumption system.

NOTE [comparisons decided by arithmetic]: `SymNode.eq` and its siblings build `sympy.Eq(a, b)`
(and `Gt`, `Lt`, ...), which asks sympy's assumptions whether `a - b` is zero or positive: a
few milliseconds for each new expression (`Eq(16*s0, 16)`: 7 ms; tiny HF Llama's first
symbolic forward compile asks about 30 such comparisons, a fifth of its sympy time). Most are
of a size against a constant or against a multiple of itself (`16*s0 > 8`, `4*s0 < 2`,
`s0 == 32*s0`), asked by contiguity checks and fulmen's layout rules. `decide` settles those
of the form `c*s + k` against `c'*s + k'` (one symbol `s`, integer coefficients), `s` ranging
over the positive integers (the symbol's own sympy assumptions, asked only when `s` does not
cancel): a bool when every `s` gives the same answer (true of every size the symbol can stand
for: what sympy answers when it can prove it, and no guard is needed, as building an
expression records none), else `DEPENDS`: two sizes answer differently, so sympy, being sound,
can prove neither and returns the comparison unevaluated, `Eq(a, b, evaluate=False)` (which the
caller then builds itself). Anything else (two symbols, a symbol not known positive and integer,
other expressions) is None, and the caller asks sympy.
"""

from __future__ import annotations

__all__ = ["DEPENDS", "decide"]

DEPENDS = "depends"  # `decide`'s answer when the truth depends on the symbol's value

_TRUTH = {"eq": lambda d: d == 0, "ne": lambda d: d != 0, "gt": lambda d: d > 0,
          "ge": lambda d: d >= 0, "lt": lambda d: d < 0, "le": lambda d: d <= 0}

# `(c, k)` of `c*s + k` and the comparison of `d = a - b` against zero it stands for
_FLIPPED = {"gt": "lt", "ge": "le", "lt": "gt", "le": "ge", "eq": "eq", "ne": "ne"}


def _linear(expr) -> tuple[int, object, int] | None:
    """`(c, s, k)` with `expr == c*s + k` (`s` None for a constant), or None for other forms."""
    if expr.is_Integer:
        return 0, None, int(expr)
    if expr.is_Symbol:
        return 1, expr, 0
    if expr.is_Mul and len(expr.args) == 2:
        c, s = expr.args  # sympy puts the number first
        if c.is_Integer and s.is_Symbol:
            return int(c), s, 0
        return None
    if expr.is_Add and len(expr.args) == 2:
        k, term = expr.args  # the number first
        inner = _linear(term) if k.is_Integer else None
        if inner is not None and inner[1] is not None and inner[2] == 0:
            return inner[0], inner[1], int(k)
    return None


def _against_zero(op: str, c: int, k: int) -> bool | str:
    """`d op 0` for every `d == c*s + k` with `s` a positive integer (`c >= 0`): a bool, or
    `DEPENDS` when two such `s` answer differently."""
    values = [k] if c == 0 else [c + k, 2 * c + k]  # the least two; larger ones are larger
    truths = {_TRUTH[op](d) for d in values}
    if c and op in ("eq", "ne") and c + k < 0 and k % c == 0:
        truths.add(op == "eq")  # d == 0 at s == -k / c, past the least two
    elif c and op in ("gt", "ge") and c + k <= 0:
        truths.add(True)  # d grows past zero
    elif c and op in ("lt", "le") and c + k <= 0:
        truths.add(False)
    return truths.pop() if len(truths) == 1 else DEPENDS


def decide(op: str, a, b) -> bool | str | None:
    """The truth of `a op b` (`op` one of eq, ne, gt, ge, lt, le; `a`, `b` sympy expressions)
    when it is one for every value of the one symbol they share, `DEPENDS` when it is not
    (NOTE [comparisons decided by arithmetic]), None for other expressions."""
    left, right = _linear(a), _linear(b)
    if left is None or right is None:
        return None
    symbol = left[1] if left[1] is not None else right[1]
    if right[1] is not None and right[1] != symbol:
        return None
    c, k = left[0] - right[0], left[2] - right[2]  # a - b == c*s + k
    if c and not (symbol.is_integer and symbol.is_positive):
        return None
    if c < 0:  # b - a == -c*s - k, compared the other way round
        c, k, op = -c, -k, _FLIPPED[op]
    return _against_zero(op, c, k)
