"""Mocked AWS on 127.0.0.1 for ``sdcguard demo`` and ``replay-incident``.

A ``moto.server.ThreadedMotoServer`` runs in this process with the HyperPod extension of
:mod:`recovery.aws.moto_hyperpod` installed, so the real adapters
(:class:`recovery.aws.hyperpod.HyperPod`, :class:`recovery.checkpoints.store.S3CheckpointStore`)
talk HTTP to it through ``endpoint_url`` exactly as they would to AWS. Nothing here is used against
real AWS.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import boto3
from botocore.exceptions import ClientError
from moto.core import DEFAULT_ACCOUNT_ID
from moto.server import ThreadedMotoServer

from recovery.aws import moto_hyperpod
from recovery.errors import PermanentError

__all__ = [
    "DEMO_INSTANCE_TYPE",
    "DEMO_LIFECYCLE_BUCKET",
    "DemoClients",
    "LocalAws",
    "create_demo_bucket",
    "create_demo_cluster",
    "start_local_aws",
]

_LOG = logging.getLogger(__name__)

DEMO_LIFECYCLE_BUCKET: Final = "sagemaker-sdcguard-lifecycle"
"""HyperPod (and moto) want lifecycle scripts under an ``s3://sagemaker-…`` bucket."""

DEMO_INSTANCE_TYPE: Final = "ml.g5.xlarge"
_DEMO_ROLE: Final = f"arn:aws:iam::{DEFAULT_ACCOUNT_ID}:role/sdcguard-hyperpod"
_FAKE_KEY: Final = "testing"  # moto accepts any credentials; these are not secrets.


class DemoClients(NamedTuple):
    """Explicit clients for :func:`create_demo_cluster`."""

    sagemaker: Any
    s3: Any


@dataclass
class LocalAws:
    """A running local moto server; :meth:`stop` (or ``with``) ends it."""

    endpoint_url: str
    region: str
    _server: ThreadedMotoServer = field(repr=False)
    _stopped: bool = field(default=False, repr=False)

    def session(self) -> boto3.session.Session:
        """A boto3 session with moto's dummy credentials, so no real ones are ever read."""
        return boto3.session.Session(
            aws_access_key_id=_FAKE_KEY,
            aws_secret_access_key=_FAKE_KEY,
            aws_session_token=_FAKE_KEY,
            region_name=self.region,
        )

    def client(self, service_name: str) -> Any:
        return self.session().client(service_name, endpoint_url=self.endpoint_url)

    def stop(self) -> None:
        """Stop the server; idempotent."""
        if self._stopped:
            return
        self._server.stop()
        self._stopped = True
        _LOG.info("local AWS stopped", extra={"endpoint_url": self.endpoint_url})

    def __enter__(self) -> LocalAws:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_local_aws(port: int = 0, *, region: str = "us-east-1") -> LocalAws:
    """Start moto on 127.0.0.1 (``port`` 0: any free port) with the HyperPod extension."""
    moto_hyperpod.install()
    # The mocked AWS's per-request access log (werkzeug) is noise beside the demo's own output.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    host, bound_port = server.get_host_and_port()
    local = LocalAws(endpoint_url=f"http://{host}:{bound_port}", region=region, _server=server)
    _LOG.info("local AWS started", extra={"endpoint_url": local.endpoint_url})
    return local


def _code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def _clients(source: LocalAws | boto3.session.Session | DemoClients) -> DemoClients:
    if isinstance(source, DemoClients):
        return source
    # LocalAws.client adds the endpoint; a plain session is for in-process ``mock_aws``.
    return DemoClients(sagemaker=source.client("sagemaker"), s3=source.client("s3"))


def _ensure_bucket(s3: Any, bucket: str) -> None:
    region = s3.meta.region_name
    args: dict[str, Any] = {"Bucket": bucket}
    if region != "us-east-1":
        args["CreateBucketConfiguration"] = {"LocationConstraint": region}
    try:
        s3.create_bucket(**args)
    except ClientError as err:
        if _code(err) != "BucketAlreadyOwnedByYou":
            raise PermanentError("s3", "create bucket", bucket, str(err)) from err


def create_demo_bucket(clients: LocalAws | boto3.session.Session | DemoClients, bucket: str) -> str:
    """Create (idempotently) an S3 bucket, e.g. for :class:`S3CheckpointStore`; its name."""
    _ensure_bucket(_clients(clients).s3, bucket)
    return bucket


def create_demo_cluster(
    clients: LocalAws | boto3.session.Session | DemoClients,
    cluster_name: str,
    instance_count: int,
    instance_group: str = "workers",
    *,
    continuous: bool = False,
) -> list[str]:
    """Create a HyperPod cluster in moto and return its instance ids, in creation order.

    Creates the lifecycle bucket too. ``continuous``: HyperPod's continuous provisioning
    (``NodeProvisioningMode="Continuous"``), whose nodes carry logical ids. Idempotent for the
    demo's re-runs against one server: an existing cluster is reused when its group has
    ``instance_count`` nodes, and refused (:class:`PermanentError`) otherwise.
    """
    if instance_count < 1:
        raise ValueError(f"instance_count must be >= 1, got {instance_count}")
    sagemaker, s3 = _clients(clients)
    _ensure_bucket(s3, DEMO_LIFECYCLE_BUCKET)
    try:
        s3.put_object(
            Bucket=DEMO_LIFECYCLE_BUCKET,
            Key="lifecycle/on_create.sh",
            Body=b"#!/bin/sh\n# sdcguard demo: nothing to set up on a simulated node\n",
        )
    except ClientError as err:
        raise PermanentError("s3", "put", DEMO_LIFECYCLE_BUCKET, str(err)) from err
    mode = {"NodeProvisioningMode": "Continuous"} if continuous else {}
    try:
        sagemaker.create_cluster(
            **mode,
            ClusterName=cluster_name,
            InstanceGroups=[
                {
                    "InstanceGroupName": instance_group,
                    "InstanceType": DEMO_INSTANCE_TYPE,
                    "InstanceCount": instance_count,
                    "LifeCycleConfig": {
                        "SourceS3Uri": f"s3://{DEMO_LIFECYCLE_BUCKET}/lifecycle",
                        "OnCreate": "on_create.sh",
                    },
                    "ExecutionRole": _DEMO_ROLE,
                    "ThreadsPerCore": 1,
                }
            ],
        )
    except ClientError as err:
        if _code(err) != "ResourceInUse":
            raise PermanentError("hyperpod", "create cluster", cluster_name, str(err)) from err
        _LOG.info("demo cluster exists; reusing it", extra={"cluster": cluster_name})
    summaries = sagemaker.list_cluster_nodes(
        ClusterName=cluster_name, InstanceGroupNameContains=instance_group
    )["ClusterNodeSummaries"]
    ids = [s["InstanceId"] for s in summaries if s["InstanceGroupName"] == instance_group]
    if len(ids) != instance_count:
        raise PermanentError(
            "hyperpod",
            "create demo cluster",
            cluster_name,
            f"group {instance_group} has {len(ids)} nodes, wanted {instance_count}",
        )
    return ids
