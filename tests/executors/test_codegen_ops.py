"""Op completeness of the codegen executor (issue 17): every op of the kernel op table has a
spelling on each target or is declared unfusible there, every prim the executor would fuse is
renderable by the target of its device, and every op of the table is a prim.

Removing a spelling from `ops.OPS` (or a target's override) makes `test_every_op_is_spelled_or_
declared_unfusible_on_each_target` name the (target, op, dtype) that lost it; a spelling that
renders to nothing the target knows makes `test_spelled_ops_render` fail."""

import shutil
import subprocess

import pytest
import torch

from fulmen.executors.codegen import codegen_ex
from fulmen.executors.codegen.cpu import CPU
from fulmen.executors.codegen.cpu import render_any as cpu_render
from fulmen.executors.codegen.cpu.target import PRELUDE as CPU_PRELUDE
from fulmen.executors.codegen.cuda import CUDA, RowSpec, Spec
from fulmen.executors.codegen.cuda import render_any as cuda_render
from fulmen.executors.codegen.ir import Access, Const, Kernel, Load, Op, Reduce, RowKernel
from fulmen.executors.codegen.ops import ALL, OPS, REDUCTIONS, Unsupported, dtype_class
from fulmen.executors.codegen.target import Target
from fulmen.ops import prims
from fulmen.ops.prims.base import all_prims
from fulmen.proxies import TensorProxy
from fulmen.tracer import trace_program

TARGETS = {"cpu": CPU, "cuda": CUDA}
DTYPES = sorted(ALL, key=str)
ELEMENTWISE = sorted(name for name, op in OPS.items() if op.arity)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _render(target: Target, kernel) -> str:
    n = len(kernel.accesses) + len(kernel.outputs)
    if target is CPU:
        layout = tuple(0 if row else 1 for row in kernel.access_rows + kernel.output_rows) \
            if isinstance(kernel, RowKernel) else (1,) * n
        return cpu_render(kernel, layout)
    if isinstance(kernel, RowKernel):
        classes = tuple(0 if row else 1 for row in kernel.access_rows + kernel.output_rows)
        return cuda_render(kernel, RowSpec(1, 1, classes, 256))
    return cuda_render(kernel, Spec(1, (1,) * n))


def _op_kernel(name: str, dtype: torch.dtype) -> Kernel:
    """`name` applied to loads of `dtype` (where: a bool mask and two `dtype` values)."""
    op = OPS[name]
    if name == "where":
        dtypes = (torch.bool, dtype, dtype)
    else:
        dtypes = (dtype,) * op.arity
    values = [Load(i, d) for i, d in enumerate(dtypes)]
    out = torch.bool if name in ("eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf",
                                 "isfinite", "signbit", "logical_not") else dtype
    values.append(Op(name, tuple(range(len(dtypes))), out))
    return Kernel(tuple(Access(i, ()) for i in range(len(dtypes))), dtypes, tuple(values),
                  (len(values) - 1,))


def test_every_op_is_spelled_or_declared_unfusible_on_each_target():
    missing = []
    for target in TARGETS.values():
        for name in ELEMENTWISE:
            for dtype in OPS[name].dtypes:
                declared = (name, dtype_class(dtype)) in target.unfusible
                if not target.spells(name, dtype) and not declared:
                    missing.append((target.name, name, _name(dtype)))
    assert not missing, f"ops without a spelling (spell them or declare them unfusible): {missing}"


def test_declared_unfusible_ops_are_not_spelled():
    for target in TARGETS.values():
        for name, cls in target.unfusible:
            dtype = {"float": torch.float32, "int": torch.int32, "bool": torch.bool}[cls]
            assert not target.spells(name, dtype), (target.name, name, cls)


@pytest.mark.parametrize("target", sorted(TARGETS), ids=str)
def test_spelled_ops_render(target):
    """Every (op, dtype) a target spells renders into a kernel with the op's expression."""
    target = TARGETS[target]
    for name in ELEMENTWISE:
        for dtype in OPS[name].dtypes:
            if target.spells(name, dtype):
                source = _render(target, _op_kernel(name, dtype))
                assert "v1" in source or name == "where", (target.name, name, dtype)


@pytest.mark.parametrize("target", sorted(TARGETS), ids=str)
def test_every_reduction_renders_on_each_target(target):
    target = TARGETS[target]
    for name, dtypes in REDUCTIONS.items():
        if name == "var":
            continue  # lowered to float64 sums (rows.py)
        for dtype in dtypes:
            kernel = RowKernel((Access(0, ()),), (dtype,), (False,),
                               (Load(0, dtype), Reduce(name, 0, dtype)), (False, True), (1,))
            assert "v1" in _render(target, kernel), (target.name, name, dtype)


