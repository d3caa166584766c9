"""What leaves the rank: alarms, their signing, and the sender that delivers them.

Torch-free (a checked contract): the control plane imports :mod:`detection.transport.alarm`
and :mod:`detection.transport.signing` in an image with no torch, and the webhook verifies with
the very code that signs. Names are imported on first use, so ``import detection.transport.signing``
loads neither httpx nor the sender.
"""

from typing import TYPE_CHECKING

from detection._lazy import lazy_exports

if TYPE_CHECKING:
    from detection.transport.alarm import Alarm, Layer, Phase
    from detection.transport.sender import AlarmSender, drain_spool, find_spools
    from detection.transport.signing import SignatureError, signed_headers, verify

__all__ = [
    "Alarm",
    "AlarmSender",
    "Layer",
    "Phase",
    "SignatureError",
    "drain_spool",
    "find_spools",
    "signed_headers",
    "verify",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Alarm": "alarm",
        "Layer": "alarm",
        "Phase": "alarm",
        "SignatureError": "signing",
        "signed_headers": "signing",
        "verify": "signing",
        "AlarmSender": "sender",
        "drain_spool": "sender",
        "find_spools": "sender",
    },
)
