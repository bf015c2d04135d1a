"""Commands the peer comparison runs: printed as they start, or only printed on --dry-run.
(bench/compare_peers.sh runs all of it under `nice`, so every child yields to others.)"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


def quoted(argv: list[str], env: dict[str, str] | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(argv)


@dataclass(frozen=True)
class Shell:
    dry_run: bool = False

    def say(self, message: str) -> None:
        print(message, flush=True)

    def run(self, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None,
            echo: bool = False, check: bool = True) -> int:
        """Run to completion, its output appended to `log` (and shown too with `echo`);
        with `check`, a non-zero exit stops the comparison."""
        self.say(f"+ {quoted(argv, env)}" + (f"  >> {log}" if log else ""))
        if self.dry_run:
            return 0
        with open(log, "a") if log else open(os.devnull, "w") as out:
            proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, text=True, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE if echo or not log else out, stderr=subprocess.STDOUT)
            if proc.stdout is not None:
                for line in proc.stdout:
                    out.write(line)
                    if echo or not log:
                        sys.stdout.write(line)
                        sys.stdout.flush()
            code = proc.wait()
        if check and code != 0:
            raise RuntimeError(f"{shlex.join(argv[:3])} ... exited with code {code}"
                               + (f"; see {log}" if log else ""))
        return code

    def python(self) -> str:
        """The interpreter new virtualenvs are made from: this one's base, not its venv."""
        return getattr(sys, "_base_executable", None) or sys.executable
