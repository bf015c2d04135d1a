"""Tensor parallelism: one model split over N rank processes, each on its own device
(or, on a CPU, its own core).

Every rank holds a slice of every decoder layer (Megatron's split):

    q|k|v, gate|up      column-parallel: each rank computes its heads / its share of the
                        MLP's intermediate features
    o, down             row-parallel: each rank's partial product, summed over the ranks
                        by one all-reduce each (two a layer)
    embedding           whole on every rank: each has the whole hidden state after
                        each all-reduce
    head                rank 0's, which alone samples (`drop_head`: the others keep no
                        untied one)

The KV cache is split with the heads: rank r holds the KV heads its query heads read.
When the model has fewer KV heads than ranks, heads are replicated (ranks r and r + 1
may hold the same head), as vLLM does; query heads must divide by N, and N by the KV
heads or the KV heads by N. Block ids are the same on every rank, so one scheduler and
one block manager (rank 0's) serve them all.

Rank 0 sends each step's `ForwardBatch` to the others as integers (`encode_batch`),
never a Python pickle; the forward pass then runs on every rank, in lockstep through
its all-reduces. On GPUs torch.distributed carries both: NCCL the all-reduces, a gloo
group the plan. Ranks on one host's CPU use a shared-memory segment for both
(shm_comm.py: microseconds where gloo took a millisecond), gloo for what does not fit.
"""
from __future__ import annotations

import datetime
import enum
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from services.engine.model import fusion, shm_comm
from services.engine.model.shm_comm import SharedMemoryComm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallel:
    """Where a rank stands: its index among `size` ranks."""
    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of {self.size}: not a tensor-parallel position")

    def q_heads(self, num_heads: int) -> range:
        per = num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, num_kv_heads: int) -> range:
        """The global KV heads this rank holds (one, replicated, when heads < ranks)."""
        if num_kv_heads >= self.size:
            per = num_kv_heads // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        head = self.rank // (self.size // num_kv_heads)
        return range(head, head + 1)

    def columns(self, n: int) -> range:
        per = n // self.size
        return range(self.rank * per, (self.rank + 1) * per)


def check_split(config, size: int) -> None:
    """ValueError, naming the numbers, for a model that cannot be split `size` ways."""
    if size == 1:
        return
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    inter = config.intermediate_size
    if heads % size:
        raise ValueError(f"--tensor-parallel-size {size}: the model's {heads} attention heads do not divide by {size}")
    if kv % size and size % kv:
        raise ValueError(f"--tensor-parallel-size {size}: the model's {kv} KV heads neither divide by {size} nor "
                         f"divide it (heads are split, or replicated when fewer than the ranks)")
    if inter % size:
        raise ValueError(f"--tensor-parallel-size {size}: the MLP's {inter} intermediate features do not divide "
                         f"by {size}")


def kv_head_ranges(num_kv_heads: int, size: int) -> list[range]:
    """Each rank's global KV heads, by rank."""
    return [TensorParallel(size, r).kv_heads(num_kv_heads) for r in range(size)]


# A decoder layer's split projections: 0 column-parallel (output features), 1 row-parallel
# (input features, summed over the ranks).
SPLITS = {"self_attn.q_proj": 0, "self_attn.k_proj": 0, "self_attn.v_proj": 0, "self_attn.o_proj": 1,
          "mlp.gate_proj": 0, "mlp.up_proj": 0, "mlp.down_proj": 1}


