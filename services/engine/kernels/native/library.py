"""A kernel source to a loaded library: built with the machine's C compiler into the cache
directory, under a name keyed by the source, the headers beside it, the flags, the
compiler and the CPU (so a cache shared between machines never hands one machine
another's build, and a changed header rebuilds), then loaded with ctypes, each function
typed from pdserve_kernels.h (header.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

from services.engine.kernels.native import header

log = logging.getLogger(__name__)

# -mprefer-vector-width is x86's alone: elsewhere (aarch64) it fails every build.
COMPILE_FLAGS = ["-O3", "-march=native", *(["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64")
                                          else []), "-ffast-math", "-fopenmp", "-fPIC"]
# Linked without -ffast-math: linking with it would add crtfastmath.o, which turns on
# flush-to-zero for the whole process when the library loads. -fopenmp links libgomp.so.1,
# which resolves to the copy torch already loaded: one OpenMP thread team for torch's ops
# and these kernels (two teams would spin against each other on the same cores).
LINK_LIBS = (["-fopenmp", "-lmvec", "-lm"], ["-fopenmp", "-lm"])
BUILD_TIMEOUT_S = 120
DTYPES = {torch.float32: 0, torch.bfloat16: 1}        # the kernels' `bf16` argument


class NativeBuildError(RuntimeError):
    """The kernel could not be built or loaded here."""


class Library:
    """One loaded kernel library. `function` gives an exported function typed as
    pdserve_kernels.h declares it; `struct`, a struct the header declares, as ctypes."""

    def __init__(self, path: Path, declared: header.Header) -> None:
        self.path = path
        self._declared = declared
        try:
            self._cdll = ctypes.CDLL(str(path))
        except OSError as e:
            raise NativeBuildError(f"cannot load {path}: {e}") from e

    def function(self, name: str) -> ctypes._CFuncPtr:
        declared = self._declared.functions.get(name)
        if declared is None:
            raise header.HeaderError(f"{name} is not declared in {header.HEADER.name}")
        fn = getattr(self._cdll, name)           # one object per name: the types stay set on it
        fn.argtypes, fn.restype = declared.argtypes, declared.restype
        return fn

    def struct(self, name: str) -> type[ctypes.Structure]:
        if name not in self._declared.structs:
            raise header.HeaderError(f"struct {name} is not declared in {header.HEADER.name}")
        return self._declared.structs[name].ctype()


def load(path: Path) -> Library:
    return Library(path, header.read())


def kernel_dir(cache_root: Path) -> Path:
    """`cache_root`/kernels, or where that is read-only (a container's baked-in cache),
    this user's own folder under the temp directory: a shared one would let another
    local user put a library there for this process to load."""
    out_dir = cache_root / "kernels"
    if _writable(out_dir):
        return out_dir
    private = Path(tempfile.gettempdir()) / f"pdserve-kernels-{os.getuid()}"
    try:
        private.mkdir(mode=0o700, exist_ok=True)
        st = private.lstat()
    except OSError as e:
        raise NativeBuildError(f"cannot create {private}: {e}") from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise NativeBuildError(f"{private} is not a folder of this user's alone: not building kernels there")
    return private


def build(source: Path, out_dir: Path, defines: tuple[str, ...] = ()) -> Path:
    """The shared library built from `source` in `out_dir`, built now unless a build of
    this source, headers, flags, compiler and CPU is already there (or being made: then
    once it is). `defines`: macros the source is compiled with (`-D`)."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise NativeBuildError("no C compiler (cc, gcc or clang) on PATH")
    version = _run([cc, "--version"]).stdout
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]     # what the source includes
    flags = [*COMPILE_FLAGS, *(f"-D{d}" for d in defines)]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(flags), version,
                                    platform.machine(), _cpu_signature()]).encode()).hexdigest()[:16]
    target = out_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        held = os.open(out_dir, os.O_RDONLY)
    except OSError as e:
        raise NativeBuildError(f"cannot create {out_dir}: {e}") from e
    try:
        # One build at a time in a folder: the workers of a fresh machine start together
        # and would each compile the same sources (~11 s of CPU); the others wait for it
        # and load what it built. The lock goes with the process that holds it. Where the
        # filesystem takes no locks, each builds, as the rename below allows.
        with contextlib.suppress(OSError):
            fcntl.flock(held, fcntl.LOCK_EX)
        if not target.exists():
            _compile(cc, flags, source, target, key)
    finally:
        os.close(held)
    return target


def _compile(cc: str, flags: list[str], source: Path, target: Path, key: str) -> None:
    out_dir = target.parent
    # names of their own (a pid repeats in another container sharing the folder)
    fd, name = tempfile.mkstemp(prefix=f".{key}.", suffix=".o", dir=out_dir)
    os.close(fd)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{key}.", suffix=".so", dir=out_dir)
    os.close(fd)
    obj, tmp = Path(name), Path(tmp_name)
    try:
        result = _run([cc, *flags, "-c", str(source), "-o", str(obj)])
        if result.returncode:
            raise NativeBuildError(f"{cc} failed on {source.name}: {result.stderr.strip()[-2000:]}")
        for libs in LINK_LIBS:
            result = _run([cc, "-shared", str(obj), "-o", str(tmp), *libs])
            if result.returncode == 0:
                break
        else:
            raise NativeBuildError(f"linking {source.name} failed: {result.stderr.strip()[-2000:]}")
        tmp.chmod(0o755)                    # as the compiler leaves it, not mkstemp's 0600
        tmp.replace(target)                 # atomic: a reader without the lock never sees half a file
    finally:
        obj.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    log.info("built %s", target)


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"{argv[0]}: {e}") from e


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)
