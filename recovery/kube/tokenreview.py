"""Kubernetes TokenReview: who a projected service-account token belongs to, says the API server.

Training pods may authenticate to the webhook with their projected service-account token
(audience ``sdcguard``) instead of a shared HMAC key: the webhook never sees a secret it could
leak, and a token expires with its pod. The webhook asks the API server (``TokenReview``,
``authentication.k8s.io/v1``) and gets back the token's user name,
``system:serviceaccount:<namespace>:<name>``, which it maps to the jobs that service account
may report for.

Invariant: :meth:`TokenReviewer.username` returns a name only for a token the API server
*authenticated* for the expected audience; an unauthenticated or wrong-audience token is
``None``, and an API server that cannot answer raises a typed
:class:`~recovery.errors.RecoveryError` (temporary ones are retried by the caller's sender).
The webhook's service account needs ``create`` on ``tokenreviews`` (a ClusterRole, see
deploy/).
"""

from __future__ import annotations

import logging

from kubernetes import client as k8s

from recovery.kube.client import call

__all__ = ["TokenReviewer"]

log = logging.getLogger(__name__)


class TokenReviewer:
    """Checks bearer tokens with the API server behind ``api_client``."""

    def __init__(self, api_client: k8s.ApiClient, audience: str = "sdcguard") -> None:
        if not audience:
            raise ValueError(
                "a token audience is required: a token for another audience is no proof"
            )
        self._api = k8s.AuthenticationV1Api(api_client)
        self._audience = audience

    def username(self, token: str) -> str | None:
        """The authenticated user name of ``token``, or ``None`` if the API server refuses it."""
        review = k8s.V1TokenReview(
            api_version="authentication.k8s.io/v1",
            kind="TokenReview",
            spec=k8s.V1TokenReviewSpec(token=token, audiences=[self._audience]),
        )
        answer = call("create", "tokenreviews", lambda: self._api.create_token_review(review))
        status = answer.status
        if status is None or not status.authenticated or status.user is None:
            log.info(
                "token refused by TokenReview",
                extra={"error": None if status is None else status.error},
            )
            return None
        if status.audiences is not None and self._audience not in status.audiences:
            log.warning(
                "token authenticated for another audience", extra={"audience": status.audiences}
            )
            return None
        name = status.user.username
        return name if isinstance(name, str) and name else None
