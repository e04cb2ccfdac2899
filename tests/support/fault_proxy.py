"""A fault-injecting HTTP proxy in front of an S3 server, for the adapter-store tests: S3 error
replies, connection resets and stalls mid-body, corrupt or truncated bodies, slow replies."""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WEIGHTS = "adapter_model.safetensors"
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}


@dataclass
class Fault:
    """kind: "status" (an S3 error reply), "reset" (RST mid-body), "corrupt" (a flipped byte),
    "truncate" (short body, honest length), "slow" (no reply for delay_s), "stall" (half the body,
    then nothing for delay_s), "pass" (no fault: just run `before`). times: how many matching
    requests get it (None: all). before: called before the request is forwarded. suffix: GETs of
    paths ending in it are faulted (default: adapter weights)."""

    kind: str
    status: int = 500
    code: str = "InternalError"
    delay_s: float = 0.0
    times: int | None = None
    before: Callable[[], None] | None = None
    suffix: str = WEIGHTS


@dataclass
class ProxyState:
    upstream: tuple[str, int]
    fault: Fault | None = None
    requests: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, method: str, path: str) -> Fault | None:
        """Record the request; the fault it gets (only GETs of fault.suffix, adapter weights by default)."""
        with self.lock:
            self.requests.append((method, path))
            fault = self.fault
            if fault is None or method != "GET" or not path.split("?")[0].endswith(fault.suffix):
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
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :]
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
        data = (
            f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{fault.code}</Code><Message>injected</Message></Error>"
        ).encode()
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
