"""moto fixtures for the HyperPod and checkpoint-store tests.

Test modules import the ``fixture_*`` functions explicitly; pytest registers each under the
name given in its decorator (``mocked_aws``, ``session``, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws
from moto.moto_api import state_manager

from recovery.aws import moto_hyperpod
from recovery.aws.local import LocalAws, create_demo_cluster, start_local_aws

REGION = "us-east-1"
CLUSTER = "sdc-test"
GROUP = "workers"
NODE_COUNT = 4


@pytest.fixture(name="aws_env")
def fixture_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy credentials and a region, so nothing reads or reaches a real account."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")


@pytest.fixture(name="mocked_aws")
def fixture_mocked_aws(aws_env: None) -> Iterator[None]:
    """In-process moto with the HyperPod extension."""
    with mock_aws():
        moto_hyperpod.install()
        yield


@pytest.fixture(name="shared_session", scope="session")
def fixture_shared_session() -> boto3.session.Session:
    """One boto3 session for the run: its loader caches the large SageMaker and S3 models.

    Its credentials are moto's dummy ones, given explicitly, never looked up.
    """
    return boto3.session.Session(
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        aws_session_token="testing",
        region_name=REGION,
    )


@pytest.fixture(name="session")
def fixture_session(
    mocked_aws: None, shared_session: boto3.session.Session
) -> boto3.session.Session:
    """The shared session, inside in-process moto."""
    return shared_session


@pytest.fixture(name="cluster_ids")
def fixture_cluster_ids(session: boto3.session.Session) -> list[str]:
    """A HyperPod cluster of :data:`NODE_COUNT` running nodes in group :data:`GROUP`."""
    return create_demo_cluster(session, CLUSTER, NODE_COUNT, GROUP)


@pytest.fixture(name="transition")
def fixture_transition() -> Iterator[Callable[[str, dict[str, Any]], None]]:
    """Set a moto state-manager transition for the test; restored afterwards."""
    touched: list[str] = []

    def set_transition(model: str, transition: dict[str, Any]) -> None:
        touched.append(model)
        state_manager.set_transition(model, transition)

    yield set_transition
    for model in touched:
        state_manager.unset_transition(model)


@pytest.fixture(name="local_aws")
def fixture_local_aws(aws_env: None) -> Iterator[LocalAws]:
    """A moto server on 127.0.0.1 with the HyperPod extension, stopped afterwards."""
    local = start_local_aws()
    try:
        yield local
    finally:
        local.stop()
