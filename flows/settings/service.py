"""Settings of the webhook service (``sdcguard serve``): the ledger, the API, what starts a flow,
and the sweep of overdue approvals."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Self

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from db.engine import DEFAULT_DATABASE_URL

__all__ = [
    "DatabaseSettings",
    "ExpirySettings",
    "PrefectTriggerSettings",
    "TriggerMode",
    "WebhookSettings",
]


class TriggerMode(StrEnum):
    """How ``sdcguard serve`` starts the incident flow (``--trigger``)."""

    PREFECT = "prefect"
    """Create a flow run of the Prefect deployment; a Prefect worker runs it."""
    LOCAL = "local"
    """Run the flow in a worker thread of the webhook service itself (one machine, demo)."""
    NONE = "none"
    """Record alarms and incidents only; someone starts the flow by hand."""


class DatabaseSettings(BaseSettings):
    """Where the ledger lives (``SDCGUARD_DATABASE_URL``)."""

    model_config = SettingsConfigDict(env_prefix="SDCGUARD_DATABASE_", extra="ignore")

    url: str = Field(
        default=DEFAULT_DATABASE_URL,
        min_length=1,
        max_length=4096,
        description=(
            "SQLAlchemy URL of the ledger, e.g. postgresql+psycopg://user@host/sdcguard. "
            "The default is a SQLite file under .sdcguard/, good for one machine only."
        ),
    )


class WebhookSettings(BaseSettings):
    """The alarm webhook and ledger API (``sdcguard serve``)."""

    model_config = SettingsConfigDict(env_prefix="SDCGUARD_WEBHOOK_", extra="ignore")

    secret: SecretStr | None = Field(
        default=None,
        min_length=16,
        description=(
            "One HMAC secret for every job (SDCGUARD_WEBHOOK_SECRET), under key id "
            "SDCGUARD_WEBHOOK_KEY_ID: for one machine or a trusted test cluster. A cluster "
            "should give each job or namespace its own key in SDCGUARD_WEBHOOK_CREDENTIALS_FILE. "
            "At least 16 characters: a short secret can be brute-forced from one signed request."
        ),
    )
    key_id: str = Field(
        default="default",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:@+=-]{0,127}$",
        description="Key id of SDCGUARD_WEBHOOK_SECRET (senders send it in X-SDCGuard-Key-Id).",
    )
    checkpoint_prefix: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "Checkpoint URIs recorded with SDCGUARD_WEBHOOK_SECRET must lie under this prefix "
            "('{job_id}' is filled in), e.g. s3://ckpts/{job_id}/. Unset: any URI."
        ),
    )
    credentials_file: Path | None = Field(
        default=None,
        description=(
            "JSON file of scoped signing keys, reader tokens and service accounts "
            "(docs/security.md); mount it from a Kubernetes Secret, never commit it."
        ),
    )
    tokenreview: bool = Field(
        default=False,
        description=(
            "Accept projected Kubernetes service-account tokens (Authorization: Bearer), "
            "checked with TokenReview against the in-cluster API server."
        ),
    )
    token_audience: str = Field(
        default="sdcguard", min_length=1, description="Audience the projected token must carry."
    )
    docs: bool = Field(default=False, description="Serve /docs and /openapi.json.")
    tls_cert: Path | None = Field(default=None, description="PEM certificate: serve HTTPS.")
    tls_key: Path | None = Field(default=None, description="PEM private key of tls_cert.")
    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        max_length=253,
        description="Interface to listen on; loopback unless the ranks run on other machines.",
    )
    port: int = Field(default=8787, ge=1, le=65535, description="TCP port to listen on.")
    max_body_bytes: int = Field(
        default=1 << 20,
        ge=1024,
        le=64 << 20,
        description=(
            "Largest request body accepted (413 above it). 1 MiB holds the rank map of a "
            "several-thousand-rank job; the limit keeps an unauthenticated caller from making "
            "the service buffer an unbounded body before its signature is checked."
        ),
    )
    window_s: int = Field(
        default=300,
        ge=1,
        le=3600,
        description="Accepted clock skew of X-SDCGuard-Timestamp, in seconds (replay window).",
    )
    read_threads: int = Field(
        default=4,
        ge=1,
        le=64,
        description=(
            "Worker threads (and, on PostgreSQL, pooled connections) of their own for reads "
            "(GET /v1/incidents…), so a flood of reads never takes a thread or a connection "
            "an alarm needs."
        ),
    )
    reads_per_s: float = Field(
        default=50.0,
        gt=0,
        le=100_000,
        description=(
            "Read budget of the whole service: reads per second (as many at once), above which "
            "a read is answered 429, with Retry-After the seconds until a read is taken again, "
            "before any work is done for it. Reads and alarms share the CPU; the budget keeps "
            "a flood from slowing alarm ingestion."
        ),
    )
    trigger: TriggerMode = Field(
        default=TriggerMode.PREFECT,
        description=(
            "What starts the incident flow when an alarm opens an incident: a Prefect "
            "deployment (prefect), a worker thread of this service (local), or nothing (none)."
        ),
    )

    @model_validator(mode="after")
    def _some_credentials(self) -> Self:
        if self.secret is None and self.credentials_file is None:
            raise ValueError(
                "set SDCGUARD_WEBHOOK_SECRET or SDCGUARD_WEBHOOK_CREDENTIALS_FILE: the webhook "
                "accepts nothing unsigned"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("SDCGUARD_WEBHOOK_TLS_CERT and _TLS_KEY go together")
        return self


class PrefectTriggerSettings(BaseSettings):
    """Which Prefect deployment an opened incident starts (``--trigger prefect``)."""

    model_config = SettingsConfigDict(env_prefix="SDCGUARD_PREFECT_", extra="ignore")

    deployment: str = Field(
        default="incident-response/incident",
        pattern=r"^[^/]+/[^/]+$",
        max_length=512,
        description="Deployment to run, as '<flow name>/<deployment name>' (see prefect.yaml).",
    )


class ExpirySettings(BaseSettings):
    """How the webhook service sweeps overdue approvals (``SDCGUARD_EXPIRY_…``)."""

    model_config = SettingsConfigDict(env_prefix="SDCGUARD_EXPIRY_", extra="ignore")

    interval_s: float = Field(default=60.0, gt=0, le=3600.0, description="Sweep period.")
    grace_s: float = Field(
        default=60.0,
        ge=0,
        le=3600.0,
        description="How long past its deadline an approval is left to close itself.",
    )
