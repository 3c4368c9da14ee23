"""The CUDA renderer and NVRTC: every kernel of the fusion corpus compiles for sm_80 and sm_90
with no warnings (no GPU needed: traces are built on "cuda" proxies), the layout planning and
argument packing, the disk cache, the fallback; and, marked `cuda`, execution against eager.

The corpus: every fusible elementwise op_db op (the codegen executor's corpus) in float32 and
in float16/bfloat16/float64 where the op supports them on CUDA, plus the regions of tiny HF
GPT-2 and Llama models. Each region's kernel is rendered for four layout classes (contiguous
vectorised, contiguous scalar, broadcast and strided with 64-bit indices); the kernels are
compiled many per NVRTC program to stay fast.
"""

import os
import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from torch.testing._internal.opinfo.core import BinaryUfuncInfo, UnaryUfuncInfo

import fulmen
from fulmen.executors import get_executor
from fulmen.executors.claim import claim_executors
from fulmen.proxies import TensorProxy
from fulmen.tracer import trace_program
from fulmen.transforms import dce
from tests.executors.test_codegen import EXTRA, NOT_FUSED
from tests.ops.opinfo_harness import matched_opinfos, samples

pytest.importorskip("cuda.bindings", reason="cuda-python is not installed")
from fulmen.executors.codegen import cuda, nvrtc  # noqa: E402

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
    return [b.sym.impl for b in trace.bsyms if isinstance(b.sym.impl, nvrtc.CudaFusedRegion)]


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
        h, b = cuda.needs_headers(kernel)
        half, bfloat = half or h, bfloat or b
        for spec in _specs(kernel, specs):
            bodies.append(cuda.render_body(kernel, spec, f"k{len(bodies)}"))
    for start in range(0, len(bodies), BATCH):
        source = cuda.prelude(half, bfloat) + "\n".join(bodies[start:start + BATCH])
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
    kernels = _unique([region.kernel for region in regions])
    assert compile_all(kernels, kind="cubin", specs=("vector", "strided")) == 2 * len(kernels)


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
    files = sorted(p.suffix for p in nvrtc.cache_dir().iterdir())
    assert files == [".cu", ".cubin"]

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again despite the cache")

    monkeypatch.setattr(nvrtc, "compile_source", no_compiler)
    assert nvrtc.compile_cached(source, 80) == image
    assert nvrtc.cache_key(source, 80, "cubin") != nvrtc.cache_key(source, 90, "cubin")


def test_nvrtc_plan_and_pack():
    kernel = _add_kernel()  # two float32 inputs, one output
    base = 1 << 20
    spec = nvrtc.plan(kernel, [1000], [[1], [1], [1]], [base, base + 4096, base + 8192])
    assert spec == cuda.Spec(1, (1, 1, 1), 4, "int")
    misaligned = nvrtc.plan(kernel, [1000], [[1], [1], [1]], [base + 4, base, base])
    assert misaligned.vec == 1
    strided = nvrtc.plan(kernel, [10, 100], [[1, 10], [0, 0], [100, 1]], [base] * 3)
    assert strided == cuda.Spec(2, (2, 0, 1), 1, "int")
    huge = nvrtc.plan(kernel, [2**31 + 5], [[1], [0], [1]], [base] * 3)
    assert huge.index == "long long"
    packed = nvrtc.pack([10, 100], [[1, 10], [0, 0], [100, 1]], [1, 2, 3])
    assert len(packed) == 8 * (1 + 2 + 6 + 3)
    assert int.from_bytes(packed[:8], "little") == 1000


def test_nvrtc_failure_falls_back_to_torch_with_one_warning(monkeypatch):
    """A load failure (no GPU here, or an image the driver refuses) runs the region on torch."""
    region = cuda_regions(lambda a, c: (a * 2 + c).exp(),
                          (TensorProxy(None, (8, 4), torch.float32, "cuda"),
                           TensorProxy(None, (4,), torch.float32, "cuda")))[0]

    def refuse(source, device):
        raise nvrtc.NvrtcError("driver refused the image")

    monkeypatch.setattr(nvrtc, "load_function", refuse)
    monkeypatch.setattr(nvrtc, "_warned", set())
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
    assert fusions and not any(isinstance(f, nvrtc.CudaFusedRegion) for f in fusions)


# --- execution on a GPU -------------------------------------------------------------------


def _check_gpu(fn, *args, exact=True):
    jfn = fulmen.jit(fn, executors=["codegen", "torch"])
    actual, expected = jfn(*args), fn(*args)
    tol = {"rtol": 0, "atol": 0} if exact else {}
    torch.testing.assert_close(actual, expected, equal_nan=True, **tol)
    assert "codegen.fusion" in str(fulmen.last_traces(jfn)[-1])
    impls = [b.sym.impl for b in fulmen.last_traces(jfn)[-1].bsyms if "fusion" in b.sym.tags]
    assert all(isinstance(i, nvrtc.CudaFusedRegion) and not i.failed for i in impls)


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
