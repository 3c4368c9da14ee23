"""Neural-network ops beyond OpInfo: torch./Tensor./F. spellings, dtype arguments, half inputs,
numerical stability, identities (dropout in eval mode returns its input), RNG agreement with
eager, mutating arguments, and small `nn.Module`s through `fulmen.jit`.

Each case runs eagerly and through `fulmen.jit` twice: the op run whole by the torch executor,
and decomposed into prims.
"""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen
from fulmen.transforms import decompose_to_prims
from tests.fresh_process import imports_module

MODES = {"whole": {}, "decomposed": {"transforms": [decompose_to_prims]}}


def assert_same(actual, expected) -> None:
    flat_e, spec_e = torch.utils._pytree.tree_flatten(expected)
    flat_a, spec_a = torch.utils._pytree.tree_flatten(actual)
    assert spec_e == spec_a
    for e, a in zip(flat_e, flat_a):
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        if e.dtype in (torch.float16, torch.bfloat16):
            # fulmen computes half inputs in float32 end to end; eager rounds more often
            torch.testing.assert_close(a, e, rtol=1e-2, atol=1e-2, equal_nan=True)
        else:
            torch.testing.assert_close(a, e, equal_nan=True)


def check(fn, *args, mode="decomposed"):
    """Run `fn` eagerly and jitted; assert equal outputs; return the jitted function."""
    expected = fn(*args)
    jfn = fulmen.jit(fn, **MODES[mode])
    assert_same(jfn(*args), expected)
    return jfn


def ops_of(jfn, stage=0) -> list[str]:
    """Qualified names of the top-level symbols of a trace (the traced one by default)."""
    return [bsym.sym.id for bsym in fulmen.last_traces(jfn)[stage].bsyms]


torch.manual_seed(0)  # the sample tensors below are built at import
x34 = torch.randn(3, 4)
x234 = torch.randn(2, 3, 4)
w54 = torch.randn(5, 4)
b5 = torch.randn(5)
h234 = torch.randn(2, 3, 4, dtype=torch.float16)
bf234 = torch.randn(2, 3, 4, dtype=torch.bfloat16)
i34 = torch.randint(-3, 3, (3, 4))
special = torch.tensor(
    [
        [0.0, float("nan"), -1.0, 2.0],
        [-float("inf"), -float("inf"), -float("inf"), -float("inf")],
        [float("inf"), 1.0, -float("inf"), 3.0],
    ]
)
large = torch.tensor([[1000.0, 1001.0, 999.0], [-1000.0, -1002.0, -1001.0]])
table = torch.randn(10, 4)
indices = torch.tensor([[0, 3, 9], [1, 0, 0]])