def test_every_op_of_the_table_is_a_prim():
    assert set(OPS) - set(all_prims()) == set()


def test_unknown_spellings_raise_unsupported_on_every_target():
    kernel = Kernel((Access(0, ()),), (torch.float32,),
                    (Load(0, torch.float32), Op("no_such_op", (0,), torch.float32)), (1,))
    for target in TARGETS.values():
        with pytest.raises(Unsupported):
            _render(target, kernel)


def _prim_bsyms(name: str, dtype: torch.dtype, device: str) -> list:
    """The statements of `prims.<name>` traced on proxies of `dtype` (none if its meta
    function refuses them)."""
    prim = getattr(prims, name)
    arity = 3 if name == "where" else OPS[name].arity

    def fn(*args):
        if name == "convert_element_type":
            return prim(args[0], torch.float32)
        return prim(*args)

    args = [TensorProxy(None, (4,), dtype, device) for _ in range(arity)]
    if name == "where":
        args[0] = TensorProxy(None, (4,), torch.bool, device)
    try:
        program = trace_program(fn, tuple(args), {})
    except Exception:  # noqa: BLE001 - a meta function refusing these dtypes
        return []
    return [b for b in program.trace.bsyms if b.sym.name == name]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_prim_fused_is_renderable(device):
    """What `can_fuse` accepts, the target of its device renders: fusibility is derived from
    the op table and the target, so no region can discover at call time that it cannot."""
    if not TARGETS[device].available():
        pytest.skip(f"the {device} target cannot build kernels here")
    fused = 0
    for name in ELEMENTWISE:
        for dtype in DTYPES:
            for bsym in _prim_bsyms(name, dtype, device):
                if not codegen_ex.can_fuse(bsym):
                    continue
                fused += 1
                if name == "convert_element_type":
                    kernel = Kernel((Access(0, ()),), (dtype,),
                                    (Load(0, dtype), Op(name, (0,), torch.float32)), (1,))
                else:
                    kernel = _op_kernel(name, dtype)
                _render(TARGETS[device], kernel)
    assert fused > 100


def test_pow_by_a_constant_is_one_decomposition_on_both_targets():
    kernel = Kernel((Access(0, ()),), (torch.float64,),
                    (Load(0, torch.float64), Const(2.0, torch.float64),
                     Op("pow", (0, 1), torch.float64)), (2,))
    for target in TARGETS.values():
        assert "(v0 * v0)" in _render(target, kernel)


def _spelled_kernels(target: Target) -> list[Kernel]:
    return [_op_kernel(name, dtype) for name in ELEMENTWISE for dtype in sorted(OPS[name].dtypes,
                                                                               key=str)
            if name != "convert_element_type" and target.spells(name, dtype)]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_cpu_spellings_compile(tmp_path):
    """Every spelled (op, dtype) of the CPU target is valid C++ (one translation unit)."""
    kernels = _spelled_kernels(CPU)
    bodies = [cpu_render(k, (1,) * (len(k.accesses) + 1)).removeprefix(CPU_PRELUDE).replace("fulmen_kernel", f"k{i}")
              for i, k in enumerate(kernels)]
    source = tmp_path / "ops.cpp"
    source.write_text(CPU_PRELUDE + "\n".join(bodies))
    result = subprocess.run(["g++", "-std=c++17", "-fopenmp", "-fsyntax-only", str(source)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def test_cuda_spellings_compile():
    """Every spelled (op, dtype) of the CUDA target compiles with NVRTC (no GPU needed)."""
    pytest.importorskip("cuda.bindings", reason="cuda-python is not installed")
    from fulmen.executors.codegen.cuda import nvrtc
    from fulmen.executors.codegen.cuda.render import render_body
    from fulmen.executors.codegen.cuda.target import prelude

    kernels = _spelled_kernels(CUDA)
    bodies = [render_body(k, Spec(1, (1,) * (len(k.accesses) + 1)), f"k{i}")
              for i, k in enumerate(kernels)]
    try:
        nvrtc.compile_source(prelude(True, True) + "\n".join(bodies), 80)
    except nvrtc.NvrtcError as error:
        if "failed for" in str(error):
            raise
        pytest.skip(f"NVRTC unusable here: {error}")
