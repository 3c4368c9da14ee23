"""The partition's checks of growing regions with reductions (NOTE [growing row regions] in
fulmen/executors/codegen/rows.py): a region that is a region already found to lower plus one
more statement is checked by lowering that statement alone, and every answer is the one that
lowering the whole region gives. Counts lowerings, never times them."""

import torch
import torch.nn.functional as F

import fulmen
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