def _layer_cuts(layer: nn.Module, tp: TensorParallel) -> dict[str, range]:
    """Each split projection of a whole (not yet split) decoder layer -> the features
    of its split dimension (`SPLITS`) that rank `tp.rank` keeps."""
    attn = layer.self_attn
    d = attn.head_dim
    q = tp.q_heads(attn.q_proj.out_features // d)
    kv = tp.kv_heads(attn.k_proj.out_features // d)
    heads, kv_heads = range(q.start * d, q.stop * d), range(kv.start * d, kv.stop * d)
    inter = tp.columns(layer.mlp.gate_proj.out_features)
    return {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads, "self_attn.v_proj": kv_heads,
            "self_attn.o_proj": heads, "mlp.gate_proj": inter, "mlp.up_proj": inter, "mlp.down_proj": inter}


def _sliced(linear: nn.Linear, dim: int, keep: range, keep_bias: bool) -> nn.Linear:
    """`linear`'s features `keep` of dimension `dim` of its weight. A column-parallel
    bias is sliced with it; a row-parallel one stays whole on one rank only
    (`keep_bias`), so the all-reduce adds it once."""
    weight = linear.weight[keep.start:keep.stop] if dim == 0 else linear.weight[:, keep.start:keep.stop]
    bias = None if linear.bias is None or (dim == 1 and not keep_bias) else \
        linear.bias[keep.start:keep.stop] if dim == 0 else linear.bias
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype, device=weight.device)
    out.weight = nn.Parameter(weight.clone(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return out


def shard_model(model: nn.Module, tp: TensorParallel,
                reduce: Callable[[torch.Tensor], torch.Tensor]) -> list[dict[str, range]]:
    """Keep `tp.rank`'s slice of every decoder layer of `model` (in place), and give each
    layer the all-reduce (`reduce`, in place on its argument) that sums its row-parallel
    products; returns what each layer kept (`_layer_cuts`). Only Llama-family layers
    (fusion.lean_compatible) are split: their forward is pdserve's (`LeanDecoderLayer`),
    which calls `reduce` where the split needs it. ValueError for any other."""
    check_split(model.config, tp.size)
    layers = list(getattr(getattr(model, "model", None), "layers", None) or [])
    if not layers or not all(fusion.lean_compatible(layer) for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise ValueError(f"tensor parallelism splits Llama-family decoder layers ({', '.join(fusion.LEAN_LAYERS)}), "
                         f"not {', '.join(kinds) or type(model).__name__}")
    kept = []
    for layer in layers:
        kept.append(_layer_cuts(layer, tp))
        for name, keep in kept[-1].items():
            owner, attr = name.split(".")
            parent = getattr(layer, owner)
            setattr(parent, attr, _sliced(getattr(parent, attr), SPLITS[name], keep, keep_bias=tp.rank == 0))
        layer.pdserve_reduce = reduce
        layer.pdserve_adds_residual = tp.rank == 0
    return kept


class NoHead(nn.Module):
    """A rank after the first in place of an untied head: only rank 0 samples, so the
    others keep no copy of the vocabulary's projection (2.1 GB at 70B in bfloat16)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_empty(hidden.shape[0], 0)


def drop_head(model: nn.Module, tp: TensorParallel) -> bool:
    """On ranks after the first, an untied head goes (`NoHead`); a tied one is the
    embedding's weight, which every rank needs. Whether it went."""
    if tp.rank == 0 or getattr(model.config, "tie_word_embeddings", True):
        return False
    model.lm_head = NoHead(model.config.vocab_size)
    return True


def _checkpoint_cuts(kept: list[dict[str, range]]) -> dict[str, tuple[int, range]]:
    """Checkpoint tensor name -> (dimension, range) of this rank's slice, from what
    `shard_model` kept of each layer (other tensors are loaded whole; row-parallel
    biases too)."""
    cuts: dict[str, tuple[int, range]] = {}
    for i, layer in enumerate(kept):
        for name, keep in layer.items():
            at = f"model.layers.{i}.{name}"
            cuts[at + ".weight"] = (SPLITS[name], keep)
            if SPLITS[name] == 0:
                cuts[at + ".bias"] = (0, keep)
    return cuts


def load_shard(model_dir: Path, config, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
               reduce: Callable[[torch.Tensor], torch.Tensor], attn_implementation: str) -> nn.Module | None:
    """Rank `tp.rank`'s shard of the model in `model_dir`, each weight read from the
    safetensors files as the slice this rank keeps: no rank ever holds the whole model
    (a 70B model is 141 GB in bfloat16), on the host or the device. None where the
    checkpoint is not safetensors (the caller loads it whole, then splits it)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        log.warning("%s has no safetensors files: each rank loads the whole model, then keeps its shard",
                    model_dir)
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    cuts = _checkpoint_cuts(shard_model(model, tp, reduce))
    drop_head(model, tp)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    loaded = set()
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    param = params.get(name)
                    if param is None:
                        continue                # a row-parallel bias or the head, on ranks after the first
                    piece = f.get_slice(name)
                    dim, keep = cuts.get(name, (None, None))
                    t = (piece[keep.start:keep.stop] if dim == 0 else piece[:, keep.start:keep.stop] if dim == 1
                         else piece[:])
                    param.copy_(t.to(dtype))
                    loaded.add(name)
    model.tie_weights()
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint has no {', '.join(missing[:3])}"
                         + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    inner = model.model                 # buffers that are computed, not stored: the rotary angles
    inner.rotary_emb = type(inner.rotary_emb)(config=config).to(device)
    return model.eval()


# ---- the step plan, as integers ----

class Command(enum.IntEnum):
    """What rank 0 tells the others to do next."""
    STEP = 1            # a forward pass: the payload is `encode_batch`'s
    COPY = 2            # copy KV blocks: (src, dst) pairs
    STOP = 3            # leave the loop
    POOL = 4            # allocate the KV pool: (num_blocks, block_size, shared)
    EXPORTS = 5         # a prefill step's writes (services/worker/ranks.py)
    CONNECT = 6         # pair with a peer: the payload is bytes
    CAPTURE = 7         # capture the decode steps' CUDA graphs (their all-reduces run on every rank)


def encode_batch(b) -> list[int]:
    """A `ForwardBatch` as a flat list of ints: all of it (only rank 0 reads the sampled
    rows, but which rows are asked for decides how a step runs: eager or a graph)."""
    out = [len(b.decode_tokens), len(b.prefill_tokens), len(b.segments), len(b.pending_rows),
           len(b.sample_rows), len(b.logprob_rows)]
    out += b.decode_tokens
    out += b.decode_positions
    for table in b.decode_tables:
        out.append(len(table))
        out += table
    out += b.prefill_tokens
    for s in b.segments:
        out += (s.start, s.num_tokens, len(s.block_ids))
        out += s.block_ids
    out += b.pending_rows
    out += b.pending_sources
    out += b.sample_rows
    out += b.logprob_rows
    return out


def decode_batch(ints: list[int], batch_type, segment_type):
    """`encode_batch`'s inverse (the types passed in: the runner's own)."""
    nd, np_, ns, npend, nsample, nlogprob = ints[:6]
    at = 6
    b = batch_type()
    b.decode_tokens = ints[at:at + nd]
    at += nd
    b.decode_positions = ints[at:at + nd]
    at += nd
    for _ in range(nd):
        n = ints[at]
        b.decode_tables.append(ints[at + 1:at + 1 + n])
        at += 1 + n
    b.prefill_tokens = ints[at:at + np_]
    at += np_
    for _ in range(ns):
        start, num, n = ints[at:at + 3]
        b.segments.append(segment_type(start, num, ints[at + 3:at + 3 + n]))
        at += 3 + n
    b.pending_rows = ints[at:at + npend]
    b.pending_sources = ints[at + npend:at + 2 * npend]
    at += 2 * npend
    b.sample_rows = ints[at:at + nsample]
    b.logprob_rows = ints[at + nsample:at + nsample + nlogprob]
    return b


COMMAND_TIMEOUT = datetime.timedelta(days=365)


def rendezvous(size: int, timeout_s: float = 120.0):
    """Rank 0's store for the ranks to meet at, listening on a port of loopback the
    kernel picks (a port found free and bound later may be another's by then: two
    workers starting at once could meet at one), and its address, host:port."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, f"127.0.0.1:{store.port}"


class RankGroup:
    """torch.distributed between a worker's ranks: `control` (gloo, host tensors) carries
    commands, `compute` (gloo on a CPU, NCCL on GPUs) the all-reduces. Ranks on one
    host's CPU do both through shared memory instead (shm_comm.py), gloo taking what
    does not fit there."""

    def __init__(self, tp: TensorParallel, device: torch.device, address: str, timeout_s: float = 120.0,
                 shared: bool = False, store=None) -> None:
        """`address`: rank 0's rendezvous, host:port; `store`: on rank 0, the store
        listening there (`rendezvous`); `shared`: ranks share GPUs (correctness checks),
        where NCCL refuses to run."""
        import torch.distributed as dist
        self.tp = tp
        self.device = device
        self.shared = shared
        backend = "nccl" if device.type == "cuda" and not shared else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:           # rank 0 listens at `address`, the others reach it there
            host, _, port = address.rpartition(":")
            store = dist.TCPStore(host, int(port), tp.size, tp.rank == 0, timeout=timeout,
                                  wait_for_workers=False)
        dist.init_process_group(backend, store=store, rank=tp.rank, world_size=tp.size, timeout=timeout,
                                **({"device_id": device} if backend == "nccl" else {}))
        self.compute = dist.group.WORLD
        # Commands wait as long as rank 0 has none to send (an idle worker): a command
        # group with the compute group's timeout ended every idle rank after it. A dead
        # rank 0 ends the wait by its closed connection, and Ranks.watch a dead follower.
        self.control = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
        self._dist = dist
        self._header = torch.zeros(3, dtype=torch.long)
        self.shm: SharedMemoryComm | None = None
        if shm_comm.usable(device, tp.size):
            self.shm = self._open_shared_memory()

    def _open_shared_memory(self) -> SharedMemoryComm:
        """Rank 0 makes the segment, the others map it; once all have, its name is
        removed (the mappings stay), so nothing is left behind however the ranks end."""
        path = [str(shm_comm.segment_path()) if self.tp.rank == 0 else None]
        comm = SharedMemoryComm(self.tp.rank, self.tp.size, Path(path[0]), create=True) if self.tp.rank == 0 else None
        self._dist.broadcast_object_list(path, 0, group=self.control)
        if comm is None:
            comm = SharedMemoryComm(self.tp.rank, self.tp.size, Path(path[0]), create=False)
        self._dist.barrier(group=self.control)
        if self.tp.rank == 0:
            Path(path[0]).unlink(missing_ok=True)
        return comm

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and self.shm.fits(t):         # the same answer on every rank: same shapes
            return self.shm.all_reduce(t)
        self._dist.all_reduce(t, group=self.compute)
        return t

    def lost(self, why: str) -> None:
        """The ranks may no longer run the same step (one failed a forward pass, a block
        copy or a graph capture that the others may have done): nothing they compute can
        be trusted, so this process exits (code 70, as when a rank dies) and the worker is
        started again."""
        log.critical("tensor-parallel rank %d: %s; exiting, the ranks are out of step", self.tp.rank, why)
        logging.shutdown()
        os._exit(70)

    # ---- rank 0 ----
    def send(self, command: Command, ints: list[int] = (), data: bytes = b"") -> None:
        if self.shm is not None:
            payload = np.array([int(command), len(ints), len(data), *ints], dtype=np.int64).tobytes() + data
            if self.shm.send(payload):
                return
        self._header.copy_(torch.tensor([int(command), len(ints), len(data)]))
        self._dist.broadcast(self._header, 0, group=self.control)
        if ints:
            self._dist.broadcast(torch.tensor(ints, dtype=torch.long), 0, group=self.control)
        if data:
            self._dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.control)

    def send_tensor(self, t: torch.Tensor) -> None:
        """A device tensor (async scheduling's pending tokens) to the others, through the
        compute group: no trip through the host."""
        self._dist.broadcast(t, 0, group=self.compute)

    # ---- the others ----
    def receive(self) -> tuple[Command, list[int], bytes]:
        if self.shm is not None:
            payload = self.shm.receive()
            if payload is not None:
                head = np.frombuffer(payload, dtype=np.int64, count=3)
                command, n, nbytes = (int(x) for x in head)
                ints = np.frombuffer(payload, dtype=np.int64, count=n, offset=24).tolist()
                return Command(command), ints, payload[24 + 8 * n:24 + 8 * n + nbytes]
        self._dist.broadcast(self._header, 0, group=self.control)
        command, n, nbytes = self._header.tolist()
        ints: list[int] = []
        data = b""
        if n:
            buf = torch.empty(n, dtype=torch.long)
            self._dist.broadcast(buf, 0, group=self.control)
            ints = buf.tolist()
        if nbytes:
            raw = torch.empty(nbytes, dtype=torch.uint8)
            self._dist.broadcast(raw, 0, group=self.control)
            data = raw.numpy().tobytes()
        return Command(command), ints, data

    def receive_tensor(self, n: int) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.long, device=self.device)
        self._dist.broadcast(t, 0, group=self.compute)
        return t

    def marked(self, n: int, mine: list[int]) -> list[int]:
        """Which of `n` items any rank marks (every rank calls it, with its own marks): a
        0/1 tensor summed over the ranks, no pickle."""
        flags = torch.zeros(n, dtype=torch.long)
        if mine:
            flags[torch.tensor(mine)] = 1
        self._dist.all_reduce(flags, group=self.control)
        return flags.nonzero().flatten().tolist()

    # ---- start-up only: small objects, pickled once ----
    def gather(self, obj) -> list | None:
        out = [None] * self.tp.size if self.tp.rank == 0 else None
        self._dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        try:
            self._dist.destroy_process_group()
        except Exception:              # noqa: BLE001 - a peer already gone: nothing left to tear down
            pass
