"""The import rules between the packages: one way, no cycles.

Two checks. Reading every module's imports (at any depth, lazy ones included), each module belongs to its
room (the longest entry of ROOMS its name starts with), and each room imports only the rooms MAY_IMPORT
lists; the rooms' graph has no cycle. And, importing each package's every module in a fresh child process,
the core loads no codec, edge, grpcio or web framework, the codecs no edge, `model/` nothing from `app/`.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from harness.server import ROOT

pytestmark = pytest.mark.slow  # imports every package in a fresh child process

WEB_FRAMEWORKS = ("fastapi", "starlette", "uvicorn", "multipart", "python_multipart", "httptools")
EDGES = ("app.web", "app.grpc", "app.batch", "app.server", "app.serving", "app.workers", "app.main")

# The rooms, each a package or a module standing alone, and what each may import, the layers below it.
# The path of an image: an edge -> the contract -> the data plane -> the engine -> the batcher -> images ->
# backends; telemetry beside every layer; the serving processes as one room over them all.
BASE = {"app", "app.choices", "app.settings"}  # the version, the closed choices, the settings object
MAY_IMPORT: dict[str, set[str]] = {
    "app": set(),
    "app.choices": set(),
    "app.settings": {"app.choices"},
    "app.telemetry": BASE,
    "app.core.contract": BASE | {"app.telemetry"},
    "app.core.images": BASE | {"app.telemetry", "app.core.contract"},
    "app.core.backends": BASE | {"app.telemetry", "app.core.contract", "app.core.images"},
    "app.core.batching": BASE | {"app.telemetry", "app.core.contract"},
    "app.core.data_plane": BASE | {"app.telemetry", "app.core.contract"},
    "app.core.loading_plane": BASE | {"app.telemetry", "app.core.contract", "app.core.data_plane"},
    "app.core.engine": BASE
    | {"app.telemetry", "app.core.contract", "app.core.images", "app.core.backends", "app.core.batching"}
    | {"app.core.data_plane"},
    "app.codecs": BASE | {"app.telemetry", "app.core.contract"},
    # the edges: the contract and the data plane they call, and the engine where one is built (the batch runner,
    # the Ray job, whose decode tasks also use the images' pure functions)
    "app.web": BASE | {"app.telemetry", "app.core.contract", "app.core.data_plane", "app.codecs"},
    "app.grpc": BASE | {"app.telemetry", "app.core.contract", "app.core.data_plane", "app.codecs"},
    "app.batch": BASE
    | {"app.telemetry", "app.core.contract", "app.core.data_plane", "app.codecs", "app.core.engine", "app.core.images"},
    "app.quantize": BASE | {"app.core.contract", "app.core.images", "app.core.backends", "app.batch"},
    "app.startup": BASE | {"app.telemetry"},
    "app.listen": BASE,
    "app.serving": BASE | {"app.telemetry", "app.core.data_plane", "app.web", "app.grpc", "app.listen"},
    "app.workers": BASE
    | {"app.telemetry", "app.core.contract", "app.core.data_plane", "app.core.images", "app.core.engine"}
    | {"app.serving", "app.startup", "app.listen"},
    "app.server": BASE
    | {"app.telemetry", "app.core.engine", "app.core.loading_plane", "app.serving", "app.workers", "app.startup"},
    "app.main": {"app.server"},
    "app.__main__": {"app.server", "app.startup", "app.listen"},
}
ROOMS = sorted(MAY_IMPORT, key=len, reverse=True)


def room(module: str) -> str | None:
    """The room `module` belongs to (None: outside app)."""
    return next((r for r in ROOMS if module == r or module.startswith(r + ".")), None)


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def app_imports(path: Path) -> set[str]:
    """The app modules a source file imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found |= {n for n in names if n == "app" or n.startswith("app.")}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("app.")}
    return found


def room_graph(root: Path) -> dict[str, set[str]]:
    """For each room: the other rooms its modules import."""
    graph: dict[str, set[str]] = {r: set() for r in MAY_IMPORT}
    for path in sorted((root / "app").rglob("*.py")):
        if "proto" in path.parts and path.name.endswith("_pb2.py"):
            continue  # generated
        mine = room(module_name(path, root))
        assert mine is not None, f"{path} is in no room of MAY_IMPORT: add its package there"
        for imported in app_imports(path):
            theirs = room(imported)
            if theirs is not None and theirs != mine and not (theirs == "app" and imported != "app"):
                graph[mine].add(theirs)
    return graph


def test_every_room_imports_only_the_layers_below_it() -> None:
    wrong = {r: sorted(used - MAY_IMPORT[r]) for r, used in room_graph(ROOT).items() if used - MAY_IMPORT[r]}
    assert wrong == {}


def test_the_rooms_have_no_cycle() -> None:
    try:
        list(TopologicalSorter(room_graph(ROOT)).static_order())
    except CycleError as e:
        pytest.fail(f"an import cycle between rooms: {e.args[1]}")


def test_the_room_rules_can_fail(tmp_path: Path) -> None:
    """A copy of app/ where the contract imports the engine breaks both rules."""
    subprocess.run(["cp", "-r", str(ROOT / "app"), str(tmp_path / "app")], check=True)
    contract = tmp_path / "app" / "core" / "contract" / "request.py"
    contract.write_text(contract.read_text() + "\nfrom app.core.engine.engine import Engine  # noqa\n")
    graph = room_graph(tmp_path)
    assert "app.core.engine" in graph["app.core.contract"] - MAY_IMPORT["app.core.contract"]
    with pytest.raises(CycleError):
        list(TopologicalSorter(graph).static_order())


PROBED = ("app.core", "app.telemetry", "app.codecs", "app.batch", "model", "app.web.app")
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
    assert under(core, "app.core.engine.engine", "app.core.contract.inference"), "the probe imported the core"
    assert under(core, "app.codecs", *EDGES, "grpc", *WEB_FRAMEWORKS) == []


def test_telemetry_imports_no_layer_and_no_web_framework(loaded: dict[str, list[str]]) -> None:
    telemetry = loaded["app.telemetry"]
    assert under(telemetry, "app.telemetry.tracing", "app.telemetry.metrics")
    assert under(telemetry, "app.core", "app.codecs", *EDGES, "grpc", *WEB_FRAMEWORKS) == []


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


def test_bench_evaluation_and_tests_share_only_the_harness() -> None:
    tools = ("bench", "evaluation", "tests")
    for tool in tools:
        assert set(tools).isdisjoint(imported_packages(ROOT / tool) - {tool})
        assert "harness" in imported_packages(ROOT / tool)
    assert set(tools).isdisjoint(imported_packages(ROOT / "harness"))


def model_graph(root: Path) -> dict[str, set[str]]:
    """For each module of model/ (a package's __main__ apart from the package): the model modules it imports,
    at any depth of the file."""
    files = {
        module_name(p, root) + (".__main__" if p.name == "__main__.py" else ""): p
        for p in (root / "model").rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                candidates = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            imported |= {c for c in candidates if c in files and c != name}
        graph[name] = imported
    return graph


def test_model_has_no_import_cycle(tmp_path: Path) -> None:
    try:
        list(TopologicalSorter(model_graph(ROOT)).static_order())
    except CycleError as e:
        pytest.fail(f"an import cycle in model/: {e.args[1]}")
    # and the check can fail: two modules that import each other
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a.py").write_text("from model.b import x\n")
    (tmp_path / "model" / "b.py").write_text("def f():\n    from model.a import y\n")
    with pytest.raises(CycleError):
        list(TopologicalSorter(model_graph(tmp_path)).static_order())
