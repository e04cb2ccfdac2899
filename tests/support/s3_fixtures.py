"""S3 test fixtures for the adapter-store tests: a real S3 protocol server on 127.0.0.1 (moto's
ThreadedMotoServer) with the fault proxy (tests/support/fault_proxy.py) in front of it.

Test modules load them with ``pytest_plugins = ["tests.support.s3_fixtures"]`` (and never import this
module themselves, so pytest can rewrite its asserts).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from adapters_store.peft_weights import ModelShape
from tests.support.fault_proxy import FaultProxy
from tests.support.store_helpers import TINY_SHAPE, upload_client


@dataclass
class S3Env:
    endpoint: str  # moto, directly (used to upload)
    proxy: FaultProxy  # the store talks to S3 through this
    client: object  # boto3 client straight to moto

    def bucket(self, name: str) -> str:
        self.client.create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        # Fake credentials; no machine-wide AWS config may leak in.
        for var in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            mp.delenv(var, raising=False)
        none = tmp_path_factory.mktemp("aws") / "none"
        mp.setenv("AWS_CONFIG_FILE", str(none))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(none))
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        port = server.get_host_and_port()[1]
        proxy = FaultProxy(port)
        endpoint = f"http://127.0.0.1:{port}"
        try:
            yield S3Env(endpoint, proxy, upload_client(endpoint))
        finally:
            proxy.close()
            server.stop()


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return TINY_SHAPE
