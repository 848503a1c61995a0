"""`bin/serve`, the README's command: the port it listens on comes from its arguments, PORT or VIT_PORT."""

from __future__ import annotations

import httpx
import pytest

from harness.server import ROOT, ServerProcess, free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.mark.parametrize("how", ["VIT_PORT", "PORT", "--port"])
def test_bin_serve_listens_where_it_is_told(how: str) -> None:
    port = free_port()
    env = {"HOST": "127.0.0.1", "VIT_GRPC_PORT": "0", "VIT_PORT": "1", "PORT": ""}  # PORT comes before VIT_PORT
    argv = [str(ROOT / "bin" / "serve")]
    if how == "--port":
        argv += ["--port", str(port)]
        env.pop("VIT_PORT")
    elif how == "PORT":
        env["PORT"] = str(port)
    else:
        env["VIT_PORT"] = str(port)
        env.pop("PORT")
    with ServerProcess(argv, env, port) as server:  # ready on that port, or it fails
        assert httpx.get(f"{server.url}/v1/model", timeout=10).json()["name"] == "vit-shapes"
