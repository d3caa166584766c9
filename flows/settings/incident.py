"""Settings of the incident flow: how it runs, its limits, the fleet-wide coordination of its
destructive stages, who hears when it needs a human, and who answered its approval form."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "ApprovalIdentitySettings",
    "CoordinationSettings",
    "FlowSettings",
    "NotifySettings",
    "PolicySettings",
]


class FlowSettings(BaseSettings):
    """How the incident flow runs under Prefect (``SDCGUARD_FLOW_…``)."""

    model_config = SettingsConfigDict(env_prefix="SDCGUARD_FLOW_", extra="ignore")

    approval_poll_s: int = Field(
        default=10,
        ge=1,
        le=300,
        description="How often a paused run checks whether the approver answered.",
    )


class PolicySettings(BaseSettings):
    """Server-side limits on the incident policy's dangerous knobs (``SDCGUARD_POLICY_…``).

    Read by the flow's own process (the worker's environment), never from a run's parameters:
    anyone with Prefect API access can set those, so a run's ``IncidentPolicy`` may only be
    stricter than these (:func:`flows.incident.policy.within_limits`). Auto-approval is off unless
    the operator of the worker turns it on here.
    """

    model_config = SettingsConfigDict(env_prefix="SDCGUARD_POLICY_", extra="ignore", frozen=True)

    auto_approve: bool = Field(
        default=False,
        description=(
            "Allow runs to approve without a human (still only on the strongest evidence and "
            "never in a storm). Off: every replacement waits for a human, whatever the run asks."
        ),
    )
    storm_node_share: float = Field(
        default=0.25,
        gt=0.0,
        le=1.0,
        description="Highest share of a job's nodes a run may implicate before it is a storm.",
    )
    storm_min_nodes: int = Field(
        default=2,
        ge=2,
        le=10_000,
        description="Highest minimum of implicated nodes for the share rule a run may use.",
    )
    storm_max_nodes_per_hour: int = Field(
        default=4,
        ge=1,
        le=10_000,
        description="Highest count of distinct nodes per window a run may allow.",
    )
    storm_window_s: int = Field(
        default=3600,
        ge=60,
        le=7 * 24 * 3600,
        description="Shortest storm window a run may use (a longer one counts more alarms).",
    )


class CoordinationSettings(BaseSettings):
    """The global limit around destructive stages (``SDCGUARD_FLOW_…``)."""

    model_config = SettingsConfigDict(env_prefix="SDCGUARD_FLOW_", extra="ignore")

    destructive_limit: str = Field(
        default="sdcguard-destructive",
        min_length=1,
        max_length=100,
        description="Name of the Prefect global concurrency limit around replace and resume.",
    )
    destructive_slots: int = Field(
        default=1,
        ge=1,
        le=100,
        description="How many incidents may replace/resume at once, fleet-wide.",
    )
    destructive_lease_s: float = Field(
        default=300.0,
        ge=60.0,  # the Prefect API's minimum
        le=3600.0,
        description="Lease of a held slot; renewed while held, expires if the holder dies.",
    )
    claim_lease_s: float = Field(
        default=300.0,
        ge=1.0,
        le=24 * 3600.0,
        description=(
            "Lease of a ledger claim (a stage or a side effect), renewed every third of it "
            "while the stage runs (flows.incident.stages._heartbeat) and before every destructive "
            "call. Another run takes a claim over only after it expired: how long the claims "
            "of a killed worker that Prefect still shows live block the incident."
        ),
    )


class NotifySettings(BaseSettings):
    """Where the needs-a-human notifications go (``SDCGUARD_FLOW_…``)."""

    model_config = SettingsConfigDict(env_prefix="SDCGUARD_FLOW_", extra="ignore")

    notification_block: str | None = Field(
        default=None,
        description=(
            "Prefect notification block (`<type-slug>/<name>`) the automation "
            "'sdcguard-needs-human' sends through; unset: the event only."
        ),
    )


class ApprovalIdentitySettings(BaseSettings):
    """``SDCGUARD_APPROVAL_IDENTITY_*``: set on the gate and on the workers that run the flow."""

    model_config = SettingsConfigDict(env_prefix="SDCGUARD_APPROVAL_IDENTITY_", extra="ignore")

    secret: SecretStr | None = Field(
        default=None,
        min_length=16,
        description="HMAC key shared by the identity gate and the workers; unset: no identity.",
    )
    header: str = Field(
        default="X-Forwarded-Email",
        min_length=1,
        description="Header the authenticating proxy sets to the signed-in user.",
    )
