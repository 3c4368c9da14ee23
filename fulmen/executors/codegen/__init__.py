"""The codegen executor: fusion regions of prims -> generated C++ kernels for CPU tensors.

    jfn = fulmen.jit(fn, executors=["codegen", "torch"])
    jfn(x, w)
    print(fulmen.last_traces(jfn)[-1])      # t3 = codegen.fusion0(x, w), its prims as comments
    print(fulmen.last_kernels(jfn)["fusion0"])  # the generated C++

The shared partitioner (`fulmen.transforms.fusion`) groups fusible prims into regions;
`lower.py` turns a pointwise region into the kernel IR (`ir.py`) and `rows.py` a region with
reductions (the normalisation schedule); `cpp.py` / `cpp_rows.py` render them, `build.py`
builds them, `cache.py` keeps them on disk (`FULMEN_CACHE_DIR`; private, verified before
loading), and `runtime.py` calls them. A new kernel costs a C++ compile of about a second, so by
default (`policy.py`: `set_compile_policy`) a region runs its prims on the torch executor until
it is hot, while its kernel compiles in the background.
"""

from __future__ import annotations

import itertools

from fulmen.core import BoundSymbol, Symbol, Trace
from fulmen.executors.base import FusionExecutor
from fulmen.executors.codegen import nvrtc
from fulmen.executors.codegen.lower import REDUCTIONS, Unsupported, fits_pointwise, fusible
from fulmen.executors.codegen.policy import set_compile_policy
from fulmen.executors.codegen.rows import lower_any
from fulmen.executors.codegen.runtime import FusedRegion
from fulmen.executors.registry import register_executor

__all__ = ["CodegenExecutor", "codegen_ex", "kernel_sources", "set_compile_policy",
           "wait_for_kernels"]

_fusion_ids = itertools.count()


class CodegenExecutor(FusionExecutor):
    """Fuses elementwise prims (and the views feeding them) into one C++ loop per region."""

    def __init__(self, name: str = "codegen") -> None:
        super().__init__(name)
        self.fusions: dict[str, Symbol] = {}

    def __getattr__(self, name: str) -> Symbol:
        fusions = self.__dict__.get("fusions", {})
        if name in fusions:
            return fusions[name]
        raise AttributeError(f"executor {self.__dict__.get('name')!r} has no fusion {name!r}")

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        return fusible(bsym) or nvrtc.fusible(bsym)  # nvrtc: regions of CUDA tensors

    def can_fuse_region(self, region: list[BoundSymbol]) -> bool:
        if not any(bsym.sym.name in REDUCTIONS for bsym in region):
            return fits_pointwise(region)
        try:
            lower_any(region, [], check_only=True)
        except Unsupported:
            return False
        return True

    def fuse(self, region: list[BoundSymbol], outputs: list) -> BoundSymbol | None:
        """One `codegen.fusionN(inputs...)` statement computing `outputs`, or None when the
        region has no computation or does not lower."""
        try:
            lowered = lower_any(region, outputs)
        except Unsupported:
            return None
        if not lowered.kernel.outputs:
            return None
        name = f"fusion{next(_fusion_ids)}"
        output = outputs[0] if len(outputs) == 1 else tuple(outputs)
        body = Trace(name, tuple(lowered.inputs), tuple(region), output,
                     provenance=f"fusion region of {self.name}")
        on_cuda = any(p.device.type == "cuda" for p in lowered.inputs)
        impl = (nvrtc.CudaFusedRegion if on_cuda else FusedRegion)(name, lowered, body)
        sym = Symbol(name, None, namespace=self.namespace, python_name=f"{self.name}.{name}",
                     impl=impl, tags={"fusion"}, executor=self)
        self.fusions[name] = sym
        return BoundSymbol(sym, tuple(lowered.inputs), {}, output, tuple(region), region[0].source)


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
            if isinstance(impl, (FusedRegion, nvrtc.CudaFusedRegion)):
                sources[bsym.sym.name] = "\n".join(impl.sources.values())
    return sources


def wait_for_kernels(*traces: Trace) -> None:
    """Block until every kernel started for the fusions of these execution traces is compiled
    (lazy policy: the kernels of regions already hot; errors surface at the next call)."""
    for trace in traces:
        for bsym in trace.bsyms:
            if isinstance(bsym.sym.impl, FusedRegion):
                bsym.sym.impl.wait()


codegen_ex = register_executor(CodegenExecutor())
