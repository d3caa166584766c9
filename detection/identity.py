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

__all__ = ["DMI_ASSET_TAG", "INSTANCE_ID_ENV", "NODE_NAME_ENV", "RankIdentity"]

_log = logging.getLogger(__name__)

#: Set by the Kubernetes downward API (``fieldRef: {fieldPath: spec.nodeName}``).
NODE_NAME_ENV = "NODE_NAME"
#: Explicit instance id, for platforms where the DMI tag is absent or wrong.
INSTANCE_ID_ENV = "SDCGUARD_INSTANCE_ID"
#: On EC2 Nitro instances the board asset tag holds the instance id (``i-0123456789abcdef0``).
DMI_ASSET_TAG = Path("/sys/devices/virtual/dmi/id/board_asset_tag")

_INSTANCE_ID = re.compile(r"^i-[0-9a-f]{8,17}$")


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

        ``node``: the argument, else ``$NODE_NAME`` (Kubernetes downward API), else the host
        name. ``instance_id``: ``$SDCGUARD_INSTANCE_ID``, else the DMI asset tag when it holds
        an ``i-…`` id, else None. ``gpu_uuid``: CUDA device ``local_rank``'s UUID
        (``GPU-…``, as ``nvidia-smi`` prints it) when CUDA is available, else None. ``env``
        defaults to ``os.environ``; ``dmi_asset_tag`` is the file to read (tests point it
        elsewhere).
        """
        environ: Mapping[str, str] = os.environ if env is None else env
        resolved_node = node or environ.get(NODE_NAME_ENV) or socket.gethostname()
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


def _gpu_uuid(rank: int, local_rank: int) -> str | None:
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if local_rank >= count:
        _log.warning(
            "local_rank %d has no CUDA device of its own (%d visible): no GPU UUID registered",
            local_rank,
            count,
            extra={"rank": rank},
        )
        return None
    uuid = torch.cuda.get_device_properties(local_rank).uuid
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"
