"""The statement-level half of `fulmen.verify`: narrow a diverging stage to its first
diverging statement (against the stage before it, or a fusion against its own region run by
torch) and write a standalone repro script for it (see `fulmen.tools.verify`).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.utils._pytree as pytree

from fulmen.core import BoundSymbol, Trace
from fulmen.core.interpret import interpret
from fulmen.core.printer import print_trace, statement_source
from fulmen.core.proxy import iter_proxies
from fulmen.tools.repro import fusion_preamble, portable_statement
from fulmen.tools.tolerances import _compare


def _narrow(good: Trace, bad: Trace, inputs_for, rtol, atol) -> BoundSymbol | None:
    """The first statement of `bad` whose outputs differ from `good`'s values of the same names
    (or, for a statement without counterparts, from its own subsymbols run by torch)."""
    _, good_env = interpret(good, *inputs_for(good))
    _, bad_env = interpret(bad, *inputs_for(bad))
    for bsym in bad.bsyms:
        if bsym.is_del:
            continue
        outputs = list(iter_proxies(bsym.output))
        known = [p for p in outputs if p.name in good_env]
        if known:
            ok, _, _ = _compare([bad_env[p.name] for p in known],
                                [good_env[p.name] for p in known], rtol, atol)
            if not ok:
                return bsym
        elif bsym.subsymbols:
            region = Trace("region", tuple(bsym.proxy_inputs), bsym.subsymbols, bsym.output)
            reference, _ = interpret(region, *[bad_env[p.name] for p in bsym.proxy_inputs])
            actual = [bad_env[p.name] for p in outputs]
            if not _compare(actual, pytree.tree_leaves(reference), rtol, atol)[0]:
                return bsym
    return None


def _counterpart(good: Trace, bsym: BoundSymbol) -> BoundSymbol | None:
    names = bsym.output_names
    return next((b for b in good.bsyms if b.output_names & names), None)


def _is_fusion(bsym: BoundSymbol) -> bool:
    return "fusion" in bsym.sym.tags and bsym.sym.executor is not None and bool(bsym.subsymbols)


def _write_repro(culprit: BoundSymbol, reference: BoundSymbol | None, directory: str) -> str:
    """A script that runs the culprit and its reference on random inputs of the same metadata
    and exits 1 when they disagree; it needs no state of this process (fusions are rebuilt).
    A fusion's reference is its own region, run by torch."""
    inputs = culprit.proxy_inputs
    parts = []
    statement = portable_statement(culprit)
    reference = portable_statement(reference) if reference is not None else None
    reference_call = None
    if _is_fusion(culprit):
        preamble, statement = fusion_preamble(culprit)
        parts.append(preamble)
        reference_call = f"{culprit.sym.name}_region"
        reference_inputs = inputs
    region = Trace("region", tuple(inputs), (statement,), culprit.output)
    parts.insert(0, print_trace(region)[0])
    if reference_call is None and reference is not None:
        if _is_fusion(reference):
            preamble, reference = fusion_preamble(reference)
            parts.append(preamble)
        ref_trace = Trace("reference", tuple(reference.proxy_inputs), (reference,),
                          reference.output)
        parts.append(print_trace(ref_trace)[0])
        reference_call = "reference"
        reference_inputs = reference.proxy_inputs
    makers = []
    for proxy in inputs:
        dtype = str(proxy.dtype)
        if proxy.dtype.is_floating_point or proxy.dtype.is_complex:
            makers.append(f"torch.randn({tuple(proxy.shape)}, dtype={dtype})")
        elif proxy.dtype == torch.bool:
            makers.append(f"torch.rand({tuple(proxy.shape)}) > 0.5")
        else:
            makers.append(f"torch.randint(0, 8, {tuple(proxy.shape)}, dtype={dtype})")
    by_name = ", ".join(f"{p.name!r}: {m}" for p, m in zip(inputs, makers))
    ref_args = ", ".join(f"values[{p.name!r}]" for p in (reference_inputs if reference_call
                                                         else ()))
    main = f'''

if __name__ == "__main__":
    import sys

    from fulmen.tools.verify import check_repro

    torch.manual_seed(0)
    values = {{{by_name}}}
    actual = region(*values.values())
    expected = {f"{reference_call}({ref_args})" if reference_call else "None"}
    if expected is None:
        print("no reference statement; actual:", actual)
        sys.exit(0)
    sys.exit(check_repro(actual, expected))
'''
    # the printed traces each carry their own header and imports; keep them as one module
    source = "\n\n".join(parts) + main
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"fulmen_repro_{culprit.sym.name}.py")
    with open(path, "w") as handle:
        handle.write(source)
    return path


def _locate(report, good, bad, inputs_for, rtol, atol, repro_dir) -> None:
    """Narrow a divergence of stage `bad` (vs the stage `good` before it) to one statement;
    `inputs_for(trace)` gives a stage's arguments."""
    if good is None:
        return
    culprit = _narrow(good, bad, inputs_for, rtol, atol)
    if culprit is None:
        return
    report.culprit = statement_source(culprit)
    report.culprit_op = culprit.sym.name
    reference = _counterpart(good, culprit)
    if reference is not None:
        report.culprit_op = f"{culprit.sym.name} (replacing {reference.sym.python_name})"
    directory = repro_dir or tempfile.mkdtemp(prefix="fulmen_verify_")
    report.repro_path = _write_repro(culprit, reference, directory)
