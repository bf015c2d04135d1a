"""The model the peers serve: a bfloat16 safetensors copy of pdserve's default model
(whose cache holds float32 weights), made once next to the peers.

    python -m bench.peers.model SRC DST
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path


def has_weights(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def is_bf16_safetensors(folder: Path) -> bool:
    if not has_weights(folder):
        return False
    config = json.loads((folder / "config.json").read_text())
    return (config.get("dtype") or config.get("torch_dtype")) == "bfloat16"


def bf16_copy(src: Path, dst: Path) -> Path:
    """`dst` as a bf16 safetensors copy of `src` (tokenizer and chat template too)."""
    if has_weights(dst):
        return dst
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
    if dst.exists():                    # another run finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(dst)
    return dst


if __name__ == "__main__":
    print(bf16_copy(Path(sys.argv[1]), Path(sys.argv[2])))
