"""Fixtures: the real default model, and a real local cluster (`pdserve up`) of separate
processes, started once per test session in float32 for token-exact parity. What tests
share besides fixtures is in tests/processes.py."""
from __future__ import annotations

import functools
import inspect
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from services.engine.text.model_store import DEFAULT_MODEL_NAME, ensure_default_model
from services.local_processes import start_private_redis
from tests import durations
from tests.processes import ROOT, RunningCluster, start_cluster, stop_cluster, terminate


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="session")
def built_kernels() -> Path:
    """The folder of built native kernels that the test clusters' workers build into
    and load from (the user's cache), for the tests that build a runner themselves. A
    build is named by its source, compiler and CPU, and made by one process at a time,
    so sharing it is safe; building them all takes ~11 s of CPU, paid once a machine."""
    from services.engine.kernels.native.library import kernel_dir
    from services.engine.text.model_store import cache_dir
    return kernel_dir(cache_dir())


def kernel_cache_in(folder: Path, built: Path) -> Path:
    """`folder` as a runner's kernel cache: its choices its own, its builds the run's."""
    (folder / "kernels").symlink_to(built, target_is_directory=True)
    return folder


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory, built_kernels):
    """A module's kernel cache: the choices it measures (kernel-choice/) are its own,
    the kernels it loads are built once a run (`built_kernels`)."""
    return kernel_cache_in(tmp_path_factory.mktemp("cache"), built_kernels)


@pytest.fixture
def fresh_kernel_cache(tmp_path, built_kernels):
    """A kernel cache with no choices measured yet, for one test."""
    return kernel_cache_in(tmp_path, built_kernels)


@pytest.fixture(scope="session")
def expected(model_dir, tmp_path_factory):
    """`model.generate`'s output for the parity cases: computed once a run, by the first
    xdist worker to ask, and read by the others (the run's shared temporary folder; a
    second computation would cost every worker seconds of CPU at the same moment)."""
    import dataclasses
    import fcntl
    import json

    from tests.parity_cases import Expected, generate_expected
    if not os.environ.get("PYTEST_XDIST_WORKER"):               # one process: nothing to share
        return generate_expected(model_dir)
    shared = tmp_path_factory.getbasetemp().parent / "parity-expected.json"     # this run's
    with open(shared.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if shared.exists():
            return {name: Expected(**e) for name, e in json.loads(shared.read_text()).items()}
        out = generate_expected(model_dir)
        shared.write_text(json.dumps({name: dataclasses.asdict(e) for name, e in out.items()}))
        return out


@pytest.fixture(scope="session")
def cluster(model_dir) -> RunningCluster:
    c = start_cluster()
    yield c
    stop_cluster(c)


@pytest.fixture(scope="session")
def tools_router(cluster):
    """A second router over the session cluster's workers, serving a chat template that
    renders tools (deploy/chat-templates/chatml-tools.jinja), sending SSE keep-alives
    after 50 ms of silence, and taking `smol` as another name of the model."""
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-tools-"))
    proc, info = cluster.router(tmp, "--chat-template", str(ROOT / "deploy" / "chat-templates" / "chatml-tools.jinja"),
                                "--sse-keepalive-seconds", "0.05", "--served-model-name", DEFAULT_MODEL_NAME, "smol")
    yield f"http://127.0.0.1:{info['http_port']}"
    terminate(proc)


@pytest.fixture
def redis_url():
    """A private redis-server on a unix socket, for one test."""
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
    started = start_private_redis(tmp)
    assert started is not None, "redis-server is not installed (make test installs it)"
    proc, url = started
    yield url
    proc.terminate()
    proc.wait(timeout=10)
    shutil.rmtree(tmp, ignore_errors=True)


def pytest_configure(config):
    # Under `make test` two workers share the cores (pytest-xdist): one torch thread
    # each, or a model running in a test's process spins OpenMP threads against the
    # other worker's.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch
        torch.set_num_threads(1)


# A test starts processes if its own code or a fixture it uses (any scope, transitively)
# does: a cluster, a service, redis, Ray, a subprocess (a compiler, helm, a fresh venv).
# Those are marked `process`; tests that load the real model in this process are
# marked `model`. `make test-fast` runs the rest: plain Python, in under a minute.
STARTS_PROCESSES = ("start_cluster(", "Services(", "spawn_service", "start_private_redis", "subprocess.",
                    "Popen(", "multiprocessing", "get_context(", "ray.init", "_interpreted(", "run_script(",
                    "start_ranks(")
LOADS_THE_MODEL = {"model_dir", "expected", "kernel_cache"}


@functools.cache
def _starts_processes(func) -> bool:
    """Whether `func`'s own code starts a process (read once per function: fixtures are
    shared by many tests)."""
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    return any(pattern in source for pattern in STARTS_PROCESSES)


# A file not yet in tests/durations.json is taken to last this long, by what it does.
UNMEASURED_SECONDS = {2: 15.0, 1: 5.0, 0: 1.0}


def pytest_collection_modifyitems(config, items):
    weight: dict[str, int] = {}                 # per file: 2 starts processes, 1 runs the model
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        funcs = [getattr(item, "function", None)]
        if info is not None:
            funcs += [d.func for defs in info.name2fixturedefs.values() for d in defs]
        kind = 0
        if any(_starts_processes(f) for f in funcs if f is not None):
            item.add_marker(pytest.mark.process)
            kind = 2
        elif LOADS_THE_MODEL & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
            kind = 1
        weight[item.path] = max(weight.get(item.path, 0), kind)
    # The longest files first, each file's tests in their own order: `make test` hands
    # whole files to two workers (pytest-xdist, told not to reorder them by their number
    # of tests), and a long file started last would run alone. Measured seconds where
    # tests/durations.json has them.
    measured = durations.load()
    seconds = {path: measured.get(str(path.relative_to(ROOT)), UNMEASURED_SECONDS[kind])
               for path, kind in weight.items()}
    items.sort(key=lambda item: -seconds[item.path])
