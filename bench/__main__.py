"""Every benchmark from one command: `python -m bench` lists them, `python -m bench SCENARIO [ARGS]` runs one.

    python -m bench                                   # the scenarios, each with what it measures
    python -m bench run --duration 5 --name cpu       # the same as python -m bench.run --duration 5 --name cpu
    python -m bench compare.engine_cost --trees . /tmp/before
    python -m bench gpu --report results --name gpu-h200

A scenario is a module of `bench/` (or of `bench/compare/`, as `compare.NAME`) that runs as a command, or a package
of `bench/` with a `__main__.py` (the GPU parts, `gpu`; the peer servers side by side, `peers`); hyphens stand for
underscores (`stand-in`). Its arguments and results are its own, as documented in
docs/performance.md; this entry only finds it and runs it as `python -m bench.SCENARIO` would.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def scenarios() -> dict[str, str]:
    """Each scenario's name and the first line of its docstring, read without importing it."""
    found: dict[str, str] = {}
    for path in sorted([*HERE.glob("*.py"), *HERE.glob("compare/*.py"), *HERE.glob("*/__main__.py")]):
        text = path.read_text()
        if path.name != "__main__.py" and '__name__ == "__main__"' not in text:
            continue
        package = path.name == "__main__.py" and path.parent != HERE
        name = path.parent.name if package else path.relative_to(HERE).with_suffix("").as_posix().replace("/", ".")
        if name == "__main__":
            continue
        described = path.with_name("__init__.py") if package else path  # the package says what it measures
        doc = ast.get_docstring(ast.parse(described.read_text())) or ""
        found[name] = doc.strip().split("\n\n")[0].replace("\n", " ")
    return found


def main() -> None:
    known = scenarios()
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        width = max(map(len, known))
        print(__doc__.split("\n\n")[0] + "\n")
        for name, summary in known.items():
            print(f"  {name:<{width}}  {summary}")
        return
    name = sys.argv[1].replace("-", "_")
    if name not in known:
        sys.exit(f"python -m bench: no scenario {sys.argv[1]!r}; there are: {', '.join(known)}")
    sys.argv = [f"python -m bench.{name}", *sys.argv[2:]]
    runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
