"""One settings object per service, built once from the command line and validated.

Each setting is a field declared with `setting(...)`: its help text, choices and flags
travel with it, and flags.py makes the command line, the PDSERVE_* defaults and the
argv `pdserve up` starts its services with from these classes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from services.common.flags import setting
from services.common.security import TLSFiles
from services.common.speculative_config import SpeculativeConfig

DTYPES = ("auto", "bfloat16", "float32", "float16")
KV_TRANSPORTS = ("auto", "shm", "nixl", "tcp")
ATTENTION_KERNELS = ("auto", "native", "torch")
MATMUL_KERNELS = ("auto", "native", "onednn")
QUANTIZATIONS = ("none", "int8")
ASYNC_SCHEDULING = ("auto", "on", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
LOG_FORMAT_HELP = "text: one line per record; json: one JSON object per record, for log collectors"
MODES = ("disaggregated", "aggregated")
CLUSTER_SECRET_HELP = ("the cluster secret (a file): signs registry records, and every router -> worker call "
                      "carries a credential derived from it. Without it any caller that reaches a worker "
                      "can drive it")


def check_ports(settings) -> None:
    """Every *_port setting a port number (0: any free one)."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.name.endswith("_port") and not 0 <= value <= 65535:
            flag = (f.metadata.get("flags") or (f"--{f.name.replace('_', '-')}",))[0]
            raise ValueError(f"{flag} must be a port number, 0-65535 (0: any free one), not {value}")


def check_log_format(value: str) -> None:
    """argparse checks choices on the command line only, not a PDSERVE_ variable's value."""
    if value not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")


# ---- the settings objects ----

