"""The import rules between the layers, each checked on every module of a package in a fresh child process.

- the core imports no codec, edge, grpcio or web framework;
- the codecs import no edge;
- the edges (web, gRPC, batch) reach the core only through the data plane and its types;
- `model/` imports nothing from `app/`.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.server import ROOT

pytestmark = pytest.mark.slow  # imports every package in a fresh child process

WEB_FRAMEWORKS = ("fastapi", "starlette", "uvicorn", "multipart", "python_multipart", "httptools")
EDGES = ("app.web", "app.grpc", "app.batch", "app.server", "app.supervisor", "app.main")
# What an edge may import from the core: the data plane and the types that cross it; the engine for
# the edges that build one (the batch runner and the Ray job); pure image functions for Ray's decode tasks.
EDGE_MAY_IMPORT = {
    "app.core.data_plane",
    "app.core.description",
    "app.core.errors",
    "app.core.request",
    "app.core.metrics",
}
BUILDS_ENGINE = {"app.batch.__main__", "app.batch.ray_job", "app.server", "app.supervisor"}
# What the process owners build for VIT_WORKERS > 1: the engine served to front-ends, a data plane over it.
SERVING_PROCESSES = {
    "app.server": {"app.core.remote"},
    "app.supervisor": {"app.core.engine_host", "app.core.remote", "app.core.shared_memory"},
}
RAY_DECODE = {"app.core.decode", "app.core.preprocess"}


PROBED = ("app.core", "app.codecs", "app.batch", "model", "app.web.app")
# Every layer imports these; the probe loads them once, before it forks a fresh child per package.
SHARED_BY_ALL = ("numpy", "PIL.Image", "safetensors.torch", "torch")
PROBE = """
import importlib, json, os, pkgutil, sys, traceback
for name in {shared!r}:
    importlib.import_module(name)
before = set(sys.modules)
found = {{}}
for package in {packages!r}:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: import every module of the package, send what sys.modules then holds
        os.close(read)
        try:
            p = importlib.import_module(package)
            for m in pkgutil.walk_packages(getattr(p, "__path__", []), p.__name__ + "."):
                importlib.import_module(m.name)
            with os.fdopen(write, "wb") as pipe:
                pipe.write(json.dumps(sorted(sys.modules)).encode())
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        sent = pipe.read()
    assert os.waitpid(pid, 0)[1] == 0, package
    found[package] = json.loads(sent)
assert set(sys.modules) == before, "the probe itself imported more than the shared modules"
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[str]]:
    """For each probed package: every module in sys.modules after importing each module of the package in a
    fresh child of one interpreter that has loaded only Python itself and SHARED_BY_ALL (none of which is a layer,
    a codec, grpcio or a web framework)."""
    code = PROBE.format(shared=SHARED_BY_ALL, packages=PROBED)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    found: dict[str, list[str]] = json.loads(out.stdout)
    return found


def under(modules: list[str], *prefixes: str) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)]


def test_the_core_imports_no_codec_edge_grpc_or_web_framework(loaded: dict[str, list[str]]) -> None:
    core = loaded["app.core"]
    assert under(core, "app.core.engine", "app.core.data_plane"), "the probe imported the core"
    assert under(core, "app.codecs", *EDGES, "grpc", *WEB_FRAMEWORKS) == []


def test_codecs_import_no_edge_and_no_web_framework(loaded: dict[str, list[str]]) -> None:
    codecs = loaded["app.codecs"]
    assert under(codecs, "app.codecs.v2_grpc", "app.codecs.proto.messages_pb2")
    assert under(codecs, *EDGES, *WEB_FRAMEWORKS) == []


def test_the_batch_edge_imports_no_web_framework(loaded: dict[str, list[str]]) -> None:
    assert under(loaded["app.batch"], *WEB_FRAMEWORKS, "app.web", "app.grpc") == []


def test_model_imports_nothing_from_app(loaded: dict[str, list[str]]) -> None:
    assert under(loaded["model"], "app") == []


def test_the_probe_can_fail(loaded: dict[str, list[str]]) -> None:
    """The same probe sees FastAPI when the web edge is imported, and each package in a child of its own."""
    assert "fastapi" in loaded["app.web.app"]
    assert under(loaded["model"], "app") == [] and under(loaded["app.core"], "app.core")


def core_imports(path: Path) -> set[str]:
    """The app.core modules a source file imports (at any depth of the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("app.core"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("app.core")}
    return found


EDGE_FILES = [
    *sorted(path for folder in ("web", "grpc", "batch") for path in (ROOT / "app" / folder).glob("*.py")),
    ROOT / "app" / "server.py",
    ROOT / "app" / "supervisor.py",
    ROOT / "app" / "main.py",
]


@pytest.mark.parametrize("path", EDGE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_edges_reach_the_core_only_through_the_data_plane(path: Path) -> None:
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    allowed = set(EDGE_MAY_IMPORT)
    if module in BUILDS_ENGINE:
        allowed.add("app.core.engine")
    if module == "app.batch.ray_job":
        allowed |= RAY_DECODE
    allowed |= SERVING_PROCESSES.get(module, set())
    assert core_imports(path) <= allowed, f"{module} imports {sorted(core_imports(path) - allowed)}"


def test_the_edge_rule_can_fail() -> None:
    assert core_imports(ROOT / "app" / "core" / "engine.py") > EDGE_MAY_IMPORT - {"app.core.metrics"}


def imported_packages(folder: Path) -> set[str]:
    """The top-level packages the Python files under `folder` import."""
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
    return found


def test_bench_and_tests_share_only_the_harness() -> None:
    assert "bench" not in imported_packages(ROOT / "tests")
    assert "tests" not in imported_packages(ROOT / "bench")
    assert {"bench", "tests"}.isdisjoint(imported_packages(ROOT / "harness"))
    assert "harness" in imported_packages(ROOT / "tests") and "harness" in imported_packages(ROOT / "bench")
