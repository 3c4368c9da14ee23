"""The CUDA renderer and NVRTC: every kernel of the fusion corpus compiles for sm_80 and sm_90
with no warnings (no GPU needed: traces are built on "cuda" proxies), the layout planning and
argument packing, the disk cache, the fallback; and, marked `cuda`, execution against eager.

The corpus: every fusible elementwise op_db op (the codegen executor's corpus) in float32 and
in float16/bfloat16/float64 where the op supports them on CUDA, plus the regions of tiny HF
GPT-2 and Llama models. Each region's kernel is rendered for four layout classes (contiguous
vectorised, contiguous scalar, broadcast and strided with 64-bit indices); the kernels are
compiled many per NVRTC program to stay fast.
"""

import functools
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.testing._internal.opinfo.core import BinaryUfuncInfo, UnaryUfuncInfo

import fulmen
from fulmen.executors import get_executor
from fulmen.executors.claim import claim_executors
from fulmen.executors.codegen.ir import RowKernel
from fulmen.proxies import TensorProxy
from fulmen.tracer import trace_program
from fulmen.transforms import dce
from fulmen.transforms.autodiff import split_forward_backward
from tests.executors.test_codegen import EXTRA, NOT_FUSED
from tests.ops.opinfo_harness import matched_opinfos, samples

pytest.importorskip("cuda.bindings", reason="cuda-python is not installed")
from fulmen.executors.codegen.cuda import nvrtc  # noqa: E402
from fulmen.executors.codegen.cuda import render as cuda  # noqa: E402
from fulmen.executors.codegen.cuda import rows as cuda_rows  # noqa: E402
from fulmen.executors.codegen.cuda import runtime as cuda_runtime  # noqa: E402
from fulmen.executors.codegen.cuda import target as cuda_target  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
EXECUTORS = [get_executor("codegen"), get_executor("torch")]
ARCHS = (80, 90)
BATCH = 120  # kernels per NVRTC program


@pytest.fixture(autouse=True)
def _kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FULMEN_CACHE_DIR", str(tmp_path / "fulmen-cache"))


def _ids(info):
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


ELEMENTWISE = [info for info in matched_opinfos()
               if isinstance(info, (UnaryUfuncInfo, BinaryUfuncInfo)) or info.name in EXTRA]


def _on_cuda(value, dtype=None):
    """A "cuda" proxy with `value`'s metadata (dtype replaced for floating tensors)."""
    if not isinstance(value, torch.Tensor):
        return value
    new_dtype = dtype if dtype is not None and value.dtype.is_floating_point else value.dtype
    return TensorProxy(None, value.shape, new_dtype, "cuda", strides=value.stride())


def cuda_regions(fn, args) -> list:
    """The `CudaFusedRegion`s the codegen executor makes for `fn(*args)` (args on "cuda")."""
    program = trace_program(fn, tuple(args), {})
    trace = claim_executors(dce(program.trace), EXECUTORS)
    return [b.sym.impl for b in trace.bsyms if isinstance(b.sym.impl, cuda_runtime.CudaFusedRegion)]


def _op_regions(info, dtype) -> list:
    regions = []
    for sample in samples(info, 2):  # float32, else int64 or bool (pick_dtype)
        kwargs = sample.kwargs

        def fn(input, *args, kwargs=kwargs):
            return info.op(input, *args, **kwargs)

        args = pytree.tree_map(lambda v: _on_cuda(v, dtype), (sample.input, *sample.args))
        try:
            regions += cuda_regions(fn, args)
        except Exception:  # the op rejects this dtype (as eager would): not a kernel to check
            continue
    return regions


SPECS = ("vector", "strided", "scalar", "broadcast")
# Layout classes compiled in `make test` per corpus dtype; the slow test compiles them all.
_SPECS_FAST = {torch.float32: ("vector",), torch.float16: ("vector",)}


def _specs(kernel, names=SPECS) -> list:
    """The layout classes a kernel is checked in: contiguous vectorised (the common launch),
    strided with 64-bit indices, contiguous scalar, and a broadcast first input."""
    n = len(kernel.accesses) + len(kernel.outputs)
    contiguous = (1,) * n
    broadcast = tuple(0 if p == 0 and len(kernel.accesses) > 1 else 1 for p in range(n))
    specs = {"vector": cuda.Spec(1, contiguous, cuda.vector_width(kernel, contiguous)),
             "strided": cuda.Spec(3, (2,) * n, 1, "long long"),
             "scalar": cuda.Spec(1, contiguous),
             "broadcast": cuda.Spec(2, broadcast, cuda.vector_width(kernel, broadcast))}
    return [specs[name] for name in names]


