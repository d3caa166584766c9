"""Alarm shapes: the DESIGN report entry and webhook body, field for field."""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime

from detection.transport.alarm import Alarm, Layer, Phase

_NODES = ["node-0", "node-1", "node-2", "node-2"]


def _alarm(suspects: list[int]) -> Alarm:
    return Alarm.for_ranks(37, Layer.AUDIT, Phase.LOSS, suspects, _NODES, {"mode": "loss"})


def test_report_entry_has_exactly_the_design_fields() -> None:
    entry = _alarm([3, 2]).to_report()
    assert entry == {
        "step": 37,
        "layer": "audit",
        "phase": "loss",
        "suspect_ranks": [2, 3],
        "suspect_nodes": ["node-2"],
        "detail": {"mode": "loss"},
    }
    json.dumps(entry)  # plain JSON, no enum objects


def test_webhook_body_has_exactly_the_design_fields() -> None:
    body = _alarm([2]).to_webhook("job-7", rank=0, node="node-0")
    assert set(body) == {
        "alarm_id",
        "job_id",
        "step",
        "rank",
        "node",
        "layer",
        "phase",
        "suspect_ranks",
        "suspect_nodes",
        "detail",
        "sent_at",
    }
    assert uuid.UUID(body["alarm_id"]).version == 5  # uuid5: deterministic per event
    assert (body["job_id"], body["step"], body["rank"], body["node"]) == ("job-7", 37, 0, "node-0")
    assert (body["layer"], body["phase"]) == ("audit", "loss")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", body["sent_at"])
    datetime.fromisoformat(body["sent_at"].replace("Z", "+00:00"))
    json.dumps(body)


def test_alarm_ids_are_deterministic_per_event() -> None:
    """A re-run of the job and a second reporter send the same id: the ledger dedups."""
    alarm = _alarm([2])
    first = alarm.to_webhook("j", 0, "n")["alarm_id"]
    assert alarm.to_webhook("j", 0, "n")["alarm_id"] == first  # the job runs the step again
    assert alarm.to_webhook("j", 1, "other")["alarm_id"] == first  # another reporting rank
    assert str(uuid.UUID(first)) == first
    assert _alarm([3]).to_webhook("j", 0, "n")["alarm_id"] != first  # another event
    assert alarm.to_webhook("other-job", 0, "n")["alarm_id"] != first


def test_reporting_rank_is_the_lowest_rank_not_suspected() -> None:
    assert _alarm([2]).reporting_rank(4) == 0
    assert _alarm([0]).reporting_rank(4) == 1
    assert _alarm([0, 1]).reporting_rank(4) == 2
    assert _alarm([]).reporting_rank(4) == 0
    assert _alarm([0, 1, 2, 3]).reporting_rank(4) == 0


def test_enums_carry_the_design_strings() -> None:
    assert [str(x) for x in Layer] == [
        "nonfinite",
        "audit",
        "fingerprint",
        "gradstats",
        "allreduce",
        "optstate",
        "abft",
    ]
    assert [str(x) for x in Phase] == [
        "pre-allreduce",
        "post-allreduce",
        "loss",
        "gradient",
        "weights",
        "optimizer-state",
        "forward",
        "backward",
    ]
