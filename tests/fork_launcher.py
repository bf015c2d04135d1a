"""Workers for the tests' own clusters (tests/processes.py: `spawn_services`), forked as
`pdserve up` forks its own (services/forkserver.py): each skips the ~4 s of imports a
fresh interpreter spends, which the suites that start and restart workers one by one
(test_pools, test_faults, test_security) paid a dozen times and more.

This process stands where `up` stands: it starts the fork server, becomes the child
subreaper its workers are reparented to, and reaps each as it exits, keeping its exit
code (no zombie outlives a worker's death: the tests probe pids). The test process asks
over stdin, a JSON line each, and reads the answer on stdout:

    {"spawn": [argv], "env": {...}, "output": PATH}  ->  {"pid": N} or {"why": "..."}
    {"poll": PID}                                    ->  {"code": C or null}

It ends, and the fork server with it, when the test process closes stdin or dies.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

from services.forkserver import ForkServer


def reap(codes: dict[int, int], lock: threading.Lock) -> None:
    """Waits for every child as it exits, keeping its exit code."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:           # none yet
            time.sleep(0.02)
            continue
        with lock:
            codes[pid] = os.waitstatus_to_exitcode(status)


def main() -> None:
    forks = ForkServer.start()
    codes: dict[int, int] = {}
    lock = threading.Lock()
    threading.Thread(target=reap, args=(codes, lock), daemon=True).start()
    for line in sys.stdin:
        request = json.loads(line)
        if "spawn" in request:
            forked = forks.spawn(request["spawn"], request["env"], output=request["output"]) if forks else None
            answer = {"pid": forked.pid} if forked else {"why": forks.why_not if forks else "no fork server here"}
        else:
            with lock:
                answer = {"code": codes.get(request["poll"])}
        print(json.dumps(answer), flush=True)
    if forks:
        forks.close()


if __name__ == "__main__":
    main()
