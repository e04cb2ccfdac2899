"""`serve run app.builder:build_app key=value …` — Ray's own builder arguments, as a user types them
(every value reaches the builder as text) — brings the default app up with the args typed as in
serve_config.yaml; the replica logs the KV cache it sized; Ctrl-C stops it."""

import os
import shutil
import signal

import httpx
import pytest

from app.model.default import DEFAULT_MODEL_NAME as BASE
from tests.support.app_fixtures import (
    example_adapter_names,
    healthy,
    port_open,
    release_shared,
    start_serve_cli,
    wait_for,
)

pytestmark = pytest.mark.serve  # starts the `serve` CLI in a subprocess

COMMAND = "serve run app.builder:build_app model=null device=cpu max_batch_size=8 adapter_dirs=examples/adapters"
PORT = 8000  # Serve's default http_options.port (an import path has no config file to set it)


def test_key_value_builder_args_start_the_default_app(tmp_path):
    assert shutil.which("serve"), "Ray's `serve` command is not on PATH (scripts/setup.sh installs it)"
    release_shared()  # the command starts a Ray of its own
    if port_open(PORT):
        pytest.fail(f"port {PORT} is taken: cannot run `{COMMAND}`")
    log = tmp_path / "serve.log"
    proc = start_serve_cli(COMMAND, log)
    url = f"http://127.0.0.1:{PORT}"
    try:
        up = wait_for(
            lambda: healthy(url) or proc.poll() is not None or "failed with exception" in log.read_text(),
            timeout=420,
            interval=1,
        )
        assert up and healthy(url), log.read_text()[-5000:]
        models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [BASE, *example_adapter_names()]  # adapter_dirs was read as a list
        reply = httpx.post(
            f"{url}/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": 2}, timeout=120
        ).json()
        assert reply["usage"]["completion_tokens"] >= 1
        # the replica logs the KV cache it holds (on the CPU: the number given)
        assert wait_for(lambda: "KV cache (explicit): 512 blocks x 16 tokens" in log.read_text(), timeout=30), (
            log.read_text()[-3000:]
        )
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        assert wait_for(lambda: not port_open(PORT), timeout=30), "the endpoint is still up"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
