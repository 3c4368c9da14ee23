"""The python executor: elementwise prims on Python numbers, as Python arithmetic.

Python numbers are concrete while tracing, so arithmetic on them is folded and never reaches a
trace today; this executor claims number-only prims should a transform produce them (and
serves as the smallest example of an operator executor).
"""

from __future__ import annotations

import math
import operator
from numbers import Number

from fulmen.executors.base import OperatorExecutor
from fulmen.executors.registry import register_executor
from fulmen.ops import prims

python_ex = OperatorExecutor("python")


def _numbers_only(*args, **kwargs) -> bool:
    return all(isinstance(arg, Number) for arg in args)


_PYTHON_OPS = {
    prims.add: operator.add, prims.sub: operator.sub, prims.mul: operator.mul,
    prims.div: operator.truediv, prims.floor_div: operator.floordiv, prims.pow: operator.pow,
    prims.neg: operator.neg, prims.abs: operator.abs, prims.eq: operator.eq,
    prims.ne: operator.ne, prims.lt: operator.lt, prims.le: operator.le, prims.gt: operator.gt,
    prims.ge: operator.ge, prims.sqrt: math.sqrt, prims.exp: math.exp, prims.log: math.log,
    prims.floor: math.floor, prims.ceil: math.ceil, prims.trunc: math.trunc,
}  # fmt: skip

for _prim, _fn in _PYTHON_OPS.items():
    python_ex.register_implementation(_prim, fn=_fn, checker=_numbers_only)

register_executor(python_ex)

__all__ = ["python_ex"]
