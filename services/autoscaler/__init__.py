"""Autoscaling of the prefill and decode pools, each on its own signal.

core.py       the policy: observations in, desired replicas and a reason out (pure)
signals.py    latency histograms routers publish and the policy reads (pure)
actuators/    what sets replica counts: kubernetes, local (`pdserve up`), ray, report
service.py    the loop: read the registry, decide, act, publish (`pdserve autoscaler`)
replay.py     a recorded load trace through the policy and a capacity model, plotted
"""
