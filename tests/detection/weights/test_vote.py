"""Strict-majority vote and non-finite attribution: the pure decisions behind two layers."""

from __future__ import annotations

from detection.guard.comm_hook import attribute_nonfinite
from detection.transport.alarm import Phase
from detection.weights.fingerprint import Fingerprint, to_fingerprint
from detection.weights.vote import KnownDivergence, majority_vote

A, B, C = Fingerprint(1, 2), Fingerprint(1, 3), Fingerprint(9, 9)


def test_unanimous_replicas_pass() -> None:
    verdict = majority_vote([A, A, A, A])
    assert verdict.passed
    assert verdict.divergent == ()


def test_strict_majority_names_the_divergent_ranks() -> None:
    assert majority_vote([A, B, A, A]).divergent == (1,)
    assert majority_vote([A, B, A, C, A]).divergent == (1, 3)
    assert majority_vote([B, A, A]).culprit_known


def test_two_replicas_or_a_tie_cannot_name_a_culprit() -> None:
    for values in ([A, B], [A, A, B, B], [A, B, C]):
        verdict = majority_vote(values)
        assert not verdict.passed
        assert not verdict.culprit_known
        assert verdict.divergent == ()


def test_to_fingerprint_reads_negative_int64_words() -> None:
    assert to_fingerprint(-1, 5) == Fingerprint((1 << 64) - 1, 5)


def test_nonfinite_local_gradient_names_its_rank() -> None:
    verdict = attribute_nonfinite([False, False, True, False], [True] * 4)
    assert verdict is not None
    assert (verdict.phase, verdict.suspects) == (Phase.PRE_ALLREDUCE, (2,))


def test_nonfinite_after_allreduce_only_on_some_ranks_names_them() -> None:
    verdict = attribute_nonfinite([False] * 4, [False, True, False, False])
    assert verdict is not None
    assert (verdict.phase, verdict.suspects) == (Phase.POST_ALLREDUCE, (1,))


def test_nonfinite_reduction_from_finite_inputs_names_no_rank() -> None:
    verdict = attribute_nonfinite([False] * 4, [True] * 4)
    assert verdict is not None
    assert (verdict.phase, verdict.suspects) == (Phase.POST_ALLREDUCE, ())


def test_finite_gradients_raise_nothing() -> None:
    assert attribute_nonfinite([False] * 4, [False] * 4) is None


def test_a_known_divergence_is_classes_of_equal_replicas_not_a_blanket() -> None:
    known = KnownDivergence()
    assert known.is_new(["a", "a", "b", "b"])  # nothing known yet
    known.record(["a", "a", "b", "b"])  # a 2-2 tie: no culprit, two classes
    assert known.minority() == frozenset()
    assert not known.is_new(["a", "a", "b", "b"])  # the same divergence again
    assert not known.is_new(["c", "c", "d", "d"])  # both classes drift on, still apart
    assert known.is_new(["a", "x", "b", "b"])  # a split inside a class is a new event
    assert known.apart(0, 2)
    assert not known.apart(0, 1)
    known.record(["a", "a", "a", "b"])
    assert known.minority() == frozenset({3})
    assert not known.is_new(["a", "a", "a", "a"])  # equal again is not a new event
    known.clear()
    assert not known.apart(0, 3)