@dataclass(kw_only=True)
class EngineSettings:
    """What every worker's engine is built from; `pdserve up` takes the same flags."""
    model: str | None = setting(None, "a local Hugging Face model folder or a Hub id (org/name: the local "
                                      "Hugging Face cache first, then the Hub) (default: SmolLM2-135M-Instruct, "
                                      "converted once)")
    revision: str | None = setting(None, "with a Hub id: the branch, tag or commit (default: main)")
    dtype: str = setting("auto", "weights and KV cache dtype; auto: bfloat16 on GPUs and on CPUs that "
                                 "compute it natively (AVX512-BF16, AMX), float32 on other CPUs", choices=DTYPES)
    quantization: str = setting("none", "int8: the decoder layers' matmuls with int8 weights (per channel) and "
                                        "activations quantized per token, like vLLM's dynamic W8A8; CPU only, "
                                        "Llama-family models; faster, not bit-exact (opt-in)",
                                choices=QUANTIZATIONS)
    device: str = setting("auto", "cpu, cuda, cuda:N or auto")
    tensor_parallel_size: int = setting(
        1, "rank processes this worker's model is split over (Megatron-style: attention heads and MLP features "
           "per rank, an all-reduce after each block half, the KV cache split by head); one GPU each from "
           "--device on, or on a CPU one process each. Prefill and decode workers may differ: KV is resharded "
           "on its way across", flags=("--tensor-parallel-size", "-tp"))
    block_size: int = setting(16, "tokens per KV block")
    max_model_len: int = setting(0, "longest sequence (prompt and output) served, in tokens (0: the model's own "
                                    "context length)")
    threads: int = setting(0, "torch threads per worker (0: automatic)")
    own_threads: int = setting(0, "of --threads, those on cores of this worker's own; the others run on cores "
                                  "lent to it at a lower priority, and a forward pass of fewer than 128 tokens, "
                                  "too small to gain from them, runs without them (0: all are its own; `up` sets "
                                  "it for a prefill worker lent the decode cores)")
    attention_kernel: str = setting("auto", "attention: native (C kernels built on first use; CPU), torch "
                                            "(torch's own ops), or auto (native where it is faster on a CPU: "
                                            "bfloat16 prefill measured at start against torch's SDPA; Triton "
                                            "paged kernels on a GPU)",
                                    choices=ATTENTION_KERNELS)
    matmul_kernel: str = setting("auto", "bfloat16 matmuls on a CPU with AVX512-BF16: native (pdserve's, and a "
                                         "decode step's layers in one call), onednn (torch's; AMX tiles where the CPU "
                                         "has them), or auto (measured at start on the model's own layers, at the "
                                         "rows of this worker's role; the CPU's rule where only one runs)",
                                 choices=MATMUL_KERNELS)
    enforce_eager: bool = setting(False, "on a GPU: run decode steps eagerly instead of replaying CUDA graphs "
                                         "captured per batch size (as vLLM's --enforce-eager)",
                                  roles=("decode",))
    async_scheduling: str = setting(
        "auto", "decode workers: plan and launch each step before reading the last one's tokens, so the device "
                "computes a step while the host handles the one before (as vLLM's --async-scheduling); auto: on a "
                "GPU (on a CPU the forward pass itself holds the host, so there is nothing to overlap)",
        choices=ASYNC_SCHEDULING, roles=("decode",))
    speculative_config: str | None = setting(
        None, "decode workers: speculative decoding, as a JSON object like vLLM's flag: "
              "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}', or method "
              "suffix (a frequency index over each prompt, its output and the worker's recent outputs); drafts are "
              "verified in one forward pass, the output is what it is without them, and how much to draft is "
              "decided each step from measured acceptance and step cost (\"adaptive\": false drafts all it finds)",
        roles=("decode",), metavar="JSON")
    kv_cache_tokens: int = setting(0, "decode workers' KV pool size in tokens (0: 65536 on a CPU; on a GPU what "
                                      "--gpu-memory-utilization leaves after the weights)", roles=("decode",))
    gpu_memory_utilization: float = setting(0.9, "on a GPU: the share of the card's memory this worker may use, "
                                                 "weights, activations and KV pool together",
                                            roles=("decode",))
    max_batch: int = setting(64, "most sequences in a decode worker's running batch", roles=("decode",))
    max_num_batched_tokens: int = setting(
        0, "tokens one forward pass may hold: decode tokens plus prompt chunks (0: 1024 on prefill "
           "workers, 512 on decode workers; on a GPU 8192 and 2048)")
    prefill_chunk_tokens: int = setting(0, "most tokens of one prompt in a forward pass (0: as many as the "
                                           "token budget leaves)")
    mixed_prefill_tokens: int = setting(
        -1, "decode workers: most prompt tokens in a forward pass that also decodes running sequences; it bounds "
            "the gap between their tokens while prompts are computed alongside (0: as many as the token budget "
            "leaves; -1: 64 on a CPU, 512 on a GPU)", roles=("decode",))
    mixed_whole_prompt_tokens: int = setting(
        -1, "decode workers: a new prompt of up to this many tokens may still go whole into a step that decodes, "
            "past --mixed-prefill-tokens, when no other prompt tokens are in it; longer ones are cut as that says "
            "(0: none; -1: the token budget with --mode aggregated on a CPU, else none)", roles=("decode",))
    prefix_cache_tokens: int = setting(16384, "prefill workers: prompt KV kept for reuse by later prompts with "
                                              "the same prefix (0: off)", roles=("prefill",))
    enable_prefix_caching: bool = setting(
        True, "decode workers: the prompts they compute themselves (every prompt with --mode aggregated; short ones "
              "otherwise) leave their full KV blocks cached in the pool's free space for later prompts with the same "
              "prefix, least recently used first out when the pool needs the room", roles=("decode",))
    kv_transport: str = setting("auto", "KV transfer backend; auto offers/uses the fastest that works for each "
                                        "pair", choices=KV_TRANSPORTS)
    log_level: str = setting("info", "", choices=LOG_LEVELS)
    log_format: str = setting("text", LOG_FORMAT_HELP, choices=LOG_FORMATS)

    def __post_init__(self) -> None:
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"--attention-kernel must be one of {', '.join(ATTENTION_KERNELS)}")
        if self.matmul_kernel not in MATMUL_KERNELS:
            raise ValueError(f"--matmul-kernel must be one of {', '.join(MATMUL_KERNELS)}")
        if self.async_scheduling not in ASYNC_SCHEDULING:
            raise ValueError(f"--async-scheduling must be one of {', '.join(ASYNC_SCHEDULING)}")
        if self.speculative_config:
            self.speculation()
        check_log_format(self.log_format)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("--block-size must be a power of two")
        if self.kv_cache_tokens and self.kv_cache_tokens < self.block_size:
            raise ValueError("--kv-cache-tokens must hold at least one block (or 0: sized for the device)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.prefill_chunk_tokens < 0:
            raise ValueError("--prefill-chunk-tokens must be 0 (as the budget allows) or more")
        if self.mixed_prefill_tokens < -1:
            raise ValueError("--mixed-prefill-tokens must be -1 (automatic), 0 (as the budget allows) or more")
        if self.mixed_whole_prompt_tokens < -1:
            raise ValueError("--mixed-whole-prompt-tokens must be -1 (automatic), 0 (none) or more")
        if self.prefix_cache_tokens < 0:
            raise ValueError("--prefix-cache-tokens must be 0 (off) or more")
        if self.max_batch < 1:
            raise ValueError("--max-batch must be at least 1")
        if self.max_model_len < 0:
            raise ValueError("--max-model-len must be 0 (the model's own) or more")
        if self.threads < 0:
            raise ValueError("--threads must be 0 (automatic) or more")
        if self.own_threads < 0:
            raise ValueError("--own-threads must be 0 (all) or more")
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be at least 1")
        if self.tensor_parallel_size > 1 and self.quantization != "none":
            raise ValueError("--quantization int8 and --tensor-parallel-size do not combine yet")
        if self.max_num_batched_tokens and self.max_num_batched_tokens < self.max_batch:
            raise ValueError(f"--max-num-batched-tokens {self.max_num_batched_tokens} cannot hold a decode token "
                             f"for each of --max-batch {self.max_batch} sequences")

    def speculation(self):
        """The parsed --speculative-config, or None; ValueError for one that is not valid."""
        if not self.speculative_config:
            return None
        return SpeculativeConfig.parse(self.speculative_config)


# A worker's stop, past its drain: the gRPC server's grace for calls still running, then
# what it may take past its parts' own bounds before it counts as stuck.
SHUTDOWN_GRACE_SECONDS = 5.0
STOP_SLACK_SECONDS = 15.0


@dataclass(kw_only=True)
class WorkerSettings(EngineSettings):
    """`pdserve prefill` and `pdserve decode`."""
    role: str                           # "prefill" or "decode": the subcommand, not a flag
    host: str = setting("127.0.0.1", "address every listener of this worker binds")
    grpc_port: int = setting(0, "gRPC port (0: any free port)", flags=("--port",))
    metrics_port: int = setting(0, "Prometheus /metrics port (0: any free port)")
    advertise: str | None = setting(None, "address routers and peers use to reach this worker (default: --host "
                                          "and the bound port)", metavar="HOST[:PORT]")
    redis: str | None = setting(None, "Redis registry (redis://host:6379/0): workers announce themselves, routers "
                                      "discover them", metavar="URL")
    registry_ttl: float = setting(3.0, "seconds a worker stays routable after its last heartbeat")
    drain_timeout: float = setting(30.0, "on SIGTERM, seconds accepted requests may still run before the worker "
                                         "stops")
    max_lease_seconds: float = setting(300.0, "decode workers: the longest a KV reservation may wait for its "
                                              "writer, whatever the caller asks", roles=("decode",))
    cluster_secret_file: str | None = setting(None, CLUSTER_SECRET_HELP, metavar="FILE")
    tls_cert: str | None = setting(None, "serve gRPC over TLS with this certificate (PEM; needs --tls-key)",
                                   metavar="FILE")
    tls_key: str | None = setting(None, "the private key of --tls-cert (PEM)", metavar="FILE")
    tls_ca: str | None = setting(None, "mutual TLS: callers must present a certificate this CA signed (PEM)",
                                 metavar="FILE")
    fault_drop_transfers: float = setting(0.0, "fault testing: fraction of KV transfers to drop midway",
                                          roles=("prefill",))
    fault_refuse_decodes: int = setting(0, "fault testing: answer this many Decode calls UNAVAILABLE, as a worker "
                                           "lost between a prompt's prefill and its decode", roles=("decode",))
    served_model_name: list[str] = setting(help="the model_name label of this worker's vLLM-style metrics: the "
                                                "first of the router's --served-model-name (default: the model "
                                                "folder's name)", metavar="NAME", factory=list, several=True)
    announce_file: str | None = setting(None, argparse.SUPPRESS)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ports(self)
        if self.tls_ca and not self.tls_cert:
            raise ValueError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key")
        TLSFiles(self.tls_cert, self.tls_key, self.tls_ca)          # the files exist, in pairs
        if not 0.0 <= self.fault_drop_transfers <= 1.0:
            raise ValueError("--fault-drop-transfers must be in [0, 1]")
        if self.fault_refuse_decodes < 0:
            raise ValueError("--fault-refuse-decodes must be 0 or more")
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, not {self.role!r}")
        if self.registry_ttl <= 0:
            raise ValueError("--registry-ttl must be positive")
        if not self.max_lease_seconds > 0:
            raise ValueError("--max-lease-seconds must be positive")

    @property
    def advertise_host(self) -> str:
        host, _, port = (self.advertise or self.host).rpartition(":")
        return host if port.isdigit() and host else (self.advertise or self.host)

    def advertise_address(self, bound_port: int) -> str:
        """host:port routers dial: --advertise as given, else its host and the bound port."""
        host, _, port = (self.advertise or "").rpartition(":")
        if port.isdigit() and host:
            return self.advertise
        return f"{self.advertise_host}:{bound_port}"

    @property
    def tls(self) -> TLSFiles:
        return TLSFiles(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def stop_seconds(self) -> float:
        """The longest a stop takes before it counts as stuck (the worker then exits at
        once): the drain, the gRPC server's grace, the engine thread's join (10 s), the
        ranks' (10 s each, one after another), and slack. Whoever stops a worker waits
        this long before killing it."""
        return self.drain_timeout + SHUTDOWN_GRACE_SECONDS + 10 * self.tensor_parallel_size + STOP_SLACK_SECONDS

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (on a GPU). Never on a prefill worker:
        its steps export each layer's KV as it is written, so they run eagerly on rank 0,
        and under tensor parallelism every rank must run a step the same way (a replayed
        graph's all-reduces are of its batch size's padding)."""
        return not self.enforce_eager and self.role != "prefill"

    def transport_options(self) -> dict[str, dict]:
        # A NIXL writer drives its own transfers when it polls; the receiving side needs a
        # progress thread. Across hosts (UCX over the network) every write waits for it:
        # at 50 ms a 32 KiB write took 40 ms, with none writes never landed; at 2 ms, 1.4 ms
        # for 2-4 % of a busy decode loop (bench/nixl_progress.py, docs/benchmarks.md).
        # A worker bound to loopback has only same-host peers, which UCX serves by CMA
        # with the progress thread pacing handshakes only: there a slow one suffices.
        local = self.host in ("127.0.0.1", "localhost", "::1")
        receiver = 0.05 if local else 0.002
        nixl = {"progress_interval": receiver if self.role == "decode" else 0.0, "host": self.host}
        return {"tcp": {"host": self.host, "advertise": self.advertise_host}, "nixl": nixl}


@dataclass(kw_only=True)
class RoutingSettings:
    """How a router admits and places requests; `pdserve up` takes the same flags."""
    max_pending: int = setting(512, "requests admitted at once, queued or running; beyond it new ones get 429 / "
                                    "RESOURCE_EXHAUSTED, except from an API key holding less than its share")
    max_running: int = setting(0, "sequences dispatched to the workers at once; the rest wait in the router's "
                                  "queue, shared fairly among API keys (0: what the decode workers batch)")
    local_prefill_max_tokens: int = setting(
        512, "prompts up to this size may prefill on the decode worker when the cost model says it is "
             "faster, longer ones only while the prefill workers are backed up (0: always use a prefill "
             "worker)")
    served_model_name: list[str] = setting(help="the model name clients send (default: the model folder's name); "
                                                "several are aliases of one model, the first named in answers",
                                           metavar="NAME", factory=list, several=True)
    api_key: list[str] = setting(help="an API key clients must send (Authorization: Bearer KEY); repeat for "
                                      "several. A key given here shows in this process's command line, which "
                                      "any local user can read (ps): prefer --api-key-file, or PDSERVE_API_KEY "
                                      "(a comma-separated list)", metavar="KEY", factory=list)
    api_key_file: str | None = setting(None, "API keys, one per line (with --api-key: both are accepted)",
                                       metavar="FILE")
    protect_metrics: bool = setting(False, "/metrics needs an API key too (/health and /ready stay open)")
    shared_prefix_cache: bool = setting(False, "prompts of different API keys share the prefix cache. By default "
                                               "each key's prompts find only its own cached blocks, so no key can "
                                               "tell from cached_tokens or its time to first token what another "
                                               "sent")
    allowed_origins: list[str] = setting(help="a web origin allowed to call the API from a browser (CORS); "
                                              "repeat for several, * for any. Default: none", metavar="ORIGIN",
                                         factory=list)
    tls_cert: str | None = setting(None, "serve HTTP and gRPC over TLS with this certificate (PEM; needs "
                                         "--tls-key)", metavar="FILE")
    tls_key: str | None = setting(None, "the private key of --tls-cert (PEM)", metavar="FILE")
    chat_template: str | None = setting(None, "a Jinja chat template file used instead of the model's own (e.g. "
                                              "one that supports tools)", metavar="FILE")
    generation_config: str = setting(
        "auto", "sampling defaults for the fields a request leaves out: auto, the model's generation_config.json "
                "(its temperature, top_p, top_k, min_p, repetition, presence and frequency penalties, and "
                "max_new_tokens as the default max_tokens), as vLLM does; vllm, none from a file (OpenAI's: "
                "temperature 1, no top-p or top-k cut); or a folder holding a generation_config.json",
        metavar="auto|vllm|FOLDER")
    reasoning_parser: str = setting(
        "none", "a reasoning model's thinking (between <think> and </think>) goes out as a chat message's "
                "`reasoning` (and `reasoning_content`), apart from its `content`, and a structured output's "
                "grammar holds only the answer after </think>, as vLLM's parsers of these names do",
        choices=("none", "deepseek_r1", "qwen3"))
    tool_call_parser: str = setting(
        "hermes", "how the model writes tool calls in free text (tool_choice auto), by vLLM's names: hermes "
                  "(or qwen3_json), <tool_call>{...}</tool_call> (Qwen, Hermes); longcat, the same in "
                  "<longcat_tool_call> tags (LongCat-Flash); qwen3_coder (or qwen3_xml), "
                  "<tool_call><function=...><parameter=...> (Qwen3-Coder); glm45 (or glm47), "
                  "<tool_call>NAME<arg_key>...</arg_key><arg_value>...</arg_value> (GLM-4.5 to 4.7); minimax_m2, "
                  "<minimax:tool_call><invoke name=...><parameter name=...> (MiniMax-M2); llama3_json (or "
                  "llama4_json), an answer of JSON calls (Llama 3.1-3.3); "
                  "pythonic, an answer of a Python list of calls (Llama 3.2 and 4); mistral, calls after "
                  "[TOOL_CALLS] (Mistral); jamba, a JSON list in <tool_calls></tool_calls> (Jamba); "
                  "phi4_mini_json, a JSON list after functools (Phi-4-mini); internlm, a JSON call in "
                  "<|action_start|><|plugin|> (InternLM2); deepseek_v3, deepseek_v31 and kimi_k2, calls in "
                  "those models' tool-call tokens",
        choices=("hermes", "qwen3_json", "longcat", "qwen3_coder", "qwen3_xml", "glm45", "glm47", "minimax_m2",
                 "llama3_json", "llama4_json", "pythonic", "mistral", "jamba", "phi4_mini_json", "internlm",
                 "deepseek_v3", "deepseek_v31", "kimi_k2"))
    tool_strict_level: str = setting(
        "auto", "which tool_choice auto calls a grammar holds (vLLM's flag): auto, those of a request with a "
                "tool marked strict (OpenAI's `strict`; its arguments held to its parameters, the others' to a JSON "
                "object); function, every request's (the call's name one of its tools', its arguments JSON); "
                "parameter, every request's, each tool taken as strict. Needs a parser whose calls a grammar "
                "can hold (hermes, qwen3_json, longcat, qwen3_coder, qwen3_xml, glm45, glm47); with the others a "
                "tool's strict changes nothing",
        choices=("auto", "function", "parameter"))
    enable_auto_tool_choice: bool = setting(
        True, "tool_choice auto (the default when a request has tools): the model may call a tool or answer, "
              "its calls found by --tool-call-parser. On by default, where vLLM needs this flag; without it "
              "only required, named and none are served")
    override_generation_config: str | None = setting(
        None, "a JSON object of those fields over the defaults, e.g. '{\"temperature\": 0.5}' (vLLM's flag)",
        metavar="JSON")
    sse_keepalive_seconds: float = setting(15.0, "a streamed response waiting this long for its next token gets "
                                                 "an SSE comment, so proxies do not cut it as idle (0: never)")
    header_timeout: float = setting(10.0, "seconds an HTTP connection has to send a whole request head (request "
                                          "line and headers), from its opening or its previous response's end; "
                                          "then it is closed (0: no limit)")
    body_timeout: float = setting(30.0, "seconds a request's body has to arrive whole once its head is in; then "
                                        "a 408 and the connection closes (0: no limit)")
    max_connections_per_client: int = setting(
        512, "HTTP connections one client address may hold open at once; the next gets 429 and is closed (0: no "
             "cap). Behind a proxy every connection comes from its address: raise it there")

    def __post_init__(self) -> None:
        check_ports(self)
        TLSFiles(self.tls_cert, self.tls_key)                       # the files exist, in pairs
        if self.chat_template and not Path(self.chat_template).is_file():
            raise ValueError(f"--chat-template {self.chat_template}: no such file")
        if self.generation_config not in ("auto", "vllm", "none") and not Path(self.generation_config).is_dir():
            raise ValueError(f"--generation-config {self.generation_config}: not auto, vllm or a folder")
        self.generation_overrides                                  # the JSON is an object
        if self.sse_keepalive_seconds < 0:
            raise ValueError("--sse-keepalive-seconds must be 0 (never) or more")
        if self.header_timeout < 0:
            raise ValueError("--header-timeout must be 0 (no limit) or more")
        if self.body_timeout < 0:
            raise ValueError("--body-timeout must be 0 (no limit) or more")
        if self.max_connections_per_client < 0:
            raise ValueError("--max-connections-per-client must be 0 (no cap) or more")
        if self.local_prefill_max_tokens < 0:
            raise ValueError("--local-prefill-max-tokens must be 0 (always disaggregate) or more")
        if self.max_pending < 1:
            raise ValueError("--max-pending must be at least 1")
        if self.max_running < 0:
            raise ValueError("--max-running must be 0 (the decode workers' batches) or more")

    @property
    def generation_overrides(self) -> dict:
        """--override-generation-config, read."""
        try:
            value = json.loads(self.override_generation_config or "{}")
        except ValueError as exc:
            raise ValueError(f"--override-generation-config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.5}'")
        return value


@dataclass(kw_only=True)
class RouterSettings(RoutingSettings):
    """`pdserve router`."""
    model: str | None = setting(None, "a local Hugging Face model folder (its tokenizer and chat template; "
                                      "default: SmolLM2-135M-Instruct)")
    revision: str | None = setting(None, "with a Hub id: the branch, tag or commit (default: main)")
    host: str = setting("127.0.0.1", "address the HTTP and gRPC listeners bind")
    http_port: int = setting(8000, "OpenAI-compatible HTTP port")
    grpc_port: int = setting(50051, "gRPC Generate API port")
    prefill: list[str] = setting(help="a prefill worker's address (repeat for several; or use --redis)",
                                 metavar="HOST:PORT", factory=list)
    decode: list[str] = setting(help="a decode worker's address (repeat for several; or use --redis)",
                                metavar="HOST:PORT", factory=list)
    redis: str | None = setting(None, "discover workers in this Redis registry instead of --prefill/--decode",
                                metavar="URL")
    registry_ttl: float = setting(3.0, "seconds a worker stays routable after its last heartbeat")
    drain_timeout: float = setting(30.0, "on SIGTERM, seconds requests already running may still take; then each "
                                         "ends with a 503 (a stream: an error event and [DONE])")
    max_model_len: int = setting(0, "longest sequence (prompt and output) admitted, in tokens (0: the model's "
                                    "own context length)")
    aggregated: bool = setting(False, "no prefill pool: decode workers prefill every prompt themselves")
    request_timeout: float = setting(600.0, "seconds a request may take end to end")
    prefill_timeout: float = setting(120.0, "seconds a remote prefill may take; also the KV write lease a "
                                            "reservation asks for")
    max_body_bytes: int = setting(8 * 1024 * 1024, "largest request accepted: an HTTP body, a gRPC message")
    cluster_secret_file: str | None = setting(None, CLUSTER_SECRET_HELP, metavar="FILE")
    worker_tls_ca: str | None = setting(None, "reach workers over TLS, verifying their certificates with this CA "
                                              "(PEM)", metavar="FILE")
    worker_tls_cert: str | None = setting(None, "mutual TLS to workers: the router's client certificate (PEM)",
                                          metavar="FILE")
    worker_tls_key: str | None = setting(None, "the private key of --worker-tls-cert (PEM)", metavar="FILE")
    worker_tls_server_name: str | None = setting(None, "the name workers' certificates carry, when they are "
                                                       "dialled by address", metavar="NAME")
    announce_file: str | None = setting(None, argparse.SUPPRESS)
    log_level: str = setting("info", "", choices=LOG_LEVELS)
    log_format: str = setting("text", LOG_FORMAT_HELP, choices=LOG_FORMATS)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.worker_tls_cert and not self.worker_tls_ca:
            raise ValueError("--worker-tls-cert (mutual TLS) needs --worker-tls-ca")
        TLSFiles(self.worker_tls_cert, self.worker_tls_key, self.worker_tls_ca)
        check_log_format(self.log_format)
        if not self.redis and (not self.decode or not (self.prefill or self.aggregated)):
            raise ValueError("the router needs --redis, or at least one --decode and one --prefill address "
                             "(or --aggregated)")

    @property
    def worker_tls(self) -> TLSFiles:
        return TLSFiles(self.worker_tls_cert, self.worker_tls_key, self.worker_tls_ca)


@dataclass(kw_only=True)
class ClusterSettings(RoutingSettings, EngineSettings):
    """`pdserve up`: the shape of the local (or Ray) cluster, plus the engine and routing
    settings its services are started with."""
    mode: str = setting("disaggregated", "disaggregated: prefill and decode workers, one core each when they "
                                         "fit; aggregated: decode workers that also prefill, sharing the cores",
                        choices=MODES)
    num_prefill: int = setting(1, "prefill workers", flags=("--prefill",), metavar="N")
    num_decode: int = setting(0, "decode workers (0: one; with --mode aggregated on CPU, one single-threaded "
                                 "worker per core)", flags=("--decode",), metavar="M")
    host: str = setting("127.0.0.1", "address the router's listeners bind")
    http_port: int = setting(8000, "OpenAI-compatible HTTP port")
    grpc_port: int = setting(50051, "gRPC Generate API port")
    pin_cpus: bool = setting(True, "pin each disaggregated worker to a core of its own when they fit")
    lend_decode_cores: bool = setting(False, "with --pin-cpus: each prefill worker also runs a thread on the decode "
                                             "workers' cores, at a lower priority, to use the time decode leaves "
                                             "idle there. Off by default: on a 2-core Zen 4 it gained nothing on "
                                             "vLLM's chat and long presets, and a long pass waits at every barrier "
                                             "for the thread on a busy decode core")
    prefill_tp: int = setting(0, "prefill workers' --tensor-parallel-size (0: --tensor-parallel-size)",
                              flags=("--prefill-tp",), metavar="P")
    decode_tp: int = setting(0, "decode workers' --tensor-parallel-size (0: --tensor-parallel-size); it may differ "
                                "from the prefill workers': KV is resharded on its way across",
                             flags=("--decode-tp",), metavar="D")
    gpus_per_worker: int = setting(1, "on a CUDA machine: GPUs each worker gets to itself (CUDA_VISIBLE_DEVICES); "
                                      "at least its tensor-parallel size")
    share_gpus: bool = setting(False, "place workers on GPUs already in use when there are too few (size each "
                                      "one's share with --gpu-memory-utilization)")
    redis: str | None = setting(None, "registry to use; default: start a private redis-server if one is "
                                      "installed, else give the router the workers' addresses", metavar="URL")
    private_registry: bool = setting(True, "without --redis, start a private redis-server as the registry when "
                                           "one is installed (off: the router is given the workers' addresses; "
                                           "not with --autoscale or --ray)")
    announce_file: str | None = setting(None, "write the cluster's addresses here as JSON")
    fork_server: bool = setting(True, "start each worker by forking a process that imported torch, transformers "
                                      "and pdserve once (Linux), not as a fresh interpreter: ~4 s less CPU a "
                                      "worker, and one that died serves again sooner (the router, which loads no "
                                      "torch, starts as a fresh interpreter either way)")
    autoscale: bool = setting(False, "grow and shrink each pool on its own signal within --min/--max-prefill/"
                                     "decode (needs the Redis registry); --prefill/--decode are the starting sizes")
    ray: bool = setting(False, "run the services as Ray actors (see --address)")
    address: str | None = setting(None, "with --ray: the Ray cluster to join (default: start a Ray instance on "
                                        "this machine)", metavar="ADDR")

    def __post_init__(self) -> None:
        EngineSettings.__post_init__(self)
        RoutingSettings.__post_init__(self)
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}")
        if self.address and not self.ray:
            raise ValueError("--address is the Ray cluster to join: it needs --ray")
        if self.num_decode < 0 or self.num_prefill < 0:
            raise ValueError("--prefill and --decode are worker counts")
        if self.gpus_per_worker < 1:
            raise ValueError("--gpus-per-worker must be at least 1")
        if self.prefill_tp < 0 or self.decode_tp < 0:
            raise ValueError("--prefill-tp and --decode-tp must be 0 (--tensor-parallel-size) or more")
        if not self.redis and not self.private_registry and (self.autoscale or self.ray):
            raise ValueError(f"{'--autoscale' if self.autoscale else '--ray'} needs a registry: --redis URL, "
                             "or drop --no-private-registry")

    @property
    def aggregated(self) -> bool:
        return self.mode == "aggregated"

    def tp(self, role: str) -> int:
        """The tensor-parallel size of `role`'s workers."""
        return (self.prefill_tp if role == "prefill" else self.decode_tp) or self.tensor_parallel_size

    def worker(self, role: str, **overrides) -> WorkerSettings:
        """A worker's settings: this cluster's engine settings, listening on loopback."""
        base = {f.name for f in dataclasses.fields(EngineSettings)}
        kwargs = {name: getattr(self, name) for name in base}
        kwargs.update(role=role, host="127.0.0.1", served_model_name=self.served_model_name,
                      tensor_parallel_size=self.tp(role))
        kwargs.update(overrides)
        return WorkerSettings(**kwargs)

    def router(self, **overrides) -> RouterSettings:
        routing = {f.name for f in dataclasses.fields(RoutingSettings)}
        kwargs = {name: getattr(self, name) for name in routing}
        kwargs.update(model=self.model, revision=self.revision, host=self.host, http_port=self.http_port,
                      grpc_port=self.grpc_port,
                      aggregated=self.aggregated, log_level=self.log_level, log_format=self.log_format,
                      max_model_len=self.max_model_len)
        kwargs.update(overrides)
        return RouterSettings(**kwargs)