def compile_all(kernels: list, kind: str = "ptx", specs=SPECS) -> int:
    """Compile every kernel in the layout classes `specs` for sm_80 and sm_90 (PTX: the front end
    and optimiser, without ptxas, which the cubin tests cover), BATCH per program; fail on a
    warning. Returns how many kernels were compiled per architecture."""
    bodies, half, bfloat = [], False, False
    for kernel in kernels:
        assert not isinstance(kernel, RowKernel), "row kernels: compile_rows"
        h, b = cuda_target.needs_headers(kernel)
        half, bfloat = half or h, bfloat or b
        for spec in _specs(kernel, specs):
            bodies.append(cuda.render_body(kernel, spec, f"k{len(bodies)}"))
    for start in range(0, len(bodies), BATCH):
        source = cuda_target.prelude(half, bfloat) + "\n".join(bodies[start:start + BATCH])
        for arch in ARCHS:
            image, log = nvrtc.compile_source(source, arch, kind)
            assert image and log == "", f"NVRTC warnings for sm_{arch}:\n{log}"
    return len(bodies)


def _unique(kernels) -> list:
    return list(dict.fromkeys(kernels))  # identical regions (repeated layers) compile once


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nvrtc_compiles_elementwise_corpus(dtype):
    kernels, not_fused = [], []
    for info in ELEMENTWISE:
        if dtype not in info.supported_dtypes("cuda") and dtype != torch.float32:
            continue
        regions = _op_regions(info, dtype)
        if not regions and _ids(info) not in NOT_FUSED:
            not_fused.append(_ids(info))
        kernels += [region.kernel for region in regions]
    if dtype == torch.float32:
        assert not not_fused, f"not fused on cuda: {not_fused}"
    kernels = _unique(kernels)
    assert len(kernels) > 40
    assert compile_all(kernels, specs=_SPECS_FAST[dtype]) == len(kernels) * len(
        _SPECS_FAST[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_nvrtc_compiles_elementwise_corpus_every_layout(dtype):
    kernels = _unique([r.kernel for info in ELEMENTWISE for r in _op_regions(info, dtype)])
    assert compile_all(kernels, kind="cubin") == 4 * len(kernels)


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=96,
                                      n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _pythia():
    litgpt_model = pytest.importorskip("litgpt.model")
    litgpt_config = pytest.importorskip("litgpt.config")
    config = litgpt_config.Config.from_name("pythia-14m", n_layer=1, vocab_size=96,
                                            padded_vocab_size=96)
    return litgpt_model.GPT(config).eval()


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, hidden_size=32,
                                      intermediate_size=64, vocab_size=96,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("make", [_llama, _pythia], ids=["llama", "pythia"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvrtc_compiles_model_regions(make, dtype):
    model = make()
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    names = list(state)
    proxies = [_on_cuda(t, dtype) for t in state.values()]
    ids = TensorProxy("ids", (2, 16), torch.int64, "cuda")

    def forward(ids, *tensors):
        out = torch.func.functional_call(model, dict(zip(names, tensors)), (ids,))
        return getattr(out, "logits", out)

    regions = cuda_regions(forward, (ids, *proxies))
    assert len(regions) >= 3
    kernels = _unique([r.kernel for r in regions if not isinstance(r.kernel, RowKernel)])
    assert compile_all(kernels, kind="cubin", specs=("vector", "strided")) == 2 * len(kernels)
    rows = _unique([r.kernel for r in regions if isinstance(r.kernel, RowKernel)])
    assert rows  # the norms and softmax
    assert compile_rows(rows, kind="cubin", specs=("rows",)) == len(rows)


def test_nvrtc_special_dtypes_and_ops():
    x = TensorProxy(None, (64, 48), torch.float32, "cuda")
    i = TensorProxy(None, (64, 48), torch.int32, "cuda")
    b = TensorProxy(None, (48,), torch.bool, "cuda")
    u = TensorProxy(None, (64, 48), torch.uint8, "cuda")

    def fn(x, i, b, u):
        return (torch.where(b, x.exp2(), -x) // 3, (i * 7) & 0x3F, ~(u | 3), x.t() > 0.5,
                x.remainder(2.5), x.copysign(-x), i.abs() + i.sign(), torch.maximum(i, i - 2),
                (b & (x > 0)) | b.logical_not(), x.nan_to_num(), x.to(torch.int64) * 2)

    regions = cuda_regions(fn, (x, i, b, u))
    assert regions
    compile_all(_unique([region.kernel for region in regions]))


def test_nvrtc_found_from_wheels():
    """NVRTC and the float16/bfloat16 headers come from pip wheels, not a system toolkit."""
    from cuda import pathfinder

    assert pathfinder.load_nvidia_dynamic_lib("nvrtc").found_via == "site-packages"
    assert nvrtc.include_dirs() and "site-packages" in nvrtc.include_dirs()[0]
    assert {80, 90} <= set(nvrtc.supported_archs())


def test_nvrtc_target_for_exact_arch_or_ptx():
    assert nvrtc.target_for((9, 0)) == (90, "cubin")
    assert nvrtc.target_for((8, 0)) == (80, "cubin")
    newest = max(nvrtc.supported_archs())
    assert nvrtc.target_for((99, 9)) == (newest, "ptx")
    with pytest.raises(nvrtc.NvrtcError):
        nvrtc.target_for((1, 0))
    image, log = nvrtc.compile_source(cuda.render(_add_kernel(), cuda.Spec(1, (1, 1, 1), 4)),
                                      90, "ptx")
    assert b".target sm_90" in image and log == ""


def _add_kernel():
    """The kernel of `a * 2 + c` on two float32 vectors."""
    a, c = (TensorProxy(None, (8,), torch.float32, "cuda") for _ in range(2))
    return cuda_regions(lambda a, c: a * 2 + c, (a, c))[0].kernel


def test_nvrtc_compile_error_is_reported():
    with pytest.raises(nvrtc.NvrtcError, match="undefined"):
        nvrtc.compile_source('extern "C" __global__ void k() { undefined_thing(); }', 80)


def test_nvrtc_disk_cache(monkeypatch):
    source = cuda.render(_add_kernel(), cuda.Spec(1, (1, 1, 1), 4))
    image = nvrtc.compile_cached(source, 80)
    files = sorted(p.name for p in nvrtc.cache_dir().glob("k_*/*"))
    assert files == ["kernel.cu", "kernel.cubin", "kernel.cubin.mac"]

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again despite the cache")

    monkeypatch.setattr(nvrtc, "compile_source", no_compiler)
    assert nvrtc.compile_cached(source, 80) == image
    assert nvrtc.cache_key(source, 80, "cubin") != nvrtc.cache_key(source, 90, "cubin")


def test_nvrtc_plan_and_pack():
    kernel = _add_kernel()  # two float32 inputs, one output
    base = 1 << 20
    spec = cuda_runtime.plan(kernel, [1000], [[1], [1], [1]], [base, base + 4096, base + 8192])
    assert spec == cuda.Spec(1, (1, 1, 1), 4, "int")
    misaligned = cuda_runtime.plan(kernel, [1000], [[1], [1], [1]], [base + 4, base, base])
    assert misaligned.vec == 1
    strided = cuda_runtime.plan(kernel, [10, 100], [[1, 10], [0, 0], [100, 1]], [base] * 3)
    assert strided == cuda.Spec(2, (2, 0, 1), 1, "int")
    huge = cuda_runtime.plan(kernel, [2**31 + 5], [[1], [0], [1]], [base] * 3)
    assert huge.index == "long long"
    packed = cuda_runtime.pack([10, 100], [[1, 10], [0, 0], [100, 1]], [1, 2, 3])
    assert len(packed) == 8 * (1 + 2 + 6 + 3)
    assert int.from_bytes(packed[:8], "little") == 1000


def _accept_cpu_stand_ins(inputs) -> bool:
    """CPU tensors stand in for CUDA ones on a machine without a GPU (a region would otherwise
    refuse them: `RegionCallable.accepts`)."""
    return True


def test_nvrtc_failure_falls_back_to_torch_with_one_warning(monkeypatch):
    """A load failure (no GPU here, or an image the driver refuses) runs the region on torch."""
    region = cuda_regions(lambda a, c: (a * 2 + c).exp(),
                          (TensorProxy(None, (8, 4), torch.float32, "cuda"),
                           TensorProxy(None, (4,), torch.float32, "cuda")))[0]

    def refuse(source, device):
        raise nvrtc.NvrtcError("driver refused the image")

    monkeypatch.setattr(nvrtc, "load_function", refuse)
    monkeypatch.setattr(cuda_runtime, "_warned", set())
    monkeypatch.setattr(region, "accepts", _accept_cpu_stand_ins)
    a, c = torch.randn(8, 4), torch.randn(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = region(a, c)
        second = region(a, c)
    torch.testing.assert_close(first, (a * 2 + c).exp())
    torch.testing.assert_close(second, first)
    assert len([w for w in caught if "torch executor" in str(w.message)]) == 1


def test_cpu_regions_stay_on_the_cpp_path():
    jfn = fulmen.jit(lambda a: a * 2 + 1, executors=["codegen", "torch"])
    x = torch.randn(16)
    torch.testing.assert_close(jfn(x), x * 2 + 1)
    fusions = [b.sym.impl for b in fulmen.last_traces(jfn)[-1].bsyms if "fusion" in b.sym.tags]
    assert fusions and not any(isinstance(f, cuda_runtime.CudaFusedRegion) for f in fusions)


# --- the row schedule: reductions and normalisations ----------------------------------------


def cuda_row_kernels(fn, args) -> list:
    """The `RowKernel`s the codegen executor makes for `fn(*args)` on "cuda" proxies: of the
    forward trace, and of the backward one when an argument requires grad (as `fulmen.jit`)."""
    trace = dce(trace_program(fn, tuple(args), {}).trace)
    traces = [trace]
    if any(getattr(a, "requires_grad", False) for a in args):
        split = split_forward_backward(trace)
        traces = [split.forward, dce(split.backward)]
    kernels = []
    for trace in traces:
        claimed = claim_executors(trace, EXECUTORS)
        kernels += [b.sym.impl.kernel for b in claimed.bsyms
                    if isinstance(b.sym.impl, cuda_runtime.CudaFusedRegion)
                    and isinstance(b.sym.impl.kernel, RowKernel)]
    return kernels


@functools.cache
def _row_corpus(dtype) -> dict:
    """name -> row kernels of the normalisation patterns and reductions, forward and backward."""
    n = 96

    def proxy(*shape, grad=True, dt=dtype):
        return TensorProxy(None, shape, dt, "cuda", requires_grad=grad)

    x, x3 = proxy(12, n), proxy(6, 5, 40)
    target = proxy(12, grad=False, dt=torch.int64)
    cases = {
        "softmax": (lambda a: F.softmax(a, -1), (x,)),
        "log_softmax": (lambda a: F.log_softmax(a * 2, -1), (x,)),
        "layer_norm": (lambda a, w, b: F.layer_norm(a, (n,), w, b), (x, proxy(n), proxy(n))),
        "rms_norm": (lambda a, w: F.rms_norm(a, (n,), w, eps=1e-6), (proxy(3, 4, n), proxy(n))),
        "cross_entropy": (lambda a, t: F.cross_entropy(a * 2, t), (x, target)),
        "logsumexp": (lambda a: torch.logsumexp(a, -1), (x,)),
        "last_axis": (lambda a: (a.sum(-1), a.amax(-1), a.var(-1), a.mean(-1)), (x3,)),
        "other_axes": (lambda a: ((a * 2).sum((1, 2)), a.amin((0, 2)), a.std((1, 2), correction=0),
                                  (a + 1).sum(0), a.sum((0, 1))), (x3,)),
        "prod": (lambda a: (a * 0.5 + 1).prod(-1), (proxy(7, 33, grad=False),)),
    }
    return {name: cuda_row_kernels(fn, args) for name, (fn, args) in cases.items()}


ROW_SPECS = ("rows", "split", "strided")


def _row_specs(kernel, names=ROW_SPECS) -> list:
    """Layout classes a row kernel is checked in: one block per contiguous row (256 threads),
    rows split over blocks (1024 threads; kernels without column sums), and two strided outer
    and inner axes in one warp with 64-bit indices."""
    rows = kernel.access_rows + kernel.output_rows
    columns = (False,) * len(kernel.accesses) + kernel.output_columns
    kmax = 3 if any(columns) else 0
    contiguous = tuple(0 if row else 1 for row in rows)
    strided = tuple(0 if row else 1 if column else 2 for row, column in zip(rows, columns))
    specs = {"rows": cuda_rows.RowSpec(1, 1, contiguous, 256, False, kmax),
             "split": None if kmax else cuda_rows.RowSpec(1, 1, contiguous, 1024, True),
             "strided": cuda_rows.RowSpec(2, 2, strided, 32, False, kmax and 1, "long long")}
    return [specs[name] for name in names if specs[name] is not None]


def compile_rows(kernels: list, kind: str = "ptx", specs=ROW_SPECS) -> int:
    """Compile every row kernel in `specs` for sm_80 and sm_90, all in one NVRTC program per
    architecture; fail on a warning. Returns how many kernel bodies were compiled."""
    bodies, half, bfloat = [], False, False
    for kernel in kernels:
        h, b = cuda_target.needs_headers(kernel)
        half, bfloat = half or h, bfloat or b
        for spec in _row_specs(kernel, specs):
            bodies.append(cuda_rows.render_rows_body(kernel, spec, f"r{len(bodies)}"))
    source = cuda_target.prelude(half, bfloat) + cuda_rows.ROW_PRELUDE + "\n".join(bodies)
    for arch in ARCHS:
        image, log = nvrtc.compile_source(source, arch, kind)
        assert image and log == "", f"NVRTC warnings for sm_{arch}:\n{log}"
    return len(bodies)


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float16, torch.bfloat16)],
                         ids=["float32", "float16+bfloat16"])
def test_nvrtc_compiles_row_corpus(dtypes):
    """float32 in every layout class; float16 and bfloat16 (one program) in the common one."""
    kernels = []
    for dtype in dtypes:
        corpus = _row_corpus(dtype)
        for name, found in corpus.items():  # every pattern is fused, forward and backward
            assert found, f"{name}: no row kernel on cuda"
        for name in ("softmax", "layer_norm", "rms_norm", "cross_entropy", "logsumexp"):
            assert len(corpus[name]) >= 2, f"{name}: the backward has no row kernel"
        backward = corpus["layer_norm"][-1]
        assert sum(backward.output_columns) == 2  # the weight and bias gradients: column sums
        kernels += [k for found in corpus.values() for k in found]
    kernels = _unique(kernels)
    specs = ROW_SPECS if dtypes == (torch.float32,) else ("rows",)
    assert compile_rows(kernels, specs=specs) >= len(kernels) * len(specs) - len(kernels)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_nvrtc_compiles_row_corpus_every_layout_cubin(dtype):
    kernels = _unique([k for ks in _row_corpus(dtype).values() for k in ks])
    assert compile_rows(kernels, kind="cubin") >= 2 * len(kernels)


def test_nvrtc_compiles_row_kernels_cubin_and_int_reductions():
    """ptxas too (cubin) for the common layout, and the integer reductions."""
    i = TensorProxy(None, (7, 33), torch.int32, "cuda")
    u = TensorProxy(None, (7, 33), torch.uint8, "cuda")
    ints = cuda_row_kernels(lambda a, b: ((a * 3).sum(-1), a.amax(-1), (a % 3 + 1).prod(-1),
                                          b.amin(-1), b.amax(-1)), (i, u))
    corpus = _row_corpus(torch.float32)
    kernels = _unique(ints + corpus["softmax"] + corpus["layer_norm"])
    assert compile_rows(kernels, kind="cubin", specs=("rows", "split")) >= len(kernels)


def test_nvrtc_row_models():
    """The row kernels of a real model's forward and backward (tiny Llama: rms_norm, softmax,
    cross-entropy) compile."""
    model = _llama()
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    names = list(params) + list(buffers)  # buffers on "cuda" too: the model moves them there
    proxies = [TensorProxy(None, t.shape, torch.bfloat16, "cuda", requires_grad=True)
               for t in params.values()]
    proxies += [TensorProxy(None, t.shape, t.dtype, "cuda") for t in buffers.values()]
    ids = TensorProxy("ids", (2, 16), torch.int64, "cuda")

    def loss(ids, *tensors):
        logits = torch.func.functional_call(model, dict(zip(names, tensors)), (ids,)).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())

    kernels = _unique(cuda_row_kernels(loss, (ids, *proxies)))
    assert len(kernels) >= 4
    assert compile_rows(kernels, specs=("rows",)) == len(kernels)


def _softmax_kernel():
    return _row_corpus(torch.float32)["softmax"][0]


def _column_kernel():
    """The layer_norm backward: row reductions, element outputs and two column sums."""
    return _row_corpus(torch.float32)["layer_norm"][-1]


def _strides(kernel, nouter, sizes, element=None):
    """Contiguous stride rows for each pointer of a row kernel over sizes (outer then inner)."""
    rows = []
    full = cuda_rows_contiguous(sizes)
    kept = cuda_rows_contiguous(sizes[:nouter]) + [0] * (len(sizes) - nouter)
    column = [0] * nouter + cuda_rows_contiguous(sizes[nouter:])
    for row, col in zip(kernel.access_rows + kernel.output_rows,
                        (False,) * len(kernel.accesses) + kernel.output_columns):
        rows.append(column if col else kept if row else (element or full))
    return rows


def cuda_rows_contiguous(sizes) -> list:
    return cuda_runtime._contiguous(list(sizes))


def test_nvrtc_row_plan_block_grid_and_split():
    kernel = _softmax_kernel()  # two reduction stages (max, then sum of exp)
    plan = cuda_rows.plan_rows(kernel, [12, 96], 1, _strides(kernel, 1, [12, 96]))
    assert plan.spec == cuda_rows.RowSpec(1, 1, (1, 1), 32, False, 0, "int")
    assert (plan.grid, plan.nsplit, plan.chunk, plan.phases, plan.work) == (12, 1, 96, 1, 0)
    assert cuda_rows.plan_rows(kernel, [8, 1000], 1, _strides(kernel, 1, [8, 1000])).spec.block \
        == 256
    many = cuda_rows.plan_rows(kernel, [1 << 22, 8], 1, _strides(kernel, 1, [1 << 22, 8]))
    assert many.grid == cuda_rows.MAX_GRID and many.spec.block == 32
    # long rows, few of them: split over blocks, one launch per stage plus the outputs
    long = cuda_rows.plan_rows(kernel, [2, 100_000], 1, _strides(kernel, 1, [2, 100_000]))
    assert long.spec.split and long.spec.block == cuda_rows.BLOCK_MAX
    assert long.nsplit == 25 and long.chunk == 4000 and long.grid == 50 and long.phases == 3
    assert long.work == 8 * 2 * 25 * 2  # a float64 partial per (row, chunk, reduction)
    for sizes in ([2, cuda_rows.LONG_ROW - 1], [cuda_rows.TARGET_BLOCKS, 100_000]):
        plan = cuda_rows.plan_rows(kernel, sizes, 1, _strides(kernel, 1, sizes))
        assert not plan.spec.split and plan.nsplit == 1 and plan.phases == 1
    # strided and broadcast inner axes, row pointers, 64-bit indices
    strided = cuda_rows.plan_rows(kernel, [4, 3, 5], 1, [[15, 1, 3], [15, 5, 1]])
    assert strided.spec.classes == (2, 1) and strided.spec.ninner == 2
    broadcast = cuda_rows.plan_rows(kernel, [4, 5], 1, [[1, 0], [5, 1]])
    assert broadcast.spec.classes == (0, 1)
    huge = cuda_rows.plan_rows(kernel, [2, 2**31], 1, [[2**31, 1], [2**31, 1]])
    assert huge.spec.index == "long long"


def test_nvrtc_row_plan_columns():
    kernel = _column_kernel()
    sizes = [1000, 768]
    plan = cuda_rows.plan_rows(kernel, sizes, 1, _strides(kernel, 1, sizes))
    assert not plan.spec.split and plan.spec.block == 256 and plan.spec.kmax == 3
    assert plan.grid == plan.groups == cuda_rows.COLUMN_GROUPS and plan.column_grid == 3
    assert plan.work == 8 * cuda_rows.COLUMN_GROUPS * 2 * 768  # float64 per group and column
    few = cuda_rows.plan_rows(kernel, [5, 768], 1, _strides(kernel, 1, [5, 768]))
    assert few.grid == few.groups == 5
    longest = cuda_rows.COLUMN_BLOCK_MAX * cuda_rows.KMAX
    assert cuda_rows.plan_rows(kernel, [4, longest], 1,
                               _strides(kernel, 1, [4, longest])).spec.kmax == cuda_rows.KMAX
    with pytest.raises(cuda_rows.NoPlan):  # longer rows of column sums run on torch
        cuda_rows.plan_rows(kernel, [4, longest + 1], 1, _strides(kernel, 1, [4, longest + 1]))


def test_nvrtc_row_pack():
    kernel = _softmax_kernel()
    sizes, rows = [3, 4, 5], [[20, 5, 1], [0, 0, 0]]
    plan = cuda_rows.plan_rows(kernel, sizes, 1, rows)
    packed = cuda_rows.pack_rows(plan, sizes, rows, [111, 222], 333, 1)
    nd, nptr = 3, 2
    assert len(packed) == 8 * (6 + nd + nptr * nd + nptr + 1)
    words = [int.from_bytes(packed[i:i + 8], "little", signed=True)
             for i in range(0, len(packed), 8)]
    assert words[:6] == [3, 20, plan.nsplit, plan.chunk, 1, 0]  # rows, count, ..., phase
    assert words[6:9] == sizes and words[9:15] == [20, 5, 1, 0, 0, 0]
    assert words[15:] == [111, 222, 333]


def test_nvrtc_row_sources():
    kernel = _softmax_kernel()
    source = cuda_rows.render_rows(kernel, cuda_rows.RowSpec(1, 1, (1, 1), 256))
    assert "__shfl_xor_sync" in source and "__syncthreads" in source and "atomic" not in source
    assert "args.phase" not in source and "_columns" not in source
    split = cuda_rows.render_rows(kernel, cuda_rows.RowSpec(1, 1, (1, 1), 1024, True))
    assert split.count("args.phase ==") == 2 and "args.work" in split
    columns = cuda_rows.render_rows(_column_kernel(), _row_specs(_column_kernel(), ("rows",))[0])
    assert "fulmen_kernel_columns" in columns and "atomic" not in columns


def test_nvrtc_row_failure_falls_back_to_torch_with_one_warning(monkeypatch):
    x = TensorProxy(None, (8, 32), torch.float32, "cuda")
    program = trace_program(lambda a: F.softmax(a * 2, -1), (x,), {})
    trace = claim_executors(dce(program.trace), EXECUTORS)
    (region,) = [b.sym.impl for b in trace.bsyms if isinstance(b.sym.impl, cuda_runtime.CudaFusedRegion)]
    assert isinstance(region.kernel, RowKernel)

    def refuse(source, device, entry=nvrtc.ENTRY):
        raise nvrtc.NvrtcError("driver refused the image")

    monkeypatch.setattr(nvrtc, "load_function", refuse)
    monkeypatch.setattr(cuda_runtime, "_warned", set())
    monkeypatch.setattr(region, "accepts", _accept_cpu_stand_ins)
    a = torch.randn(8, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = region(a), region(a)
    torch.testing.assert_close(first, F.softmax(a * 2, -1))
    torch.testing.assert_close(second, first)
    assert region.failed
    assert len([w for w in caught if "torch executor" in str(w.message)]) == 1


# --- execution on a GPU -------------------------------------------------------------------


def _check_gpu(fn, *args, exact=True):
    jfn = fulmen.jit(fn, executors=["codegen", "torch"])
    actual, expected = jfn(*args), fn(*args)
    tol = {"rtol": 0, "atol": 0} if exact else {}
    torch.testing.assert_close(actual, expected, equal_nan=True, **tol)
    assert "codegen.fusion" in str(fulmen.last_traces(jfn)[-1])
    impls = [b.sym.impl for b in fulmen.last_traces(jfn)[-1].bsyms if "fusion" in b.sym.tags]
    assert all(isinstance(i, cuda_runtime.CudaFusedRegion) and not i.failed for i in impls)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_cuda_execution_dtypes_and_special_values(dtype):
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5, -2.5])
    x = torch.cat([special, torch.randn(2000)]).to(dtype).cuda()
    y = torch.cat([special.flip(0), torch.randn(2000)]).to(dtype).cuda()
    _check_gpu(lambda a, b: torch.maximum(a * b + 1, a - b), x, y)
    _check_gpu(lambda a, b: torch.where(a > b, a.exp(), torch.tanh(b)) / 3, x, y, exact=False)
    _check_gpu(lambda a: (a.isnan(), a.isinf(), a.signbit(), a.abs().floor()), x)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_execution_layouts():
    x = torch.randn(640, 480, device="cuda")
    b = torch.randn(480, device="cuda")
    _check_gpu(lambda a, c: a + c, x, b)
    _check_gpu(lambda a: a.t() * 2 + a.t().exp(), x, exact=False)
    _check_gpu(lambda a: a[::2, 3:400:3].sin(), x, exact=False)
    _check_gpu(lambda a, c: a.flip(1) - c, x, b)
    _check_gpu(lambda a: a * 2 + 1, x[:, 1:])  # misaligned: the scalar path
    _check_gpu(lambda a: a * 2 + 1, torch.randn(3, device="cuda"))
    _check_gpu(lambda a, c: a * c + 1, torch.tensor(2.5, device="cuda"),
               torch.tensor(-1.0, device="cuda"))
    _check_gpu(lambda a: (a.exp() + 1, a > 0), torch.randn(0, 4, device="cuda"))
    _check_gpu(lambda a, c: (a & c) | ~a, torch.rand(999, device="cuda") > 0.5,
               torch.rand(999, device="cuda") > 0.5)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("info", ELEMENTWISE, ids=_ids)
