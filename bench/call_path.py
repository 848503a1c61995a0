"""The file boundaries one request crosses in `app/`, counted from the calls it makes, in every serving process.

    python -m bench.call_path --trees . /tmp/before

Each tree serves its bundled checkpoint with `VIT_WORKERS=2` (two front-ends and the engine process) and one
more process-wide profile hook (`sys.setprofile`, from a `sitecustomize` module put first on its path). After
two warm-up requests of each kind, each round clears what the hooks saw, sends one request (a `/predict` with
one JPEG, or a V2 `infer` with one), and collects them. A call counts where a function of one file of `app/`
calls a function of another, directly or through library code (FastAPI dispatching to a route, say); a call
the event loop makes (a callback, a task's step) counts as a deferred call into its file, and one a thread of a
pool or of the batcher starts, as a call from that thread. What every round saw
and no idle window of the same length (one after each round) saw is the figure, so heartbeats and polls are
left out: the distinct calls that cross
from one file to another (a caller and a callee), the deferred ones among them, and the files they touch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.common import write_results
from harness.cpu import children
from harness.images import encode
from harness.records import commit, table
from harness.server import Server
from model.shapes import make_sample

HOOK = """
import os, signal, sys, threading, json
_root = os.environ["CALL_PATH_APP"]
_edges = set()
_on = [False]
_loop_files = ("/asyncio/events.py", "/asyncio/base_events.py")


def _rel(path):
    return path[len(_root) - len("app/"):]


_outer = set()  # the frames that run the event loop (or wait in it): a call from one is a deferred call


def _profile(frame, event, arg):
    if not _on[0] or event != "call":
        return
    callee = frame.f_code.co_filename
    if not callee.startswith(_root):
        return
    caller = frame.f_back
    while caller is not None and not caller.f_code.co_filename.startswith(_root):
        caller = caller.f_back
    if caller is None:
        _edges.add(("<thread>", "", _rel(callee), frame.f_code.co_name))
    elif caller.f_code in _outer:
        _edges.add(("<event loop>", "", _rel(callee), frame.f_code.co_name))
    elif caller.f_code.co_filename != callee:
        _edges.add((_rel(caller.f_code.co_filename), caller.f_code.co_name, _rel(callee), frame.f_code.co_name))


def _start(signum, frame):
    _edges.clear()
    _outer.clear()
    outer = frame.f_back  # the signal handler runs on top of what the main thread was doing: waiting in the loop
    while outer is not None:
        _outer.add(outer.f_code)
        outer = outer.f_back
    _on[0] = True


def _dump(signum, frame):
    _on[0] = False
    path = os.path.join(os.environ["CALL_PATH_OUT"], f"{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump(sorted(_edges), f)


sys.setprofile(_profile)
threading.setprofile(_profile)
signal.signal(signal.SIGUSR1, _start)
signal.signal(signal.SIGUSR2, _dump)
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.call_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", type=Path, nargs="+", default=[Path(".")], help="checkouts to compare")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--list", action="store_true", help="print each crossing call")
    p.add_argument("--name", default="call-path", help="results file name (bench/results/<name>.json and .md)")
    return p.parse_args()


def v2_body(jpeg: bytes) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(
        {
            "inputs": [
                {"name": "image", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": len(jpeg) + 4}}
            ],
            "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}}],
        }
    ).encode()
    body = header + len(jpeg).to_bytes(4, "little") + jpeg
    return body, {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}


def send(url: str, route: str, jpeg: bytes) -> None:
    if route == "predict":
        r = httpx.post(f"{url}/predict", files={"file": ("a.jpg", jpeg, "image/jpeg")}, timeout=30)
    else:
        body, headers = v2_body(jpeg)
        r = httpx.post(f"{url}/v2/models/vit-shapes/infer", content=body, headers=headers, timeout=30)
    r.raise_for_status()


def serving_pids(server: Server) -> list[int]:
    """Every process of the server but the supervisor's helpers that run no app code (all are signalled)."""
    return [server.proc.pid, *children(server.proc.pid)]


def window(server: Server, out: str, act: Callable[[], None]) -> set[tuple[str, ...]]:
    """The calls every serving process made while `act` ran (and a moment either side)."""
    pids = serving_pids(server)
    for f in Path(out).glob("*.json"):
        f.unlink()
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    time.sleep(0.2)
    act()
    time.sleep(0.2)
    for pid in pids:
        os.kill(pid, signal.SIGUSR2)
    time.sleep(0.5)
    edges: set[tuple[str, ...]] = set()
    for f in Path(out).glob("*.json"):
        edges |= {tuple(e) for e in json.loads(f.read_text())}
    return edges


def measure(tree: Path, rounds: int) -> dict[str, list[list[str]]]:
    tree = tree.resolve()
    jpeg = encode(make_sample(7, 0).image.resize((500, 375)), "JPEG")
    found: dict[str, list[list[str]]] = {}
    with tempfile.TemporaryDirectory() as hook_dir, tempfile.TemporaryDirectory() as out:
        Path(hook_dir, "sitecustomize.py").write_text(HOOK)
        env = {
            "PYTHONPATH": f"{hook_dir}:{tree}",
            "CALL_PATH_APP": f"{tree}/app/",
            "CALL_PATH_OUT": out,
            "VIT_WORKERS": "2",
        }
        with Server(tree / "weights" / "vit-shapes.safetensors", tree=tree, **env) as server:
            for route in ("predict", "v2"):
                for _ in range(2):
                    send(server.url, route, jpeg)
            for route in ("predict", "v2"):
                seen: list[set[tuple[str, ...]]] = []
                idle: set[tuple[str, ...]] = set()
                for _ in range(rounds):
                    seen.append(window(server, out, functools.partial(send, server.url, route, jpeg)))
                    idle |= window(server, out, lambda: None)
                found[route] = sorted(list(e) for e in set.intersection(*seen) - idle)
    return found


def summary(edges: list[list[str]]) -> dict[str, int]:
    files = {e[0] for e in edges if e[0] != "<event loop>"} | {e[2] for e in edges}
    return {
        "crossings": len(edges),
        "deferred": sum(e[0] == "<event loop>" for e in edges),
        "from_threads": sum(e[0] == "<thread>" for e in edges),
        "files": len(files),
    }


def main() -> None:
    args = parse_args()
    rows = []
    for tree in args.trees:
        found = measure(tree, args.rounds)
        for route, edges in found.items():
            rows.append({"tree": str(tree), "commit": commit(tree), "route": route, **summary(edges), "calls": edges})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "calls"}))
            if args.list:
                for e in edges:
                    print(f"    {e[0]}:{e[1]} -> {e[2]}:{e[3]}")
    report = {"rounds": args.rounds, "workers": 2, "rows": rows}
    write_results(args.name, report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    rows = [
        [r["tree"], r["commit"], r["route"], r["crossings"], r["deferred"], r["from_threads"], r["files"]]
        for r in report["rows"]
    ]
    header = ["tree", "commit", "request", "calls from one file of app/ into another", "deferred", "from threads"]
    return "\n".join(
        [
            "# The file boundaries one request crosses in `app/`",
            "",
            f"`python -m bench.call_path`: the bundled checkpoint served with `VIT_WORKERS={report['workers']}`; the "
            "distinct calls of one request (a `/predict` with one JPEG, a V2 `infer` with one) from a function of "
            "one file of `app/` into another, in every process, seen in all of "
            f"{report['rounds']} rounds and in none of the idle windows between them; each call is listed in the "
            "JSON.",
            "",
            *table([*header, "files"], rows),
            "",
        ]
    )


if __name__ == "__main__":
    main()
