"""CPU time of processes and threads, read from /proc: one process, a process with its descendants, each kind of
thread in a process, and the service's processes by role (engine, front-ends, supervisor)."""

from __future__ import annotations

import os
import re
from pathlib import Path


def stat_cpu_s(stat: Path) -> float:
    """User + system CPU seconds in a /proc `stat` file (a process's or one thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads, not its children); 0 once it is gone."""
    try:
        return stat_cpu_s(Path(f"/proc/{pid}/stat"))
    except OSError:
        return 0.0


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants."""
    return sum(own_cpu_s(p) for p in [pid, *children(pid)])


def direct_children(pid: int) -> list[int]:
    """The processes `pid` started, from any of its threads (each thread lists the children it forked: a JVM, say,
    starts its workers from threads other than its first)."""
    kids: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return kids


def children(pid: int) -> list[int]:
    """Every descendant of a process."""
    kids = direct_children(pid)
    return kids + [g for k in kids for g in children(k)]


def threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each kind of thread of a process, by name with its number dropped ("forward_1": "forward")."""
    kinds: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            seconds = stat_cpu_s(task / "stat")
        except OSError:  # ended meanwhile
            continue
        kind = (
            "event loop"
            if task.name == str(pid)
            else "other Python threads"
            if name == "python"
            else re.sub(r"/\d+$", "", name)
        )
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    return kinds


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def roles(supervisor: int, workers: int) -> dict[str, list[int]]:
    """The pids of each role: one process serving alone is the engine (and its own front). With serving
    processes, the engine is spawned by the supervisor and the front-ends are forked by its fork server."""
    if workers == 1:
        return {"engine": [supervisor], "front-ends": [], "supervisor": []}
    found: dict[str, list[int]] = {"engine": [], "front-ends": [], "supervisor": [supervisor], "other": []}
    for pid in direct_children(supervisor):
        line = cmdline(pid)
        if "forkserver" in line:
            found["front-ends"] += direct_children(pid)
            found["other"].append(pid)  # the fork server itself, idle while serving
        elif "spawn_main" in line:
            found["engine"].append(pid)
        else:
            found["other"].append(pid)  # multiprocessing's resource tracker
    if len(found["engine"]) != 1 or len(found["front-ends"]) != workers:
        raise RuntimeError(f"expected 1 engine and {workers} front-ends under pid {supervisor}, found {found}")
    return found


def cpu_by_role(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds used so far by each role's processes."""
    return {role: sum(own_cpu_s(p) for p in ps) for role, ps in pids.items()}