def test_cuda_execution_opinfo(info):
    from tests.ops.opinfo_harness import assert_same

    ran = 0
    for sample in info.sample_inputs("cuda", torch.float32, requires_grad=False):
        kwargs = sample.kwargs

        def fn(input, *args, kwargs=kwargs):
            return info.op(input, *args, **kwargs)

        try:
            expected = fn(sample.input, *sample.args)
        except Exception:
            continue
        jfn = fulmen.jit(fn, executors=["codegen", "torch"])
        assert_same(expected, jfn(sample.input, *sample.args), info)
        ran += 1
        if ran >= int(os.environ.get("FULMEN_CODEGEN_SAMPLES", "2")):
            break
    assert ran > 0


def _gpu_norm_cases(n: int, dtype):
    w, b = (torch.randn(n, device="cuda", dtype=dtype) for _ in range(2))
    target = torch.randint(0, n, (64,), device="cuda")
    return {"softmax": lambda x: F.softmax(x, -1),
            "log_softmax": lambda x: F.log_softmax(x * 2, -1),
            "layer_norm": lambda x: F.layer_norm(x, (n,), w, b),
            "rms_norm": lambda x: F.rms_norm(x, (n,), w, eps=1e-6),
            "cross_entropy": lambda x: F.cross_entropy(x.float(), target),
            "logsumexp": lambda x: torch.logsumexp(x, -1)}


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "layer_norm", "rms_norm",
                                  "cross_entropy", "logsumexp"])
