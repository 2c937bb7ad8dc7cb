"""The step's scale or skip (offload/runtime/step_scale.py), as numbers: no tensors, no engine."""

from __future__ import annotations

import math

import pytest

from offload.runtime.step_scale import Outcome, needs_norm, step_scale

BASE = dict(unscale=0.25, overflow=False, nonfinite_loss=False, norm=2.0, guard="skip",
            updated_in_backward=False, clip=0.0)


def scale(**kw):
    return step_scale(**{**BASE, **kw})


def test_a_plain_step_applies_the_unscale_and_reports_the_norm():
    s = scale()
    assert (s.outcome, s.grad_scale, s.reported_norm) == (Outcome.APPLY, 0.25, 2.0)


def test_clipping_is_torchs_factor_clamped_to_one():
    assert scale(clip=1.0).grad_scale == pytest.approx(0.25 * 1.0 / (2.0 + 1e-6), rel=1e-15)
    assert scale(clip=5.0).grad_scale == 0.25  # the norm is under the max: no clipping
    assert scale(clip=1.0).reported_norm == 2.0  # the norm before clipping, as torch returns


@pytest.mark.parametrize("kw,outcome", [
    (dict(overflow=True, norm=None), Outcome.OVERFLOW),
    (dict(nonfinite_loss=True, norm=None), Outcome.NONFINITE_LOSS),
    (dict(norm=math.inf), Outcome.NONFINITE_GRAD),
    (dict(norm=math.nan), Outcome.NONFINITE_GRAD),
    (dict(norm=math.nan, guard="raise"), Outcome.NONFINITE_GRAD_RAISE),
])
def test_every_skip_has_its_reason_no_scale_and_an_infinite_reported_norm(kw, outcome):
    s = scale(**kw)
    assert s.outcome is outcome and s.outcome.skipped
    assert s.grad_scale is None and s.reported_norm == math.inf


def test_the_guard_off_or_a_step_already_updated_in_backward_applies_a_nonfinite_norm():
    for kw in (dict(guard="off"), dict(updated_in_backward=True)):
        s = scale(norm=math.inf, **kw)
        assert s.outcome is Outcome.APPLY and s.grad_scale == 0.25 and s.reported_norm == math.inf


def test_the_norm_is_taken_only_when_the_step_is_not_already_skipped():
    assert needs_norm(False, False)
    assert not needs_norm(True, False) and not needs_norm(False, True)
    with pytest.raises(ValueError, match="the norm is needed"):
        scale(norm=None)
