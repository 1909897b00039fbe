"""math-verify wrapper: DAPO-style answers (fractions, radicals, intervals, sets, LaTeX vs
plain), and errors/time-outs scored 0 without crashing."""

from __future__ import annotations

import time

import pytest

from rollout_bridge.envs.math_tir.verifier import MathVerifier, VerifierConfig, gold_text

CASES = [
    ("34", "Adding up, the answer is \\boxed{34}.", 1.0),
    ("34", "so the answer is 34", 1.0),  # plain text, no box
    ("34", "\\boxed{35}", 0.0),
    ("\\frac{1}{2}", "The probability is \\boxed{\\frac{1}{2}}", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),  # LaTeX gold vs decimal
    ("\\dfrac{3}{4}", "\\boxed{3/4}", 1.0),  # LaTeX vs plain fraction
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
    ("2\\sqrt{3}", "\\boxed{\\sqrt{12}}", 1.0),  # radicals, simplified vs not
    ("2\\sqrt{3}", "\\boxed{3\\sqrt{2}}", 0.0),
    ("(0, 1]", "\\boxed{(0,1]}", 1.0),  # intervals
    ("(0,1]", "\\boxed{[0,1]}", 0.0),
    ("\\{1,2\\}", "\\boxed{\\{2,1\\}}", 1.0),  # sets, any order
    ("x^2+2x+1", "\\boxed{(x+1)^2}", 1.0),  # symbolic equality
    ("34", "", 0.0),  # nothing to parse
]


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(VerifierConfig(timeout_s=3.0)) as v:
        yield v


@pytest.mark.parametrize("gold, response, expected", CASES)
def test_dapo_style_answers(verifier, gold, response, expected):
    assert verifier.score(gold, response) == expected


def test_hanging_check_is_a_failed_score_and_the_next_one_works(verifier):
    errors = verifier.errors
    start = time.monotonic()
    assert verifier.score("5", "\\boxed{9^{9^{9^{9}}}}") == 0.0  # sympy would run for ages
    assert time.monotonic() - start < 3.0 + 2.0
    assert verifier.errors == errors + 1
    assert verifier.score("5", "\\boxed{5}") == 1.0


def test_unparseable_ground_truth_is_a_failed_score(verifier):
    errors = verifier.errors
    assert verifier.score("", "\\boxed{5}") == 0.0
    assert verifier.errors == errors + 1


def test_gold_text():
    assert gold_text(" 34 ") == "$34$"
    assert gold_text("$x$") == "$x$"
    assert gold_text("\\boxed{2}") == "\\boxed{2}"


def test_config_rejects_non_positive_timeouts():
    with pytest.raises(ValueError, match="verifier.timeout_s"):
        VerifierConfig(timeout_s=0)
