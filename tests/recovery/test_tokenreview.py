"""TokenReview through the official client against the HTTP-level fake API server."""

from __future__ import annotations

from kubernetes import client as k8s

from recovery.kube.tokenreview import TokenReviewer
from tests.recovery.fake_kube import FakeKube

SA = "system:serviceaccount:team-a:trainer"


def test_a_token_the_api_server_authenticates_names_its_service_account(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    fake_kube.add_token("projected-token-of-trainer", SA)
    reviewer = TokenReviewer(kube_client, audience="sdcguard")
    assert reviewer.username("projected-token-of-trainer") == SA
    [sent] = fake_kube.requests_to("POST", r"/apis/authentication\.k8s\.io/v1/tokenreviews")
    assert sent.body["spec"] == {"token": "projected-token-of-trainer", "audiences": ["sdcguard"]}


def test_unknown_and_wrong_audience_tokens_name_nobody(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    fake_kube.add_token("token-for-vault", SA, audiences=["vault"])
    reviewer = TokenReviewer(kube_client, audience="sdcguard")
    assert reviewer.username("not-a-token") is None
    assert reviewer.username("token-for-vault") is None
