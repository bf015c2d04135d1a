"""Latency per worker, for the autoscaler: time to first token by the prefill worker
that computed the prompt, inter-token gaps by the decode worker that generated them.

Counts are cumulative histograms over services/common/histograms.LATENCY_BOUNDS,
published to the registry with each refresh; the autoscaler takes differences between
reports, so a report lost or late costs nothing. A worker that left routing is dropped
after one last report.
"""
from __future__ import annotations

import time
import uuid

from services.common.histograms import LATENCY_BOUNDS, NUM_BUCKETS, bucket_of
from services.rpc import autoscaler_pb2


class LatencyLedger:
    def __init__(self) -> None:
        self.router_id = uuid.uuid4().hex[:12]
        self.ttft: dict[str, list[int]] = {}
        self.itl: dict[str, list[int]] = {}

    @staticmethod
    def _observe(table: dict[str, list[int]], epoch: str, seconds: float) -> None:
        if epoch:
            table.setdefault(epoch, [0] * NUM_BUCKETS)[bucket_of(seconds)] += 1

    def observe_ttft(self, prefill_epoch: str, seconds: float) -> None:
        self._observe(self.ttft, prefill_epoch, seconds)

    def observe_itl(self, decode_epoch: str, seconds: float) -> None:
        self._observe(self.itl, decode_epoch, seconds)

    def report(self, live_epochs: set[str]) -> autoscaler_pb2.LatencyReport:
        """Everything counted so far; then forget the workers no longer live."""
        report = autoscaler_pb2.LatencyReport(
            router_id=self.router_id, reported_at=time.time(), bounds=LATENCY_BOUNDS,
            ttft=[autoscaler_pb2.WorkerLatency(epoch=e, counts=c) for e, c in self.ttft.items()],
            itl=[autoscaler_pb2.WorkerLatency(epoch=e, counts=c) for e, c in self.itl.items()])
        for table in (self.ttft, self.itl):
            for epoch in [e for e in table if e not in live_epochs]:
                del table[epoch]
        return report
