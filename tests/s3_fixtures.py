"""S3 test fixtures: a real S3 protocol server on 127.0.0.1 (moto), a fault-injecting
HTTP proxy in front of it, and tiny PEFT adapters written straight to safetensors
(PEFT's own save is ~0.5 s per adapter: too slow for hundreds).

Import the fixtures into a test module: ``from tests.s3_fixtures import s3, shape``.
"""
from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from adapters_store.peft_weights import ModelShape

WEIGHTS = "adapter_model.safetensors"
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}


# -- adapters ---------------------------------------------------------------------------------------
def write_adapter(out: Path, shape: ModelShape, rank: int = 2, targets=("q_proj", "v_proj"), seed: int = 0,
                  alpha: float | None = None) -> Path:
    """A PEFT LoRA directory with random A [r, in] and B [out, r] for every layer and target."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for layer in range(shape.num_layers):
        for m in targets:
            d_in, d_out = shape.dims[m]
            group = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{m}"
            state[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen)
            state[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / WEIGHTS))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "target_modules": list(targets),
              "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def upload_dir(client, bucket: str, prefix: str, local: Path) -> str:
    """Upload a PEFT directory's files to s3://bucket/prefix/ and return that URI."""
    for f in sorted(local.iterdir()):
        if f.is_file():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes())
    return f"s3://{bucket}/{prefix}/"


def assert_same_weights(got, want) -> None:
    assert got.manifest == want.manifest
    assert set(got.tensors) == set(want.tensors)
    for where, (a, b) in want.tensors.items():
        assert torch.equal(got.tensors[where][0], a) and torch.equal(got.tensors[where][1], b), where


# -- fault proxy ------------------------------------------------------------------------------------
@dataclass
class Fault:
    """kind: "status" (an S3 error reply), "reset" (RST mid-body), "corrupt" (a flipped byte),
    "truncate" (short body, honest length), "slow" (no reply for delay_s), "stall" (half the body,
    then nothing for delay_s), "pass" (no fault: just run `before`). times: how many matching
    requests get it (None: all). before: called before the request is forwarded."""

    kind: str
    status: int = 500
    code: str = "InternalError"
    delay_s: float = 0.0
    times: int | None = None
    before: Callable[[], None] | None = None


@dataclass
class ProxyState:
    upstream: tuple[str, int]
    fault: Fault | None = None
    requests: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, method: str, path: str) -> Fault | None:
        """Record the request; the fault it gets (only GETs of adapter weights are faulted)."""
        with self.lock:
            self.requests.append((method, path))
            fault = self.fault
            if fault is None or method != "GET" or not path.split("?")[0].endswith(WEIGHTS):
                return None
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    self.fault = None
            return fault

    def count(self, method: str, suffix: str) -> int:
        with self.lock:
            return sum(1 for m, p in self.requests if m == method and p.split("?")[0].endswith(suffix))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: ProxyState

    def setup(self):
        super().setup()
        # Headers and body go out in separate writes: without this, Nagle + delayed ACK add ~40 ms each.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self._proxy()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _proxy(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
        fault = self.state.take(self.command, self.path)
        if fault and fault.kind == "status":
            return self._error(fault)
        if fault and fault.before:
            fault.before()
        if fault and fault.kind == "slow":
            time.sleep(fault.delay_s)
        status, headers, data, length = self._forward(body)
        if fault and fault.kind == "corrupt":
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
        if fault and fault.kind == "truncate":
            data = data[: len(data) // 2]
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        # A HEAD reply has no body but must carry the object's length.
        self.send_header("Content-Length", length if self.command == "HEAD" else str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault and fault.kind in ("reset", "stall"):
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            if fault.kind == "stall":
                time.sleep(fault.delay_s)
            # SO_LINGER 0: close() sends a TCP RST, as a crashed server or middlebox would.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        self.wfile.write(data)

    def _forward(self, body: bytes):
        conn = http.client.HTTPConnection(*self.state.upstream, timeout=30)
        try:
            conn.request(self.command, self.path, body=body or None, headers=dict(self.headers.items()))
            resp = conn.getresponse()
            data = resp.read()
            headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_HEADERS]
            return resp.status, headers, data, resp.getheader("Content-Length", "0")
        finally:
            conn.close()

    def _error(self, fault: Fault):
        data = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{fault.code}</Code>"
                f"<Message>injected</Message></Error>").encode()
        self.send_response(fault.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a client that timed out and left: expected here
        pass


class FaultProxy:
    def __init__(self, upstream_port: int):
        self.state = ProxyState(("127.0.0.1", upstream_port))
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.server = _QuietServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def store_config(endpoint_url: str, root: Path, **overrides):
    """A store config for the S3 server at endpoint_url (usually the fault proxy), test-sized timeouts."""
    from adapters_store.disk_cache import DiskCacheConfig
    from adapters_store.s3_source import S3Config
    from adapters_store.store import StoreConfig

    s3_cfg = S3Config(endpoint_url=endpoint_url, connect_timeout_s=1.0, read_timeout_s=1.0, max_attempts=2)
    return StoreConfig(**{"max_rank": 16, "disk": DiskCacheConfig(root / "cache"), "s3": s3_cfg, **overrides})


# -- fixtures ---------------------------------------------------------------------------------------
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
        import boto3

        endpoint = f"http://127.0.0.1:{port}"
        try:
            yield S3Env(endpoint, proxy, boto3.client("s3", endpoint_url=endpoint))
        finally:
            proxy.close()
            server.stop()


# The shape of tests.helpers.make_tiny_llama (hidden 64, 8 heads, 2 KV heads, MLP 160, 3 layers), written
# out so that store tests need no model (test_store_s3 checks it against the real config).
TINY_SHAPE = ModelShape(3, {"q_proj": (64, 64), "k_proj": (64, 16), "v_proj": (64, 16), "o_proj": (64, 64),
                            "gate_proj": (64, 160), "up_proj": (64, 160), "down_proj": (160, 64)})


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return TINY_SHAPE
