"""Text in and out: chat templates, incremental UTF-8-safe detokenization, stop strings."""
from __future__ import annotations

import codecs
import copy
import functools
import json
from pathlib import Path

from services.engine.text.model_store import generic_config


def load_tokenizer(model_dir: Path):
    """The tokenizer class the model's tokenizer_config.json names, loaded alone: a
    tokenizer's module imports no torch, and the router loads none. Where it names no
    class transformers has, the class AutoTokenizer picks, handed the generic config
    (model_store.generic_config: the same model type without the model's own config
    class; transformers' config classes import torch)."""
    import transformers
    path = Path(model_dir) / "tokenizer_config.json"
    name = json.loads(path.read_text()).get("tokenizer_class") if path.is_file() else None
    named = getattr(transformers, name, None) if isinstance(name, str) else None
    if named is not None:
        return named.from_pretrained(model_dir)
    from transformers import AutoTokenizer
    try:
        config = generic_config(model_dir)
    except (OSError, ValueError):            # no config.json: AutoTokenizer finds its own way
        return AutoTokenizer.from_pretrained(model_dir)
    return AutoTokenizer.from_pretrained(model_dir, config=config)


def eos_token_ids(model_dir: Path) -> frozenset[int]:
    """The ids `model.generate` stops on: generation_config's, else the tokenizer's."""
    path = Path(model_dir) / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    if eos is None:
        eos = json.loads((Path(model_dir) / "config.json").read_text()).get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                add_special_tokens: bool = False, continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> list[int]:
    """The template writes its own special tokens; `add_special_tokens` adds the
    tokenizer's BOS/EOS on top (as vLLM's /tokenize may ask). `continue_final_message`
    leaves the last message open for the model to go on with; `template_kwargs` are
    further variables for the template (vLLM's chat_template_kwargs)."""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, tokenize=False,
                                         **(template_kwargs or {}))
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def encode_prompt(tokenizer, prompt: str, add_special_tokens: bool = True) -> list[int]:
    return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)


def token_bytes(tokenizer, token_id: int, text: str) -> bytes:
    """One token's own bytes (`text` its decoding alone). A token that is a piece of a
    UTF-8 character decodes to U+FFFD; its bytes are then the piece itself, read from the
    token's vocabulary entry: SentencePiece's byte fallback (`<0xE2>`) or byte-level BPE's
    one character per byte. What OpenAI's logprobs `bytes` are for: a client joins a
    character's pieces."""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        decoder = _byte_level_decoder()
        if piece and all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
    return text.encode("utf-8")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's bytes_to_unicode), inverted:
    printable bytes stand for themselves, the rest for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def _rust_decode(tokenizer):
    """The `tokenizers` library's own decode under `tokenizer`, where transformers'
    decode adds nothing to it: a fast tokenizer whose class keeps transformers' decode,
    called without clean-up (which IncrementalDetokenizer never asks for). It skips the
    argument handling around it, a third of the router's detokenizing per token."""
    from transformers import PreTrainedTokenizerFast
    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerFast.decode
            and cls._decode is PreTrainedTokenizerFast._decode):
        return tokenizer._tokenizer.decode
    return None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without ever splitting a
    UTF-8 character: text is held back while the tail decodes to U+FFFD."""

    def __init__(self, tokenizer, prompt_tail: list[int] | None = None, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        # A few prompt tokens give the first generated token its leading-space context.
        self._ids: list[int] = list(prompt_tail or [])[-4:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Only a slow (Python) tokenizer reads spaces_between_special_tokens; a fast one
        # ignores it, in transformers as in vLLM.
        self._options = {"skip_special_tokens": skip_special_tokens, "clean_up_tokenization_spaces": False}
        if not spaces_between_special_tokens:
            self._options["spaces_between_special_tokens"] = False
        self._rust = _rust_decode(tokenizer)
        self._skip = skip_special_tokens

    def _decode(self, ids: list[int]) -> str:
        if self._rust is not None:
            return self._rust(ids, skip_special_tokens=self._skip)
        return self._tok.decode(ids, **self._options)

    def fork(self) -> "IncrementalDetokenizer":
        """A copy that goes on apart from this one (to try a token without taking it)."""
        other = copy.copy(self)
        other._ids = list(self._ids)
        return other

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """At the end of a stream: whatever is left, but a last character the output
        stopped inside (max_tokens after two of its three bytes), which is left out, as
        vLLM leaves it out, rather than written as U+FFFD. A replacement character the
        tokens spell whole stays."""
        # The tokens that hold only the bytes of a character left unfinished are left
        # out, however many: a byte-fallback tokenizer (Llama 2's, Mistral's) writes a
        # U+FFFD a byte. Bytes that can never be a character (a lead byte followed by
        # another) stay U+FFFD, as vLLM writes them.
        held = self._ids[self._read_offset:]
        end = len(self._ids) - _unfinished_tokens(self._tok, held)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:end])
        self._prefix_offset = self._read_offset = len(self._ids)
        text = full[len(prefix):] if len(full) > len(prefix) else ""
        if end == len(self._ids) and text.endswith("\ufffd") and _ends_inside_a_character(self._tok, held):
            text = text[:-1]                # a token of the character's bytes and others before them
        return text


def _unfinished_tokens(tokenizer, ids: list[int]) -> int:
    """How many of the last of `ids` hold nothing but the bytes of a UTF-8 character the
    output stopped inside (0 where there is none, or where a token holds those bytes and
    others)."""
    pieces = [token_bytes(tokenizer, i, tokenizer.decode([i])) for i in ids[-4:]]
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(b"".join(pieces), final=False)
    pending = len(decoder.getstate()[0])
    covered = count = 0
    while covered < pending and count < len(pieces):
        count += 1
        covered += len(pieces[-count])
    return count if pending and covered == pending else 0


def _ends_inside_a_character(tokenizer, ids: list[int]) -> bool:
    """Whether the bytes of `ids` (token_bytes) end partway through a UTF-8 character."""
    tail = b"".join(token_bytes(tokenizer, i, tokenizer.decode([i])) for i in ids[-4:])
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(tail, final=False)
    return bool(decoder.getstate()[0])


def held_tail(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that begins one of `tags` (short of the
    whole tag): what a stream must hold back until more text says whether a tag comes."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class StopMatcher:
    """Finds stop strings across deltas and holds back text that may begin one, so no
    part of a stop string ever reaches the client."""

    def __init__(self, stops: tuple[str, ...], include_in_output: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self._include = include_in_output       # vLLM's include_stop_str_in_output
        self.matched: str | None = None         # the stop string that was hit

    def feed(self, text: str, armed: bool = True) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit). Not `armed` (the
        output is shorter than min_tokens: vLLM looks for no stop string then), the text
        passes as it is."""
        if not self._stops:
            return text, False
        buf = self._pending + text
        if not armed:
            self._pending = ""
            return buf, False
        hits = [(i, i + len(s), s) for i, s in ((buf.find(s), s) for s in self._stops) if i >= 0]
        if hits:
            self._pending = ""
            start, end, self.matched = min(hits)
            return buf[:end if self._include else start], True
        cut = len(buf) - held_tail(buf, self._stops)
        self._pending = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
