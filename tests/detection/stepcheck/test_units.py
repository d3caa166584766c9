"""The per-step layer's pieces on their own: the all-reduce rounding bound against real float32
reductions, the calibrated statistical tests, the optimizer-state flag, the Linear checksums."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch import nn

from detection.faults.injector import flip_bit_
from detection.row.words import nonfinite_flag
from detection.stepcheck import allreduce as allreduce_check
from detection.stepcheck.abft import LinearChecksums
from detection.stepcheck.abft_bound import tolerance
from detection.stepcheck.allreduce import (
    CHUNK,
    WIDE_MAX,
    bucket_norm,
    check_reduction,
    chunked_sum,
    reduction_bound,
    unit_roundoff,
)
from detection.stepcheck.checks import _parse_array, _parse_lists
from detection.stepcheck.gradstats import (
    BUCKET_FIELDS,
    LocalGradStats,
    StatsConfig,
    StatsConfigError,
)
from detection.stepcheck.gradstats_detector import GradStatsDetector
from detection.weights.optstate import OptimizerStateCheck, StateFlag, state_nonfinite_flag

U32 = unit_roundoff(torch.float32)


def _reduce(grads: list[torch.Tensor], order: list[int]) -> torch.Tensor:
    """DDP's average in float32: divide each rank's bucket by W, then sum in ``order``."""
    world = len(grads)
    total = torch.zeros_like(grads[0])
    for r in order:
        total = total + grads[r] / world
    return total


def _sums(grads: list[torch.Tensor], reduced: list[torch.Tensor]) -> tuple[list[list[float]], ...]:
    local = [[chunked_sum(g).item()] for g in grads]
    norms = [[bucket_norm(g).item()] for g in grads]
    post = [[chunked_sum(r).item()] for r in reduced]
    return local, norms, post


def test_unit_roundoff_of_float32_is_two_to_the_minus_24() -> None:
    assert U32 == 2.0**-24


def test_real_float32_reductions_stay_inside_the_bound() -> None:
    """Many random buckets, heavy-tailed and with cancellation, reduced in random orders by
    float32 arithmetic: never outside the derived bound."""
    rng = random.Random(7)
    for trial in range(60):
        world = rng.choice([2, 3, 4, 6, 8])
        n = rng.choice([1, 7, 1000, 50_000])
        gen = torch.Generator().manual_seed(trial)
        scale = 10.0 ** rng.uniform(-8, 3)
        grads = [
            torch.randn(n, generator=gen) * scale * torch.exp(3 * torch.randn(n, generator=gen))
            for _ in range(world)
        ]
        if trial % 3 == 0:  # near-total cancellation across ranks
            grads[-1] = -sum(grads[:-1], torch.zeros(n)) + 1e-3 * grads[-1]
        order = list(range(world))
        rng.shuffle(order)
        reduced = _reduce(grads, order)
        local, norms, post = _sums(grads, [reduced] * world)
        assert check_reduction(local, norms, post, [n], U32) is None, trial
        worst = abs(world * post[0][0] - math.fsum(x[0] for x in local))
        assert worst <= reduction_bound(world, n, [x[0] for x in norms], U32)


def test_the_bound_is_the_docstrings_formula_to_the_last_bit() -> None:
    """The bound's size-dependent factor is kept per bucket size: the bound is still the
    formula of the module docstring, evaluated in its order, bit for bit, and ``inf`` where a
    bucket is too large for any (also when its norms are all zero)."""

    def gamma(k: float, u: float) -> float:
        return k * u / (1.0 - k * u)

    def formula(world: int, n: int, norms: list[float], u: float) -> float:
        v, acc = 2.0**-53, min(u, 2.0**-24)
        if n * acc >= 0.5:
            return math.inf
        coefficient = (
            u
            + gamma(world - 1, u) * (1.0 + u)
            + (gamma(CHUNK - 1, acc) + gamma(n // CHUNK + 1, v)) * (2.0 + world * u)
            + gamma(world, v)
            + v * (1.0 + world * u)
        )
        inflation = 1.0 / ((1.0 - acc) * math.sqrt(1.0 - gamma(n, acc)))
        return coefficient * inflation * math.sqrt(n) * math.fsum(norms) * (1.0 + 1e-6)

    rng = random.Random(11)
    u64 = unit_roundoff(torch.float64)
    for _ in range(300):
        world = rng.choice([2, 3, 5, 8, 64])
        n = rng.choice([1, 17, 4096, 1 << 20, 1 << 23, 1 << 25])
        u = rng.choice([U32, u64])
        norms = [10.0 ** rng.uniform(-20, 20) for _ in range(world)]
        assert reduction_bound(world, n, norms, u) == formula(world, n, norms, u)
    assert reduction_bound(2, 1 << 25, [0.0, 0.0], U32) == math.inf


def test_a_flip_in_one_ranks_reduced_bucket_names_that_rank() -> None:
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(4096, generator=gen) * 1e-3 for _ in range(4)]
    reduced = [_reduce(grads, [0, 1, 2, 3]) for _ in range(4)]
    flip_bit_(reduced[2], 100, 23)  # the lowest exponent bit: x2 or ÷2 of one element
    finding = check_reduction(*_sums(grads, reduced), [4096], U32)
    assert finding is not None
    assert finding.suspects == (2,)
    assert finding.to_detail()["check"] == "reduced sums differ between replicas"


def test_a_corrupted_reduction_seen_by_every_rank_breaks_the_bound_and_names_nobody() -> None:
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(4096, generator=gen) * 1e-3 for _ in range(4)]
    reduced = _reduce(grads, [0, 1, 2, 3])
    flip_bit_(reduced, 9, 26)  # one element x256 or ÷256, on every replica alike
    finding = check_reduction(*_sums(grads, [reduced] * 4), [4096], U32)
    assert finding is not None
    assert finding.suspects == ()
    detail = finding.to_detail()
    assert detail["statistic"] > detail["threshold"] > 0


def _reduction_table(
    rng: np.random.Generator, world: int, n_buckets: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int], np.ndarray]:
    """Per rank and bucket: local sums, norms and reduced sums as clean float32 all-reduces
    leave them (reduced = the float32 average, the same on every replica), and the bounds."""
    numel = rng.integers(1, 300_000, n_buckets).tolist()
    norms = np.exp(rng.normal(0, 3, (world, n_buckets))) * np.sqrt(numel)
    sums = rng.normal(0, 1, (world, n_buckets)) * norms
    mean = (sums.astype(np.float32) / np.float32(world)).sum(0, dtype=np.float32)
    reduced = np.repeat(mean.astype(np.float64)[None], world, axis=0)
    bounds = np.array(
        [reduction_bound(world, n, norms[:, b].tolist(), U32) for b, n in enumerate(numel)]
    )
    return sums, norms, reduced, numel, bounds


def _by_definition(
    monkeypatch: pytest.MonkeyPatch,
    sums: np.ndarray,
    norms: np.ndarray,
    reduced: np.ndarray,
    numel: list[int],
) -> object:
    """check_reduction with no screen: the per-bucket loop over every bucket."""
    with monkeypatch.context() as patched:
        patched.setattr(allreduce_check, "ARRAY_MIN", 1 << 62)
        return check_reduction(sums.tolist(), norms.tolist(), reduced.tolist(), numel, U32)


@pytest.mark.parametrize(("world", "n_buckets"), [(4, 80), (16, 40), (64, 9), (3, 300)])
def test_the_screened_reduction_check_finds_what_the_loop_finds(
    monkeypatch: pytest.MonkeyPatch, world: int, n_buckets: int
) -> None:
    """A large table is screened with array ops, then only the buckets kept are checked one by
    one: on clean tables, corruptions at, just under and just over the bound, replicas that
    differ, non-finite values and zero-norm buckets, the finding is the loop's, to the bit."""
    rng = np.random.default_rng(world * 1000 + n_buckets)
    assert world * n_buckets > allreduce_check.ARRAY_MIN  # the screen is on
    for trial in range(54):
        sums, norms, reduced, numel, bounds = _reduction_table(rng, world, n_buckets)
        expected = np.array([math.fsum(sums[:, b].tolist()) for b in range(n_buckets)])
        kind = trial % 9
        b = int(rng.integers(n_buckets))
        ranks = rng.choice(world, int(rng.integers(1, world + 1)), replace=False)
        if kind == 1:  # a residual a hair under, at or over the bound on some ranks
            factor = 1.0 + float(rng.choice([-1e-15, -1e-12, 0.0, 1e-15, 1e-12, 1e-6]))
            reduced[ranks, b] = (expected[b] + bounds[b] * factor) / world
        elif kind == 2:  # far over the bound, on every rank alike
            reduced[:, b] = (expected[b] + 1e3 * bounds[b]) / world
        elif kind == 3:  # one replica's reduced sum differs in its last bit
            reduced[ranks[0], b] = np.nextafter(reduced[ranks[0], b], np.inf)
        elif kind == 4:  # non-finite values in one bucket (another may still break the bound)
            table = (sums, norms, reduced)[int(rng.integers(3))]
            table[ranks[0], b] = float(rng.choice([np.nan, np.inf, -np.inf]))
            other = (b + 1) % n_buckets
            reduced[:, other] = (expected[other] + 2 * bounds[other]) / world
        elif kind == 5:  # zero gradients in a bucket (bound zero), maybe a value where none is
            sums[:, b], norms[:, b], reduced[:, b] = 0.0, 0.0, 0.0
            if trial % 16 == 5:
                reduced[:, b] = 1e-300
        elif kind == 6:  # -0.0 and 0.0 are one value; NaN on one replica is not a difference
            reduced[:, b] = 0.0
            reduced[ranks[0], b] = -0.0
            reduced[ranks[-1], (b + 1) % n_buckets] = np.nan
        elif kind == 7:  # corruptions in several buckets: the worst is the one reported
            for c in rng.choice(n_buckets, 3, replace=False):
                reduced[:, c] = (expected[c] + float(rng.uniform(2, 9)) * bounds[c]) / world
        elif kind == 8:  # local sums that cancel: numpy's sum is off by far more than fsum
            big = 1e12 * bounds[b]
            sums[1, b], sums[2 % world, b] = big, -big
            sums[0, b] = bounds[b] * float(rng.uniform(1, 2))
            exact = math.fsum(sums[:, b].tolist())
            reduced[:, b] = (exact + bounds[b] * (1.0 + float(rng.choice([-1e-6, 1e-6])))) / world
        screened = check_reduction(sums, norms, reduced, numel, U32)
        assert screened == _by_definition(monkeypatch, sums, norms, reduced, numel), (trial, kind)
        if kind == 0:
            assert screened is None, trial  # a clean table passes


