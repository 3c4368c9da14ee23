"""The partition's checks of growing regions with reductions (NOTE [growing row regions] in
fulmen/executors/codegen/rows.py): a region that is a region already found to lower plus one
more statement is checked by lowering that statement alone, and every answer is the one that
lowering the whole region gives. Counts lowerings, never times them."""

import torch
import torch.nn.functional as F

import fulmen
from fulmen.core import flatten
from fulmen.executors.codegen import rows
from fulmen.executors.codegen.ops import Unsupported


def _block(x, w, b):
    h = F.layer_norm(x, (x.shape[-1],), w, b)
    scores = torch.softmax(h @ h.transpose(-1, -2) * 0.5, dim=-1)
    return (scores @ h).sigmoid().sum()


def test_growing_row_regions_are_checked_by_their_new_statement(monkeypatch):
    answers, whole = [], []
    fits, lowering = rows.RowChecks.fits, rows._row_lowering

    def checked(self, region):
        answer = fits(self, region)
        try:
            lowering(region, [])  # the whole region (not counted)
            expected = True
        except Unsupported:
            expected = False
        answers.append((answer, expected))
        return answer

    def counted(region, outputs):
        if not outputs:  # a check, not the lowering of a fused region
            whole.append(len(region))
        return lowering(region, outputs)

    monkeypatch.setattr(rows.RowChecks, "fits", checked)
    monkeypatch.setattr(rows, "_row_lowering", counted)
    x = torch.randn(4, 6, 8)
    w, b = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    jfn = fulmen.jit(_block)
    out = jfn(x, w, b)
    out.backward()
    ew, eb = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    expected = _block(x, ew, eb)
    expected.backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close((w.grad, b.grad), (ew.grad, eb.grad))
    assert answers and all(answer == truth for answer, truth in answers)
    fitting = sum(answer for answer, _ in answers)
    assert len(whole) < fitting  # some regions were checked by their last statement alone


def _answers(monkeypatch):
    """Record (answer, answer of the whole lowering) of every row check, and the sizes of the
    regions lowered whole for a check."""
    answers, whole = [], []
    fits, lowering = rows.RowChecks.fits, rows._row_lowering

    def checked(self, region):
        answer = fits(self, region)
        try:
            lowering(region, [])
            expected = True
        except Unsupported:
            expected = False
        answers.append((answer, expected))
        return answer

    def counted(region, outputs):
        if not outputs:
            whole.append(len(region))
        return lowering(region, outputs)

    monkeypatch.setattr(rows.RowChecks, "fits", checked)
    monkeypatch.setattr(rows, "_row_lowering", counted)
    return answers, whole


def _sums_of_other_shapes(x):
    # the sum of the slice is a region first; the horizontal merge (both read x) then asks of
    # it plus a sum of another shape, which no row kernel computes
    return x[:, :6].sum(-1), x.sum(-1)


def _transposed_sum(x):
    # the second merge pass asks of [permute, sum] plus the mul producing what the permute
    # reads: the whole lowering refuses a view of a computed value, the base saw an input
    return (x * 2).t().sum(-1)


def _refused_then_grown(x, w):
    # the row region meets statements it cannot take (a permute of a computed value) and then
    # ones it can: each extends the same kept base
    h = torch.softmax(x, dim=-1)
    return (h * w).t().sum(-1), (h + w).exp().sum(-1)


def test_every_row_check_answers_as_the_whole_lowering(monkeypatch):
    """A kept base extended by a region's other statements answers as the whole region's
    lowering: reductions of another shape, a base reading what the others compute, refusals
    rolled back (NOTE [growing row regions])."""
    answers, whole = _answers(monkeypatch)
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    cases = ((_sums_of_other_shapes, (x,)), (_transposed_sum, (x,)),
             (_refused_then_grown, (x, w)))
    for fn, args in cases:
        answers.clear()
        torch.testing.assert_close(fulmen.jit(fn)(*args), fn(*args))
        assert answers and all(answer == truth for answer, truth in answers), fn.__name__
        assert any(not truth for _, truth in answers), fn.__name__  # a refusal was asked


def test_row_checks_of_two_sizes_answer_as_the_whole_lowering(monkeypatch):
    """The kept lowerings are keyed by the statements they hold (never by what they compute):
    the same program at a size where a dim is 1 (which changes what lowers) is checked anew."""
    answers, whole = _answers(monkeypatch)
    for shape in ((4, 6, 8), (4, 1, 8), (1, 6, 8)):
        x = torch.randn(shape)
        w, b = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
        out = fulmen.jit(_block)(x, w, b)
        torch.testing.assert_close(out, _block(x, w, b))
    assert answers and all(answer == truth for answer, truth in answers)


def _normalised_and_transposed(x, y):
    return x / x.sum(-1, keepdim=True), (y * 2).t()


def test_a_refused_extension_leaves_its_base_as_it_was():
    """The base of a refused check answers the next check as if never extended: the product
    lowered before the refusal is no value of the base, so a view of it is a view of an input
    (the row checks asked directly, in the order a partition could ask them)."""
    jfn = fulmen.jit(_normalised_and_transposed)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    jfn(x, y)
    statements = [sub for bsym in fulmen.last_traces(jfn)[0].bsyms for sub in flatten(bsym)]
    names = [bsym.sym.name for bsym in statements]
    assert names == ["sum", "broadcast_in_dim", "broadcast_in_dim", "div", "mul", "permute"]
    base, product, view = statements[:4], statements[4], statements[5]
    checks = rows.RowChecks()
    assert checks.fits(base)
    assert not checks.fits([*base, product, view])  # a permute of a computed element value
    assert checks.fits([*base, view])  # a permute of an input
