"""Fixtures of the recovery tests: the HTTP-level fake Kubernetes API and a real client on it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client as k8s

from recovery.kube.client import api_client_for_host
from tests.recovery.fake_kube import FakeKube


@pytest.fixture
def fake_kube() -> Iterator[FakeKube]:
    """A fresh fake Kubernetes API server on 127.0.0.1, stopped after the test."""
    with FakeKube() as fake:
        yield fake


@pytest.fixture
def kube_client(fake_kube: FakeKube) -> Iterator[k8s.ApiClient]:
    """The official ``kubernetes`` client, configured (by ``recovery.kube.client``) for
    ``fake_kube``."""
    api_client = api_client_for_host(fake_kube.url, token="test-token")
    try:
        yield api_client
    finally:
        api_client.close()
