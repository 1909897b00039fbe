"""Tests for spopp_jax.evaluation (SPEC 7 scores), against hand-derived values."""

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from spopp_jax.evaluation import (
    area_under_curve,
    c10_score,
    last_mean,
    paired_differences,
    plotted_steps,
)

rewards = st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=40)


def test_auc_single_step_is_the_reward():
    assert area_under_curve([0.37]) == pytest.approx(0.37)


def test_auc_hand_derived():
    # T = 3: ((0 + 0.5)/2 + (0.5 + 1)/2) / 2 = (0.25 + 0.75)/2 = 0.5
    assert area_under_curve([0.0, 0.5, 1.0]) == pytest.approx(0.5)
    # T = 4: ((0.2+0.4)/2 + (0.4+0.4)/2 + (0.4+1.0)/2)/3 = (0.3 + 0.4 + 0.7)/3
    assert area_under_curve([0.2, 0.4, 0.4, 1.0]) == pytest.approx(1.4 / 3)


def test_auc_weighs_end_points_half():
    # a trapezoid area differs from the step mean exactly by the end points' half weight
    r = np.array([0.1, 0.9, 0.3, 0.6, 0.2])
    t = r.size
    expected = (r.sum() - 0.5 * (r[0] + r[-1])) / (t - 1)
    assert area_under_curve(r) == pytest.approx(expected)
    assert area_under_curve(r) != pytest.approx(r.mean())


@hypothesis.given(rewards)
def test_auc_lies_between_min_and_max(curve):
    auc = area_under_curve(curve)
    assert min(curve) - 1e-12 <= auc <= max(curve) + 1e-12


@hypothesis.given(rewards, st.floats(-1.0, 1.0))
def test_auc_shifts_with_a_constant(curve, shift):
    shifted = [r + shift for r in curve]
    assert area_under_curve(shifted) == pytest.approx(area_under_curve(curve) + shift, abs=1e-9)


def test_c10_hand_derived():
    r = [0.0] * 5 + [1.0] * 5 + [0.3] * 7  # steps after the 10th are ignored
    # AUC(r_1..r_10): 9 intervals, 4 at 0, one (0+1)/2, 4 at 1 -> 4.5/9 = 0.5; mean(r_6..10) = 1
    assert c10_score(r) == pytest.approx(0.5 * (0.5 + 1.0))


def test_c10_needs_ten_steps():
    with pytest.raises(ValueError, match="at least 10"):
        c10_score([0.5] * 9)


def test_last_mean():
    assert last_mean([0.0, 0.2, 0.4, 0.6, 0.8, 1.0], k=5) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="k"):
        last_mean([0.1, 0.2], k=5)


def test_plotted_steps_block_means_and_drop_incomplete_block():
    per_update = [0.0, 0.5, 1.0, 0.5, 0.25]
    np.testing.assert_allclose(plotted_steps(per_update, 2), [0.25, 0.75])
    with pytest.raises(ValueError, match="no complete plotted step"):
        plotted_steps([0.1], 2)


def test_paired_differences_hand_derived():
    out = paired_differences([0.5, 0.7, 0.4], [0.3, 0.7, 0.6])
    np.testing.assert_allclose(out.differences, [0.2, 0.0, -0.2], atol=1e-12)
    assert out.mean == pytest.approx(0.0)
    assert out.std == pytest.approx(0.2)  # sqrt((0.04 + 0 + 0.04) / 2)
    assert (out.positive, out.negative, out.zero) == (1, 1, 1)


def test_paired_differences_single_pair_has_nan_std():
    out = paired_differences([0.5], [0.25])
    assert out.mean == pytest.approx(0.25) and np.isnan(out.std)


@pytest.mark.parametrize("bad", [[], [0.1, float("nan")], [[0.1, 0.2]]])
def test_bad_curves_are_refused(bad):
    with pytest.raises(ValueError):
        area_under_curve(bad)


def test_unequal_pairs_are_refused():
    with pytest.raises(ValueError, match="equal lengths"):
        paired_differences([0.1, 0.2], [0.1])
