"""Start-up agreement and the calibration diagnosis, as pure functions."""

from __future__ import annotations

import struct

import torch

from detection.audit.calibration import (
    calibration_causes,
    check_agreement,
    diagnose_self_replay,
    replay_environment,
)


def _bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def test_agreeing_ranks_have_no_problem_and_the_environment_names_what_matters() -> None:
    env = replay_environment(torch.device("cpu"))
    assert {"torch", "threads", "deterministic", "float32_matmul_precision"} <= env.keys()
    assert check_agreement([env, dict(env)]) == []


def test_a_differing_setting_is_named_with_ranks_and_fix() -> None:
    base = replay_environment(torch.device("cpu"))
    other = {**base, "threads": base["threads"] + 1, "device_name": "B"}
    problems = check_agreement([{**base, "device_name": "A"}, other, {**base, "device_name": "A"}])
    assert len(problems) == 2
    device, threads = problems
    assert "device_name differs" in device
    assert "'B' on ranks [1]" in device
    assert "same hardware" in device
    assert "threads differs" in threads
    assert "torch.set_num_threads" in threads


def test_self_replay_diagnosis() -> None:
    own = [_bits(1.0), 5, 6]
    assert diagnose_self_replay(0, 3, own, own, own, mode="loss") is None
    noisy = diagnose_self_replay(0, 3, own, [_bits(1.1), 5, 6], [_bits(1.2), 5, 6], mode="loss")
    assert noisy is not None
    assert "generator" in noisy
    scaled = diagnose_self_replay(
        1, 3, [_bits(0.25), 0, 0], [_bits(1.0), 0, 0], [_bits(1.0), 0, 0], mode="loss"
    )
    assert scaled is not None
    assert "scaled by 0.25" in scaled
    grad = diagnose_self_replay(1, 3, own, [_bits(1.0), 7, 6], [_bits(1.0), 7, 6], mode="gradient")
    assert grad is not None
    assert "local gradient differs" in grad


def test_calibration_causes_name_the_disagreeing_pair() -> None:
    own = [[1, 0, 0], [2, 0, 0]]
    selves = [own[0] + own[0], own[1] + own[1]]
    assert calibration_causes(0, [1, 0], own, [own[1], own[0]], selves, mode="loss") == []
    causes = calibration_causes(0, [1, 0], own, [[9, 0, 0], own[0]], selves, mode="loss")
    assert len(causes) == 1
    assert "rank 0 replaying rank 1" in causes[0]
