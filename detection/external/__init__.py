"""Alarms from other SDC detectors, and the adapters that raise them (no torch).

Megatron-Core's exit codes 16/17 (:mod:`detection.external.megatron`, a wrapper around each
rank's process), torchtitan's ``SDCReplayMismatch`` (:func:`report_sdc_mismatch`, around the
trainer's step) and hardware health events (``recovery.telemetry.health_alarm``, on the node)
each become an :class:`ExternalAlarm`, posted signed to ``POST /v1/external-alarms`` through a
spool so that an unreachable webhook never loses one. Torch-free (a checked contract): the
wrapper runs in a launcher, before any training code. Names are imported on first use.
"""

from typing import TYPE_CHECKING

from detection._lazy import lazy_exports

if TYPE_CHECKING:
    from detection.external.alarm import EXTERNAL_LAYER, ExternalAlarm, InvalidExternalAlarm, Source
    from detection.external.delivery import DeliveryConfigError, WebhookTarget, deliver
    from detection.external.torchtitan import report_sdc_mismatch

__all__ = [
    "EXTERNAL_LAYER",
    "DeliveryConfigError",
    "ExternalAlarm",
    "InvalidExternalAlarm",
    "Source",
    "WebhookTarget",
    "deliver",
    "report_sdc_mismatch",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "EXTERNAL_LAYER": "alarm",
        "ExternalAlarm": "alarm",
        "InvalidExternalAlarm": "alarm",
        "Source": "alarm",
        "DeliveryConfigError": "delivery",
        "WebhookTarget": "delivery",
        "deliver": "delivery",
        "report_sdc_mismatch": "torchtitan",
    },
)
