"""Lightning (installed with litgpt), the way its users add a compiler: Fabric with the jitted
module inside its wrapper (`fabric.setup(fulmen.jit(model))`) and around it
(`fulmen.jit(fabric.setup(model))`: the wrapper hooks every output tensor, so the call runs
eagerly), and a `Trainer` fitting a `LightningModule` that calls a jitted network, with
mixed precision, gradient clipping and accumulation; parameters and buffers after training
are compared with the same run eagerly."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fulmen

L = pytest.importorskip("lightning")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.BatchNorm1d(16),
                         nn.Linear(16, 1))


_DATA = [(torch.randn(4, 8, generator=torch.Generator().manual_seed(i)),
          torch.randn(4, 1, generator=torch.Generator().manual_seed(100 + i))) for i in range(4)]


def _state(model):
    return [t.detach().clone() for t in model.state_dict().values()]


def _fabric_run(order):
    model = _net()
    fabric = L.Fabric(accelerator="cpu", devices=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrapped, opt = fabric.setup(fulmen.jit(model) if order == "inside" else model, opt)
    if order == "around":
        wrapped = fulmen.jit(wrapped)
    torch.manual_seed(1)
    for x, y in _DATA:
        opt.zero_grad()
        fabric.backward(F.mse_loss(wrapped(x), y))
        opt.step()
    return _state(model), wrapped


@pytest.mark.parametrize("order", ["inside", "around"])
def test_fabric_trains_as_eager(order):
    want, _ = _fabric_run(None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got, wrapped = _fabric_run(order)
    torch.testing.assert_close(got, want)
    if order == "around":  # Fabric's output hooks: the calls run eagerly, said once
        assert sum("never fire" in str(w.message) for w in record) == 1
        assert fulmen.compile_stats(wrapped).eager_calls == len(_DATA)
    else:
        assert fulmen.compile_stats(wrapped.module).eager_calls == 0


class _Module(L.LightningModule):
    def __init__(self, jitted):
        super().__init__()
        self.net = _net()
        self.forward_fn = fulmen.jit(self.net) if jitted else self.net

    def training_step(self, batch, index):
        x, y = batch
        return F.mse_loss(self.forward_fn(x).float(), y)

    def validation_step(self, batch, index):  # the sanity check runs it in eval mode first
        x, y = batch
        self.log("val_loss", F.mse_loss(self.forward_fn(x).float(), y))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 2)]


@pytest.mark.parametrize("options", [
    {"precision": "bf16-mixed"},
    {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5},
])
def test_trainer_fit_with_a_jitted_network_matches_eager(options):
    runs = []
    for jitted in (False, True):
        torch.manual_seed(1)
        module = _Module(jitted)
        trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, **options)
        loader = torch.utils.data.DataLoader(_DATA, batch_size=None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's tips about workers and loggers
            trainer.fit(module, loader, loader)
        runs.append((_state(module.net), module))
    torch.testing.assert_close(runs[1][0], runs[0][0])
    stats = fulmen.compile_stats(runs[1][1].forward_fn)
    assert stats.eager_calls == 0 and stats.cache_hits > 0
