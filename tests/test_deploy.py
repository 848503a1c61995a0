"""Deployment files, checked without a Docker engine: the compose files parse and agree with the
Dockerfile and the settings, and the environment the Dockerfile describes really serves predictions."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from app.settings import Settings
from harness.images import encode
from harness.server import free_ports
from model.shapes import make_sample

ROOT = Path(__file__).resolve().parent.parent


class ComposeLoader(yaml.SafeLoader):
    """YAML loader that accepts Compose's !reset and !override tags."""


ComposeLoader.add_constructor("!reset", lambda loader, node: {"__reset__": True})
ComposeLoader.add_constructor("!override", lambda loader, node: loader.construct_mapping(node))  # type: ignore[arg-type]


def compose(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.load((ROOT / name).read_text(), Loader=ComposeLoader)
    return data


class Dockerfile:
    def __init__(self, path: Path) -> None:
        text = re.sub(r"\\\n\s*", " ", path.read_text())  # join continued lines
        self.lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]

    def instructions(self, name: str) -> list[str]:
        return [line.split(None, 1)[1] for line in self.lines if line.split(None, 1)[0].upper() == name]

    def runtime_stage(self) -> list[str]:
        start = max(i for i, line in enumerate(self.lines) if line.upper().startswith("FROM "))
        return self.lines[start:]

    @property
    def cmd(self) -> list[str]:
        cmd: list[str] = json.loads(self.instructions("CMD")[-1])
        return cmd

    @property
    def env(self) -> dict[str, str]:
        pairs = " ".join(self.instructions("ENV"))
        return dict(re.findall(r"(\w+)=(\S+)", pairs))


DOCKERFILE = Dockerfile(ROOT / "Dockerfile")


def test_dockerfile_installs_the_locked_requirements_before_copying_code() -> None:
    runs = DOCKERFILE.instructions("RUN")
    install = next(r for r in runs if "pip install" in r)
    assert "-r /tmp/requirements.lock" in install
    copies = DOCKERFILE.instructions("COPY")
    assert "requirements.lock /tmp/requirements.lock" in copies
    # the code is copied only in the runtime stage, after the dependency stage is complete
    runtime = DOCKERFILE.runtime_stage()
    assert any(line.startswith("COPY --from=deps /opt/venv") for line in runtime)
    assert {"COPY app/ app/", "COPY model/ model/", "COPY weights/ weights/"} <= set(runtime)
    assert "COPY pyproject.toml ./" in runtime  # the version the service reports comes from it
    # CI installs the same lock (bin/venv installs requirements-dev.lock, which includes it)
    assert "-r requirements.lock" in (ROOT / "requirements-dev.lock").read_text()
    assert "requirements-dev.lock" in (ROOT / "bin" / "venv").read_text()


def test_dockerfile_runs_one_worker_as_non_root_with_a_readiness_healthcheck() -> None:
    user = DOCKERFILE.instructions("USER")[-1]
    assert user not in ("root", "0")
    cmd = DOCKERFILE.cmd
    assert cmd[:3] == ["python", "-m", "app"]  # the process's owner: HTTP and gRPC over one engine
    port = cmd[cmd.index("--port") + 1]
    assert DOCKERFILE.instructions("EXPOSE") == [port, str(Settings.model_fields["grpc_port"].default)]
    assert f"127.0.0.1:{port}/health/ready" in DOCKERFILE.instructions("HEALTHCHECK")[0]
    assert DOCKERFILE.env["VIT_WEIGHTS"] == "/srv/weights/vit-shapes.safetensors"
    assert set(DOCKERFILE.instructions("WORKDIR")) == {"/srv"}  # the runtime and ray targets
    assert (ROOT / "weights" / "vit-shapes.safetensors").is_file()


def test_dockerignore_keeps_tests_caches_and_venvs_out() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("**")] == "**"  # everything is excluded unless re-included
    included = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert included == {"requirements.lock", "requirements-ray.lock", "pyproject.toml", "app", "model", "weights"}


