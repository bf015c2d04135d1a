"""KV bytes crossing a real process boundary through the shm backend, and the
compatibility handshake."""
import contextlib
import json
import multiprocessing as mp

import pytest
import torch

import time

from kv_transfer.backends import create_transport
from kv_transfer.base import IncompatiblePeer, TransferError, TransferState, block_runs, wait_for
from kv_transfer.fake import FakeFabric, FakeTransport
from services.common.shm import live_segments
from services.engine.model.kv_cache import KVLayout, KVPoolMemory, compat_hash

LAYOUT = KVLayout(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def _writer(backend: str, layout: KVLayout, meta: bytes, compat: str, src_blocks, dst_blocks, seed: int, q) -> None:
    torch.manual_seed(seed)
    local = KVPoolMemory.allocate(KVLayout(**{**layout.__dict__, "num_blocks": 8}))
    local.tensor.copy_(torch.randn(local.tensor.shape))
    t = create_transport(backend)
    t.register(local, compat)
    peer = t.connect(meta, compat)
    xfers = [t.write(peer, src_blocks, dst_blocks, range(layer, layer + 1))   # layer by layer, as prefill does
             for layer in range(layout.num_layers)]
    wait_for(t, xfers, time.monotonic() + 30)
    q.put(local.tensor[:, :, src_blocks].view(torch.uint8).clone().numpy())
    t.shutdown()


@pytest.mark.parametrize("backend", ["shm", "tcp"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backend_moves_bit_identical_blocks_between_processes(backend, dtype):
    layout = KVLayout(**{**LAYOUT.__dict__, "dtype": dtype})
    pool = KVPoolMemory.allocate(layout, shared=backend == "shm")
    compat = compat_hash("m", layout)
    t = create_transport(backend)
    meta = t.register(pool, compat)
    src, dst = [0, 1, 2, 5], [9, 10, 11, 3]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_writer, args=(backend, layout, meta, compat, src, dst, 7, q))
    p.start()
    sent = torch.from_numpy(q.get(timeout=60))
    p.join(60)
    assert p.exitcode == 0
    assert torch.equal(pool.tensor[:, :, dst].view(torch.uint8), sent)
    untouched = [i for i in range(LAYOUT.num_blocks) if i not in dst]
    assert torch.count_nonzero(pool.tensor[:, :, untouched]) == 0
    t.shutdown()
    path = pool.path
    pool.close()
    if path is not None:
        assert not path.exists() and path not in live_segments()


@contextlib.contextmanager
def tcp_link(receiving: KVLayout, sending: KVLayout):
    """A tcp receiver holding a zeroed `receiving` pool and a one-stream sender paired
    with it, whose own `sending` pool is random: (sender, peer, pool, local)."""
    compat = compat_hash("m", receiving)
    receiver, sender = create_transport("tcp"), create_transport("tcp", streams=1)
    pool, local = KVPoolMemory.allocate(receiving), KVPoolMemory.allocate(sending)
    local.tensor.copy_(torch.randn(local.tensor.shape))
    try:
        peer = sender.connect(receiver.register(pool, compat), compat)
        sender.register(local, compat)
        yield sender, peer, pool, local
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_tcp_frame_with_more_pieces_than_one_system_call_takes():
    """A frame of scattered blocks needs more buffers than one sendmsg/recvmsg accepts
    (IOV_MAX): it is split across calls and still lands byte for byte."""
    layout = KVLayout(num_layers=2, num_blocks=600, block_size=1, num_kv_heads=1, head_dim=4, dtype="float32")
    with tcp_link(layout, layout) as (sender, peer, pool, local):
        src = list(range(0, 600, 2))                 # 300 runs of one block, in both layers, K and V
        dst = list(range(599, 0, -2))
        wait_for(sender, [sender.write(peer, src, dst)], time.monotonic() + 30)
        assert torch.equal(pool.tensor[:, :, dst], local.tensor[:, :, src])
        assert torch.count_nonzero(pool.tensor[:, :, list(range(0, 600, 2))]) == 0


def test_tcp_frame_outside_the_pool_is_drained_refused_and_the_link_kept():
    """A frame naming blocks past the receiver's pool fails that transfer (its bytes are
    read and dropped, nothing is written) and the next frame on the link lands."""
    big = KVLayout(num_layers=2, num_blocks=64, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32")
    small = KVLayout(**{**big.__dict__, "num_blocks": 8})
    with tcp_link(small, big) as (sender, peer, pool, local):
        with pytest.raises(TransferError, match="failed"):
            wait_for(sender, [sender.write(peer, list(range(40)), list(range(20, 60)))], time.monotonic() + 10)
        assert torch.count_nonzero(pool.tensor) == 0
        wait_for(sender, [sender.write(peer, [1, 2], [3, 4])], time.monotonic() + 10)
        assert torch.equal(pool.tensor[:, :, [3, 4]], local.tensor[:, :, [1, 2]])


def test_tcp_receiver_outlives_a_failed_accept_and_refuses_a_frame_of_absurd_runs(monkeypatch):
    """The receiver's one accepting thread goes on after accept fails (a worker out of
    descriptors for a moment: the OS failure is a double here, as running the process
    out of descriptors would fail the tests beside it); and a frame claiming more runs
    than the pool has blocks ends its connection before anything is allocated for it,
    where it asked for up to 32 GiB, and the receiver goes on serving."""
    import errno
    import socket

    from kv_transfer.tcp import HEADER, HELLO, MAGIC

    class Flaky:
        def __init__(self, sock):
            self.sock, self.failed = sock, False

        def accept(self):
            if not self.failed:
                self.failed = True
                raise OSError(errno.EMFILE, "Too many open files")
            return self.sock.accept()

        def __getattr__(self, name):
            return getattr(self.sock, name)
    compat = compat_hash("m", LAYOUT)
    receiver, sender = create_transport("tcp"), create_transport("tcp", streams=1)
    server = socket.create_server
    monkeypatch.setattr(socket, "create_server", lambda *args, **kw: Flaky(server(*args, **kw)))
    pool, local = KVPoolMemory.allocate(LAYOUT), KVPoolMemory.allocate(LAYOUT)
    local.tensor.copy_(torch.randn(local.tensor.shape))
    try:
        meta = receiver.register(pool, compat)
        sender.register(local, compat)
        peer = sender.connect(meta, compat)
        wait_for(sender, [sender.write(peer, [1], [2])], time.monotonic() + 10)
        assert receiver._listener.failed and torch.equal(pool.tensor[:, :, 2], local.tensor[:, :, 1])
        rogue = socket.create_connection(receiver._listener.getsockname())
        rogue.settimeout(10)
        rogue.sendall(HELLO.pack(MAGIC, receiver._token) + HEADER.pack(MAGIC, 1, 0, 1, 2**32 - 1, 0, 0))
        assert rogue.recv(1) == b""                    # closed, nothing allocated for it
        rogue.close()
        wait_for(sender, [sender.write(peer, [3], [4])], time.monotonic() + 10)
        assert torch.equal(pool.tensor[:, :, 4], local.tensor[:, :, 3])
    finally:
        sender.shutdown()
        receiver.shutdown()

def test_a_shm_writer_lets_go_of_a_stopped_peers_pool():
    """A prefill worker's shm transport maps each decode worker's pool it wrote to. Once a
    decode worker stops (its segment unlinked), the pages stay the host's while any
    mapping lives: the writer's next connection lets go of every gone peer's, where it
    held them until it stopped itself (a full pool per decode worker that came and went)."""
    compat = compat_hash("m", LAYOUT)
    writer = create_transport("shm")
    writer.register(KVPoolMemory.allocate(LAYOUT), compat)
    gone_pool, live_pool = KVPoolMemory.allocate(LAYOUT, shared=True), KVPoolMemory.allocate(LAYOUT, shared=True)
    gone, live = create_transport("shm"), create_transport("shm")
    gone_meta, live_meta = gone.register(gone_pool, compat), live.register(live_pool, compat)
    try:
        writer.write(writer.connect(gone_meta, compat), [0], [1])
        gone_pool.close()                                # that decode worker stops: its segment goes
        writer.connect(live_meta, compat)
        assert list(writer._peers) == [str(live_pool.path)]
    finally:
        writer.shutdown()
        live_pool.close()

def test_a_failed_exports_drain_keeps_the_link_other_requests_share():
    """One request's write fails (its frame refused) after another of its writes landed:
    its finish fails, then its drain waits only for writes still in flight. Asked again,
    a transport reports a transfer whose end it already told as failed, and the drain
    took that for a broken link and closed it under every other request writing to the
    same decode worker."""
    from services.worker.kv_export import Export, KVExporter, Target
    with tcp_link(LAYOUT, LAYOUT) as (sender, peer, pool, local):
        landed = sender.write(peer, [0], [3], range(0, 1))
        refused = sender.write(peer, [1], [4000], range(1, 2))          # past the receiver's pool
        export = Export([Target(sender, peer)], [3], time.monotonic() + 10, xfers=[(sender, landed),
                                                                                   (sender, refused)])
        exporter = KVExporter({"tcp": sender}, "h", LAYOUT)
        with pytest.raises(TransferError):
            exporter.finish(export)
        exporter._drain(export)
        wait_for(sender, [sender.write(peer, [2], [5])], time.monotonic() + 10)      # another request's write
        assert torch.equal(pool.tensor[:, :, 5], local.tensor[:, :, 2])

def test_tcp_never_begins_a_write_past_its_deadline_and_keeps_the_link():
    """A frame queued behind a backlog whose deadline has passed by its turn is never
    sent (its destination blocks may be another request's by then): the write FAILs,
    nothing lands, and the next write on the link does."""
    with tcp_link(LAYOUT, LAYOUT) as (sender, peer, pool, local):
        late = sender.write(peer, [1, 2], [3, 4], deadline=time.monotonic() - 0.001)
        with pytest.raises(TransferError, match="failed"):
            wait_for(sender, [late], time.monotonic() + 10)
        assert torch.count_nonzero(pool.tensor) == 0
        wait_for(sender, [sender.write(peer, [1, 2], [3, 4], deadline=time.monotonic() + 10)], time.monotonic() + 10)
        assert torch.equal(pool.tensor[:, :, [3, 4]], local.tensor[:, :, [1, 2]])


def test_tcp_write_to_a_dead_peer_fails_instead_of_hanging():
    pool = KVPoolMemory.allocate(LAYOUT)
    receiver = create_transport("tcp")
    meta = receiver.register(pool, "h")
    sender = create_transport("tcp", io_timeout=2.0)
    local = KVPoolMemory.allocate(LAYOUT)
    sender.register(local, "h")
    peer = sender.connect(meta, "h")
    wait_for(sender, [sender.write(peer, [0], [1])], time.monotonic() + 10)
    receiver.shutdown()                                  # the peer goes away
    t0 = time.monotonic()
    with pytest.raises(Exception):
        for _ in range(50):                              # the loss is noticed within a few writes
            wait_for(sender, [sender.write(peer, [0, 1, 2, 3], [4, 5, 6, 7])], time.monotonic() + 5)
    assert time.monotonic() - t0 < 15
    sender.shutdown()


def test_tcp_writer_lets_go_of_dead_links_and_of_outcomes_nobody_asks_for(monkeypatch):
    """A decode worker that restarts comes back under a new token, so nothing reconnects
    under its old link's key: the writer's next connection closes every dead link's
    sockets; and the outcomes of transfers nobody polls (a wait given up at a failure)
    are kept to a bound."""
    import kv_transfer.tcp as tcp
    monkeypatch.setattr(tcp, "MAX_FINISHED", 8)
    pool = KVPoolMemory.allocate(LAYOUT)
    gone, live, sender = create_transport("tcp"), create_transport("tcp"), create_transport("tcp", io_timeout=2.0)
    sender.register(KVPoolMemory.allocate(LAYOUT), "h")
    try:
        peer = sender.connect(gone.register(pool, "h"), "h")
        wait_for(sender, [sender.write(peer, [0], [1])], time.monotonic() + 10)
        gone.shutdown()                                  # that decode worker goes away
        with pytest.raises(TransferError):
            for _ in range(50):
                wait_for(sender, [sender.write(peer, [0, 1], [2, 3])], time.monotonic() + 5)
        dead = sender._peers[peer.peer_id]
        for _ in range(20):                              # posted to a dead link, never polled
            sender.write(peer, [0], [1])
        assert len(sender._states) <= 8
        sender.connect(live.register(KVPoolMemory.allocate(LAYOUT), "h"), "h")
        assert peer.peer_id not in sender._peers and all(st.sock.fileno() < 0 for st in dead.streams)
    finally:
        sender.shutdown()
        live.shutdown()

def test_mismatched_layout_refuses_to_pair():
    pool = KVPoolMemory.allocate(LAYOUT, shared=True)
    try:
        meta = create_transport("shm").register(pool, compat_hash("m", LAYOUT))
        other = KVLayout(**{**LAYOUT.__dict__, "dtype": "bfloat16"})
        with pytest.raises(IncompatiblePeer):
            create_transport("shm").connect(meta, compat_hash("m", other))
        assert json.loads(meta)["compat_hash"] == compat_hash("m", KVLayout(**{**LAYOUT.__dict__, "num_blocks": 2}))
    finally:
        pool.close()


def test_fake_backend_copies_and_can_drop():
    fabric = FakeFabric()
    dst_pool, src_pool = KVPoolMemory.allocate(LAYOUT), KVPoolMemory.allocate(LAYOUT)
    src_pool.tensor.normal_()
    a, b = FakeTransport(fabric), FakeTransport(fabric)
    meta = a.register(dst_pool, "h")
    b.register(src_pool, "h")
    peer = b.connect(meta, "h")
    assert b.poll(b.write(peer, [0, 1], [4, 5])) is TransferState.DONE
    assert torch.equal(dst_pool.tensor[:, :, 4:6], src_pool.tensor[:, :, 0:2])
    fabric.drop_writes = True
    assert b.poll(b.write(peer, [2], [6])) is TransferState.FAILED


def test_block_runs_merge_consecutive_pairs():
    assert block_runs([0, 1, 2, 7], [5, 6, 7, 1]) == [(0, 5, 3), (7, 1, 1)]
    assert create_transport("fake").name == "fake"
    with pytest.raises(ValueError):
        create_transport("carrier-pigeon")


def test_pairing_prefers_the_fastest_backend_and_falls_back_loudly():
    from kv_transfer.backends import pair
    pool = KVPoolMemory.allocate(LAYOUT, shared=True)
    try:
        shm, tcp = create_transport("shm"), create_transport("tcp")
        offers = [("tcp", tcp.register(pool, "h")), ("shm", shm.register(pool, "h"))]
        writers = {"shm": create_transport("shm"), "tcp": create_transport("tcp")}
        t, _, fell_back = pair(offers, writers, "h")
        assert t.name == "shm" and not fell_back
        # shared memory that is not reachable from here (another host): pair over TCP, and say so
        gone = json.dumps({**json.loads(offers[1][1]), "path": "/dev/shm/pdserve-kv-0-elsewhere"}).encode()
        seen = []
        t, _, fell_back = pair([offers[0], ("shm", gone)], writers, "h", lambda a, b: seen.append((a, b)))
        assert t.name == "tcp" and fell_back and seen == [("shm", "tcp")]
        with pytest.raises(IncompatiblePeer):
            pair(offers, writers, "other-hash")
        with pytest.raises(IncompatiblePeer, match="no common"):
            pair([("nixl", b"{}")], {"tcp": writers["tcp"]}, "h")
        for x in [shm, tcp, *writers.values()]:
            x.shutdown()
    finally:
        pool.close()


def test_shared_pool_larger_than_dev_shm_is_refused_up_front(monkeypatch):
    import services.engine.model.kv_cache as memory
    monkeypatch.setattr(memory, "shm_free_bytes", lambda: 1024)
    before = live_segments()
    with pytest.raises(MemoryError, match="/dev/shm"):
        KVPoolMemory.allocate(LAYOUT, shared=True)
    assert live_segments() == before


def test_a_tensor_parallel_decode_worker_offers_shm_only_where_every_ranks_pool_fits(monkeypatch):
    """Rank 0's pool fits in /dev/shm, its other rank's would not: shm is not offered
    (the ranks' pools go to private memory, another backend carries the KV) instead of
    the other rank failing to start."""
    from types import SimpleNamespace

    import services.decode.worker as decode
    import services.engine.model.kv_cache as memory
    from services.common.settings import WorkerSettings
    monkeypatch.setattr(memory, "shm_free_bytes", lambda: LAYOUT.nbytes * 3 // 2)
    shm, tcp = create_transport("shm"), create_transport("tcp")
    worker = SimpleNamespace(transports={"shm": shm, "tcp": tcp}, layout=LAYOUT, runner=SimpleNamespace(kv_heads=None))
    pool = decode.DecodeWorker._allocate_pool(worker, WorkerSettings(role="decode", tensor_parallel_size=2), "cpu")
    try:
        assert pool.path is None and list(worker.transports) == ["tcp"]
    finally:
        pool.close()
        tcp.shutdown()
    assert LAYOUT.nbytes == LAYOUT.numel() * 4


@pytest.mark.slow          # the benchmark's own check; the transports are tested above
def test_bandwidth_bench_pairs_every_transfer_with_a_copy(tmp_path):
    """`python -m bench.kv_transfer` (bandwidth part, 1 MiB, 2 rounds) writes, per
    backend, its GB/s, the memcpy it was paired with and the median ratio."""
    import subprocess
    import sys
    out = tmp_path / "kv.json"
    proc = subprocess.run([sys.executable, "-m", "bench.kv_transfer", "--no-ttft", "--sizes", "1", "--repeats", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())["bandwidth"]
    assert {"shm", "tcp"} <= set(result["backends"])
    for rows in [*result["backends"].values(), result["raw_tcp_socket"]]:
        row = rows["1"]
        assert row["gbps"] > 0 and row["memcpy_gbps"] > 0 and 0 < row["ratio_to_memcpy"] < 10
    assert "x memcpy" in proc.stdout


def test_a_pool_on_a_gpu_is_never_offered_through_a_host_only_backend():
    """No GPU is needed to decide: `auto` for a pool on cuda:0 leaves shm and tcp out
    (NIXL, where installed, is all that remains), and naming a host-only backend is
    refused at start with the reason."""
    from kv_transfer.backends import PREFERENCE, open_transports, transport_class
    host_only = [n for n in PREFERENCE if not transport_class(n).device_memory]
    assert set(host_only) == {"shm", "tcp"}
    try:
        opened = open_transports("auto", device="cuda:0")
    except TransferError as exc:                     # no NIXL here: nothing may carry a device pool
        assert "cuda:0" in str(exc) and "nixl" in str(exc).lower()
    else:
        assert set(opened) == {"nixl"}
        for t in opened.values():
            t.shutdown()
    for name in host_only:
        with pytest.raises(TransferError, match="host memory only"):
            open_transports(name, device="cuda:0")
    host = open_transports("auto", device="cpu")                 # a host pool keeps every backend
    try:
        assert {"shm", "tcp"} <= set(host)
    finally:
        for t in host.values():
            t.shutdown()


def test_tcp_receiver_lets_go_of_connections_that_never_say_who_they_are(monkeypatch):
    """Each accepted connection held a thread waiting for its hello for ever, and anyone
    who reached the port could open them by the thousand: one that sends no hello
    within HELLO_SECONDS is closed, and no more than MAX_UNPROVEN wait at once; writers
    still pair and write."""
    import socket

    import kv_transfer.tcp as tcp
    monkeypatch.setattr(tcp, "HELLO_SECONDS", 0.5)
    monkeypatch.setattr(tcp, "MAX_UNPROVEN", 4)
    receiver, sender = create_transport("tcp"), create_transport("tcp", streams=1)
    pool, local = KVPoolMemory.allocate(LAYOUT), KVPoolMemory.allocate(LAYOUT)
    local.tensor.copy_(torch.randn(local.tensor.shape))
    meta = receiver.register(pool, "h")
    port = receiver._listener.getsockname()[1]
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    try:
        time.sleep(0.2)
        assert receiver._unproven <= 4
        time.sleep(1.0)
        assert receiver._unproven == 0
        for s in silent:                         # each closed by the receiver by now
            s.settimeout(2)
            assert s.recv(1) == b""
        sender.register(local, "h")
        peer = sender.connect(meta, "h")
        wait_for(sender, [sender.write(peer, [1, 2], [3, 4])], time.monotonic() + 10)
        assert torch.equal(pool.tensor[:, :, [3, 4]], local.tensor[:, :, [1, 2]])
    finally:
        for s in silent:
            s.close()
        sender.shutdown()
        receiver.shutdown()
