"""Who approved: the typed name is a claim; an identity is recorded only when the gate in front
of the Prefect API signed it for that flow run, from the authenticating proxy's header.

The round trips go through the session's real Prefect API: a flow pauses for the real form,
and is resumed through the gate (with the proxy's header) or straight at the API (no gate, a
typed ``identity``)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import httpx
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.flow_runs import pause_flow_run, resume_flow_run

from flows.incident.approval.form import ApprovalChoice, ApprovalDecision, answered_by
from flows.incident.approval.identity import (
    UNAUTHENTICATED,
    ApprovalIdentityGate,
    identity_token,
    resolve_identity,
)
from flows.incident.report import answered_as

SECRET = "approval-identity-secret-0123456789"
RUN = str(uuid.uuid4())


def test_a_token_verifies_only_for_its_run_under_the_secret() -> None:
    token = identity_token(SECRET, "alice@example.com", RUN, "X-Forwarded-Email")
    ok = resolve_identity("Alice", token, RUN, SECRET)
    assert ok.authenticated == "alice@example.com"
    assert ok.source == "gate:X-Forwarded-Email"
    assert ok.claimed == "Alice"
    for problem, args in {
        "issued for another flow run": (token, str(uuid.uuid4()), SECRET),
        "bad signature": (token, RUN, "another-secret-0123456789abcdef"),
        "no SDCGUARD_APPROVAL_IDENTITY_SECRET": (token, RUN, None),
        "not an identity token": ("alice@example.com", RUN, SECRET),
    }.items():
        refused = resolve_identity("Alice", *args)
        assert refused.authenticated is None
        assert refused.source.startswith(UNAUTHENTICATED)
        assert problem in refused.source
    plain = resolve_identity("Alice", None, RUN, SECRET)
    assert (plain.authenticated, plain.source) == (None, UNAUTHENTICATED)
    assert answered_as(plain.as_record()) == "claimed; unauthenticated"
    assert answered_as(ok.as_record()) == (
        "claimed; authenticated as alice@example.com via gate:X-Forwarded-Email"
    )


def _through_gate(
    path: str, body: dict[str, Any], headers: dict[str, str], forward: Any = None
) -> list[bytes]:
    """Send one request through the gate to an app that records the body it was handed."""
    seen: list[bytes] = []

    async def downstream(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        seen.append(message.get("body", b""))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    gate = ApprovalIdentityGate(forward or downstream, SECRET)

    async def go() -> None:
        transport = httpx.ASGITransport(app=gate)
        async with httpx.AsyncClient(transport=transport, base_url="http://prefect") as client:
            await client.post(path, json=body, headers=headers)  # the caller checks the effect

    asyncio.run(go())
    return seen


def test_the_gate_replaces_a_typed_identity_and_leaves_other_routes_alone() -> None:
    import json

    path = f"/api/flow_runs/{RUN}/resume"
    typed = {"run_input": {"approver": "Alice", "identity": "v1.forged.0000"}}
    [stamped] = _through_gate(path, typed, {"X-Forwarded-Email": "alice@example.com"})
    token = json.loads(stamped)["run_input"]["identity"]
    assert resolve_identity("Alice", token, RUN, SECRET).authenticated == "alice@example.com"

    [bare] = _through_gate(path, typed, {})
    assert "identity" not in json.loads(bare)["run_input"]

    [other] = _through_gate("/api/flow_runs/filter", typed, {"X-Forwarded-Email": "x@y"})
    assert json.loads(other) == typed


@flow(name="approval-identity-probe")
def _probe() -> dict[str, Any]:
    form = ApprovalDecision.with_initial_data(description="probe")
    answer = pause_flow_run(wait_for_input=form, timeout=120, poll_interval=1, key="approval")
    return answered_by(answer).as_record()


def _paused_run_id(name: str, timeout_s: float = 90.0) -> str:
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            for run in client.read_flow_runs():
                if run.name == name and run.state is not None and run.state.is_paused():
                    return str(run.id)
            time.sleep(0.3)
    raise AssertionError(f"flow run {name} never paused")


def _run_probe(resume: Any) -> dict[str, Any]:
    name = f"probe-{uuid.uuid4().hex[:8]}"
    result: list[dict[str, Any]] = []
    thread = threading.Thread(
        target=lambda: result.append(_probe.with_options(flow_run_name=name)())
    )
    thread.start()
    run_id = _paused_run_id(name)
    # The form's schema is saved just after the pause: a resume that races it is re-sent.
    for _ in range(50):
        if resume(run_id):
            break
        time.sleep(0.2)
    thread.join(120)
    assert result, "the probe flow did not finish"
    return result[0]


_ANSWER = {
    "decision": ApprovalChoice.APPROVE.value,
    "approver": "Alice",
    "reason": "replay shows hardware",
    "nodes": [],
    "uncordon_on_reject": False,
}


@pytest.mark.slow
def test_a_resume_through_the_gate_records_the_proxys_user(
    prefect_api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SDCGUARD_APPROVAL_IDENTITY_SECRET", SECRET)
    origin = prefect_api.removesuffix("/api")

    async def forward(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        headers.pop("host", None)
        async with httpx.AsyncClient(base_url=origin, timeout=30) as client:
            answer = await client.post(scope["path"], content=message["body"], headers=headers)
        await send({"type": "http.response.start", "status": answer.status_code, "headers": []})
        await send({"type": "http.response.body", "body": answer.content})

    def via_gate(run_id: str) -> bool:
        statuses: list[int] = []

        async def forward_recording(scope: Any, receive: Any, send: Any) -> None:
            async def recording(message: Any) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])
                await send(message)

            await forward(scope, receive, recording)

        _through_gate(
            f"/api/flow_runs/{run_id}/resume",
            {"run_input": {**_ANSWER, "identity": "typed by the client"}},
            {"X-Forwarded-Email": "alice@example.com"},
            forward=forward_recording,
        )
        return statuses[-1] in (200, 201) and _resumed(run_id)

    record = _run_probe(via_gate)
    assert record == {
        "approver_claimed": "Alice",
        "approver_authenticated": "alice@example.com",
        "identity_source": "gate:X-Forwarded-Email",
    }


@pytest.mark.slow
def test_a_resume_straight_at_the_api_is_unauthenticated_whatever_it_types(
    prefect_api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SDCGUARD_APPROVAL_IDENTITY_SECRET", SECRET)

    def direct(run_id: str) -> bool:
        try:
            resume_flow_run(run_id, run_input={**_ANSWER, "identity": "alice@example.com"})
        except RuntimeError:
            return False
        return _resumed(run_id)

    record = _run_probe(direct)
    assert record["approver_claimed"] == "Alice"
    assert record["approver_authenticated"] is None
    assert record["identity_source"] == (
        f"{UNAUTHENTICATED} (identity not verified: not an identity token)"
    )


def _resumed(run_id: str) -> bool:
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(uuid.UUID(run_id)).state
    return state is not None and not state.is_paused()
