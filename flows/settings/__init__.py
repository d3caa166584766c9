"""Settings of sdcguard's control plane: one pydantic-settings class per concern.

Every class reads ``SDCGUARD_<CONCERN>_<FIELD>`` from the environment, so an operator sets
``SDCGUARD_DATABASE_URL`` or ``SDCGUARD_WEBHOOK_SECRET`` and nothing else needs to know where the
value came from. Lower packages (``db``, ``detection``, ``recovery``) never read these classes:
they take explicit constructor arguments, and ``flows`` builds them from the settings here.

- :mod:`~flows.settings.service` — the webhook service: ``SDCGUARD_DATABASE_…``,
  ``SDCGUARD_WEBHOOK_…``, ``SDCGUARD_TRIGGER_…``, ``SDCGUARD_EXPIRY_…``;
- :mod:`~flows.settings.backends` — the backends the flow acts through: ``SDCGUARD_RECOVERY_…``,
  ``SDCGUARD_AWS_…``, ``SDCGUARD_KUBE_…``;
- :mod:`~flows.settings.incident` — the incident flow: ``SDCGUARD_FLOW_…``, ``SDCGUARD_POLICY_…``,
  ``SDCGUARD_APPROVAL_IDENTITY_…``.

Read them with :func:`load_settings`, whose errors never echo a value.
"""

from flows.settings._load import SettingsError, load_settings
from flows.settings.backends import AwsSettings, BackendMode, KubeSettings, RecoverySettings
from flows.settings.incident import (
    ApprovalIdentitySettings,
    CoordinationSettings,
    FlowSettings,
    NotifySettings,
    PolicySettings,
)
from flows.settings.service import (
    DatabaseSettings,
    ExpirySettings,
    PrefectTriggerSettings,
    TriggerMode,
    WebhookSettings,
)

__all__ = [
    "ApprovalIdentitySettings",
    "AwsSettings",
    "BackendMode",
    "CoordinationSettings",
    "DatabaseSettings",
    "ExpirySettings",
    "FlowSettings",
    "KubeSettings",
    "NotifySettings",
    "PolicySettings",
    "PrefectTriggerSettings",
    "RecoverySettings",
    "SettingsError",
    "TriggerMode",
    "WebhookSettings",
    "load_settings",
]
