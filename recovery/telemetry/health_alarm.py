"""A hardware health event as an external alarm: a critical Xid, or a pending GPU Recovery Action.

The health adapter of ``POST /v1/external-alarms``: a node agent (a DaemonSet, a cron job, a
Slurm prolog/epilog) reads the node's kernel log and ``nvidia-smi -q -x``, and every finding
that is evidence against a GPU — an Xid this project's policy calls ``critical``
(:data:`~recovery.telemetry.xid.XID_POLICY`), or an NVML recovery action other than ``none`` —
becomes one alarm naming the node, for the job that runs there. A healthy reading gives none.

A health event carries no training step (``step`` is absent: the webhook records the alarm at
step 0, so no checkpoint is trusted without a human). Its ``occurrence`` is the Xid's log time
(two Xids of one kind at different times are two events; the same line read twice is one), and
for a recovery action the driver's timestamp of the reading is *not* used: a GPU stuck for hours
is one event, however often it is polled.
"""

from __future__ import annotations

from detection.external.alarm import ExternalAlarm, Source
from recovery.telemetry.nvidia_smi import NvidiaSmiReport
from recovery.telemetry.xid import KernelLog, XidSeverity, xid_info

__all__ = ["health_alarms"]


def health_alarms(
    *,
    job_id: str,
    node: str,
    nvidia_smi: NvidiaSmiReport | None = None,
    kernel_log: KernelLog | None = None,
) -> list[ExternalAlarm]:
    """One alarm per critical Xid event and per GPU whose driver asks for a recovery action."""
    alarms: list[ExternalAlarm] = []
    for gpu in nvidia_smi.gpus if nvidia_smi else ():
        action = gpu.recovery_action
        if action is None or not action.pending:
            continue
        alarms.append(
            ExternalAlarm(
                job_id=job_id,
                source=Source.HEALTH.value,
                kind=f"gpu-recovery-action-{action.value}",
                node=node,
                evidence={
                    "gpu_uuid": gpu.uuid,
                    "pci_bus_id": gpu.pci_bus_id,
                    "product": gpu.product_name,
                    "recovery_action": action.value,
                    "driver_version": nvidia_smi.driver_version if nvidia_smi else None,
                    "reset_required": gpu.reset_required,
                },
                occurrence=gpu.uuid or gpu.pci_bus_id or str(gpu.index),
            )
        )
    for event in kernel_log.events if kernel_log else ():
        info = xid_info(event.xid)
        if info.severity is not XidSeverity.CRITICAL:
            continue
        when = event.timestamp.isoformat() if event.timestamp else event.uptime_s
        alarms.append(
            ExternalAlarm(
                job_id=job_id,
                source=Source.HEALTH.value,
                kind=f"xid-{event.xid}",
                node=node,
                evidence={
                    "xid": event.xid,
                    "description": info.description,
                    "recommended_action": str(info.action),
                    "pci_bus_id": event.pci_bus_id,
                    "gpu_uuid": (
                        kernel_log.gpu_uuids.get(event.pci_bus_id) if kernel_log else None
                    ),
                    "message": event.message[:1000],
                    "at": when,
                },
                occurrence=f"{event.pci_bus_id}@{when if when is not None else event.line}",
            )
        )
    return alarms