def _clean_values(rng: random.Random, world: int, level: float) -> list[dict[str, float]]:
    return [
        {"loss": math.exp(rng.gauss(0.5, 0.1)), "l2[0]": math.exp(rng.gauss(level, 0.15))}
        for _ in range(world)
    ]


@pytest.mark.parametrize("numel", [1, 1_000, WIDE_MAX, WIDE_MAX + 1, 200_003])
def test_a_buckets_sum_stays_within_the_error_its_bound_assumes(numel: int, kernels: str) -> None:
    """Both regimes of chunked_sum (float64 outright up to WIDE_MAX, float32 chunks of CHUNK
    above), on both paths: against the exact sum, the error stays under the chunked model's
    gamma(C - 1) times the absolute sum that reduction_bound charges for it; a small bucket is
    summed in float64, so its error is far below that."""
    gen = torch.Generator().manual_seed(numel)
    bucket = torch.randn(numel, generator=gen) * torch.exp(4 * torch.randn(numel, generator=gen))
    values = [float(v) for v in bucket.tolist()]
    exact = math.fsum(values)
    absolute = math.fsum(abs(v) for v in values)
    error = abs(chunked_sum(bucket).item() - exact)
    assert error <= (CHUNK - 1) * U32 / (1 - (CHUNK - 1) * U32) * absolute
    if numel <= WIDE_MAX:
        assert error <= 2 * numel * 2.0**-53 * absolute


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_nonfinite_flag_is_one_exactly_for_nan_and_infinities(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    values = torch.tensor([0.0, -0.0, 1.5, -big, big, math.inf, -math.inf, math.nan], dtype=dtype)
    assert nonfinite_flag(values).tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    # a float32 sum that overflows is non-finite too: what the optimizer-state flag relies on
    assert nonfinite_flag(torch.tensor([big, big], dtype=dtype).sum()).item() == 1


@pytest.mark.parametrize("numel", [1_000, 1 << 21])  # in cache and bandwidth-bound buckets
def test_a_buckets_peak_is_its_largest_magnitude_and_nan_when_it_holds_one(
    numel: int, kernels: str
) -> None:
    bucket = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    for at, value in ((7, -1e3), (numel - 1, 2e3)):
        bucket[at] = value
        stats = LocalGradStats(torch.device("cpu"))
        stats.on_local(0, bucket)
        assert stats.row()[3].item() == abs(value)  # [n_buckets, sum, l2, peak, reduced]
    bucket[numel // 2] = math.nan
    stats = LocalGradStats(torch.device("cpu"))
    stats.on_local(0, bucket)
    assert math.isnan(stats.row()[3].item())


def test_statistics_learn_then_name_the_outlying_rank_on_its_step() -> None:
    rng = random.Random(3)
    detector = GradStatsDetector(4, StatsConfig(warmup=20))
    for _ in range(20):
        assert detector.test(_clean_values(rng, 4, -2.0)) == []  # calibrating: silent
        detector.learn(_clean_values(rng, 4, -2.0))
    for _ in range(300):
        values = _clean_values(rng, 4, -2.0)
        assert detector.test(values) == []
        detector.learn(values)
    values = _clean_values(rng, 4, -2.0)
    values[1]["l2[0]"] *= 500.0  # one element x65536 in a bucket of ~17k: the norm x~500
    findings = detector.test(values)
    assert [f.rank for f in findings] == [1]
    assert findings[0].deviation > findings[0].threshold >= math.log(8.0)


@pytest.mark.parametrize("world", [2, 3, 4, 7, 8])
def test_the_array_tests_agree_with_the_loop_value_for_value(world: int) -> None:
    """Large tables are tested over arrays, small ones by the loop that defines the tests: on
    the same steps (clean ones, flips up and down, NaN and Inf, zeros, a jump on every rank,
    several buckets) both give the same findings and the same histories, to the last bit."""
    rng = random.Random(world)
    findings = 0
    for warmup, k, floor in ((1, 4.0, 1.5), (5, 16.0, 8.0), (12, 8.0, 2.0)):
        config = StatsConfig(warmup=warmup, k=k, floor_factor=floor)
        loop = GradStatsDetector(world, config, array_min=1 << 30)
        arrays = GradStatsDetector(world, config, array_min=0)
        # the guard's one pass: test, and learn a step nothing else found anything in
        rows = GradStatsDetector(world, config, array_min=1 << 30)
        buckets = rng.choice([1, 3])
        for _ in range(80):
            values = [
                {
                    "loss": math.exp(rng.gauss(0.5, 0.1)),
                    **{f"l2[{b}]": math.exp(rng.gauss(-2, 0.2)) for b in range(buckets)},
                    **{f"amax[{b}]": math.exp(rng.gauss(-4, 0.3)) for b in range(buckets)},
                }
                for _ in range(world)
            ]
            if rng.random() < 0.15:
                rank, key = rng.randrange(world), rng.choice(list(values[0]))
                values[rank][key] *= rng.choice([1e3, 50.0, 1e-3, math.inf, math.nan, 0.0])
            if rng.random() < 0.05:
                for per in values:
                    per["loss"] *= 100.0
            expected = loop.test(values)
            assert arrays.test(values) == expected
            names = list(values[0])
            table = [[per[name] for name in names] for per in values]
            other_layer_found = rng.random() < 0.1  # e.g. the reduction check: nothing learnt
            assert rows.test_learn_table(names, table, learn=not other_layer_found) == expected
            findings += len(expected)
            if not expected and not other_layer_found:
                loop.learn(values)
                arrays.learn(values)
            assert arrays.history() == loop.history()
            assert rows.history() == loop.history()
            assert rows.steps_learnt == loop.steps_learnt
            assert getattr(rows._tests, "_spread", None) == getattr(loop._tests, "_spread", None)
    assert findings > 0  # the comparison covered findings, not only clean steps


def test_the_array_tests_see_a_table_changed_in_place() -> None:
    """A step's logs are reused from its test for its learning: a table changed in place in
    between is read afresh, not from that reuse."""
    detector = GradStatsDetector(4, StatsConfig(warmup=2, k=4.0, floor_factor=2.0), array_min=0)
    names = ["loss", "l2[0]"]
    rng = np.random.default_rng(0)
    for _ in range(4):
        detector.learn_table(names, np.exp(rng.normal(0, 0.05, (4, 2))))
    raw = np.exp(rng.normal(0, 0.05, (4, 2)))
    assert detector.test_table(names, raw) == []
    raw[2, 1] *= 1e3
    assert [f.rank for f in detector.test_table(names, raw)] == [2]


@pytest.mark.parametrize("poison", [None, 1, 2, 3, 4, 5])
def test_a_steps_rows_read_as_lists_and_as_an_array_are_the_same(poison: int | None) -> None:
    """Small tables are read as lists, large ones as an array: the same rows give the same
    sums, norms, reduced sums, ratios, test values and finiteness either way (a NaN in the
    loss, a sum, a peak or a reduced sum makes the step non-finite; one in an L2 norm, which
    may overflow from finite elements, does not)."""
    rng = random.Random(poison or 0)
    world, n_ratios, n_buckets = 3, 4, 5
    rows = [
        [7.0, rng.random(), *(rng.random() for _ in range(n_ratios)), float(n_buckets)]
        + [rng.gauss(0, 1) for _ in range(BUCKET_FIELDS * n_buckets)]
        for _ in range(world)
    ]
    if poison is not None:  # 1: loss, 2: a bucket's sum, 3: its L2, 4: its reduced sum, 5: peak
        at = {1: 1, 2: 3 + n_ratios, 3: 4 + n_ratios, 4: 6 + n_ratios, 5: 9 + n_ratios}[poison]
        rows[1][at] = math.nan
    lists = _parse_lists(rows, n_ratios)
    array = _parse_array(np.asarray(rows), n_ratios)
    assert lists.finite == array.finite == (poison in (None, 3))
    assert lists.n_buckets == array.n_buckets == n_buckets
    for name in ("ratios", "sums", "norms", "reduced", "values"):  # NaN equal to NaN here
        np.testing.assert_array_equal(getattr(lists, name), getattr(array, name), err_msg=name)
    assert array.values.shape == (world, 1 + 2 * n_buckets)


def test_two_ranks_rely_on_the_temporal_test() -> None:
    rng = random.Random(4)
    detector = GradStatsDetector(2, StatsConfig(warmup=20))
    for _ in range(200):
        detector.learn(_clean_values(rng, 2, -3.0))
    values = _clean_values(rng, 2, -3.0)
    values[0]["l2[0]"] *= 1e6
    findings = detector.test(values)
    assert [(f.rank, f.test) for f in findings] == [(0, "temporal")]


def test_a_jump_on_every_rank_at_once_is_the_jobs_dynamics_not_a_fault() -> None:
    rng = random.Random(5)
    detector = GradStatsDetector(2, StatsConfig(warmup=20))
    for _ in range(200):
        detector.learn(_clean_values(rng, 2, -3.0))
    values = _clean_values(rng, 2, -3.0)
    for v in values:
        v["l2[0]"] *= 1e3
    assert detector.test(values) == []


def test_optimizer_state_flag_sees_an_infinite_second_moment() -> None:
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    params = list(model.parameters())
    assert state_nonfinite_flag(optimizer, params, torch.device("cpu")).item() == 0
    optimizer.state[params[0]]["exp_avg_sq"][1, 2] = math.inf
    assert state_nonfinite_flag(optimizer, params, torch.device("cpu")).item() == 1
    check = OptimizerStateCheck()
    assert check.observe([0, 1]) == (1,)
    assert check.observe([0, 1]) is None  # the same state, still non-finite: one event
    assert check.observe([0, 0]) is None
    assert check.observe([1, 0]) == (0,)


@pytest.mark.parametrize(
    ("one_pass_max", "join_max"),
    [(1 << 20, 1 << 16), (8, 1 << 16), (1 << 20, 0)],
    ids=["one-pass", "mixed", "per-tensor"],
)
def test_a_kept_state_flag_follows_the_live_optimizer_state(
    one_pass_max: int, join_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flag keeps the state's tensors between steps; whatever replaces them (the first
    step creating the state, ``load_state_dict``, a new key, a tensor swapped in place of
    another) is what it reads next, never the tensors it kept. Whether the state is summed
    through one concatenation, tensor by tensor, or both (small tensors joined, the others
    alone), a non-finite value anywhere raises it."""
    monkeypatch.setattr("detection.weights.optstate._ONE_PASS_MAX", one_pass_max)
    monkeypatch.setattr("detection.weights.optstate._JOIN_MAX", join_max)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters())
    params = list(model.parameters())
    flag = StateFlag(optimizer, params, torch.device("cpu"))
    assert flag().tolist() == [0]  # no state yet
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert flag().tolist() == [0]
    optimizer.state[params[2]]["exp_avg"][0, 1] = math.nan  # in place: the kept view sees it
    assert flag().tolist() == [1]
    optimizer.state[params[2]]["exp_avg"].zero_()
    assert flag().tolist() == [0]
    saved = optimizer.state_dict()
    saved["state"][1]["exp_avg_sq"] = torch.full((3,), math.inf)
    optimizer.load_state_dict(saved)  # new tensors in a new state mapping
    assert flag().tolist() == [1]
    optimizer.state[params[1]]["exp_avg_sq"] = torch.zeros(3)  # one tensor swapped
    assert flag().tolist() == [0]
    optimizer.state[params[3]]["extra"] = torch.tensor([math.inf])  # a new key
    assert flag().tolist() == [1]
    assert state_nonfinite_flag(optimizer, params, torch.device("cpu")).tolist() == [1]


def _abft_model(flip_output: bool = False) -> tuple[nn.Sequential, LinearChecksums]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    if flip_output:  # before the checksums' hooks, as the guard binds the fault injector first
        model[2].register_forward_hook(lambda _m, _i, out: _flipped(out, 77, 24))
    return model, LinearChecksums(model, list(model.parameters()))


def _grad_pairs(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(p, p.grad) for p in model.parameters() if p.grad is not None]


def test_linear_checksums_stay_small_on_clean_steps_fp32_and_bf16() -> None:
    model, abft = _abft_model()
    for autocast in (False, True):
        abft.open()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(torch.randn(256, 64)).float().pow(2).mean()
        loss.backward()
        abft.on_local_gradient(_grad_pairs(model))
        abft.close()
        ratios = abft.ratios().tolist()
        assert max(ratios) < 1.0, (autocast, ratios)
        assert min(ratios) > 0.0  # every layer checked in both directions


def test_linear_checksums_see_a_flipped_output_and_a_flipped_weight_gradient() -> None:
    model, abft = _abft_model(flip_output=True)
    abft.open()
    model(torch.randn(256, 64)).pow(2).mean().backward()
    grad = model[0].weight.grad
    assert grad is not None
    flip_bit_(grad.view(-1), 1234, 27)
    abft.on_local_gradient(_grad_pairs(model))
    abft.close()
    (fwd0, bwd0), (fwd1, _bwd1) = abft.ratios().view(2, 2).tolist()
    # ratios count in units of each layer's rounding bound (clean: ≤ 1, abft_bound)
    assert fwd1 > 10.0  # the flipped output of the last layer (bit 24: one value x2 or /2)
    # the flipped weight gradient of the first: bit 27 of an element it shrinks, by the element
    assert bwd0 > 2.0
    assert fwd0 < 1.0


def test_one_bucket_compared_in_one_pass_gives_each_layer_its_own_worst_ratio() -> None:
    """The bucket's parameters (a weight with one tolerance, a LayerNorm's with one per
    channel) are compared in one concatenated pass: each layer gets the largest ratio of its
    own parameters, exactly as compared one by one, and a NaN gradient counts as ``inf``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.LayerNorm(24), nn.Linear(24, 8))
    abft = LinearChecksums(model, list(model.parameters()))

    def one_by_one() -> list[float]:
        worst = [0.0] * len(abft.layers)
        for p, g in _grad_pairs(model):
            layer, is_weight = abft._by_param[id(p)]
            expected = layer.expected(is_weight)
            assert expected is not None
            got = layer.reduce(g.float(), is_weight).reshape(-1)
            ratio = ((got - expected.value.reshape(-1)).abs() / (expected.scale() + 1e-30)).amax()
            value = math.inf if math.isnan(ratio.item()) else ratio.item()
            worst[layer.index] = max(worst[layer.index], value)
        return worst

    for poison in (False, True):
        abft.open()
        model.zero_grad(set_to_none=True)
        model(torch.randn(32, 16)).pow(2).mean().backward()
        grad = model[1].weight.grad
        assert grad is not None
        flip_bit_(grad.view(-1), 5, 27)  # one channel of the LayerNorm weight
        if poison:
            last = model[2].bias.grad
            assert last is not None
            last[3] = math.nan
        reference = one_by_one()
        abft.on_local_gradient(_grad_pairs(model))  # one bucket: all six parameters
        abft.close()
        gradient = abft.ratios().view(-1, 2)[:, 1].tolist()
        assert gradient == pytest.approx(reference, rel=1e-6), (poison, gradient, reference)
        assert gradient[1] > 100.0
        assert gradient[0] < 1.0
        assert (gradient[2] == math.inf) is poison