def test_cuda_execution_normalisations_forward_and_backward(name, dtype):
    for n in (96, 1000, 50_257):  # one warp, several warps, a vocabulary row
        fn = _gpu_norm_cases(n, dtype)[name]
        x0 = torch.randn(64, n, device="cuda", dtype=dtype)
        x, xe = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        jfn = fulmen.jit(fn, executors=["codegen", "torch"])
        out, expected = jfn(x), fn(xe)
        tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
        torch.testing.assert_close(out, expected, **tol)
        cotangent = torch.randn_like(expected)
        (out * cotangent).sum().backward()
        (expected * cotangent).sum().backward()
        torch.testing.assert_close(x.grad, xe.grad, **tol)
        for trace in (fulmen.last_traces(jfn)[-1], fulmen.last_backward_traces(jfn)[-1]):
            impls = [b.sym.impl for b in trace.bsyms if "fusion" in b.sym.tags]
            assert impls and all(isinstance(i, cuda_runtime.CudaFusedRegion) and not i.failed
                                 for i in impls)
            assert "torchex.sum" not in str(trace) and "torchex.amax" not in str(trace)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_execution_reductions_layouts_and_special_values():
    x = torch.randn(6, 5, 40, device="cuda")
    _check_gpu(lambda a: ((a * 2).sum(-1), (a + 1).sum((1, 2), keepdim=True), a.amin((0, 2)),
                          a.var(-1), a.std((1, 2), correction=0), (a - 1).sum()), x, exact=False)
    _check_gpu(lambda a: (a * 0.5 + 1).prod(-1), x, exact=False)
    i = torch.randint(-50, 50, (7, 33), device="cuda", dtype=torch.int32)
    _check_gpu(lambda a: ((a * 3).sum(-1), a.amax(-1), a.amin(-1), (a % 3 + 1).prod(-1)), i)
    u = torch.randint(0, 250, (7, 33), device="cuda", dtype=torch.uint8)
    _check_gpu(lambda a: (a.amax(-1), a.amin(-1)), u)
    s = torch.randn(4, 700, device="cuda")
    s[0, 3], s[1, 600], s[2, 5], s[2, 6] = float("nan"), float("inf"), float("inf"), -float("inf")
    _check_gpu(lambda a: (a.amax(-1), a.amin(-1), a.sum(-1), a.softmax(-1), a.var(-1)), s,
               exact=False)
    y = torch.randn(300, 500, device="cuda")
    _check_gpu(lambda a: a.t().sum(-1), y, exact=False)  # strided rows
    _check_gpu(lambda a: a[:, ::3].exp().sum(-1), y, exact=False)
    _check_gpu(lambda a, c: (a.t() * c).softmax(-1), y, torch.randn(300, device="cuda"),
               exact=False)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        z = torch.randn(64, 3000, device="cuda", dtype=dtype)
        _check_gpu(lambda a: ((a * 2).sum(-1), a.amax(-1), (a * 2).sum(0)), z, exact=False)
    _check_gpu(lambda a: ((a + 1).sum(-1), (a * 2).prod(-1)), torch.randn(4, 0, device="cuda"))
    _check_gpu(lambda a: (a + 1).sum(0), torch.randn(0, 5, device="cuda"))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_execution_long_rows_are_split_and_accurate():
    x = torch.randn(3, 300_000, device="cuda") * 4
    assert cuda_rows.plan_rows(_softmax_kernel(), [3, 300_000], 1,
                               [[300_000, 1], [300_000, 1]]).spec.split
    jfn = fulmen.jit(lambda a: (a.softmax(-1), a.var(-1), (a + 10).sum(-1)),
                     executors=["codegen", "torch"])
    actual = jfn(x)
    reference = (x.double().softmax(-1), x.double().var(-1), (x.double() + 10).sum(-1))
    eager = (x.softmax(-1), x.var(-1), (x + 10).sum(-1))
    for a, e, r in zip(actual, eager, reference):  # as close to float64 as eager, or closer
        assert (a - r).abs().max() <= max((e - r).abs().max(), 1e-7 * r.abs().max())
    again = jfn(x)
    assert all(torch.equal(a, b) for a, b in zip(actual, again))  # deterministic


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_execution_column_sums_are_accurate_and_deterministic():
    w, b = torch.randn(768, device="cuda"), torch.randn(768, device="cuda")
    x0 = torch.randn(4096, 768, device="cuda")
    jfn = fulmen.jit(lambda a, w, b: F.layer_norm(a, (768,), w, b),
                     executors=["codegen", "torch"])
    grads = []
    for _ in range(2):
        inputs = [t.clone().requires_grad_() for t in (x0, w, b)]
        out = jfn(*inputs)
        (out * 1.5).sum().backward()
        grads.append([t.grad for t in inputs])
    assert all(torch.equal(g1, g2) for g1, g2 in zip(*grads))  # no atomics: bitwise repeatable
    eager = [t.clone().requires_grad_() for t in (x0, w, b)]
    (F.layer_norm(eager[0], (768,), eager[1], eager[2]) * 1.5).sum().backward()
    reference = [t.double().requires_grad_() for t in (x0, w, b)]
    (F.layer_norm(reference[0], (768,), reference[1], reference[2]) * 1.5).sum().backward()
    for a, e, r in zip(grads[0], eager, reference):
        assert (a.double() - r.grad).abs().max() <= (e.grad.double() - r.grad).abs().max() + 1e-5
    backward = str(fulmen.last_backward_traces(jfn)[-1])
    assert backward.count("codegen.fusion") == 1 and "torchex.sum" not in backward
    t = torch.randn(5000, 300, device="cuda")
    _check_gpu(lambda a: ((a * 2).sum(0), (a.t() - 1).sum(0)), t, exact=False)
