"""Plain PyTorch training patterns users jit, each compared with eager over several optimizer
steps (losses, parameters and buffers after every step): packed LSTM sequences, BatchNorm with
a cumulative average (`momentum=None` reads `num_batches_tracked`), a VAE built on
`torch.distributions`, a causal `nn.TransformerDecoder` with key padding and dropout,
`EmbeddingBag` with offsets, resampling ops; and the calling contexts around a jitted module:
`torch.inference_mode`, `torch.func.functional_call`, a dtype change after jitting, autocast
with a `GradScaler`, grad mode toggled between calls, outputs that alias an input, weights
pruned, reparametrized or frozen between steps, `parametrize.cached()` blocks."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import prune
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fulmen
from fulmen.ops import meta, opaque


def _train_matches_eager(make, batch, steps=3, loss_fn=lambda out: out.pow(2).mean()):
    """Train a fresh `make()` eagerly and jitted from the same seeds with SGD; every step's loss
    and the final parameters and buffers must agree."""
    runs = []
    for jitted in (False, True):
        torch.manual_seed(0)
        model = make()
        step_fn = fulmen.jit(model) if jitted else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(steps):
            torch.manual_seed(100 + step)  # dropout draws the same masks in both runs
            loss = loss_fn(step_fn(*batch(step)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        state = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
        runs.append((losses, state))
    (want_losses, want_state), (got_losses, got_state) = runs
    torch.testing.assert_close(got_losses, want_losses)
    torch.testing.assert_close(got_state, want_state)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class _PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=0)
        self.rnn = nn.LSTM(8, 16, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, 3)

    def forward(self, ids, lengths):
        packed = pack_padded_sequence(self.emb(ids), lengths, batch_first=True,
                                      enforce_sorted=False)
        out, _ = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True)
        return self.head(out.sum(1))


def test_packed_lstm_trains_as_eager():
    ids = torch.randint(1, 20, (4, 7), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([7, 3, 5, 2])
    for row, length in enumerate(lengths):
        ids[row, length:] = 0
    _train_matches_eager(_PackedLSTM, lambda step: (ids, lengths))


@pytest.mark.parametrize("make", [lambda: nn.LSTM(3, 4, bidirectional=True),
                                  lambda: nn.GRU(3, 4, num_layers=2),
                                  lambda: nn.RNN(3, 4, nonlinearity="relu")],
                         ids=["lstm", "gru", "rnn_relu"])
def test_a_packed_sequence_passed_in_runs_as_eager_with_symbolic_sizes(make, monkeypatch):
    """A `PackedSequence` given to a jitted RNN with `dynamic=True`: the packed overload of
    `torch.lstm` reads `batch_sizes`' values, and PyTorch's kernel on fake tensors crashed the
    process; the call now runs on the real values (a graph break), equal to eager. (The spy
    refuses, rather than runs, a packed call that reaches the meta kernel: it would crash.)"""
    reached = []

    def spy(fn, *args, **kwargs):
        if fn in (torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu) \
                and isinstance(args[3], list):
            reached.append(fn)
            raise RuntimeError("packed RNN on meta tensors")
        return meta.run_meta(fn, *args, **kwargs)

    monkeypatch.setattr(opaque, "run_meta", spy)
    torch.manual_seed(0)
    rnn = make()
    jitted = fulmen.jit(lambda packed: rnn(packed)[0].data, dynamic=True)
    for seq, lengths in ((5, [5, 3, 2]), (6, [6, 6, 4, 1])):
        x = _randn(seq, len(lengths), 3, seed=seq).requires_grad_()
        x_eager = x.detach().clone().requires_grad_()
        got = jitted(pack_padded_sequence(x, torch.tensor(lengths)))
        want = rnn(pack_padded_sequence(x_eager, torch.tensor(lengths)))[0].data
        torch.testing.assert_close(got, want)
        want_grads = torch.autograd.grad(want.pow(2).sum(), (x_eager, *rnn.parameters()))
        got_grads = torch.autograd.grad(got.pow(2).sum(), (x, *rnn.parameters()))
        torch.testing.assert_close(got_grads, want_grads)
    assert fulmen.compile_stats(jitted).eager_calls == 0
    assert not reached


def test_batchnorm_cumulative_average_trains_as_eager():
    """momentum=None averages by `1 / num_batches_tracked`: a buffer's value that changes on
    every call."""
    def make():
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    _train_matches_eager(make, lambda step: (_randn(2, 3, 8, 8, seed=step),), steps=10)


class _VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 8)
        self.dec = nn.Linear(2, 6)

    def forward(self, x):
        h = self.enc(x)
        q = torch.distributions.Normal(h[:, :2], h[:, 2:4].exp())
        prior = torch.distributions.Normal(torch.zeros(2), torch.ones(2))
        kl = torch.distributions.kl_divergence(q, prior).sum(-1)
        recon = torch.distributions.Normal(self.dec(q.rsample()), 1.0).log_prob(x).sum(-1)
        return (kl - recon).mean()


def test_vae_with_distributions_trains_as_eager():
    _train_matches_eager(_VAE, lambda step: (_randn(5, 6, seed=step),), loss_fn=lambda out: out)


class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        layer = nn.TransformerDecoderLayer(16, 4, 32, batch_first=True, dropout=0.1)
        self.dec = nn.TransformerDecoder(layer, 2)
        self.out = nn.Linear(16, 30)

    def forward(self, tgt, memory, padding):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.dec(self.emb(tgt), memory, tgt_mask=mask, tgt_key_padding_mask=padding,
                     tgt_is_causal=True)
        return self.out(h)


def test_transformer_decoder_with_padding_trains_and_evaluates_as_eager():
    tgt = torch.randint(0, 30, (3, 6), generator=torch.Generator().manual_seed(0))
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[0, 4:] = True
    memory = _randn(3, 5, 16, seed=1)
    _train_matches_eager(_Decoder, lambda step: (tgt, memory, padding))
    torch.manual_seed(0)
    model = _Decoder().eval()
    with torch.no_grad():
        torch.testing.assert_close(fulmen.jit(model)(tgt, memory, padding),
                                   model(tgt, memory, padding))


class _Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 4, mode="mean", padding_idx=0)

    def forward(self, ids, offsets):
        return self.bag(ids, offsets)


def test_embedding_bag_with_offsets_trains_as_eager():
    ids, offsets = torch.tensor([1, 2, 0, 4, 5, 6, 7]), torch.tensor([0, 3, 5])
    _train_matches_eager(_Bag, lambda step: (ids, offsets))


class _Resample(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.up = nn.ConvTranspose2d(2, 2, 2, stride=2)

    def forward(self, x, grid):
        y = F.interpolate(self.conv(x), scale_factor=2, mode="bilinear", align_corners=False)
        y = F.grid_sample(y, grid, align_corners=True)
        return self.up(y) + F.pixel_shuffle(torch.cat([y] * 4, 1), 2)


def test_resampling_ops_train_as_eager():
    grid = torch.rand(2, 8, 8, 2, generator=torch.Generator().manual_seed(0)) * 2 - 1
    _train_matches_eager(_Resample, lambda step: (_randn(2, 2, 4, 4, seed=step), grid))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))


def test_inference_mode_then_training():
    model = _mlp()
    jitted = fulmen.jit(model)
    x = _randn(5, 4, seed=0)
    with torch.inference_mode():
        torch.testing.assert_close(jitted(x), model(x))
    jitted(x).sum().backward()
    got = model[0].weight.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    torch.testing.assert_close(got, model[0].weight.grad)


def test_functional_call_on_a_jitted_module_uses_the_given_parameters():
    model = _mlp()
    jitted = fulmen.jit(model)
    x = _randn(5, 4, seed=0)
    params = {name: p.detach() * 0.5 for name, p in model.named_parameters()}
    with torch.no_grad():
        before = jitted(x)
        torch.testing.assert_close(torch.func.functional_call(jitted, params, (x,)),
                                   torch.func.functional_call(model, params, (x,)))
        torch.testing.assert_close(jitted(x), before)


def test_dtype_change_after_jitting():
    model = _mlp()
    jitted = fulmen.jit(model)
    x = _randn(5, 4, seed=0)
    with torch.no_grad():
        jitted(x)
        model.to(torch.bfloat16)
        got = jitted(x.bfloat16())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, model(x.bfloat16()))


def test_autocast_with_grad_scaler_trains_as_eager():
    runs = []
    for jitted in (False, True):
        model = _mlp()
        step_fn = fulmen.jit(model) if jitted else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
        losses = []
        for step in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = step_fn(_randn(5, 4, seed=step)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    torch.testing.assert_close(runs[1], runs[0])


def test_grad_mode_toggled_between_calls():
    model = _mlp()
    jitted = fulmen.jit(model)
    x = _randn(5, 4, seed=0)
    for enabled in (False, True, False, True):
        with torch.set_grad_enabled(enabled):
            out = jitted(x)
        assert out.requires_grad == enabled
        torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("dynamic", [False, True])
def test_returned_views_alias_the_input(dynamic):
    def views(x):
        return x[0], x.t(), x

    jitted = fulmen.jit(views, dynamic=dynamic)
    for rows in (3, 4):
        x = torch.randn(rows, 3)
        row, transposed, same = jitted(x)
        assert same is x
        row.add_(1)
        transposed[1, 0] = 7.0
        assert torch.equal(x[0], row) and x[0, 1] == 7.0


class _Doubled(nn.Module):
    def forward(self, weight):
        return weight * 2


def test_a_parametrization_cached_by_the_caller_follows_the_parameters():
    """NOTE [library caches]: inside `parametrize.cached()`, a weight the caller read first was
    the cached tensor the trace captured as a constant: later blocks ran on the first step's
    weight (stale values) and backpropagated into its spent graph."""
    from torch.nn.utils import parametrize

    runs = []
    for jitted in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        parametrize.register_parametrization(model, "weight", _Doubled())
        step_fn = fulmen.jit(model) if jitted else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outs = []
        for step in range(3):
            x = _randn(5, 4, seed=step)
            with parametrize.cached():
                penalty = model.weight.pow(2).sum()  # cached: the block's weight from here
                loss = step_fn(x).pow(2).mean() + step_fn(2 * x).mean() + penalty
            loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad(), parametrize.cached():
                norm = model.weight.norm()  # cached before the call, under no_grad
                outs.append((loss.detach(), norm, step_fn(x)))
        runs.append((outs, [p.detach().clone() for p in model.parameters()]))
    torch.testing.assert_close(runs[1], runs[0])


def _prune_then_remove(model, step):
    if step == 0:
        prune.l1_unstructured(model[0], "weight", amount=0.4)
    elif step == 1:
        prune.remove(model[0], "weight")


def _old_spectral_norm(model, step):
    if step == 0:  # a forward pre-hook that updates its `weight_u` buffer in training
        torch.nn.utils.spectral_norm(model[2])


def _weight_norm(model, step):
    if step == 0:
        torch.nn.utils.parametrizations.weight_norm(model[0])


def _freeze_then_adapt(model, step):
    if step == 0:  # LoRA-style: freeze the base layer, train an adapter added after jitting
        model[0].requires_grad_(False)
        model.append(nn.Linear(3, 3))


@pytest.mark.parametrize("change", [_prune_then_remove, _old_spectral_norm, _weight_norm,
                                    _freeze_then_adapt])
def test_weights_reparametrized_or_frozen_between_steps_train_as_eager(change):
    """Hooks, parametrizations and requires_grad flags that training libraries add to a model
    between steps, after it was jitted: every step follows the model as it is now."""
    runs = []
    for jitted in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        step_fn = fulmen.jit(model) if jitted else model
        losses = []
        for step in range(3):
            loss = step_fn(_randn(5, 4, seed=step)).pow(2).mean()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
                        p.grad = None
            losses.append(loss.detach())
            torch.manual_seed(10 + step)  # (spectral norm's random start vector)
            change(model, step)
        state = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
        runs.append((losses, state))
    torch.testing.assert_close(runs[1], runs[0])


class _TiedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("ties", [(True, False), (False, True)], ids=["tied-first", "untied-first"])
def test_functional_call_untying_tied_weights_matches_eager(ties):
    """`tie_weights=False` swaps a tensor in for the first place of a tied weight only: the
    compiled program, which reads a tied weight once, computed with it in both places (after a
    tied call) or raised a TypeError (first call). Such calls run eagerly."""
    torch.manual_seed(0)
    model = _TiedTwice()
    jitted = fulmen.jit(model)
    x = torch.ones(1, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tie in ties:
            got = []
            for fn in (model, jitted):
                w = _randn(3, 3, seed=1).requires_grad_()
                out = torch.func.functional_call(fn, {"a.weight": w}, (x,), tie_weights=tie)
                out.sum().backward()
                got.append((out, w.grad))
            torch.testing.assert_close(got[1], got[0])
    torch.testing.assert_close(jitted(x), model(x))