CASES = {
    # matmul family
    "matmul 2d": (lambda a, b: torch.matmul(a, b), x34, torch.randn(4, 5)),
    "matmul batched broadcast": (lambda a, b: a.matmul(b), x234, torch.randn(4, 2)),
    "matmul vector": (lambda a, b: a @ b, x34, torch.randn(4)),
    "rmatmul": (lambda a, b: b.__rmatmul__(a), x34, torch.randn(4, 2)),
    "mm": (lambda a, b: torch.mm(a, b), x34, torch.randn(4, 2)),
    "mm method": (lambda a, b: a.mm(b), x34, torch.randn(4, 2)),
    "bmm": (lambda a, b: torch.bmm(a, b), x234, torch.randn(2, 4, 3)),
    # linear
    "linear": (lambda x, w, b: F.linear(x, w, b), x234, w54, b5),
    "linear no bias": (lambda x, w: F.linear(x, w), x34, w54),
    "linear bias kw": (lambda x, w, b: F.linear(x, w, bias=b), x34, w54, b5),
    # activations
    "relu": (lambda x: torch.relu(x), x34),
    "relu method": (lambda x: x.relu(), i34),
    "relu nan": (lambda x: torch.relu(x), special),
    "F.relu": (lambda x: F.relu(x), x234),
    "F.relu inplace False": (lambda x: F.relu(x, inplace=False), special),
    "gelu": (lambda x: F.gelu(x), x234),
    "gelu tanh": (lambda x: F.gelu(x, approximate="tanh"), x234),
    "gelu half": (lambda x: F.gelu(x), h234),
    # +inf left out: eager's gelu(inf) is inf from its scalar loop, NaN from its AVX-512 loop
    "gelu special": (lambda x: F.gelu(x), torch.where(special == float("inf"), 1e30, special)),
    "silu": (lambda x: F.silu(x), x234),
    "silu bfloat16": (lambda x: F.silu(x), bf234),
    "silu special": (lambda x: F.silu(x), special),
    # softmax family
    "softmax": (lambda x: torch.softmax(x, -1), x234),
    "softmax method": (lambda x: x.softmax(1), x234),
    "softmax dtype": (lambda x: torch.softmax(x, 0, dtype=torch.float64), x234),
    "softmax dtype positional": (lambda x: torch.softmax(x, 0, torch.float64), x234),
    "softmax int with dtype": (lambda x: x.softmax(1, dtype=torch.float32), i34),
    "softmax half": (lambda x: x.softmax(-1), h234),
    "softmax large": (lambda x: x.softmax(-1), large),
    "softmax inf rows": (lambda x: x.softmax(-1), special),
    "softmax 0-d": (lambda x: x.sum().softmax(0), x34),
    "softmax empty": (lambda x: x.softmax(0), torch.randn(0, 3)),
    "special.softmax": (lambda x: torch.special.softmax(x, 1), x34),
    "F.softmax": (lambda x: F.softmax(x, dim=-1), x234),
    "F.softmax dtype": (lambda x: F.softmax(x, 1, dtype=torch.float64), x234),
    "log_softmax": (lambda x: torch.log_softmax(x, 1), x234),
    "log_softmax method": (lambda x: x.log_softmax(-1), x34),
    "log_softmax large": (lambda x: x.log_softmax(-1), large),
    "log_softmax inf rows": (lambda x: x.log_softmax(-1), special),
    "log_softmax bfloat16": (lambda x: x.log_softmax(-1), bf234),
    "F.log_softmax": (lambda x: F.log_softmax(x, dim=0), x234),
    "special.log_softmax": (lambda x: torch.special.log_softmax(x, 0), x34),
    # layer_norm
    "layer_norm": (
        lambda x, w, b: F.layer_norm(x, (4,), w, b),
        x234,
        torch.randn(4),
        torch.randn(4),
    ),
    "layer_norm no affine": (lambda x: F.layer_norm(x, [3, 4]), x234),
    "layer_norm list shape eps": (
        lambda x, w: F.layer_norm(x, [4], weight=w, eps=1e-3),
        x234,
        torch.randn(4),
    ),
    "layer_norm bias only": (lambda x, b: F.layer_norm(x, (3, 4), bias=b), x234, torch.randn(3, 4)),
    "layer_norm half": (
        lambda x, w, b: F.layer_norm(x, (4,), w, b),
        h234,
        torch.randn(4, dtype=torch.float16),
        torch.randn(4, dtype=torch.float16),
    ),
    "layer_norm constant rows": (lambda x: F.layer_norm(x, (4,)), torch.ones(2, 4)),
    # embedding and dropout
    "embedding": (lambda i, w: F.embedding(i, w), indices, table),
    "embedding padding_idx": (lambda i, w: F.embedding(i, w, padding_idx=0), indices, table),
    "embedding negative padding_idx": (lambda i, w: F.embedding(i, w, -1), indices, table),
    "embedding int32": (lambda i, w: F.embedding(i, w), indices.int(), table),
    "dropout eval": (lambda x: F.dropout(x, 0.5, training=False) * 2, x34),
    "dropout p=0": (lambda x: F.dropout(x, 0.0) + 1, x34),
    "torch.dropout eval": (lambda x: torch.dropout(x, 0.3, False) + 1, x34),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_eager(case, mode):
    fn, *args = CASES[case]
    jfn = check(fn, *args, mode=mode)
    assert not any(op.startswith("opaque") for op in ops_of(jfn)), ops_of(jfn)


def test_spellings_route_to_their_symbols():
    def fn(x, w):
        return (x @ w, x.relu(), F.relu(x), x.softmax(-1), F.softmax(x, -1), F.gelu(x))

    jfn = check(fn, x34, torch.randn(4, 4))
    assert ops_of(jfn) == [
        "ltorch.matmul",
        "ltorch.relu",
        "ltorch.functional_relu",
        "ltorch.softmax",
        "ltorch.functional_softmax",
        "ltorch.gelu",
    ]


def test_softmax_subtracts_the_max():
    jfn = check(lambda x: x.softmax(-1), large)
    trace = str(fulmen.last_traces(jfn)[0])
    assert "prims.amax(x, (1,))" in trace
    assert not jfn(large).isnan().any()


def test_softmax_implicit_dim_warns_like_eager():
    with pytest.warns(UserWarning, match="Implicit dimension"):
        expected = F.softmax(x234)
    with pytest.warns(UserWarning, match="Implicit dimension"):
        actual = fulmen.jit(lambda x: F.softmax(x))(x234)
    assert_same(actual, expected)


def test_half_inputs_compute_in_float32():
    jfn = check(lambda x: F.layer_norm(x, (4,)), h234)
    trace = str(fulmen.last_traces(jfn)[0])
    assert "prims.convert_element_type(x, torch.float32)" in trace
    assert jfn(h234).dtype == torch.float16


def test_dropout_identity_returns_the_input():
    for fn in (
        lambda x: F.dropout(x, 0.5, training=False),
        lambda x: F.dropout(x, p=0.0),
        lambda x: torch.dropout(x, 0.5, False),
    ):
        jfn = fulmen.jit(fn)
        assert jfn(x34) is x34
        assert ops_of(jfn) == []


@pytest.mark.parametrize("mode", list(MODES))
def test_dropout_training_matches_eager_under_the_same_seed(mode):
    x = torch.randn(64, 32)
    jfn = fulmen.jit(lambda x: F.dropout(x, 0.3) * 2, **MODES[mode])
    jfn(x)  # compile first: tracing must not draw random numbers
    torch.manual_seed(1234)
    expected = F.dropout(x, 0.3) * 2
    torch.manual_seed(1234)
    actual = jfn(x)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert "prims.bernoulli" in str(fulmen.last_traces(jfn)[0])
    torch.manual_seed(1234)
    assert torch.equal(
        fulmen.jit(lambda x: torch.dropout(x, 0.3, True))(x),
        (torch.manual_seed(1234), torch.dropout(x, 0.3, True))[1],
    )


@pytest.mark.parametrize("layout", ["permuted", "channels_last", "sliced"])
def test_dropout_of_a_strided_input_in_training_matches_eager(layout):
    # eager draws its mask in the input's memory order (`empty_like`); the mask was drawn
    # contiguous whenever the input required grad (HF Whisper's permuted conv output)
    base = torch.randn(2, 3, 4, 5)
    x = {"permuted": base.permute(0, 2, 3, 1), "sliced": base[..., ::2],
         "channels_last": base.contiguous(memory_format=torch.channels_last)}[layout]
    x = x.detach().requires_grad_()

    def fn(x):
        return F.dropout(x + 1, 0.4)

    jfn = fulmen.jit(fn)
    for seed in (0, 1):
        torch.manual_seed(seed)
        expected = fn(x)
        torch.manual_seed(seed)
        actual = jfn(x)
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_dropout_in_training_of_a_fused_transposed_value_has_eagers_strides(codegen_eager):
    """The dropout of an input requiring grad is decomposed (its mask is a value) and fused:
    the kernel writes row-major, and its output was returned so, (6, 1) where eager's is the
    transposed (1, 8) (the output was not known to have eager's layout: the dropout meta
    kernel is a Python reference, not run by a layout query; `fulmen.tracer.layout` now has
    the rule). Values, strides and the gradient as eager's."""
    def fn(x):
        return F.dropout(x.t() * 2, 0.5)

    x = torch.randn(6, 8, requires_grad=True)
    jfn = fulmen.jit(fn)
    for seed in (0, 1):
        torch.manual_seed(seed)
        expected = fn(x)
        torch.manual_seed(seed)
        actual = jfn(x)
        assert torch.equal(actual, expected)
        assert actual.stride() == expected.stride()
        cotangent = torch.randn_like(expected)
        assert torch.equal(torch.autograd.grad(actual, x, cotangent)[0],
                           torch.autograd.grad(expected, x, cotangent)[0])


def test_the_layout_query_of_a_dropout_leaves_the_global_generator_alone():
    """A dropout of a tensor whose size-1 dim has an odd stride (`x.t()` of a (1, 6) tensor, a
    one-token `q.transpose(1, 2)`) asks how eager's kernel lays the result out by running it
    once on two-element stand-ins (NOTE [size-1 strides]): that run drew from torch's global
    generator while tracing. With another thread alive (a data loader's, a notebook's) the
    compiled first call then drew its mask two numbers late: other values than eager's under
    the same seed, and a generator left elsewhere (alone, the call ran eagerly every time,
    its state change taken for the function reseeding)."""
    def fn(x):
        return F.dropout(x.t() * 2, 0.5), torch.rand(4)

    x = torch.randn(1, 6)
    jfn = fulmen.jit(fn)
    done = threading.Event()
    helper = threading.Thread(target=done.wait)
    helper.start()
    try:
        for seed in (0, 1):
            torch.manual_seed(seed)
            expected = fn(x)
            after_eager = torch.random.get_rng_state()
            torch.manual_seed(seed)
            actual = jfn(x)
            for a, e in zip(actual, expected, strict=True):
                assert torch.equal(a, e) and a.stride() == e.stride()
            assert torch.equal(torch.random.get_rng_state(), after_eager)
    finally:
        done.set()
        helper.join()
    assert fulmen.compile_stats(jfn).eager_calls == 0


@pytest.mark.parametrize("layout", ["transposed", "permuted"])
def test_dropout_of_a_strided_input_with_symbolic_sizes_matches_eager(layout):
    """nn.TransformerEncoderLayer's dropout after attention (batch_first: the attention output
    transposed back): with symbolic sizes the mask was drawn row-major, so from the second
    sequence length on every dropout mask differed from eager's under the same seed."""
    def fn(x):
        x = x.transpose(0, 1) if layout == "transposed" else x.permute(1, 2, 0)
        return F.dropout(x * 2, 0.3).relu()

    jfn = fulmen.jit(fn)
    for seed, n in enumerate((7, 7, 9, 11, 5)):
        x = torch.randn(n, 3, 4, requires_grad=True)  # (the mask is drawn decomposed)
        torch.manual_seed(seed)
        expected = fn(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(jfn(x), expected, rtol=0, atol=0, msg=str(n))
    assert fulmen.compile_stats(jfn).cache_misses == 2  # the later sizes: symbolic


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: F.embedding(torch.tensor([1, 2]), x, max_norm=1.0),
    ],
)
def test_mutating_arguments_raise_under_fullgraph_and_run_eagerly_otherwise(fn):
    # inplace=True is functionalized (tests/tracer/test_inplace.py); max_norm is not compiled
    x = torch.randn(4, 3) * 3
    before = x.clone()
    with pytest.raises(fulmen.FulmenError, match="not supported yet"):
        fulmen.jit(fn, fullgraph=True)(x)
    assert torch.equal(x, before)
    expected = fn(before)  # renormalises rows 1 and 2 of `before` in place
    with pytest.warns(UserWarning, match="not supported yet"):
        torch.testing.assert_close(fulmen.jit(fn)(x), expected)
    torch.testing.assert_close(x, before)


