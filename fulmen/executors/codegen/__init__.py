"""The codegen executor: fusion regions of prims -> generated kernels (C++ for CPU tensors,
CUDA C++ for CUDA tensors).

    jfn = fulmen.jit(fn, executors=["codegen", "torch"])
    jfn(x, w)
    print(fulmen.last_traces(jfn)[-1])      # t3 = codegen.fusion0(x, w), its prims as comments
    print(fulmen.last_kernels(jfn)["fusion0"])  # the generated source

The package reads as the pipeline (each module imports only those above it):

    ops.py      the kernel op table (arity, dtypes, common C spellings) and fusibility
    ir.py       the kernel IR;  sizes.py: symbolic sizes (what lowering may decide, each call's)
    lower.py / rows.py: a region -> a pointwise / row kernel
    target.py   `Target`: how one dialect spells IR values (types, literals, loads, ops)
    build.py    when kernels compile, the compile threads, build keys;  cache.py: the disk cache
    region.py   what every fused-region callable shares (strides, outputs, the fallback)
    cpu/        the C++ target: render, rows, compiler, output pool, runtime
    cuda/       the CUDA target: render, rows, NVRTC, runtime

The shared partitioner (`fulmen.transforms.fusion`) groups fusible prims into regions; a prim is
fusible when the op table lists it for its dtype and the target of its device spells it, so a
fused region always renders. A new CPU kernel costs a C++ compile of about a second, so by
default (`build.py`: `set_compile_policy`) a region runs its prims on the torch executor until it
is hot, while its kernel compiles in the background.
"""

from __future__ import annotations

import functools

import torch

from fulmen.core import BoundSymbol, Trace
from fulmen.executors.base import FusionExecutor
from fulmen.executors.codegen.build import set_compile_policy
from fulmen.executors.codegen.cpu import CPU, FusedRegion
from fulmen.executors.codegen.cuda import CUDA, CudaFusedRegion
from fulmen.executors.codegen.lower import fits_pointwise
from fulmen.executors.codegen.ops import REDUCTIONS, VIEWS, Unsupported, fusible
from fulmen.executors.codegen.region import RegionCallable
from fulmen.executors.codegen.rows import RowChecks, lower_any
from fulmen.executors.codegen.target import Target
from fulmen.executors.dense_layout import dense_order
from fulmen.executors.registry import get_executor, register_executor
from fulmen.executors.torch import AS_LAYOUT

__all__ = ["CodegenExecutor", "codegen_ex", "kernel_sources", "set_compile_policy",
           "target_of", "wait_for_kernels"]

# device type -> (target, the callable class of its fusions)
TARGETS: dict[str, tuple[Target, type]] = {"cpu": (CPU, FusedRegion),
                                           "cuda": (CUDA, CudaFusedRegion)}


def target_of(bsym: BoundSymbol) -> Target | None:
    """The target rendering `bsym`'s kernels: that of the one device of its tensors, when the
    target can build kernels here; else None (`bsym` is not fused)."""
    args = [*bsym.args[0], *bsym.args[1:]] if bsym.sym.name == "cat" else bsym.args
    devices = {a.device for a in args if isinstance(a, torch.Tensor)}
    if len(devices) != 1:
        return None
    target = TARGETS.get(next(iter(devices)).type, (None, None))[0]
    return target if target is not None and target.available() else None


def _cat_of_views(region: list[BoundSymbol]) -> bool:
    """Whether a CPU region computes nothing: views of its inputs concatenated. The kernel
    would read every operand, masked, at every element (a qkv split's backward: 3 masked
    strided loads per element, about 4x the time of torch's copies and `cat` on GPT-2's
    (2, 64, 192) gradient); torch copies each operand once into its place. CUDA keeps the
    kernel (one launch instead of several)."""
    names = {bsym.sym.name for bsym in region}
    return "cat" in names and names <= VIEWS | {"cat"} and all(
        proxy.device.type == "cpu" for bsym in region for proxy in bsym.proxy_outputs)


def _on_torch(body: Trace):
    """The fallback of a codegen fusion: its region's own trace run by the torch executor.

    NOTE [the fallback's layouts]: torch's ops follow their operands' layout where eager's
    whole op may not (a layer norm of a transposed input is row-major in eager, its prims run
    one by one give a transposed result), and the claim pass takes a fusion's outputs to be
    laid out as its kernel writes them. So an output whose eager layout the trace knows (exact,
    dense strides) comes back in that layout: `F.layer_norm(x.T)` returned transposed
    strides for the calls before its kernel was ready (the lazy compile policy), eager's after.
    Symbolic strides give the order of the dims, and the strides follow from the run's sizes
    (`x.softmax(-1)` of a transposed `x` next to other fused outputs, dynamic: transposed
    strides for the first calls, row-major once the kernel ran).
    """
    run = FusionExecutor.fallback_callable(body, get_executor("torch"))
    single = not isinstance(body.output, tuple)
    layouts = [_known_layout(p) for p in ((body.output,) if single else body.output)]
    if not any(layouts):
        return run

    def relaid(*inputs):
        results = run(*inputs)
        listed = [results] if single else list(results)
        listed = [t if s is None else AS_LAYOUT.impl(t, s(t.shape) if callable(s) else s)
                  for t, s in zip(listed, layouts)]
        return listed[0] if single else tuple(listed)

    return relaid


