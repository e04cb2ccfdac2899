"""Adapters in S3 (or any S3-compatible store: MinIO, R2, …) through boto3.

boto3's own configuration conventions hold: the credential chain (env, profiles,
SSO, instance/role credentials), ``AWS_PROFILE``, ``AWS_ENDPOINT_URL`` /
``AWS_ENDPOINT_URL_S3`` and the config file for the endpoint, the region. Only
what a server must bound is set here: connect/read timeouts, boto3's 'standard'
retry mode (5xx, throttling, connection errors, with backoff), and a deadline
for a whole download, so that a server trickling bytes cannot hold a load forever.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from adapters_store.disk_cache import DiskCache, ObjectInfo, VerifyingSink
from adapters_store.errors import (
    AdapterFetchError,
    AdapterNotFoundError,
    SourceChangedError,
    SourceResponseError,
    SourceTimeoutError,
)
from adapters_store.metrics import Progress
from adapters_store.paths import S3Uri, cache_file
from adapters_store.peft_weights import WEIGHTS_FILE
from adapters_store.sources import (
    BIN_FILE,
    CONFIG_FILE,
    Snapshot,
    b64_to_hex,
    check_config_size,
    missing_weights,
    version_of,
)

_NOT_FOUND = {"404", "NoSuchKey", "NoSuchBucket", "NotFound"}
_THROTTLED = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "TooManyRequestsException",
    "RequestThrottled",
    "503",
}
_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")  # multipart ETags end in "-<parts>" and are no MD5


@dataclass(frozen=True)
class S3Config:
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0  # per socket read, also while streaming the body
    max_attempts: int = 3  # tries per request including the first, boto3 'standard' retry mode
    download_deadline_s: float = 600.0
    profile: str | None = None  # None: boto3's chain (AWS_PROFILE, env credentials, …)
    region: str | None = None  # None: AWS_REGION / AWS_DEFAULT_REGION / the profile's region
    endpoint_url: str | None = None  # None: AWS_ENDPOINT_URL(_S3) or the config file, else AWS
    max_pool_connections: int = 16
    chunk_bytes: int = 1 << 20
    progress_every_s: float = 5.0


def make_client(cfg: S3Config):
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(profile_name=cfg.profile)
    return session.client(
        "s3",
        region_name=cfg.region,
        endpoint_url=cfg.endpoint_url,
        config=Config(
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
            retries={"mode": "standard", "total_max_attempts": cfg.max_attempts},
            max_pool_connections=cfg.max_pool_connections,
        ),
    )


def fetch_error(exc: Exception, what: str) -> Exception:
    """A boto3/botocore failure as the store's error of its kind (not found, changed, unusable
    answer, timed out, unavailable)."""
    from botocore.exceptions import (
        ClientError,
        ConnectTimeoutError,
        FlexibleChecksumError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in _NOT_FOUND or status == 404:
            return AdapterNotFoundError(f"{what} does not exist")
        if code == "PreconditionFailed" or status == 412:
            return SourceChangedError(f"{what} changed while downloading; retry")
        if status in (401, 403):
            return SourceResponseError(f"{what}: access denied ({code}); check the replicas' AWS credentials")
        if code in _THROTTLED or status in (429, 503):
            return AdapterFetchError(f"{what}: S3 is throttling ({code or status}); retry later")
        kind = AdapterFetchError if status >= 500 else SourceResponseError
        return kind(f"{what}: S3 error {status} {code}")
    if isinstance(exc, (ReadTimeoutError, ConnectTimeoutError)):
        return SourceTimeoutError(f"{what}: S3 timed out ({exc})")
    if isinstance(exc, FlexibleChecksumError):
        return SourceResponseError(f"{what}: checksum mismatch ({exc}); discarded")
    if isinstance(exc, NoCredentialsError):
        return AdapterFetchError(f"{what}: no AWS credentials found (env, profile, or instance role)")
    return AdapterFetchError(f"{what}: S3 unavailable ({type(exc).__name__}: {exc})")


def client_errors() -> tuple[type[Exception], ...]:
    from botocore.exceptions import BotoCoreError, ClientError

    return ClientError, BotoCoreError, OSError


def etag_is_md5(head: dict) -> bool:
    """Whether the ETag derives from MD5 (of the object, or of its parts): not under SSE-KMS or SSE-C."""
    return not (head.get("ServerSideEncryption", "").startswith("aws:kms") or head.get("SSECustomerAlgorithm"))


def object_info(head: dict) -> ObjectInfo:
    """ObjectInfo from a HeadObject response; only full-object checksums are kept."""
    etag = head.get("ETag", "").strip('"') or None
    composite = head.get("ChecksumType") == "COMPOSITE"
    md5 = etag if etag and _MD5_ETAG.match(etag) and etag_is_md5(head) else None

    def checksum(header: str) -> str | None:
        value = head.get(header)
        return None if composite or not value or "-" in value else b64_to_hex(value)

    meta_sha = head.get("Metadata", {}).get("sha256", "").lower()
    sha256 = checksum("ChecksumSHA256") or (meta_sha if re.fullmatch(r"[0-9a-f]{64}", meta_sha) else None)
    return ObjectInfo(head["ContentLength"], etag, head.get("VersionId"), md5, sha256, checksum("ChecksumCRC32"))


def version_pin(info: ObjectInfo) -> dict:
    """GetObject arguments that read exactly this version: a concurrent re-upload then fails
    (412) instead of mixing contents."""
    return {"VersionId": info.version_id} if info.version_id else {"IfMatch": f'"{info.etag}"'}


class S3Source:
    def __init__(self, uri: S3Uri, client, cache: DiskCache, cfg: S3Config):
        self.loc, self.client, self.cache, self.cfg = uri, client, cache, cfg
        self.uri = str(uri)

    def snapshot(self) -> Snapshot:
        config, config_etag = self._get_config()
        weights = self._head(WEIGHTS_FILE)
        version = version_of("s3", self.uri, config_etag, weights.etag or "", weights.version_id or "")
        return Snapshot(self.uri, config, weights, version)

    def read_weights(self, snap: Snapshot) -> tuple[bytes, str]:
        path = cache_file(self.cache.root, self.loc, snap.version, WEIGHTS_FILE)
        blob = self.cache.read(path, snap.weights)
        if blob is not None:
            return blob, "disk"
        return self.cache.fill(path, snap.weights, lambda sink: self._download(snap.weights, sink)), "s3"

    def list_files(self) -> list[str]:
        """File names directly under this adapter's prefix (never a sibling's: the prefix ends in "/")."""
        return [item["Key"].rsplit("/", 1)[-1] for item in list_under(self.client, self.loc, "Contents")]

    def _what(self, filename: str) -> str:
        return f"s3://{self.loc.bucket}/{self.loc.key(filename)}"

    def _get_config(self) -> tuple[bytes, str]:
        what = self._what(CONFIG_FILE)
        try:
            resp = self.client.get_object(Bucket=self.loc.bucket, Key=self.loc.key(CONFIG_FILE))
            check_config_size(resp["ContentLength"], self.uri)
            return resp["Body"].read(), resp.get("ETag", "")
        except client_errors() as exc:
            err = fetch_error(exc, what)
        if isinstance(err, AdapterNotFoundError):
            raise AdapterNotFoundError(f"no adapter at {self.uri} ({CONFIG_FILE} not found)")
        raise err

    def _head(self, filename: str) -> ObjectInfo:
        try:
            return object_info(
                self.client.head_object(Bucket=self.loc.bucket, Key=self.loc.key(filename), ChecksumMode="ENABLED")
            )
        except client_errors() as exc:
            err = fetch_error(exc, self._what(filename))
        if isinstance(err, AdapterNotFoundError):
            raise missing_weights(self.uri, BIN_FILE in self.list_files())
        raise err

    def _download(self, info: ObjectInfo, sink: VerifyingSink) -> None:
        pin = version_pin(info)
        what, deadline = self._what(WEIGHTS_FILE), time.monotonic() + self.cfg.download_deadline_s
        progress = Progress(what, info.size, self.cfg.progress_every_s)
        try:
            body = self.client.get_object(Bucket=self.loc.bucket, Key=self.loc.key(WEIGHTS_FILE), **pin)["Body"]
            try:
                for chunk in body.iter_chunks(self.cfg.chunk_bytes):
                    sink.write(chunk)
                    progress.update(len(chunk))
                    if time.monotonic() > deadline:
                        raise SourceTimeoutError(f"{what}: download exceeded {self.cfg.download_deadline_s:.0f} s")
            finally:
                body.close()
        except client_errors() as exc:
            raise fetch_error(exc, what) from None


def list_under(client, loc: S3Uri, field: str):
    """ListObjectsV2 entries directly under loc's prefix: objects ("Contents": Key, Size, ETag, …)
    or sub-prefixes ("CommonPrefixes": Prefix)."""
    paginator = client.get_paginator("list_objects_v2")
    try:
        for page in paginator.paginate(Bucket=loc.bucket, Prefix=loc.prefix, Delimiter="/"):
            yield from page.get(field, [])
    except client_errors() as exc:
        raise fetch_error(exc, str(loc)) from None