def test_unsupported_arguments_fall_back_to_the_torch_op():
    # mixed bfloat16 input / float32 weight: eager supports it, the decomposition does not
    jfn = check(
        lambda x, w, b: F.layer_norm(x, (4,), w, b),
        bf234,
        torch.randn(4),
        torch.randn(4),
        mode="whole",
    )
    assert ops_of(jfn) == ["opaque.nn_functional_layer_norm"]
    a, b = torch.randn(3, 4), torch.randn(4, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError):  # eager rejects mixed dtypes; so does the traced op
        fulmen.jit(lambda a, b: a @ b)(a, b)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8, padding_idx=0)
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU(approximate="tanh")
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(16, 4, bias=False)

    def forward(self, idx):
        h = self.norm(self.embed(idx))
        h = self.drop(self.act(self.fc1(h)))
        return F.log_softmax(self.fc2(h) + F.silu(h).sum(-1, keepdim=True), dim=-1)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
def test_module_forward(mode, training):
    model = Block().train(training)
    idx = torch.randint(0, 10, (2, 5))
    jmodel = fulmen.jit(model, **MODES[mode])
    with torch.no_grad():
        jmodel(idx)  # compile
        torch.manual_seed(7)
        expected = model(idx)
        torch.manual_seed(7)
        actual = jmodel(idx)
    assert_same(actual, expected)
    ops = ops_of(jmodel)
    assert not any(op.startswith("opaque") for op in ops), ops
    assert ("ltorch.dropout" in ops) == training


def test_linear_shape_errors_name_the_op():
    jfn = fulmen.jit(lambda x, w: torch.nn.functional.linear(x, w))
    with pytest.raises(fulmen.FulmenError, match="linear.*5 features"):
        jfn(torch.randn(2, 5), torch.randn(3, 4))


def test_first_linear_trace_does_not_import_dynamo():
    # PyTorch's meta path for linear with a bias (addmm's Python decomposition) imports
    # torch._dynamo, about a second; the linear prim describes the common case itself
    assert not imports_module("import torch, fulmen\n"
                              "m, x = torch.nn.Linear(8, 4), torch.randn(2, 8)\n"
                              "torch.testing.assert_close(fulmen.jit(m)(x), m(x))")
