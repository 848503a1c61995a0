"""`python -m app` and this checkout's other command lines (`python -m model.evaluate`, `python -m app.batch`, ...)
forked from a process that has already imported what they import: the same process, started without paying the
interpreter's import of torch, the web stack and the service again (about 2 s of a core each time here).

`python -m harness.preloaded SOCKET` imports what `python -m app` imports, and torchvision (which the model's
command lines import), then listens on the Unix socket SOCKET. Each connection asks for one process: its module,
arguments, environment and working folder, with the files its stdout and stderr go to. The preloaded process
forks; the child becomes `python -m MODULE` with exactly that environment, in a session of its own, and runs as
the interpreter would run it (`runpy`, its exit code the process's). The preloaded process answers the child's
pid, then its exit code when it ends. It exits when the process that started it closes its stdin.

`start_command` is `subprocess.Popen` and `run_command` `subprocess.run(argv, capture_output=True, text=True)` for a
command line of this checkout, forked where it may be.

Only a start whose environment differs from the preloaded process's in variables nothing preloaded has read can
be forked: the service's own settings (`VIT_*`), OpenTelemetry's (`OTEL_*`, read when the service configures
tracing), pytest's name of the test running, torch's compiler cache (read when torch compiles, and set then in
the test process), the Hugging Face hub's (`HF_*`, read as `huggingface_hub` is imported, which the service does
only to fetch a model) and the tokenizers' (`TOKENIZERS_*`, while `tokenizers` is not loaded). Anything else
(`PYTHONPATH`, the threads OpenMP reads as it loads) could have been read at import, and such a start gets a
fresh interpreter (`fork_allowed`).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "model", "bench", "evaluation", "harness")  # this checkout's: what a fork may run
PRELOADED = ("app.startup", "app.server", "torchvision")  # what `python -m app` imports, and the model's commands
# pytest's name of the test running; torch's compiler cache, which torch reads (and sets) when it compiles; and the
# device stand-in's, which harness.stand_in_app reads as it runs (afresh, as __main__)
READ_AT_RUN_TIME = ("VIT_", "OTEL_", "STAND_IN_", "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
# a library's variables, and the library that reads them (as it loads, or once loaded): open_clip's import sets
# TOKENIZERS_PARALLELISM in a test process that converts a CLIP model
READ_AT_IMPORT = {"HF_": "huggingface_hub", "TOKENIZERS_": "tokenizers"}
FRESH: list[str] = []  # this process's starts of this checkout's command lines that got a fresh interpreter, and why


def read_before(env: Mapping[str, str], preloaded: Mapping[str, str], modules: Collection[str]) -> list[str]:
    """The variables in which `env` differs from `preloaded`, the environment of a process that imported `modules`
    (top-level names), and which that process may have read already."""
    changed = {k for k in env.keys() | preloaded.keys() if env.get(k) != preloaded.get(k)}
    unread = [prefix for prefix, module in READ_AT_IMPORT.items() if module not in modules]
    return sorted(k for k in changed if not k.startswith((*READ_AT_RUN_TIME, *unread)))


def fork_allowed(env: Mapping[str, str], preloaded: Mapping[str, str], modules: Collection[str]) -> bool:
    """Whether a process with `env` behaves the same forked from one that imported `modules` (top-level names)
    with the environment `preloaded`."""
    return not read_before(env, preloaded, modules)


class Forked:
    """A process forked by the preloaded one: what `subprocess.Popen` offers for it (`pid`, `poll`, `wait`,
    `send_signal`, `kill`, `returncode`), its exit code read from the preloaded process's answer."""

    def __init__(self, connection: socket.socket, argv: list[str]) -> None:
        self.args = argv
        self.returncode: int | None = None
        self._connection = connection
        self._received = b""
        pid = self._line(timeout=60)
        if pid is None:
            raise RuntimeError("the preloaded process did not fork")
        self.pid = int(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._exit(self._line(timeout=0))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._exit(line)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _line(self, timeout: float | None) -> str | None:
        """The next line of the answer, "" when the connection closed without one, None if none came in time."""
        while b"\n" not in self._received:
            if not select.select([self._connection], [], [], timeout)[0]:
                return None
            chunk = self._connection.recv(4096)
            if not chunk:
                return ""
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line.decode()

    def _exit(self, line: str | None) -> None:
        if line is not None:
            self.returncode = int(line) if line else -signal.SIGKILL  # the preloaded process itself was killed
            self._connection.close()


class Preloaded:
    """This process's preloaded interpreter, started on first use."""

    _lock = threading.Lock()
    _started: Preloaded | None = None
    _owner = 0

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.folder = tempfile.TemporaryDirectory(prefix="preloaded-")
        self.address = str(Path(self.folder.name) / "socket")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness.preloaded", self.address],
            cwd=ROOT,
            stdin=subprocess.PIPE,  # closed when this process ends: the preloaded one then ends too
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if not ready.startswith("ready "):
            raise RuntimeError("the preloaded process did not start")
        self.modules: list[str] = json.loads(ready.removeprefix("ready "))

    def allows(self, env: Mapping[str, str]) -> bool:
        """Whether a process with `env` may be forked from this one; where not, why goes into `FRESH`."""
        if not (why := read_before(env, self.env, self.modules)):
            return True
        FRESH.append(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').removesuffix(' (call)')}: {', '.join(why)}")
        return False

    @classmethod
    def get(cls) -> Preloaded:
        with cls._lock:
            if cls._started is None or cls._owner != os.getpid() or cls._started.proc.poll() is not None:
                cls._started, cls._owner = cls(), os.getpid()
            return cls._started

    def start(
        self,
        module: str,
        arguments: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        stdout: IO[str],
        stderr: IO[str],
    ) -> Forked:
        """`python -m MODULE ARGUMENTS` with exactly `env`, from `cwd`, its output to `stdout` and `stderr`."""
        connection = socket.socket(socket.AF_UNIX)
        connection.connect(self.address)
        request = {"module": module, "arguments": list(arguments), "env": dict(env), "cwd": str(cwd)}
        socket.send_fds(connection, [json.dumps(request).encode()], [stdout.fileno(), stderr.fileno()])
        connection.shutdown(socket.SHUT_WR)
        return Forked(connection, [sys.executable, "-m", module, *arguments])


def forkable(argv: Sequence[str], cwd: Path) -> str | None:
    """The module `argv` runs where it is `python -m MODULE ...` of this checkout, run from its root; else None."""
    if len(argv) < 3 or list(argv[:2]) != [sys.executable, "-m"] or cwd.resolve() != ROOT:
        return None
    return argv[2] if argv[2].split(".")[0] in PACKAGES else None


def start_command(
    argv: Sequence[str],
    stdout: IO[str],
    stderr: IO[str],
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    fork: bool = True,
) -> subprocess.Popen[str] | Forked:
    """`argv` started in a session of its own, reading nothing, its output to `stdout` and `stderr`: with `fork`,
    forked from this process's preloaded interpreter where it is a command line of this checkout and `env` (this
    process's when None) allows it; else a `subprocess.Popen`."""
    where = Path.cwd() if cwd is None else cwd
    full_env = dict(os.environ if env is None else env)
    module = forkable(argv, where) if fork else None
    if module is not None and (preloaded := Preloaded.get()).allows(full_env):
        return preloaded.start(module, argv[3:], full_env, where, stdout, stderr)
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        text=True,
        start_new_session=True,
    )


def run_command(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(argv, env=env, cwd=cwd, timeout=timeout, check=check, capture_output=True, text=True)`
    through `start_command`; past `timeout`, its process group is killed and `subprocess.TimeoutExpired` raised."""
    with tempfile.TemporaryFile(mode="w+") as out, tempfile.TemporaryFile(mode="w+") as err:
        proc = start_command(argv, out, err, env, cwd)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(list(argv), proc.wait(), out.read(), err.read())
    if check:
        done.check_returncode()
    return done


def serve(address: str) -> dict[str, Any]:
    """Fork a process for each connection and report its pid and exit code; in a forked child, return its
    request."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    children: dict[int, socket.socket] = {}
    print("ready", json.dumps(sorted({name.split(".")[0] for name in sys.modules})), flush=True)
    while True:
        readable = select.select([listener, sys.stdin, wake_read], [], [])[0]
        if sys.stdin in readable and not sys.stdin.readline():
            sys.exit(0)  # the process that started this one has ended
        if wake_read in readable:
            os.read(wake_read, 4096)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if (asked := children.pop(pid, None)) is not None:
                    with contextlib.suppress(OSError):  # the caller may have gone
                        asked.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    asked.close()
        if listener in readable:
            connection = listener.accept()[0]
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
            while chunk := connection.recv(1 << 20):
                message += chunk
            sys.stdout.flush()
            in_session_read, in_session = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.setsid()  # before the pid is answered: the caller stops the server by its process group
                os.close(in_session)
                os.close(in_session_read)
                os.dup2(fds[0], 1)
                os.dup2(fds[1], 2)
                for fd in (*fds, wake_read, wake_write):
                    os.close(fd)
                listener.close()
                connection.close()
                for other in children.values():
                    other.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                request: dict[str, Any] = json.loads(message)
                return request
            for fd in fds:
                os.close(fd)
            os.close(in_session)
            os.read(in_session_read, 1)  # end of file once the child has closed its copy, in its own session
            os.close(in_session_read)
            connection.sendall(f"{pid}\n".encode())
            children[pid] = connection


def become(request: dict[str, Any]) -> None:
    """This forked child runs `python -m MODULE` as the interpreter would."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-m", *request["arguments"]]
    if not hasattr(sys.modules.get(request["module"]), "__path__"):  # a module imported here: run afresh as __main__
        sys.modules.pop(request["module"], None)  # as the interpreter would (a package runs its __main__)
    import runpy

    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    import importlib

    for module in PRELOADED:
        importlib.import_module(module)

    become(serve(sys.argv[1]))
