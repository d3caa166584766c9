"""NVIDIA NVSentinel as the remediation (``nvsentinel``): one ``ExternalFault`` per node.

:class:`NVSentinelRemediation` creates one ``ExternalFault`` for the node and follows it until
NVSentinel reports it done; NVSentinel cordons, drains and remediates, and clears the fault once
its child maintenance resource completes. When the incident resolves,
:meth:`NVSentinelRemediation.release` deletes the ``ExternalFault`` we created. Never twice: the
resource's name is a function of incident and node, so a repeat finds it instead of creating a
second one.

The ``ExternalFault`` shape is that of NVSentinel's design ADR-049
(``docs/designs/049-external-fault.md`` in github.com/NVIDIA/NVSentinel): cluster-scoped
``externalfaults`` in the group ``nvsentinel.dgxc.nvidia.com`` (version from the settings, ``v1``
in the ADR's example), ``spec.healthEvent`` carrying NVSentinel's HealthEvent fields, completion
as ``status.completionTime`` or the condition ``FaultCleared=True``. The ADR is a design, not a
released API: the fields we write and read are defined once here (:func:`external_fault`,
:func:`_fault_done`) so a change in NVSentinel is a change in one place.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3HTTPError

from recovery.errors import PermanentError, TemporaryError
from recovery.kube import client as kube
from recovery.kube.remediation import DEFAULT_POOL_LABELS, NodeWatch
from recovery.nodes import LABEL_INCIDENT
from recovery.remediation import (
    RemediationKind,
    RemediationOutcome,
    RemediationVerb,
    remedy,
)

__all__ = [
    "EXTERNAL_FAULT_GROUP",
    "EXTERNAL_FAULT_PLURAL",
    "NVSentinelRemediation",
    "external_fault",
]

log = logging.getLogger(__name__)

EXTERNAL_FAULT_GROUP = "nvsentinel.dgxc.nvidia.com"
EXTERNAL_FAULT_PLURAL = "externalfaults"
_CHECK_NAME = "sdcguard-silent-data-corruption"
_NAME_UNSAFE = re.compile(r"[^a-z0-9.-]+")


def external_fault(
    name: str, api_version: str, node: str, incident_id: str, action: str, message: str
) -> dict[str, Any]:
    """The ``ExternalFault`` for ``node`` (ADR-049's shape; see the module docstring)."""
    now = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    return {
        "apiVersion": api_version,
        "kind": "ExternalFault",
        "metadata": {
            "name": name,
            "labels": {LABEL_INCIDENT: incident_id, "app.kubernetes.io/managed-by": "sdcguard"},
        },
        "spec": {
            "healthEvent": {
                "version": 1,
                "agent": "sdcguard",
                "checkName": _CHECK_NAME,
                "componentClass": "GPU",
                "nodeName": node,
                "isFatal": True,
                "isHealthy": False,
                "recommendedAction": action,
                "errorCode": ["SDCGUARD-SILENT-DATA-CORRUPTION"],
                "entitiesImpacted": [{"entityType": "Node", "entityValue": node}],
                "generatedTimestamp": now,
                "message": message,
                "metadata": {"sdcguardIncident": incident_id},
            }
        },
    }


def _fault_done(obj: Mapping[str, Any]) -> bool:
    status = obj.get("status") or {}
    if status.get("completionTime"):
        return True
    return any(
        c.get("type") == "FaultCleared" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


class NVSentinelRemediation:
    """``nvsentinel``: an ``ExternalFault`` for the node, followed to completion, then deleted.

    Needs RBAC: ``get``/``create``/``delete`` on ``externalfaults`` of
    ``nvsentinel.dgxc.nvidia.com`` and ``get``/``list`` on ``nodes``. NVSentinel itself cordons,
    drains and remediates with its own permissions.
    """

    kind = RemediationKind.NVSENTINEL
    releases_on_resolve = True

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        version: str = "v1",
        replace_action: str = "REPLACE_VM",
        reboot_action: str = "RESTART_VM",
        pool_labels: Sequence[str] = DEFAULT_POOL_LABELS,
        poll_s: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._custom = k8s.CustomObjectsApi(api_client)
        self._version = version
        self._actions = {
            RemediationVerb.REPLACE: replace_action,
            RemediationVerb.REBOOT: reboot_action,
        }
        self._watch = NodeWatch(api_client, pool_labels, poll_s, sleep)
        self._poll_s = poll_s
        self._sleep = sleep

    def describe(self, verb: RemediationVerb) -> str:
        return (
            f"an NVSentinel ExternalFault ({self._actions[verb]}) is created for the node: "
            "NVSentinel cordons, drains and remediates it; training resumes once it reports "
            "the fault cleared, and the ExternalFault is deleted when the incident resolves"
        )

    def plan(self, node: str, incident_id: str, verb: RemediationVerb) -> dict[str, Any]:
        name = _NAME_UNSAFE.sub("-", f"sdcguard-{incident_id}-{node}".lower())[:253].strip("-.")
        return {
            "backend": self.kind.value,
            "verb": verb.value,
            "node": node,
            "incident_id": incident_id,
            "fault": name,
            "action": self._actions[verb],
            **self._watch.identity(node),
        }

    def start(self, plan: Mapping[str, Any], *, first: bool) -> None:
        name, node = str(plan["fault"]), str(plan["node"])
        if self._read(name) is not None:
            log.info("ExternalFault %s exists already; following it", name, extra={"node": node})
            return
        body = external_fault(
            name,
            f"{EXTERNAL_FAULT_GROUP}/{self._version}",
            node,
            str(plan["incident_id"]),
            str(plan["action"]),
            f"sdcguard incident {plan['incident_id']}: silent data corruption on {node}",
        )
        try:
            self._custom.create_cluster_custom_object(
                EXTERNAL_FAULT_GROUP, self._version, EXTERNAL_FAULT_PLURAL, body
            )
        except ApiException as err:
            if err.status == 409:  # created by an earlier attempt between our read and now
                return
            raise kube.translate(err, verb="create", target=f"externalfault/{name}") from err
        except (Urllib3HTTPError, OSError) as err:
            raise kube.translate(err, verb="create", target=f"externalfault/{name}") from err
        log.info("created ExternalFault %s for %s", name, node, extra={"node": node})

    def wait(
        self, plan: Mapping[str, Any], *, timeout_s: float, taken: Collection[str]
    ) -> dict[str, Any]:
        name, node = str(plan["fault"]), str(plan["node"])
        deadline = time.monotonic() + timeout_s
        while True:
            obj = self._read(name)
            if obj is None:
                raise PermanentError(
                    kube.SYSTEM,
                    "follow",
                    f"externalfault/{name}",
                    "deleted before it completed: somebody force-closed it; a human decides",
                )
            if _fault_done(obj):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise TemporaryError(
                    kube.SYSTEM,
                    "follow",
                    f"externalfault/{name}",
                    f"not completed after {timeout_s:g} s",
                )
            self._sleep(min(self._poll_s, left))
        raw = self._watch.current(node)
        if raw is not None and raw.metadata.uid == plan["uid"]:
            return remedy(node, RemediationOutcome.RESTORED, node, fault=name)
        new_node, instance = self._watch.new_node(
            plan, taken, deadline, timeout_s
        )  # the remediation replaced the machine
        return remedy(
            node, RemediationOutcome.REPLACED, new_node, fault=name, new_instance_id=instance
        )

    def release(self, result: Mapping[str, Any], incident_id: str) -> bool:
        name = str(result["fault"])
        try:
            self._custom.delete_cluster_custom_object(
                EXTERNAL_FAULT_GROUP, self._version, EXTERNAL_FAULT_PLURAL, name
            )
        except ApiException as err:
            if err.status == 404:
                return False
            raise kube.translate(err, verb="delete", target=f"externalfault/{name}") from err
        except (Urllib3HTTPError, OSError) as err:
            raise kube.translate(err, verb="delete", target=f"externalfault/{name}") from err
        return True

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            found: Any = self._custom.get_cluster_custom_object(
                EXTERNAL_FAULT_GROUP, self._version, EXTERNAL_FAULT_PLURAL, name
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise kube.translate(err, verb="get", target=f"externalfault/{name}") from err
        except (Urllib3HTTPError, OSError) as err:
            raise kube.translate(err, verb="get", target=f"externalfault/{name}") from err
        return dict(found)