def test_compose_service_port_health_gpu_and_settings() -> None:
    service = compose("docker-compose.yml")["services"]["vit"]
    port = DOCKERFILE.cmd[DOCKERFILE.cmd.index("--port") + 1]
    grpc_port = Settings.model_fields["grpc_port"].default
    assert service["ports"] == [f"${{VIT_PORT:-8000}}:{port}", f"${{VIT_GRPC_HOST_PORT:-{grpc_port}}}:{grpc_port}"]
    assert service["build"] == "."
    health = " ".join(service["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/health/ready" in health
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    assert service["restart"] == "unless-stopped"
    grace = int(service["stop_grace_period"].rstrip("s"))
    assert grace > Settings.model_fields["drain_timeout_s"].default  # the joint drain fits before SIGKILL
    # every setting can be overridden from the environment or .env, with the service's own default
    env = service["environment"]
    for name in Settings.model_fields:
        key = f"VIT_{name.upper()}"
        assert key in env, key
        assert env[key].startswith(f"${{{key}:-"), key
    assert any(v.endswith(":/models:ro") for v in service["volumes"])


def test_compose_defaults_match_the_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VIT_ONNX_CACHE")  # the tests' own
    env = compose("docker-compose.yml")["services"]["vit"]["environment"]
    for name, field in Settings.model_fields.items():
        default = re.fullmatch(r"\$\{\w+:-(.*)\}", env[f"VIT_{name.upper()}"]).group(1)  # type: ignore[union-attr]
        if name == "weights":
            assert default == DOCKERFILE.env["VIT_WEIGHTS"]
        elif field.default is None:
            assert default == ""
        else:
            assert Settings(**{name: default} if default else {}).model_dump()[name] == Settings().model_dump()[name]


def test_cpu_override_drops_the_gpu() -> None:
    service = compose("docker-compose.cpu.yml")["services"]["vit"]
    assert service["deploy"] == {"__reset__": True}
    assert service["environment"]["VIT_DEVICE"] == "cpu"


def test_scale_out_pins_one_gpu_per_replica_behind_the_balancer() -> None:
    services = compose("docker-compose.scale.yml")["services"]
    replicas = {k: v for k, v in services.items() if k.startswith("vit-")}
    gpus = [v["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for v in replicas.values()]
    assert sorted(g for ids in gpus for g in ids) == [str(i) for i in range(len(replicas))]
    nginx = (ROOT / "deploy" / "nginx.conf").read_text()
    for name in replicas:
        assert f"server {name}:8000" in nginx
    assert services["lb"]["depends_on"] == {name: {"condition": "service_healthy"} for name in replicas}


def runtime_lock() -> dict[str, str]:
    """The runtime lock's pins: canonical distribution name to version."""
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            name, version = line.split("==")
            pins[canonical(name)] = version.strip()
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def link_runtime_environment(venv: Path) -> None:
    """A fresh virtual environment holding exactly the runtime lock's distributions, as pip installed them
    from that lock into this test environment (the dev lock includes it): their files are hard-linked
    (copied across file systems), so it costs seconds where reinstalling the CUDA wheels costs minutes. A
    runtime dependency missing from the lock fails `pip check` here, or the server's imports below."""
    pins = runtime_lock()
    installed = {canonical(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    versions = {name: dist.version for name, dist in installed.items()}
    wrong = {name: versions.get(name) for name, pin in pins.items() if versions.get(name) != pin}
    assert not wrong, f"this environment does not hold the runtime lock (run bin/venv --dev): {wrong}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv)}))
    for name in pins:
        dist = installed[name]
        for file in dist.files or []:
            if file.parts[0] == "..":
                continue  # console scripts: the image runs `python -m app`
            src = Path(str(dist.locate_file(file)))
            if not src.is_file():
                continue  # a byte-code file RECORD names but was never written
            dest = site / file
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dest)
            except OSError:
                shutil.copy2(src, dest)
    check = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "check"],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.fixture
def venv(tmp_path: Path) -> Iterator[Path]:
    """A folder for a virtual environment, removed afterwards: pytest keeps the last runs' folders."""
    path = tmp_path / "venv"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.e2e
def test_the_image_environment_serves_predictions(tmp_path: Path, venv: Path) -> None:
    """Build what the Dockerfile builds (a venv of its lock, its copied files, its command) and use it."""
    link_runtime_environment(venv)
    srv = tmp_path / "srv"
    for line in DOCKERFILE.runtime_stage():
        if line.startswith("COPY ") and "--from" not in line:
            src, dest = line.split()[1:3]
            if (ROOT / src).is_file():
                (srv / dest).mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / src, srv / dest)
            else:
                shutil.copytree(ROOT / src, srv / dest, ignore=shutil.ignore_patterns("__pycache__", "*.state.pt"))
    port, grpc_port = free_ports(2)
    cmd = list(DOCKERFILE.cmd)
    cmd[cmd.index("--port") + 1] = str(port)
    cmd[cmd.index("--host") + 1] = "127.0.0.1"
    env = {k: v.replace("/srv", str(srv)) for k, v in DOCKERFILE.env.items() if k.startswith(("VIT_", "PYTHON"))}
    env |= {"PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    env["VIT_GRPC_PORT"] = str(grpc_port)  # the image's 8001 may be taken by another server on this machine
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=srv, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "not ready in time"
            time.sleep(0.2)
        sample = make_sample(777, 0)
        r = httpx.post(f"{url}/predict", files={"file": ("s.png", encode(sample.image), "image/png")}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["model"]["name"] == "vit-shapes"
        assert len(r.json()["results"][0]["probabilities"]) == 10
    finally:
        proc.terminate()
        proc.wait(timeout=30)