def test_under_autocast_the_forward_expectation_is_taken_in_float32() -> None:
    """Inside the loop's bf16 autocast the expectation ``x @ W.sum(0) + b.sum()`` is still
    computed in float32 (autocast would run a ``matmul`` in bf16 and add its own rounding to the
    residual it bounds): the noted ratio equals a float64 reference of the same formula."""
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    abft = LinearChecksums(model, list(model.parameters()))
    x = torch.randn(256, 64)
    abft.open()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        y = model(x)
    abft.close()
    noted = abft.ratios()[0].item()
    w, b = model.weight.detach().double(), model.bias.detach().double()
    xd = x.double()
    residual = (y.double().sum(-1) - (xd @ w.sum(0) + b.sum())).abs()
    u = float(torch.finfo(torch.bfloat16).eps) / 2.0
    scale = (xd.norm(dim=-1) * (w.norm() * math.sqrt(32)) + b.abs().sum()) * u * math.sqrt(64)
    reference = (residual / scale).max().item()
    assert 0.0 < reference < 1.0
    # noted in units of the derived rounding bound (bf16 inputs and output: abft_bound)
    assert noted == pytest.approx(reference / tolerance(64, 32, u, u), rel=1e-3)


def test_the_ratios_of_a_step_are_the_largest_of_its_forward_calls() -> None:
    """A layer called twice in a step (two micro-batches) keeps the worse call's ratio, and the
    next step starts from nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    flip = [True]
    # registered before the checksums' hooks, as the guard binds its fault injector first
    model[2].register_forward_hook(lambda _m, _i, out: _flipped(out, 5, 30) if flip[0] else out)
    abft = LinearChecksums(model, list(model.parameters()))
    clean = torch.randn(64, 64)
    abft.open()
    model(clean)
    flip[0] = False
    model(clean)  # clean call after the flipped one: the flipped call's ratio stays
    abft.close()
    (fwd0, _), (fwd1, _) = abft.ratios().view(2, 2).tolist()
    assert fwd1 > 100.0
    assert fwd0 < 1.0
    abft.open()
    model(clean)
    abft.close()
    assert max(abft.ratios().view(2, 2)[:, 0].tolist()) < 1.0


def _flipped(out: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    clone = out.clone()
    flip_bit_(clone, index, bit)
    return clone


@pytest.mark.parametrize(
    "bad",
    [
        {"k": 0.0},
        {"floor_factor": 1.0},
        {"warmup": 0},
        {"alpha": 0.0},
        {"abft_margin": 0.5},
        {"early_factor": 4.0},
    ],
)
def test_stats_config_refuses_values_that_would_disarm_the_tests(bad: dict[str, float]) -> None:
    with pytest.raises(StatsConfigError):
        StatsConfig(**bad)  # type: ignore[arg-type]
