"""Where the adapter registry keeps its state between restarts: a local JSON file or
one ``s3://bucket/key`` object, rewritten whole on every change.

Each write is atomic, so a crash mid-write leaves the previous state readable: a local
file is written next to its target, fsync'ed and renamed over it (``os.replace``); an
S3 PUT replaces the object at once by S3's own semantics. The state is JSON (never a
pickle): ``{"epoch": int, "adapters": {name: {"path", "version"}}, "removed": [name]}``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

FORMAT = 1


class RegistryStoreError(RuntimeError):
    pass


class LocalFile:
    def __init__(self, path: str):
        self.path = Path(path).expanduser().absolute()

    def load(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None

    def save(self, state: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class S3Object:
    """boto3's usual chain for credentials, region and endpoint (AWS_ENDPOINT_URL, …)."""

    def __init__(self, uri: str):
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        if not bucket or not key or key.endswith("/"):
            raise RegistryStoreError(f"registry_path {uri!r} must name an object: s3://bucket/key.json")
        self.bucket, self.key, self._client = bucket, key, None

    def _s3(self):
        if self._client is None:
            from botocore.handlers import add_expect_header

            from adapters_store.s3_source import S3Config, make_client

            self._client = make_client(S3Config())
            # No `Expect: 100-continue` on the PUT (a few hundred bytes): a server may answer it twice
            # (moto's does), and botocore then reads the second answer as the PUT's and closes the
            # connection (ConnectionClosedError).
            self._client.meta.events.unregister("before-call.s3", add_expect_header)
        return self._client

    def load(self) -> dict | None:
        try:
            body = self._s3().get_object(Bucket=self.bucket, Key=self.key)["Body"].read()
        except self._s3().exceptions.NoSuchKey:
            return None
        return json.loads(body)

    def save(self, state: dict) -> None:
        body = json.dumps(state, indent=1, sort_keys=True).encode()
        self._s3().put_object(Bucket=self.bucket, Key=self.key, Body=body, ContentType="application/json")


def open_store(location: str | None) -> LocalFile | S3Object | None:
    if not location:
        return None
    return S3Object(location) if location.startswith("s3://") else LocalFile(location)
