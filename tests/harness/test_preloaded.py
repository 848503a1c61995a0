"""Servers and command lines forked from the preloaded interpreter (the suite's): the same process as a fresh
interpreter's, with its own environment, session, output streams and exit code; a start whose environment could
have been read at import gets a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from harness.preloaded import Forked, Preloaded, fork_allowed, run_command
from harness.server import ROOT, Server, ServerProcess, free_port

pytestmark = pytest.mark.skipif(not ServerProcess.preloaded, reason="the suite's servers are not preloaded")


def test_only_variables_read_at_run_time_or_by_libraries_not_loaded_may_differ() -> None:
    base = {"PATH": "/bin", "VIT_DEVICE": "cpu", "HF_HOME": "/a"}
    assert fork_allowed({**base, "VIT_DEVICE": "cuda", "VIT_WORKERS": "2", "OTEL_SDK_DISABLED": "true"}, base, [])
    assert not fork_allowed({**base, "PYTHONPATH": "/elsewhere"}, base, [])
    assert not fork_allowed({**base, "OMP_NUM_THREADS": "4"}, base, [])
    assert not fork_allowed({k: v for k, v in base.items() if k != "PATH"}, base, [])  # removed is changed too
    assert fork_allowed({**base, "HF_HOME": "/b"}, base, ["torch"])
    assert not fork_allowed({**base, "HF_HOME": "/b"}, base, ["torch", "huggingface_hub"])
    assert fork_allowed({**base, "TOKENIZERS_PARALLELISM": "false"}, base, ["torch"])
    assert not fork_allowed({**base, "TOKENIZERS_PARALLELISM": "false"}, base, ["torch", "tokenizers"])


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


def test_a_command_line_is_forked_with_its_own_streams_arguments_and_exit_code(tmp_path: Path) -> None:
    missing = tmp_path / "missing.safetensors"
    with tempfile.TemporaryFile(mode="w+") as out, tempfile.TemporaryFile(mode="w+") as err:
        forked = Preloaded.get().start(
            "model.evaluate", ["--checkpoint", str(missing)], dict(os.environ), ROOT, out, err
        )
        assert forked.wait(timeout=60) == 1  # the command's exit code for what is missing
        out.seek(0)
        err.seek(0)
        assert out.read() == ""
        assert f"checkpoint {missing}: file not found" in err.read()
    helped = run_command([sys.executable, "-m", "model.evaluate", "--help"], check=True)
    assert helped.stdout.startswith("usage: ") and "--checkpoint" in helped.stdout and helped.stderr == ""
    with pytest.raises(subprocess.CalledProcessError):
        run_command([sys.executable, "-m", "model.evaluate", "--checkpoint", str(missing)], check=True)


def test_a_command_past_its_timeout_is_killed_with_its_process_group(tiny_checkpoint: Path) -> None:
    port = free_port()
    env = {**os.environ, "VIT_WEIGHTS": str(tiny_checkpoint), "VIT_DEVICE": "cpu", "VIT_GRPC_PORT": "0"}
    with pytest.raises(subprocess.TimeoutExpired):
        run_command([sys.executable, "-m", "app", "--port", str(port)], env=env, timeout=4)
    with pytest.raises(httpx.TransportError):  # nothing serves there any more
        httpx.get(f"http://127.0.0.1:{port}/health/live", timeout=2)
