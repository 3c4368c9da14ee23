"""The float64 accuracy rule (`fulmen.accuracy`): errors measured against a float64 run."""

import pytest
import torch

from fulmen.tools.accuracy import assert_accurate, check_accuracy


def _with_error(reference, error, dtype=torch.float32):
    """`reference` moved by an rms error of about `error`, in `dtype`."""
    signs = torch.where(torch.arange(reference.numel()) % 2 == 0, 1.0, -1.0).double()
    return (reference + error * signs.reshape(reference.shape)).to(dtype)


def test_twice_eager_error_passes_three_times_fails_in_float32():
    reference = torch.linspace(-1, 1, 64, dtype=torch.float64)
    eager = _with_error(reference, 1e-4)
    assert check_accuracy(_with_error(reference, 1.9e-4), eager, reference).ok
    result = check_accuracy(_with_error(reference, 3e-4), eager, reference)
    assert not result.ok and "eager's" in result.detail


def test_low_precision_allows_three_times_eager_error():
    reference = torch.linspace(-1, 1, 64, dtype=torch.float64)
    eager = _with_error(reference, 1e-2)
    actual = _with_error(reference, 2.5e-2)
    assert not check_accuracy(actual, eager, reference, low_precision=False).ok
    assert check_accuracy(actual, eager, reference, low_precision=True).ok


def test_floor_accepts_rounding_when_eager_is_exact_by_luck():
    reference = torch.tensor([0.5, 0.25, 2.0], dtype=torch.float64)
    eager = reference.float()  # exact: eager's error is 0
    one_ulp = torch.nextafter(eager, torch.full_like(eager, 10.0))
    assert check_accuracy(one_ulp, eager, reference).ok
    assert not check_accuracy(eager * 1.001, eager, reference).ok  # a real error is not


def test_metadata_integers_and_non_finite_positions_must_match():
    reference = torch.tensor([1.0, 2.0], dtype=torch.float64)
    eager = reference.float()
    assert not check_accuracy(eager.half(), eager, reference).ok
    assert not check_accuracy(torch.tensor([1.0, float("inf")]), eager, reference).ok
    assert not check_accuracy(torch.tensor([1, 3]), torch.tensor([1, 2]), None).ok
    with_inf = torch.tensor([1.0, float("inf")])
    assert check_accuracy(with_inf, with_inf, torch.tensor([1.0, 2.0]).double()).ok


def test_assert_accurate_computes_the_reference_only_when_needed():
    def never():
        raise AssertionError("float64 run not needed: the results are equal")

    x = torch.randn(4)
    assert_accurate({"a": x, "b": [x]}, {"a": x.clone(), "b": [x.clone()]}, never)
    reference = x.double()
    with pytest.raises(AssertionError, match="less accurate than eager"):
        assert_accurate([x + 0.01], [x], lambda: [reference])
