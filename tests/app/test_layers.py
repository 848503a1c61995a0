"""The import rules between the layers: the serving core, the codecs and the batch edge import no web framework."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.server import ROOT

WEB_FRAMEWORKS = ("fastapi", "starlette", "uvicorn", "multipart", "python_multipart", "httptools")


@pytest.mark.parametrize("package", ["app.core", "app.codecs", "app.batch"])
def test_imports_no_web_framework(package: str) -> None:
    """Every module of the package, imported in a fresh interpreter, leaves no web framework in sys.modules."""
    code = (
        f"import importlib, pkgutil, sys, {package} as p\n"
        f"names = [m.name for m in pkgutil.iter_modules(p.__path__)]\n"
        f"for name in names: importlib.import_module('{package}.' + name)\n"
        f"print(len(names), sorted(m for m in sys.modules if m.split('.')[0] in {WEB_FRAMEWORKS!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    count, imported = out.stdout.strip().split(" ", 1)
    assert int(count) >= 2 and imported == "[]", f"{package} pulled in: {imported}"


def test_the_web_edge_does_import_fastapi() -> None:
    """The check above can fail: the same probe sees FastAPI when the edge is imported."""
    code = "import sys, app.web.app; print('fastapi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
