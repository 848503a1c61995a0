"""Servers forked from the preloaded `python -m app` (the suite's servers): the same server as a fresh interpreter's,
with its own environment, session, output and exit code; a start whose environment could have been read at
import gets a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from harness.preloaded import Forked, fork_allowed
from harness.server import Server, ServerProcess

pytestmark = pytest.mark.skipif(not ServerProcess.preloaded, reason="the suite's servers are not preloaded")


def test_only_variables_read_at_run_time_or_by_libraries_not_loaded_may_differ() -> None:
    base = {"PATH": "/bin", "VIT_DEVICE": "cpu", "HF_HOME": "/a"}
    assert fork_allowed({**base, "VIT_DEVICE": "cuda", "VIT_WORKERS": "2", "OTEL_SDK_DISABLED": "true"}, base, [])
    assert not fork_allowed({**base, "PYTHONPATH": "/elsewhere"}, base, [])
    assert not fork_allowed({**base, "OMP_NUM_THREADS": "4"}, base, [])
    assert not fork_allowed({k: v for k, v in base.items() if k != "PATH"}, base, [])  # removed is changed too
    assert fork_allowed({**base, "HF_HOME": "/b"}, base, ["torch"])
    assert not fork_allowed({**base, "HF_HOME": "/b"}, base, ["torch", "huggingface_hub"])


def test_a_forked_server_serves_with_its_own_settings_session_output_and_exit_code(tiny_checkpoint: Path) -> None:
    with Server(tiny_checkpoint, VIT_MODELS=f"forked={tiny_checkpoint}") as server:
        assert isinstance(server.proc, Forked)
        assert os.getsid(server.proc.pid) == server.proc.pid  # its own session: stopped with its process group
        assert [m["name"] for m in httpx.get(f"{server.url}/v1/models").json()["models"]] == ["forked"]
        assert server.proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            server.proc.wait(timeout=0.1)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0  # drained and stopped, as `python -m app` exits on SIGTERM
        output = server.stop()
    assert "ready: HTTP on 127.0.0.1" in output and "stopped" in output


def test_a_start_that_fails_says_why_with_the_interpreters_exit_code(tiny_checkpoint: Path) -> None:
    server = Server(tiny_checkpoint, VIT_MAX_BATCH_SIZE="none")
    assert isinstance(server.proc, Forked)
    with pytest.raises(RuntimeError, match="server exited early") as failed:
        server.__enter__()
    assert "VIT_MAX_BATCH_SIZE" in str(failed.value)
    assert server.proc.returncode == 3  # the service's exit code for a start that failed


def test_an_environment_read_at_import_gets_a_fresh_interpreter(tiny_checkpoint: Path) -> None:
    with Server(tiny_checkpoint, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1") as server:
        assert isinstance(server.proc, subprocess.Popen)
        assert httpx.get(f"{server.url}/health/ready").status_code == 200