def _known_layout(proxy):
    """`proxy`'s strides when they are eager's (exact), dense and non-overlapping: a tuple
    when static, else a function of the run's shape giving them (`_strides_in_order`)."""
    if not getattr(proxy, "_fulmen_exact_strides", False):
        return None
    shape, strides = tuple(proxy.shape), tuple(proxy.stride())
    if not all(type(v) is int for v in (*shape, *strides)):
        order = dense_order(shape, strides)
        return None if order is None else functools.partial(_strides_in_order, order)
    expected = 1
    for size, stride in sorted((p for p in zip(shape, strides) if p[0] > 1),
                               key=lambda p: p[1]):
        if stride != expected:
            return None
        expected *= size
    return strides


def _strides_in_order(order: list[int], shape) -> tuple[int, ...]:
    """Dense strides of `shape` with the dims of `order` innermost first (a dim not in it has
    size 1 or 0: its stride is never compared)."""
    strides, expected = [0] * len(shape), 1
    for d in order:
        strides[d] = expected
        expected *= shape[d]
    return tuple(expected if d not in order else s for d, s in enumerate(strides))


class CodegenExecutor(FusionExecutor):
    """Fuses elementwise prims, the views feeding them and row reductions into one kernel per
    region, rendered for the region's device by its target. Regions with symbolic sizes are
    fused too (`sizes.py`): one kernel serves every size."""

    symbolic_sizes = True
    asks_escapes = True  # a lazy value (lower.py) leaving its region makes it unlowerable

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        return fusible(bsym, target_of(bsym))

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._row_checks = RowChecks()  # NOTE [growing row regions]

    def can_fuse_region(self, region: list[BoundSymbol], escapes=None) -> bool:
        if not any(bsym.sym.name in REDUCTIONS for bsym in region):
            return fits_pointwise(region, escapes)
        return self._row_checks.fits(region)

    def fuse(self, region: list[BoundSymbol], outputs: list) -> BoundSymbol | None:
        """One `codegen.fusionN(inputs...)` statement computing `outputs`, or None when the
        region has no computation, only moves elements into a `cat` on the CPU, or does not
        lower."""
        if _cat_of_views(region):
            return None
        try:
            lowered = lower_any(region, outputs)
        except Unsupported:
            return None
        if not lowered.kernel.outputs:
            return None
        name = self.next_fusion_name()
        output = outputs[0] if len(outputs) == 1 else tuple(outputs)
        body = Trace(name, tuple(lowered.inputs), tuple(region), output,
                     provenance=f"fusion region of {self.name}")
        on_cuda = any(isinstance(p, torch.Tensor) and p.device.type == "cuda"
                      for p in lowered.inputs)
        runtime = TARGETS["cuda" if on_cuda else "cpu"][1]
        try:
            impl = runtime(name, lowered, functools.partial(_on_torch, body))
        except Unsupported:  # symbolic sizes its inputs' shapes do not determine
            return None
        return self.fusion_statement(name, impl, region, lowered.inputs, outputs)


def kernel_sources(*traces: Trace) -> dict[str, str]:
    """The generated C++ (CUDA C++ for CUDA regions) of every fusion in execution traces, by
    fusion name; a fusion compiled for several layouts lists each (`fulmen.last_kernels(jfn)`
    gives those of a jitted function's last compilation, forward and backward).

    Example:
        >>> kernel_sources(fulmen.last_traces(jfn)[-1])["fusion0"]
    """
    sources = {}
    for trace in traces:
        for bsym in trace.bsyms:
            impl = bsym.sym.impl
            if isinstance(impl, RegionCallable):
                sources[bsym.sym.name] = "\n".join(impl.sources.values())
    return sources


def wait_for_kernels(*traces: Trace) -> None:
    """Block until every kernel started for the fusions of these execution traces is compiled
    (lazy policy: the kernels of regions already hot; errors surface at the next call)."""
    for trace in traces:
        for bsym in trace.bsyms:
            if isinstance(bsym.sym.impl, FusedRegion):
                bsym.sym.impl.wait()


codegen_ex = register_executor(CodegenExecutor("codegen"))
