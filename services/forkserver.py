"""Workers that `pdserve up` starts by forking one process that imported them once.

A worker started as a fresh interpreter imports torch, transformers and pdserve before it
does anything of its own: ~4 s of CPU, most of a worker's start on a CPU machine, paid
again by every worker, every restart and every worker the autoscaler adds. The fork
server pays it once: `up` starts it first, it imports what the workers import, then
forks each worker on request. The worker goes straight to its own start (its settings,
its model's weights), and one that died serves again seconds sooner. The router is
still started by exec: it loads no torch (tests/test_router_process.py), and a fork
would carry all of it.

A worker is still `up`'s own child: the server forks twice, the first child forks the
worker and exits at once, and the worker is reparented to `up`, which is a child
subreaper (PR_SET_CHILD_SUBREAPER). So `up` waits for it, signals it and reads its exit
code as for a process it started itself (`ForkedProcess`: the part of subprocess.Popen
that `up` uses). Once `up` is its parent, the worker asks to die with it, keeps to its
cores, lowers its priority where asked, takes its own environment and runs the command
line it was given, as `python -m services.cli` would, under that command line in `ps`.

Forking is safe while the server holds no thread but its own and has not loaded the CUDA
driver (no CUDA call: a GPU worker initialises CUDA itself, after the fork):
both are checked once its imports are done (OpenBLAS, which numpy and scipy bring, is
told to start no threads of its own). Where either fails, or off Linux, `up` starts each
worker as a fresh interpreter, as `--no-fork-server` asks.

An `up` that was itself forked from such a server, holding its imports (the tests start
their clusters from one: tests/fork_launcher.py), forks its server from itself instead of
starting a fresh interpreter that would import it all again.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from services.common.lifecycle import exit_now
from services.local_processes import child_pids, child_setup

# What a worker imports before serving: the CLI, both workers, and transformers'
# modelling (2 s of the 4), with the default model's architecture.
PRELOAD = ("services.cli", "services.worker.main", "services.decode.worker", "services.prefill.worker",
           "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.llama.modeling_llama")
READY_TIMEOUT = 120.0
_PR_SET_CHILD_SUBREAPER = 36
_HEADER = struct.Struct("!I")


def _send(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket) -> dict | None:
    """The next message, or None once the other end has closed."""
    def exactly(n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf
    header = exactly(_HEADER.size)
    body = header and exactly(_HEADER.unpack(header)[0])
    return None if body is None else json.loads(body)


class ForkedProcess:
    """A service the fork server started, as `up` sees it: its child (reparented), with
    the part of subprocess.Popen's interface that `up` uses."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._lock = threading.Lock()       # `up`'s supervision and its autoscaler thread both poll

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:   # reaped elsewhere: gone, its code unknown
                    pid, status = self.pid, 255 << 8
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """`up`'s end: start the server, then `spawn` services from it."""

    def __init__(self, proc: subprocess.Popen | ForkedProcess, sock: socket.socket) -> None:
        self.proc = proc
        self._sock = sock
        self._lock = threading.Lock()       # one request at a time (the autoscaler spawns too)
        self._ready: bool | None = None
        self.why_not: str | None = None     # why services start by exec instead, once known

    @classmethod
    def start(cls) -> "ForkServer | None":
        """Starts the server (its imports run while `up` does the rest of its start; it
        dies with `up`), or None where services cannot be forked: off Linux, or no child
        subreaper."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
                return None
        except OSError:
            return None
        ours, theirs = socket.socketpair()
        if all(name in sys.modules for name in PRELOAD) and len(os.listdir("/proc/self/task")) == 1:
            # `up` already holds what the workers import (it was itself forked from such a
            # server: a test's fork launcher's): the server is a fork of it, imports and all.
            pid = os.fork()
            if pid == 0:                    # never back into `up`'s code, whatever happens
                try:
                    ours.close()
                    child_setup(None)()
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # `up`'s handler is `up`'s
                    _title([sys.executable, "-m", "services.forkserver", str(theirs.fileno())])
                    _main(theirs.fileno(), os.getppid())
                finally:
                    os._exit(1)
            theirs.close()
            return cls(ForkedProcess(pid, [sys.executable, "-m", "services.forkserver"]), ours)
        env = {**os.environ, "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}
        proc = subprocess.Popen([sys.executable, "-m", "services.forkserver", str(theirs.fileno())],
                                pass_fds=[theirs.fileno()], env=env, preexec_fn=child_setup(None))
        theirs.close()
        return cls(proc, ours)

    def _wait_ready(self) -> bool:
        if self._ready is None:
            self._sock.settimeout(READY_TIMEOUT)
            try:
                hello = _recv(self._sock)
            except OSError as exc:
                hello = {"why": f"it did not answer ({exc})"}
            self._sock.settimeout(None)
            self._ready = bool(hello and hello.get("ready"))
            if not self._ready:
                self.why_not = (hello or {}).get("why") or "it exited while importing"
        return self._ready

    def spawn(self, argv: list[str], env: dict[str, str], cpus: set[int] | None = None,
              nice: int = 0, output: str | None = None) -> ForkedProcess | None:
        """`python -m services.cli *argv`, forked, or None if the server cannot fork it
        (`why_not` says why): start it by exec then. `output`: a file its stdout and
        stderr are appended to (default: the server's, which are `up`'s)."""
        with self._lock:
            if not self._wait_ready():
                return None
            try:
                _send(self._sock, {"argv": argv, "env": env, "cpus": sorted(cpus) if cpus else None,
                                   "nice": nice, "output": output})
                answer = _recv(self._sock)
            except OSError as exc:
                answer = {"why": str(exc)}
            if not answer or "pid" not in answer:
                self._ready, self.why_not = False, (answer or {}).get("why") or "the fork server exited"
                return None
            return ForkedProcess(answer["pid"], argv)

    def close(self) -> None:
        self._sock.close()                  # the server ends when it reads the close
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def adopted_orphans(known: set[int]) -> list[int]:
    """Reaps the exited processes `up` adopted as a subreaper that it never started (a
    dead worker's own children, e.g. its tensor-parallel ranks), so none stays a zombie;
    returns their pids. `known`: the pids `up` waits for itself."""
    reaped = []
    try:
        children = child_pids()
    except OSError:
        return reaped
    for pid in children - known:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                reaped.append(pid)
        except ChildProcessError:
            pass
    return reaped


# ---- the server's end ----

def _why_not_safe() -> str | None:
    tasks = os.listdir("/proc/self/task")
    if len(tasks) > 1:
        names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks)
        return f"its imports started {len(tasks) - 1} thread(s) ({', '.join(names)})"
    import torch
    # Any CUDA call (torch.cuda.is_available() too) loads the driver, which a fork's
    # child cannot use; torch's own flag covers only its lazy init.
    if torch.cuda.is_initialized() or "/libcuda.so" in open("/proc/self/maps").read():
        return "its imports initialised CUDA"
    return None


def _fork_service(request: dict) -> int | dict:
    """Forks the service twice (see the module's docstring). In the server: the
    service's pid. In the service: `request`."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:                         # the first child: fork the service, say its pid, end
        os.close(read)
        service = -1
        try:
            service = os.fork()
            if service == 0:
                os.close(write)
                return request
            os.write(write, str(service).encode())
        finally:
            if service != 0:                # the first child, whatever happened: never returns
                os._exit(0)
    os.close(write)
    answer = os.read(read, 32)
    os.close(read)
    os.waitpid(middle, 0)
    if not answer:
        raise OSError("could not fork the service")
    return int(answer)


def serve(fd: int) -> dict | None:
    """The server's loop. Returns None in the server once `up` has closed its end, and
    the request in each service it forks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C is for `up`, which closes us
    sock = socket.socket(fileno=fd)
    why = None
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            why = f"importing {name} failed ({exc})"
            break
    why = why or _why_not_safe()
    try:
        _send(sock, {"ready": why is None, "why": why})
        if why:
            return None
        gc.freeze()     # what it imported: never scanned again, here or in a worker (nor its pages copied)
        while (request := _recv(sock)) is not None:
            try:
                forked = _fork_service(request)
            except OSError as exc:
                _send(sock, {"why": f"fork failed ({exc})"})
                continue
            if isinstance(forked, dict):
                sock.close()
                return forked
            _send(sock, {"pid": forked})
    except OSError:     # `up` is gone, or stopped before we were ready
        pass
    return None


def _title(command: list[str]) -> None:
    """`ps` shows the process's command line, as if it had been started by exec (where
    setproctitle is installed; it takes /proc/PID/environ's space for it)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(shlex.join(command))
    setproctitle.setthreadtitle(os.path.basename(sys.executable))     # its name in top, as before


def exit_code(run, *args) -> int:
    """`run(*args)`'s exit status, as `sys.exit` would make it of what it returns or raises."""
    try:
        code = run(*args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    return code if isinstance(code, int) else 0


def run_service(request: dict, parent: int) -> int:
    """In the forked service: wait to be `parent`'s (`up`'s) child, set up as `up`'s
    children are, then run its command line (which exits)."""
    deadline = time.monotonic() + 5.0
    while os.getppid() != parent:
        if time.monotonic() > deadline:
            return 1                        # `up` is gone
        time.sleep(0.001)
    child_setup(set(request["cpus"]) if request["cpus"] else None, request["nice"])()
    if os.getppid() != parent:              # `up` died before we could ask to die with it
        return 1
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request.get("output"):
        fd = os.open(request["output"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    _title([sys.executable, "-m", "services.cli", *request["argv"]])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [sys.argv[0], *request["argv"]]
    # `python -m services.cli`, through the module the server preloaded (runpy would run a
    # second copy of it as __main__, and warn that it was imported already). By name, as
    # PRELOAD names it: the command line the server runs, not a layer it builds on.
    return importlib.import_module("services.cli").main(request["argv"])


def _main(fd: int, up: int) -> None:
    """The server's process, to its end: serve `up` over `fd`, or run a service it forked."""
    service = serve(fd)
    if service is None:
        os._exit(0)                         # nothing to flush, and a whole interpreter to tear down
    exit_now(exit_code(run_service, service, up))     # a service has stopped all it started


if __name__ == "__main__":
    _main(int(sys.argv[1]), os.getppid())
