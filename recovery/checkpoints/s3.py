"""Checkpoints as S3 objects: :class:`S3CheckpointStore`, with the invariants of
:mod:`recovery.checkpoints.store` (atomic publish, verification by re-reading what is stored)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlparse

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from recovery.aws.errors import ServiceCodes, from_botocore
from recovery.checkpoints.store import (
    CHUNK,
    InvalidCheckpointUri,
    StoredCheckpoint,
    atomic_target,
    os_error,
    sha256_file,
)
from recovery.errors import (
    ConflictError,
    NotFoundError,
    PermanentError,
    RecoveryError,
    TemporaryError,
)

__all__ = ["SHA256_METADATA_KEY", "S3CheckpointStore"]

_LOG = logging.getLogger(__name__)
_MIB: Final = 1024 * 1024

SHA256_METADATA_KEY: Final = "sha256"
"""S3 user metadata key (``x-amz-meta-sha256``) holding the sha256 computed before upload."""


_S3_THROTTLING: Final = frozenset({"SlowDown", "Throttling", "ThrottlingException", "503"})
_S3_NOT_FOUND: Final = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
_S3_FORBIDDEN: Final = frozenset({"AccessDenied", "403", "InvalidAccessKeyId"})


_S3_CODES: Final = ServiceCodes(
    throttling=_S3_THROTTLING,
    not_found=_S3_NOT_FOUND,
    forbidden=_S3_FORBIDDEN,
    temporary=("RequestTimeout", "InternalError"),
    conflict_statuses=(409, 412),
)


def _s3_error(err: Exception, verb: str, target: str) -> RecoveryError:
    if isinstance(err, S3UploadFailedError):
        # boto3 raises it inside ``except ClientError`` without ``from``: the context holds
        # the S3 error code that decides retry or not.
        inner = err.__cause__ or err.__context__
        if isinstance(inner, ClientError | BotoCoreError):
            err = inner
        else:
            return TemporaryError("s3", verb, target, str(err))
    return from_botocore(err, system="s3", verb=verb, target=target, codes=_S3_CODES)


def _s3_client(
    region: str,
    endpoint_url: str | None,
    max_attempts: int,
    retry_mode: str,
    session: boto3.session.Session | None,
) -> Any:
    if retry_mode not in ("standard", "adaptive"):
        raise ValueError(f"retry_mode must be 'standard' or 'adaptive', got {retry_mode!r}")
    config = Config(
        region_name=region, retries={"mode": retry_mode, "total_max_attempts": max_attempts}
    )
    source = session if session is not None else boto3.session.Session()
    return source.client("s3", endpoint_url=endpoint_url, config=config)


class S3CheckpointStore:
    """Checkpoints as S3 objects under ``s3://bucket/prefix``.

    Files above ``multipart_threshold`` go up in parts (boto3's managed transfer, classic
    client, so S3's multipart semantics apply: nothing is visible before completion and a
    failed transfer aborts its upload). The sha256 is computed locally before upload and kept
    as user metadata for people and tools; verification still re-reads the object.
    """

    def __init__(
        self,
        s3_client: Any,
        bucket: str,
        prefix: str = "",
        *,
        multipart_threshold: int = 64 * _MIB,
        multipart_chunksize: int = 16 * _MIB,
        max_concurrency: int = 4,
    ) -> None:
        self._s3 = s3_client
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=max_concurrency > 1,
            preferred_transfer_client="classic",
        )

    @classmethod
    def from_settings(
        cls,
        bucket: str,
        prefix: str = "",
        *,
        region: str,
        endpoint_url: str | None = None,
        max_attempts: int = 8,
        retry_mode: str = "standard",
        session: boto3.session.Session | None = None,
        multipart_threshold: int = 64 * _MIB,
        multipart_chunksize: int = 16 * _MIB,
    ) -> S3CheckpointStore:
        """Build the client (botocore retries for throttling/5xx) and the store."""
        client = _s3_client(region, endpoint_url, max_attempts, retry_mode, session)
        return cls(
            client,
            bucket,
            prefix,
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
        )

    @property
    def bucket(self) -> str:
        return self._bucket

    def _key(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise InvalidCheckpointUri("s3", "address", key, "expected a non-empty relative key")
        return f"{self._prefix}/{key}" if self._prefix else key

    @staticmethod
    def _split(uri: str) -> tuple[str, str]:
        parsed = urlparse(uri)
        key = parsed.path.lstrip("/")
        if parsed.scheme != "s3" or not parsed.netloc or not key:
            raise InvalidCheckpointUri("s3", "address", uri, "expected s3://bucket/key")
        return parsed.netloc, key

    def put(self, local_path: Path, key: str) -> StoredCheckpoint:
        full_key = self._key(key)
        uri = f"s3://{self._bucket}/{full_key}"
        try:
            sha, size = sha256_file(Path(local_path))
        except OSError as err:
            raise os_error(err, "put", str(local_path)) from err
        try:
            self._s3.upload_file(
                str(local_path),
                self._bucket,
                full_key,
                ExtraArgs={"Metadata": {SHA256_METADATA_KEY: sha}},
                Config=self._transfer,
            )
            head = self._s3.head_object(Bucket=self._bucket, Key=full_key)
        except (ClientError, BotoCoreError, S3UploadFailedError) as err:
            raise _s3_error(err, "put", uri) from err
        stored_sha = head.get("Metadata", {}).get(SHA256_METADATA_KEY)
        if head.get("ContentLength") != size or stored_sha != sha:
            # Another writer replaced the object between our upload and our read-back.
            raise ConflictError(
                "s3",
                "put",
                uri,
                f"read back size {head.get('ContentLength')} sha256 {stored_sha}, "
                f"wrote {size} {sha}",
            )
        _LOG.info("checkpoint stored", extra={"uri": uri, "sha256": sha, "size": size})
        return StoredCheckpoint(uri=uri, sha256=sha, size=size)

    def verify(self, uri: str, sha256: str) -> bool:
        bucket, key = self._split(uri)
        digest = hashlib.sha256()
        try:
            body = self._s3.get_object(Bucket=bucket, Key=key)["Body"]
            try:
                for chunk in body.iter_chunks(CHUNK):
                    digest.update(chunk)
            finally:
                body.close()
        except (ClientError, BotoCoreError) as err:
            raise _s3_error(err, "verify", uri) from err
        actual = digest.hexdigest()
        if actual != sha256:
            _LOG.warning(
                "checkpoint sha256 mismatch",
                extra={"uri": uri, "expected": sha256, "actual": actual},
            )
        return actual == sha256

    def s3_sha256(self, uri: str) -> str | None:
        """The object's sha256 from S3's own checksum (``ChecksumSHA256``, which S3 computed and
        validated on upload), hex; None when the object has none or only a multipart composite
        (``…-N``), so the caller must re-read the bytes. No object data is transferred."""
        bucket, key = self._split(uri)
        try:
            head = self._s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        except (ClientError, BotoCoreError) as err:
            raise _s3_error(err, "head", uri) from err
        checksum = head.get("ChecksumSHA256")
        if not checksum or "-" in str(checksum) or head.get("ChecksumType") == "COMPOSITE":
            return None
        try:
            return base64.b64decode(str(checksum), validate=True).hex()
        except (binascii.Error, ValueError):
            return None

    def read_small(self, uri: str, limit: int = 4 * _MIB) -> bytes:
        """The whole object (a manifest), refused above ``limit`` bytes."""
        bucket, key = self._split(uri)
        try:
            obj = self._s3.get_object(Bucket=bucket, Key=key)
            if int(obj.get("ContentLength") or 0) > limit:
                raise PermanentError("s3", "read", uri, f"larger than {limit} bytes")
            data: bytes = obj["Body"].read()
        except (ClientError, BotoCoreError) as err:
            raise _s3_error(err, "read", uri) from err
        return data

    def fetch(self, uri: str, dest: Path) -> Path:
        bucket, key = self._split(uri)
        dest = Path(dest).absolute()
        try:
            with atomic_target(dest) as temp:
                self._s3.download_file(bucket, key, str(temp), Config=self._transfer)
        except (ClientError, BotoCoreError) as err:
            raise _s3_error(err, "fetch", uri) from err
        except OSError as err:
            raise os_error(err, "fetch", str(dest)) from err
        return dest

    def exists(self, uri: str) -> bool:
        bucket, key = self._split(uri)
        try:
            self._s3.head_object(Bucket=bucket, Key=key)
        except ClientError as err:
            error = _s3_error(err, "head", uri)
            if isinstance(error, NotFoundError):
                return False
            raise error from err
        except BotoCoreError as err:
            raise _s3_error(err, "head", uri) from err
        return True

    def delete(self, uri: str) -> None:
        bucket, key = self._split(uri)
        try:
            self._s3.delete_object(Bucket=bucket, Key=key)
        except (ClientError, BotoCoreError) as err:
            raise _s3_error(err, "delete", uri) from err

    def list_uris(self, prefix: str = "") -> list[str]:
        full_prefix = f"{self._prefix}/{prefix}" if self._prefix else prefix
        uris: list[str] = []
        try:
            paginator = self._s3.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self._bucket, Prefix=full_prefix):
                uris.extend(
                    f"s3://{self._bucket}/{item['Key']}" for item in page.get("Contents", ())
                )
        except (ClientError, BotoCoreError) as err:
            raise _s3_error(err, "list", f"s3://{self._bucket}/{full_prefix}") from err
        return sorted(uris)
