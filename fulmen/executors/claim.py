"""The claim pass: turn a trace of torch-level ops into an execution trace.

For each statement, the executors are asked in priority order; the first that claims it
(`OperatorExecutor.claim`) replaces it with a call of its implementation. A statement nobody
claims is replaced by its subsymbols, each offered in turn. Fusion executors run their fusion
pass over the trace first.
"""

from __future__ import annotations

from collections.abc import Sequence

from fulmen.core import BoundSymbol, FulmenError, Trace
from fulmen.executors.base import Executor, FusionExecutor, OperatorExecutor
from fulmen.transforms.base import transform


def _claim(bsym: BoundSymbol, executors: Sequence[OperatorExecutor]) -> list[BoundSymbol]:
    for ex in executors:
        claimed = ex.claim(bsym)
        if claimed is not None:
            return [claimed]
    if bsym.sym.executor is not None and bsym.sym.executor not in executors:
        raise FulmenError(
            f"is an operator of executor {bsym.sym.executor.name!r}, which is not in the "
            "executor list",
            op=bsym.sym.python_name,
            where=bsym.source,
            hint=f"pass executors=[{bsym.sym.executor.name!r}, ...] to fulmen.jit",
        )
    if not bsym.subsymbols:
        names = [ex.name for ex in executors]
        raise FulmenError(f"no executor in {names} can run it", op=bsym.sym.id, where=bsym.source)
    claimed = []
    for sub in bsym.subsymbols:
        claimed.extend(_claim(sub.replace(source=bsym.source), executors))
    return claimed


@transform("claiming by executors")
def claim_executors(trace: Trace, executors: Sequence[Executor]) -> Trace:
    """Rewrite every statement to run on the first executor in `executors` that claims it."""
    for i, ex in enumerate(executors):
        if isinstance(ex, FusionExecutor):
            before = [e for e in executors[:i] if isinstance(e, OperatorExecutor)]
            trace = ex.fusion_pass(trace, before)
    operator_executors = [ex for ex in executors if isinstance(ex, OperatorExecutor)]
    bsyms = []
    for bsym in trace.bsyms:
        if bsym.sym.python_name == "del" or isinstance(bsym.sym.executor, FusionExecutor):
            bsyms.append(bsym)
        else:
            bsyms.extend(_claim(bsym, operator_executors))
    return trace.replace(bsyms=tuple(bsyms))
