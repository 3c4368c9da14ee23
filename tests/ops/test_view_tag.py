"""`Tag.VIEW` is declared with each op (remat, the memory estimate and fusion read it): every op
declared a view returns a view in eager, decomposes into view prims and `prims.reshape` only,
and is a view for the functionalizer too."""

import pytest
import torch

import fulmen
from fulmen.core import Tag, flatten
from fulmen.ops import prims
from fulmen.ops.torch.base import all_torch_ops
from fulmen.tracer.view_calls import VIEW_FUNCTIONS

# one call per torch-level op declared a view (a new declaration needs a sample here)
SAMPLES = {
    "view": lambda x: x.view(6, 4),
    "view_as": lambda x: x.view_as(torch.empty(4, 6)),
    "unflatten": lambda x: x.unflatten(1, (2, 2)),
    "squeeze": lambda x: x[:1].squeeze(0),
    "unsqueeze": lambda x: x.unsqueeze(1),
    "expand": lambda x: x[:1].expand(3, 4),
    "expand_as": lambda x: x[:1].expand_as(torch.empty(5, 4)),
    "broadcast_to": lambda x: torch.broadcast_to(x[:1], (3, 4)),
    "permute": lambda x: x.permute(1, 0),
    "transpose": lambda x: x.transpose(0, 1),
    "swapaxes": lambda x: x.swapaxes(0, 1),
    "swapdims": lambda x: x.swapdims(0, 1),
    "t": lambda x: x.t(),
    "T": lambda x: x.T,
    "mT": lambda x: x.mT,
    "mH": lambda x: x.mH,
    "movedim": lambda x: x.movedim(0, 1),
    "moveaxis": lambda x: x.moveaxis(0, 1),
    "split": lambda x: x.split(2)[1],
    "split_with_sizes": lambda x: x.split_with_sizes([1, 5])[1],
    "chunk": lambda x: x.chunk(3)[2],
    "tensor_split": lambda x: x.tensor_split(3)[1],
    "unbind": lambda x: x.unbind(0)[2],
    "narrow": lambda x: x.narrow(0, 1, 3),
    "select": lambda x: x.select(1, 2),
    "getitem": lambda x: x[1:, None, ::2],
}


def _declared_views() -> dict:
    return {name: sym for name, sym in all_torch_ops().items() if Tag.VIEW in sym.tags}


def test_every_declared_view_has_a_sample():
    assert sorted(_declared_views()) == sorted(SAMPLES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_declared_view_is_a_view(name):
    x = torch.randn(6, 4)
    assert SAMPLES[name](x).untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    jfn = fulmen.jit(SAMPLES[name], executors=["torch"])
    torch.testing.assert_close(jfn(x), SAMPLES[name](x))
    statements = [b for b in fulmen.last_traces(jfn)[0].bsyms if b.sym.name == name]
    assert statements and all(b.is_view for b in statements)
    for bsym in statements:  # views only: a prim declared a view, or prims.reshape
        assert all(part.sym is prims.reshape or Tag.VIEW in part.sym.tags
                   for part in flatten(bsym)), bsym


def test_declared_views_are_views_for_the_functionalizer():
    for sym in _declared_views().values():
        kind = VIEW_FUNCTIONS.get(sym.torch_fn)
        assert kind is not None and not kind[2], sym  # a view, not a maybe-view


def test_copying_ops_are_not_views():
    for name in ("reshape", "reshape_as", "flatten", "contiguous", "repeat", "clone"):
        sym = all_torch_ops().get(name)
        assert sym is None or Tag.VIEW not in sym.tags, name
    assert all(Tag.VIEW not in sym.tags for sym in (prims.reshape, prims.flip, prims.pad))


def test_an_undeclared_tag_is_refused():
    with pytest.raises(ValueError):
        fulmen.core.Symbol("x", None, namespace=prims.base.PRIMS_NAMESPACE, tags={"veiw"})
