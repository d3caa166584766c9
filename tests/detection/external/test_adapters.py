"""The adapters' decisions, without a network: what each event becomes, and what stays silent."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from detection.external.alarm import EXTERNAL_LAYER, ExternalAlarm, InvalidExternalAlarm
from detection.external.megatron import MegatronWatch, megatron_alarm
from detection.external.torchtitan import is_sdc_mismatch

# The line Megatron-Core's rerun state machine logs on the rank that saw the unexpected result.
MEGATRON_LINE = (
    b"[rank2]: Unexpected result tensor(nan, device='cuda:2') on rank 2 at iteration #1234 "
    b"invocation #1 (message='loss is NaN')\n"
)


def test_the_same_event_has_the_same_id_and_another_event_another() -> None:
    one = ExternalAlarm("job-1", "megatron", "exit-17", node="node-2", rank=2, step=5)
    again = ExternalAlarm("job-1", "megatron", "exit-17", node="node-2", rank=2, step=5)
    assert one.alarm_id == again.alarm_id
    uuid.UUID(one.alarm_id)
    assert one.to_webhook()["alarm_id"] == one.alarm_id
    other_step = ExternalAlarm("job-1", "megatron", "exit-17", node="node-2", rank=2, step=6)
    other_node = ExternalAlarm("job-1", "megatron", "exit-17", node="node-3", rank=2, step=5)
    assert len({one.alarm_id, other_step.alarm_id, other_node.alarm_id}) == 3


def test_the_body_leaves_out_what_the_detector_does_not_know() -> None:
    body = ExternalAlarm("job-1", "health", "xid-79", node="node-2").to_webhook()
    assert set(body) == {"alarm_id", "job_id", "source", "kind", "node", "evidence", "sent_at"}
    assert EXTERNAL_LAYER == "external"


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"node": None, "rank": None}, "names a node or a rank"),
        ({"source": "Megatron LM"}, "source must match"),
        ({"kind": ""}, "kind must match"),
        ({"step": -1}, "step must be an integer"),
        ({"evidence": {"x": float("nan")}}, "evidence is not JSON"),
    ],
)
def test_an_alarm_that_accuses_no_one_or_is_malformed_is_refused(
    fields: dict[str, object], complaint: str
) -> None:
    base: dict[str, object] = {
        "job_id": "job-1",
        "source": "megatron",
        "kind": "exit-16",
        "node": "node-2",
    }
    with pytest.raises(InvalidExternalAlarm, match=complaint):
        ExternalAlarm(**{**base, **fields})  # type: ignore[arg-type]


def _watch(*lines: bytes) -> MegatronWatch:
    watch = MegatronWatch()
    for line in lines:
        watch.feed(line)
    return watch


@pytest.mark.parametrize("code", [16, 17])
def test_the_rank_megatron_named_reports_its_node_and_the_iteration(code: int) -> None:
    alarm = megatron_alarm(
        code, _watch(b"iteration 1233 loss 2.1\n", MEGATRON_LINE), job_id="j", node="n2", rank=2
    )
    assert alarm is not None
    assert (alarm.kind, alarm.node, alarm.rank, alarm.step) == (f"exit-{code}", "n2", 2, 1234)
    assert alarm.evidence["named_by_megatron"] is True
    assert "on rank 2 at iteration #1234" in str(alarm.evidence["log_line"])


def test_the_other_ranks_of_the_collective_exit_stay_silent_unless_told() -> None:
    quiet = _watch(b"iteration 1233 loss 2.1\n")
    assert megatron_alarm(16, quiet, job_id="j", node="n0", rank=0) is None
    assert megatron_alarm(16, _watch(MEGATRON_LINE), job_id="j", node="n0", rank=0) is None
    every = megatron_alarm(16, quiet, job_id="j", node="n0", rank=0, report_all=True)
    assert every is not None
    assert every.evidence["named_by_megatron"] is False
    assert every.step is None


def test_without_a_log_line_the_step_comes_from_megatrons_checkpoint_tracker(
    tmp_path: Path,
) -> None:
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1200\n")
    alarm = megatron_alarm(
        16, _watch(), job_id="j", node="n0", rank=0, checkpoint_dir=tmp_path, report_all=True
    )
    assert alarm is not None
    assert alarm.step == 1200


@pytest.mark.parametrize("code", [0, 1, 2, 15, 18, 137])
def test_any_other_exit_reports_nothing(code: int) -> None:
    assert megatron_alarm(code, _watch(MEGATRON_LINE), job_id="j", node="n2", rank=2) is None


def test_the_mismatch_is_known_by_its_name_or_by_the_class_given() -> None:
    class SDCReplayMismatch(RuntimeError):
        pass

    class Narrower(SDCReplayMismatch):
        pass

    class Unrelated(RuntimeError):
        pass

    assert is_sdc_mismatch(SDCReplayMismatch("x"))
    assert is_sdc_mismatch(Narrower("x"))
    assert not is_sdc_mismatch(RuntimeError("SDCReplayMismatch"))
    assert is_sdc_mismatch(Unrelated("x"), Unrelated)
    assert not is_sdc_mismatch(SDCReplayMismatch("x"), Unrelated)


def test_the_adapters_read_the_training_job_contracts_variables() -> None:
    """delivery.py repeats the contract's names (the contract's module imports torch)."""
    from detection import contract, identity
    from detection.external import delivery

    assert delivery.JOB_ID_ENV == contract.JOB_ID_ENV
    assert delivery.WEBHOOK_URL_ENV == contract.WEBHOOK_URL_ENV
    assert delivery.WEBHOOK_SECRET_ENV == contract.WEBHOOK_SECRET_ENV
    assert delivery.NODE_NAME_ENV == identity.NODE_NAME_ENV
