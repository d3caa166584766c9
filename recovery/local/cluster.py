"""The local backend's simulated cluster: a JSON state file shared by several processes.

The webhook, the incident flow and the demo each run in their own process and must see one
cluster: which node is cordoned, tainted, labelled for replacement, which instance backs it.
The state is one JSON file; every change is a read-modify-write under an exclusive ``flock`` on
a sidecar lock file, and the new state replaces the old by ``os.replace`` of a fully written
temporary file. Invariants:

- no lost updates: two processes updating different nodes (or the same one) both see their
  change in the final state, because the whole read-modify-write holds the lock;
- readers never see a half-written file (atomic rename), even without taking the lock;
- node names are never reused: a replaced instance leaves (state ``Gone``, kept for the record)
  and its replacement joins under the next free ``node-N`` with the new instance id, as a new
  EC2 instance joins an EKS cluster under a new node name.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from recovery.errors import NotFoundError, PermanentError
from recovery.nodes import NodeInfo, Taint

__all__ = [
    "LocalCluster",
    "NodeRecord",
    "NodeState",
    "default_instance_id",
]

log = logging.getLogger(__name__)

SYSTEM = "local-cluster"
_FORMAT_VERSION = 1
_NODE_NAME = re.compile(r"^node-(\d+)$")
_T = TypeVar("_T")


class NodeState(StrEnum):
    """Lifecycle of a simulated node; only ``Ready`` nodes can run work."""

    READY = "Ready"
    REPLACING = "Replacing"
    GONE = "Gone"


@dataclass
class NodeRecord:
    """The mutable record of one node inside the state file, as :meth:`LocalCluster.update`
    hands it to its callback. ``spare`` nodes are the pool replays and replacements draw from."""

    name: str
    instance_id: str
    spare: bool = False
    state: NodeState = NodeState.READY
    unschedulable: bool = False
    taints: list[Taint] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    replaces: str | None = None
    replaced_by: str | None = None

    def info(self) -> NodeInfo:
        return NodeInfo(
            name=self.name,
            instance_id=self.instance_id,
            unschedulable=self.unschedulable,
            taints=tuple(self.taints),
            labels=MappingProxyType(dict(self.labels)),
            annotations=MappingProxyType(dict(self.annotations)),
            ready=self.state is NodeState.READY,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "instance_id": self.instance_id,
            "spare": self.spare,
            "state": self.state.value,
            "unschedulable": self.unschedulable,
            "taints": [t.to_dict() for t in self.taints],
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "replaces": self.replaces,
            "replaced_by": self.replaced_by,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> NodeRecord:
        return cls(
            name=str(raw["name"]),
            instance_id=str(raw["instance_id"]),
            spare=bool(raw.get("spare", False)),
            state=NodeState(raw.get("state", NodeState.READY.value)),
            unschedulable=bool(raw.get("unschedulable", False)),
            taints=[Taint.from_dict(t) for t in raw.get("taints", [])],
            labels={str(k): str(v) for k, v in raw.get("labels", {}).items()},
            annotations={str(k): str(v) for k, v in raw.get("annotations", {}).items()},
            replaces=raw.get("replaces"),
            replaced_by=raw.get("replaced_by"),
        )


def default_instance_id(node: str) -> str:
    """A stable, well-formed EC2 instance id for a simulated node (``i-`` + 17 hex digits)."""
    return "i-" + hashlib.sha256(node.encode()).hexdigest()[:17]


class LocalCluster:
    """Handle on a simulated cluster's state file; cheap to construct, safe across processes."""

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)
        self._lock_path = _lock_path_for(self._path)
        if not self._path.exists():
            raise NotFoundError(
                SYSTEM, "open", str(self._path), "no cluster state; create it with create()"
            )

    @classmethod
    def create(
        cls,
        path: str | Path,
        nodes: list[str],
        spares: list[str],
        instance_ids: dict[str, str] | None = None,
    ) -> LocalCluster:
        """Write a fresh cluster (replacing any state at ``path``): ``nodes`` then ``spares``,
        all ready and schedulable. Instance ids default to :func:`default_instance_id`."""
        names = [*nodes, *spares]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique across nodes and spares: {names}")
        ids = dict(instance_ids or {})
        unknown = set(ids) - set(names)
        if unknown:
            raise ValueError(f"instance ids given for unknown nodes: {sorted(unknown)}")
        records = [
            NodeRecord(name=n, instance_id=ids.get(n) or default_instance_id(n), spare=n in spares)
            for n in names
        ]
        if len({r.instance_id for r in records}) != len(records):
            raise ValueError("instance ids must be unique")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with _flock(_lock_path_for(target), exclusive=True):
            _write_records(target, records)
        log.info("created local cluster %s: nodes %s, spares %s", target, nodes, spares)
        return cls(target)

    @property
    def path(self) -> Path:
        return self._path

    # -- reads ---------------------------------------------------------------------------

    def node(self, name: str, *, verb: str = "get") -> NodeInfo:
        """The node named ``name``; :class:`NotFoundError` if it never existed or is gone."""
        with self._locked(exclusive=False):
            return self._present(self._read(), name, verb).info()

    def nodes(self) -> list[NodeInfo]:
        """Every node still in the cluster (not ``Gone``), in join order."""
        with self._locked(exclusive=False):
            return [r.info() for r in self._read() if r.state is not NodeState.GONE]

    def records(self) -> list[NodeRecord]:
        """Every record ever held, ``Gone`` ones included (copies: changing them changes
        nothing)."""
        with self._locked(exclusive=False):
            return self._read()

    def spares(self, exclude: Iterable[str] = ()) -> list[str]:
        """Spare nodes that can take work now: ready, not cordoned, not in ``exclude``."""
        skip = set(exclude)
        with self._locked(exclusive=False):
            return [
                r.name
                for r in self._read()
                if r.spare
                and r.state is NodeState.READY
                and not r.unschedulable
                and r.name not in skip
            ]

    def node_for_instance(self, instance_id: str) -> str:
        """The present node backed by ``instance_id``."""
        with self._locked(exclusive=False):
            for record in self._read():
                if record.instance_id == instance_id and record.state is not NodeState.GONE:
                    return record.name
        raise NotFoundError(SYSTEM, "find", f"instance/{instance_id}", "no node has this instance")

    # -- writes --------------------------------------------------------------------------

    def update(self, name: str, fn: Callable[[NodeRecord], _T], *, verb: str = "update") -> _T:
        """Apply ``fn`` to the node's record under the exclusive lock and save; return its value.

        If ``fn`` raises, nothing is written. Renaming the node or changing its instance id
        inside ``fn`` is refused: identity changes go through :meth:`replace_instance`.
        """
        with self._locked(exclusive=True):
            records = self._read()
            record = self._present(records, name, verb)
            before = (record.name, record.instance_id)
            result = fn(record)
            if (record.name, record.instance_id) != before:
                raise ValueError(f"update() must not change the identity of node {name}")
            self._write(records)
            return result

    def set_state(self, name: str, state: NodeState) -> None:
        """Mark a node ``Ready`` or ``Replacing`` (``Gone`` only happens by replacement)."""
        if state is NodeState.GONE:
            raise ValueError("a node leaves only through replace_instance()")

        def apply(record: NodeRecord) -> None:
            record.state = state

        self.update(name, apply, verb="set-state")

    def replace_instance(self, old_node: str, new_instance_id: str) -> str:
        """Retire ``old_node`` and join ``new_instance_id`` as a new node; return its name.

        The new node is ready, schedulable and clean (no taints, labels or annotations of the old
        one: it is a different machine) and keeps the old node's ``spare`` role. Idempotent: a
        repeated call for the same old node and instance returns the node already joined.
        """
        with self._locked(exclusive=True):
            records = self._read()
            by_name = {r.name: r for r in records}
            old = by_name.get(old_node)
            if old is None:
                raise NotFoundError(SYSTEM, "replace", f"node/{old_node}", "no such node")
            if old.state is NodeState.GONE:
                successor = by_name.get(old.replaced_by or "")
                if successor is not None and successor.instance_id == new_instance_id:
                    return successor.name
                raise NotFoundError(
                    SYSTEM, "replace", f"node/{old_node}", f"already replaced by {old.replaced_by}"
                )
            if old.instance_id == new_instance_id:
                raise PermanentError(
                    SYSTEM,
                    "replace",
                    f"node/{old_node}",
                    f"replacement instance {new_instance_id} is the instance being replaced",
                )
            for record in records:
                if record.instance_id == new_instance_id and record.state is not NodeState.GONE:
                    raise PermanentError(
                        SYSTEM,
                        "replace",
                        f"node/{old_node}",
                        f"instance {new_instance_id} already backs node {record.name}",
                    )
            new_name = _next_node_name(by_name)
            old.state = NodeState.GONE
            old.replaced_by = new_name
            records.append(
                NodeRecord(
                    name=new_name,
                    instance_id=new_instance_id,
                    spare=old.spare,
                    replaces=old_node,
                )
            )
            self._write(records)
        log.info(
            "instance %s of %s left; %s joined as %s",
            old.instance_id,
            old_node,
            new_instance_id,
            new_name,
            extra={"node": old_node},
        )
        return new_name

    # -- file handling -------------------------------------------------------------------

    def _locked(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        return _flock(self._lock_path, exclusive=exclusive)

    def _read(self) -> list[NodeRecord]:
        try:
            raw = json.loads(self._path.read_text())
        except FileNotFoundError as err:
            raise NotFoundError(SYSTEM, "read", str(self._path), "cluster state is gone") from err
        except ValueError as err:
            raise PermanentError(SYSTEM, "read", str(self._path), f"corrupt state: {err}") from err
        if not isinstance(raw, dict) or raw.get("version") != _FORMAT_VERSION:
            raise PermanentError(
                SYSTEM, "read", str(self._path), f"unknown state format (want {_FORMAT_VERSION})"
            )
        return [NodeRecord.from_dict(copy.deepcopy(n)) for n in raw["nodes"]]

    def _write(self, records: list[NodeRecord]) -> None:
        _write_records(self._path, records)

    @staticmethod
    def _present(records: list[NodeRecord], name: str, verb: str) -> NodeRecord:
        for record in records:
            if record.name == name:
                if record.state is NodeState.GONE:
                    raise NotFoundError(
                        SYSTEM,
                        verb,
                        f"node/{name}",
                        f"node left (replaced by {record.replaced_by})",
                    )
                return record
        raise NotFoundError(SYSTEM, verb, f"node/{name}", "no such node")


def _lock_path_for(path: Path) -> Path:
    # The lock lives on a sidecar file: the state file itself is replaced by rename, and a lock
    # on a replaced inode would protect nothing.
    return path.with_name(path.name + ".lock")


@contextlib.contextmanager
def _flock(lock_path: Path, *, exclusive: bool) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _write_records(path: Path, records: list[NodeRecord]) -> None:
    payload = {"version": _FORMAT_VERSION, "nodes": [r.to_dict() for r in records]}
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _next_node_name(by_name: Mapping[str, NodeRecord]) -> str:
    numbers = [int(m.group(1)) for n in by_name if (m := _NODE_NAME.match(n))]
    return f"node-{max(numbers, default=-1) + 1}"
