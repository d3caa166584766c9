"""Who a rank is in hardware terms: the node, the cloud instance and the GPU it runs on.

An alarm names ranks; cordoning and replacing need nodes and instances. Each rank registers
this identity once (DESIGN "rank registration"), so the incident flow can map a suspect rank to
the machine to act on even after the job is gone. Detection makes no network calls: the
instance id comes from the environment or from the EC2 Nitro DMI asset tag, which the
hypervisor writes into the guest's firmware tables and any process can read.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DMI_ASSET_TAG",
    "INSTANCE_ID_ENV",
    "NODE_NAME_ENV",
    "IdentityError",
    "RankIdentity",
    "gpu_index",
    "strict_contract",
]

_log = logging.getLogger(__name__)

#: Set by the Kubernetes downward API (``fieldRef: {fieldPath: spec.nodeName}``).
NODE_NAME_ENV = "NODE_NAME"
#: Explicit instance id, for platforms where the DMI tag is absent or wrong.
INSTANCE_ID_ENV = "SDCGUARD_INSTANCE_ID"
#: On EC2 Nitro instances the board asset tag holds the instance id (``i-0123456789abcdef0``).
DMI_ASSET_TAG = Path("/sys/devices/virtual/dmi/id/board_asset_tag")

_INSTANCE_ID = re.compile(r"^i-[0-9a-f]{8,17}$")
#: ``strict``: refuse to guess (the training-job contract, docs/training-job.md); ``off``: guess.
CONTRACT_ENV = "SDCGUARD_CONTRACT"


class IdentityError(RuntimeError):
    """The rank's identity cannot be known without guessing, and guessing was refused."""


def strict_contract(env: Mapping[str, str]) -> bool:
    """Whether the training-job contract is enforced: ``SDCGUARD_CONTRACT=strict``, or inside a
    Kubernetes pod (``KUBERNETES_SERVICE_HOST`` set) unless ``SDCGUARD_CONTRACT=off``. Inside a
    pod the host name is the *pod* name, which no node is called: guessing it makes cordon 404."""
    value = env.get(CONTRACT_ENV, "").strip().lower()
    if value in ("strict", "real", "1", "true"):
        return True
    if value in ("off", "0", "false"):
        return False
    return bool(env.get("KUBERNETES_SERVICE_HOST"))


@dataclass(frozen=True)
class RankIdentity:
    """One rank's place in the job and in the fleet. Immutable: it is registered once."""

    rank: int
    local_rank: int
    world_size: int
    node: str
    instance_id: str | None
    gpu_uuid: str | None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")
        if not self.node:
            raise ValueError("node must not be empty")

    def to_dict(self) -> dict[str, Any]:
        """The DESIGN rank-registration row (``POST /v1/jobs/{job_id}/ranks``)."""
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "node": self.node,
            "instance_id": self.instance_id,
            "gpu_uuid": self.gpu_uuid,
        }

    @classmethod
    def detect(
        cls,
        rank: int,
        local_rank: int,
        world_size: int,
        node: str | None = None,
        env: Mapping[str, str] | None = None,
        *,
        dmi_asset_tag: str | Path = DMI_ASSET_TAG,
    ) -> RankIdentity:
        """Detect this process's identity.

        ``node``: the argument, else ``$NODE_NAME`` (Kubernetes downward API), else — only
        outside the training-job contract (:func:`strict_contract`) — the host name, with a
        warning; under the contract a missing ``NODE_NAME`` raises :class:`IdentityError`.
        ``instance_id``: ``$SDCGUARD_INSTANCE_ID``, else the DMI asset tag when it holds
        an ``i-…`` id, else None. ``gpu_uuid``: the UUID of the CUDA device this process uses
        (:func:`gpu_index`: right under a per-process ``CUDA_VISIBLE_DEVICES`` too)
        (``GPU-…``, as ``nvidia-smi`` prints it) when CUDA is available, else None. ``env``
        defaults to ``os.environ``; ``dmi_asset_tag`` is the file to read (tests point it
        elsewhere).
        """
        environ: Mapping[str, str] = os.environ if env is None else env
        resolved_node = node or environ.get(NODE_NAME_ENV)
        if not resolved_node:
            if strict_contract(environ):
                raise IdentityError(
                    f"{NODE_NAME_ENV} is not set: inject it with the downward API "
                    "(env: {name: NODE_NAME, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}); "
                    "the host name of a pod names no node (docs/training-job.md)"
                )
            resolved_node = socket.gethostname()
            _log.warning(
                "%s is not set: using the host name %r as the node name; cordon and replace "
                "will fail if no node is called that",
                NODE_NAME_ENV,
                resolved_node,
                extra={"rank": rank},
            )
        instance_id = environ.get(INSTANCE_ID_ENV) or _instance_from_dmi(Path(dmi_asset_tag))
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            node=resolved_node,
            instance_id=instance_id,
            gpu_uuid=_gpu_uuid(rank, local_rank),
        )


def _instance_from_dmi(path: Path) -> str | None:
    """The EC2 instance id from the DMI asset tag, or None off EC2 (no file, another value)."""
    try:
        tag = path.read_text(encoding="ascii", errors="replace").strip()
    except OSError as err:
        _log.debug("no DMI asset tag at %s: %s", path, err)
        return None
    return tag if _INSTANCE_ID.match(tag) else None


def gpu_index(local_rank: int, visible_count: int, current: int | None) -> int | None:
    """The CUDA device index this rank computes on.

    Under a per-process ``CUDA_VISIBLE_DEVICES`` (one GPU each, as many launchers set it) every
    rank sees exactly one device, index 0, whatever its ``local_rank``; with all GPUs visible
    the rank's device is the one it selected (``torch.cuda.current_device()`` after
    ``set_device``), and ``local_rank`` only when it selected none. None: no device of its own.
    """
    if visible_count <= 0:
        return None
    if visible_count == 1:
        return 0
    if current is not None and current != 0:
        return current
    return local_rank if local_rank < visible_count else None


def _gpu_uuid(rank: int, local_rank: int) -> str | None:
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    index = gpu_index(local_rank, count, torch.cuda.current_device())
    if index is None:
        _log.warning(
            "local_rank %d has no CUDA device of its own (%d visible): no GPU UUID registered",
            local_rank,
            count,
            extra={"rank": rank},
        )
        return None
    uuid = torch.cuda.get_device_properties(index).uuid
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"
