"""Dump every generated kernel source of the demo model and pythia-14m into a directory.

    .venv/bin/python tests/executors/snapshot_kernels.py /tmp/kernels_before
    diff -r /tmp/kernels_before /tmp/kernels_after

The models (the GPT of `examples/train_gpt.py` with its default config, litgpt's pythia-14m with
random weights as in `tests/models`) are traced with `executors=["codegen", "torch"]`: a
training step (forward and backward traces) and a no-grad forward, float32, plus a bfloat16
no-grad forward of pythia for the half-precision paths. Nothing is compiled (the compile policy
waits for 10**9 calls): each fusion's kernel is rendered here, by the CPU target for a few
layout classes and by the CUDA target for a few specs (rendering needs no GPU). Files are named
`<case>/<trace>_<k>_<target>_<layout>.{cpp,cu}`, with `k` the fusion's position in its trace,
so runs in different processes compare file by file. A kernel the CUDA target cannot render is
recorded as a `.unsupported` file holding the reason.

This is the byte-identity check of the codegen refactor (issue 17), kept as a tool for the next.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import fulmen  # noqa: E402
from fulmen.executors.codegen import set_compile_policy  # noqa: E402


def _renderers():
    """(cpu_render(kernel, layout), cuda_render(kernel, spec), Spec, RowSpec, RowKernel,
    vector_width, unsupported exception types) from whichever codegen layout is installed."""
    try:  # the package layout of issue 17
        from fulmen.executors.codegen.cpu import render_any as cpu_render
        from fulmen.executors.codegen.cuda import RowSpec, Spec, vector_width
        from fulmen.executors.codegen.cuda import render_any as cuda_render
        from fulmen.executors.codegen.ir import RowKernel
        from fulmen.executors.codegen.ops import Unsupported
        return cpu_render, cuda_render, Spec, RowSpec, RowKernel, vector_width, (Unsupported,)
    except ImportError:  # the layout before issue 17 (commit f2a01c3 and earlier)
        from fulmen.executors.codegen import cpp, cpp_rows, cuda, cuda_rows
        from fulmen.executors.codegen.ir import RowKernel
        from fulmen.executors.codegen.lower import Unsupported

        def cpu_render(kernel, layout):
            if isinstance(kernel, RowKernel):
                return cpp_rows.render_rows(kernel, layout)
            return cpp.render(kernel, layout)

        def cuda_render(kernel, spec):
            if isinstance(spec, cuda_rows.RowSpec):
                return cuda_rows.render_rows(kernel, spec)
            return cuda.render(kernel, spec)

        return (cpu_render, cuda_render, cuda.Spec, cuda_rows.RowSpec, RowKernel,
                cuda.vector_width, (Unsupported, cuda.Unsupported, KeyError))


def _cpu_layouts(kernel, RowKernel) -> dict[str, tuple]:
    nacc, nout = len(kernel.accesses), len(kernel.outputs)
    if isinstance(kernel, RowKernel):
        rows = tuple(kernel.access_rows) + tuple(kernel.output_rows)
        default = tuple(0 if row else 1 for row in rows)
        strided = tuple(0 if row else 2 for row in rows)
        return {"default": default, "strided": strided}
    return {"default": (1,) * (nacc + nout), "strided": (2,) * (nacc + nout),
            "broadcast": (0,) * nacc + (1,) * nout}


def _cuda_specs(kernel, Spec, RowSpec, RowKernel, vector_width) -> dict[str, object]:
    nacc, nout = len(kernel.accesses), len(kernel.outputs)
    if isinstance(kernel, RowKernel):
        rows = tuple(kernel.access_rows) + tuple(kernel.output_rows)
        default = tuple(0 if row else 1 for row in rows)
        columns = any(kernel.output_columns)
        specs = {"default": RowSpec(1, 1, default, 256, False, 4 if columns else 0, "int")}
        if not columns:
            strided = tuple(0 if row else 2 for row in rows)
            specs["split"] = RowSpec(2, 2, strided, 1024, True, 0, "long long")
        return specs
    default = (1,) * (nacc + nout)
    return {"default": Spec(1, default, vector_width(kernel, default), "int"),
            "strided": Spec(3, (2,) * (nacc + nout), 1, "long long"),
            "broadcast": Spec(1, (0,) * nacc + (1,) * nout,
                              vector_width(kernel, (0,) * nacc + (1,) * nout), "int")}


def dump(traces: dict[str, object], out: Path) -> int:
    """Render the kernels of every fusion of the execution traces into `out`; files written."""
    cpu_render, cuda_render, Spec, RowSpec, RowKernel, vector_width, unsupported = _renderers()
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for label, trace in traces.items():
        k = 0
        for bsym in trace.bsyms:
            lowered = getattr(bsym.sym.impl, "lowered", None)
            if lowered is None:
                continue
            kernel = lowered.kernel
            stem = f"{label}_{k:03d}"
            (out / f"{stem}_ir.txt").write_text(str(kernel) + "\n")
            for name, layout in _cpu_layouts(kernel, RowKernel).items():
                (out / f"{stem}_cpu_{name}.cpp").write_text(cpu_render(kernel, layout))
                written += 1
            for name, spec in _cuda_specs(kernel, Spec, RowSpec, RowKernel, vector_width).items():
                try:
                    (out / f"{stem}_cuda_{name}.cu").write_text(cuda_render(kernel, spec))
                except unsupported as error:
                    (out / f"{stem}_cuda_{name}.unsupported").write_text(f"{error}\n")
                written += 1
            k += 1
    return written


def _train_step(jmodel, ids):
    logits = jmodel(ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
    loss.backward()


def cases():
    """(case name, model factory, dtype, training?, ids) of each traced call."""
    from train_gpt import make_model

    from tests.models.test_real_models import VOCAB, pythia

    def gpt():
        return make_model(layers=2, width=128, heads=4, context=128)

    return [("gpt_train", gpt, torch.float32, True, (2, 128), 256),
            ("gpt_eval", gpt, torch.float32, False, (2, 128), 256),
            ("pythia_train", pythia, torch.float32, True, (2, 16), VOCAB),
            ("pythia_eval", pythia, torch.float32, False, (2, 16), VOCAB),
            ("pythia_eval_bf16", pythia, torch.bfloat16, False, (2, 16), VOCAB)]


def op_kernels():
    """One small pointwise kernel per supported (op, operand dtype) of the executor's prims,
    every conversion pair, and pow by each constant exponent: the whole op table, rendered."""
    from fulmen.executors.codegen.ir import Access, Const, Kernel, Load, Op

    try:
        from fulmen.executors.codegen.ops import OPS
        supported = {name: op.dtypes for name, op in OPS.items() if op.arity}
    except ImportError:
        from fulmen.executors.codegen.lower import SUPPORTED as supported
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
              torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]
    boolean = {"eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite", "signbit",
               "logical_not"}
    unary = {"neg", "abs", "floor", "ceil", "round", "trunc", "sign", "logical_not", "isnan",
             "isinf", "isfinite", "signbit", "bitwise_not", "exp", "exp2", "expm1", "log",
             "log1p", "log2", "log10", "sqrt", "rsqrt", "sin", "cos", "tan", "asin", "acos",
             "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc",
             "reciprocal"}
    kernels = {}
    for name in sorted(supported):
        if name in ("convert_element_type", "where"):
            continue
        for dtype in [d for d in dtypes if d in supported[name]]:
            out = torch.bool if name in boolean else dtype
            if name in unary:
                acc, values = (Access(0, ()),), (Load(0, dtype), Op(name, (0,), out))
            else:
                acc = (Access(0, ()), Access(1, ()))
                values = (Load(0, dtype), Load(1, dtype), Op(name, (0, 1), out))
            kernels[f"{name}_{str(dtype)[6:]}"] = Kernel(acc, (dtype,) * len(acc), values,
                                                         (len(values) - 1,))
    for src in dtypes:
        for dst in dtypes:
            values = (Load(0, src), Op("convert_element_type", (0,), dst))
            kernels[f"convert_{str(src)[6:]}_{str(dst)[6:]}"] = Kernel(
                (Access(0, ()),), (src,), values, (1,))
    for dtype in dtypes:
        values = (Load(0, torch.bool), Load(1, dtype), Load(2, dtype), Op("where", (0, 1, 2), dtype))
        kernels[f"where_{str(dtype)[6:]}"] = Kernel(
            (Access(0, ()), Access(1, ()), Access(2, ())), (torch.bool, dtype, dtype), values, (3,))
    for dtype in (torch.float16, torch.float32, torch.float64):
        for exponent in (2.0, 3.0, 0.5, -0.5, -1.0, -2.0, 1.0, 1.5, float("inf"), float("nan")):
            edtype = torch.float64 if dtype == torch.float32 else dtype
            values = (Load(0, dtype), Const(exponent, edtype), Op("pow", (0, 1), dtype))
            kernels[f"pow_{str(dtype)[6:]}_{exponent}"] = Kernel(
                (Access(0, ()),), (dtype,), values, (2,))
    return kernels


def dump_ops(out: Path) -> int:
    """Render every kernel of `op_kernels` on both targets (errors recorded as text)."""
    cpu_render, cuda_render, Spec, _, _, vector_width, _ = _renderers()
    out.mkdir(parents=True, exist_ok=True)
    for name, kernel in op_kernels().items():
        n = len(kernel.accesses) + len(kernel.outputs)
        for suffix, render, layout in (
                ("cpp", cpu_render, (1,) * n),
                ("cu", cuda_render, Spec(1, (1,) * n, vector_width(kernel, (1,) * n), "int"))):
            try:
                text = render(kernel, layout)
            except Exception as error:  # noqa: BLE001 - the snapshot records every outcome
                text = f"ERROR {type(error).__name__}: {error}\n"
            (out / f"{name}.{suffix}").write_text(text)
    return 2 * len(op_kernels())


def main(out: Path) -> None:
    set_compile_policy("lazy", hot_calls=10**9)  # render only, never compile
    total = dump_ops(out / "ops")
    print(f"ops: {total} sources")
    for name, make, dtype, training, shape, vocab in cases():
        torch.manual_seed(0)
        model = make().to(dtype)
        model.train(training)
        ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0))
        jmodel = fulmen.jit(model, executors=["codegen", "torch"])
        if training:
            _train_step(jmodel, ids)
            traces = {"fwd": fulmen.last_traces(jmodel)[-1],
                      "bwd": fulmen.last_backward_traces(jmodel)[-1]}
        else:
            with torch.no_grad():
                jmodel(ids)
            traces = {"fwd": fulmen.last_traces(jmodel)[-1]}
        count = dump(traces, out / name)
        total += count
        print(f"{name}: {count} sources")
    print(f"{total} sources in {out}")


if __name__ == "__main__":
    os.environ.setdefault("FULMEN_CACHE_DIR", "/tmp/fulmen-snapshot-cache")
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kernels"))
