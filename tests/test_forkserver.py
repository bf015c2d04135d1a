"""The fork server `pdserve up` starts its workers from (services/forkserver.py): driven
the way `up` drives it, in a process of its own (it becomes a child subreaper, which the
test process must not), and its refusal, against this process and a server's end that
says no."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from services.forkserver import ForkServer, _send, _why_not_safe
from tests.processes import ROOT

DRIVER = """
import importlib, json, os, sys
from services.forkserver import PRELOAD, ForkServer, ForkedProcess, adopted_orphans

if sys.argv[1] == "preloaded":      # an `up` forked from a server: its own is forked from it
    for name in PRELOAD:
        importlib.import_module(name)
forks = ForkServer.start()
assert isinstance(forks.proc, ForkedProcess) == (sys.argv[1] == "preloaded")
ok = forks.spawn(["--version"], dict(os.environ))
bad = forks.spawn(["decode", "--no-such-flag"], dict(os.environ))
parents = [int(open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[1]) for p in (ok, bad)]
codes = [ok.wait(timeout=60), bad.wait(timeout=60)]
orphans = adopted_orphans({forks.proc.pid})
forks.close()
print(json.dumps({"up": os.getpid(), "parents": parents, "codes": codes, "orphans": orphans,
                  "server": forks.proc.returncode}))
"""


# a preloaded server starts every test cluster (tests/processes.py): by default, that
# path is checked by them
@pytest.mark.parametrize("up", ["fresh", pytest.param("preloaded", marks=pytest.mark.slow)])
def test_workers_fork_as_ups_own_children_and_give_it_their_exit_codes(up):
    """Two commands forked: each is the driver's (`up`'s) own child, reparented, and its
    exit code comes back as a Popen's would (0 for --version, argparse's 2 for a flag
    that does not exist), leaving no zombie; the server ends when `up` closes its end.
    Whether the server is a fresh interpreter, or a fork of an `up` that holds its
    imports already (as the tests' clusters are)."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}      # as a server's imports run: no thread but its own
    done = subprocess.run([sys.executable, "-c", DRIVER, up], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["parents"] == [out["up"]] * 2
    assert out["codes"] == [0, 2], done.stderr[-3000:]
    assert out["orphans"] == [] and out["server"] == 0


def test_a_server_that_cannot_fork_safely_says_why_and_up_starts_by_exec():
    """A process with a thread besides its own is no place to fork from, and the check
    says so. A server that answers that it is not ready forks nothing: `spawn` gives
    None and the reason, and `up` starts the worker by exec."""
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert "thread(s)" in (_why_not_safe() or "")
    finally:
        release.set()
        thread.join()
    ours, theirs = socket.socketpair()
    idle = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    forks = ForkServer(idle, ours)
    try:
        _send(theirs, {"ready": False, "why": "its imports started 2 thread(s)"})
        assert forks.spawn(["--version"], {}) is None
        assert forks.why_not == "its imports started 2 thread(s)"
    finally:
        theirs.close()
        idle.stdin.close()
        forks.close()
