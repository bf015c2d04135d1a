"""Incremental detokenization, stop strings and sampling-parameter validation."""
import json

import pytest

from services.common.settings import RouterSettings
from services.engine.text.tokenizer import IncrementalDetokenizer, StopMatcher, load_tokenizer, token_bytes
from services.router.protocol import APIError
from services.router.sampling import resolve_sampling, sampling_defaults


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.mark.parametrize("text", ["héllo 海 🙂 wörld", "日本語のテキスト、絵文字👍🏽も。", "plain ascii, with  spaces"])
def test_token_by_token_deltas_rebuild_the_text_and_never_split_utf8(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    deltas = [d.push([i]) for i in ids] + [d.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


def test_an_output_cut_inside_a_character_ends_before_it(tok):
    """max_tokens can end an output after some of a character's bytes: the text then ends
    before that character (as vLLM's), not in U+FFFD; a U+FFFD the tokens spell whole stays."""
    text = "おはよう 日本語 👍🏽"
    ids = tok.encode(text, add_special_tokens=False)
    for cut in range(1, len(ids) + 1):
        d = IncrementalDetokenizer(tok)
        out = "".join(d.push([i]) for i in ids[:cut]) + d.flush()
        assert "\ufffd" not in out and text.startswith(out), (cut, out)
    d = IncrementalDetokenizer(tok)
    assert "".join(d.push([i]) for i in tok.encode("a\ufffd", add_special_tokens=False)) + d.flush() == "a\ufffd"


@pytest.mark.parametrize("text", ["héllo 海 🙂 wörld", "日本語のテキスト、絵文字👍🏽も。"])
def test_each_tokens_bytes_join_into_the_text(tok, text):
    """Logprobs' `bytes`: a token that is a piece of a character decodes alone to U+FFFD,
    but its bytes are the piece, so the tokens' bytes joined are the text's UTF-8."""
    ids = tok.encode(text, add_special_tokens=False)
    alone = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in t for t in alone)            # the case at hand: split characters
    assert b"".join(token_bytes(tok, i, t) for i, t in zip(ids, alone)) == text.encode()


def test_stop_matcher_cuts_before_the_stop_and_holds_back_partial_matches():
    m = StopMatcher(("STOP",))
    assert m.feed("abc ST") == ("abc ", False)     # "ST" may begin the stop string: held back
    assert m.feed("OP and more") == ("", True)
    m = StopMatcher(("xyz", "hello!"))
    assert m.feed("hello xy") == ("hello ", False)
    assert m.feed("w") == ("xyw", False)          # no longer a possible start: released
    assert m.feed(" hel") == (" ", False)
    assert m.flush() == "hel"
    assert StopMatcher(()).feed("anything") == ("anything", False)


def test_resolve_sampling_defaults_and_ranges():
    p = resolve_sampling(prompt_len=10, max_model_len=100, vocab_size=1000)
    assert p.max_tokens == 90 and p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0
    assert resolve_sampling(prompt_len=10, max_model_len=100, vocab_size=1000, seed=-1).seed >= 0
    bad = [dict(max_tokens=0), dict(max_tokens=91), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
           dict(top_k=-2), dict(min_tokens=5, max_tokens=2), dict(temperature=float("nan"))]
    for kw in bad:
        with pytest.raises(APIError) as e:
            resolve_sampling(prompt_len=10, max_model_len=100, vocab_size=1000, **kw)
        assert e.value.status == 400
    with pytest.raises(APIError, match="maximum context length") as e:
        resolve_sampling(prompt_len=100, max_model_len=100, vocab_size=1000)
    assert e.value.code == "context_length_exceeded"


def test_min_tokens_masks_eos_in_logits_made_under_inference_mode():
    import torch

    from services.engine.model.sampler import sample
    from services.engine.core.sampling import SamplingParams
    with torch.inference_mode():                    # as the model runner returns them
        logits = torch.zeros(2, 8)
        logits[:, 3] = 10.0                         # EOS is every row's best token
    params = [SamplingParams(max_tokens=4, temperature=0.0, min_tokens=2),
              SamplingParams(max_tokens=4, temperature=0.0)]
    assert sample(logits, params, [0, 0], frozenset({3})).token_ids == [0, 3]
    assert sample(logits, params, [2, 0], frozenset({3})).token_ids == [3, 3]
    assert logits[0, 3] == 10.0                     # the caller's tensor is untouched


def test_a_choice_rewritten_with_vllms_text_options(tok):
    """skip_special_tokens false shows special tokens; a stop token's text stays out
    unless include_stop_str_in_output; a stop string ends the text before it or after."""
    from services.router.output_text import ChoiceText, TextOptions
    ids = tok.encode("Hello there, friend<|im_end|>", add_special_tokens=False)
    assert ids[-1] == 2

    def run(options: TextOptions, stops: tuple[str, ...] = (), size: int = 1, finish: str = "stop") -> str:
        text = ChoiceText(tok, [], stops, options)
        chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
        return "".join(text.feed(c, finish if k == len(chunks) - 1 else None) for k, c in enumerate(chunks))
    for size in (1, 3, 100):
        assert run(TextOptions(skip_special_tokens=False), size=size) == "Hello there, friend"
        assert run(TextOptions(skip_special_tokens=False, include_stop_str_in_output=True), size=size) == \
            "Hello there, friend<|im_end|>"
        assert run(TextOptions(skip_special_tokens=False), size=size, finish="length") == \
            "Hello there, friend<|im_end|>"
        assert run(TextOptions(), size=size) == "Hello there, friend"
        assert run(TextOptions(include_stop_str_in_output=True), (", f",), size=size) == "Hello there, f"
        assert run(TextOptions(), (", f",), size=size) == "Hello there"


def test_a_rewritten_choice_arms_stop_strings_a_token_at_a_time(tok):
    """A delta of several tokens (a verify step's, or outputs joined on their way) that
    crosses min_tokens: a stop string completed before min_tokens does not end the text,
    as it does not end the choice (output.py reads such deltas a token at a time too)."""
    from services.router.output_text import ChoiceText, TextOptions
    ids = tok.encode(" one. two three. four five", add_special_tokens=False)
    assert tok.decode(ids[:2]) == " one."

    def run(deltas: list[list[int]]) -> str:
        text = ChoiceText(tok, [], (".",), TextOptions(include_stop_str_in_output=True), min_tokens=4)
        return "".join(text.feed(d, "stop" if k == len(deltas) - 1 else None) for k, d in enumerate(deltas))
    one_a_delta = run([[t] for t in ids[:5]])
    assert one_a_delta == " one. two three."
    assert run([ids[:1], ids[1:4], ids[4:5]]) == run([ids[:1], ids[1:5]]) == one_a_delta


def test_a_stop_matcher_not_armed_lets_a_stop_string_pass():
    """Before min_tokens (vLLM): no stop string is looked for, and nothing is held back."""
    m = StopMatcher(("END",))
    assert m.feed("one EN", armed=False) == ("one EN", False)
    assert m.feed("D two E", armed=True) == ("D two ", False)         # "E" may begin "END": held
    assert m.feed("ND three", armed=True) == ("", True)


def test_an_sse_event_is_one_line_to_clients_that_split_on_unicode_line_breaks():
    """A token may hold U+2028, U+2029 or U+0085, which JSON leaves raw and which
    str.splitlines (httpx's iter_lines) takes for line ends: they go escaped, so every
    data line parses as it is read."""
    import json

    from services.router.choices import sse
    text = "a\u2028b\x85c\u2029d 日\n"
    event = sse({"choices": [{"text": text}]}).decode()
    (line, blank, *rest) = event.splitlines()
    assert blank == "" and not rest and json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text


def test_a_requests_absent_sampling_fields_take_the_models_generation_config(tmp_path):
    """As vLLM's --generation-config auto: the model folder's sampling fields fill what a
    request leaves out (max_new_tokens: max_tokens, within the context), and what it
    sets wins, an explicit neutral value too; vllm reads no file; the override goes over
    the file; a value no request could take stops the router, naming the file."""
    config = tmp_path / "generation_config.json"
    config.write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                  "repetition_penalty": 1.05, "presence_penalty": 0.5, "frequency_penalty": 0.25,
                                  "max_new_tokens": 40, "bos_token_id": 1, "do_sample": True}))
    defaults = sampling_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
                        "presence_penalty": 0.5, "frequency_penalty": 0.25, "max_tokens": 40}
    p = resolve_sampling(prompt_len=10, max_model_len=100, vocab_size=1000, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.6, 0.9, 20, 0.05, 40)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.05, 0.5, 0.25)
    assert resolve_sampling(prompt_len=80, max_model_len=100, vocab_size=1000, defaults=defaults).max_tokens == 20
    mine = resolve_sampling(prompt_len=10, max_model_len=100, vocab_size=1000, defaults=defaults, temperature=0,
                            top_p=1, top_k=-1, min_p=0, repetition_penalty=1, presence_penalty=0,
                            frequency_penalty=0, max_tokens=90)
    assert (mine.temperature, mine.top_p, mine.top_k, mine.min_p, mine.max_tokens) == (0, 1, 0, 0, 90)
    assert (mine.repetition_penalty, mine.presence_penalty, mine.frequency_penalty) == (1, 0, 0)
    assert sampling_defaults(tmp_path, "vllm") == {}
    assert sampling_defaults(tmp_path / "none-here") == {}          # a model without the file
    assert sampling_defaults(tmp_path, "vllm", {"temperature": 0.5}) == {"temperature": 0.5}
    assert sampling_defaults(tmp_path, "auto", {"max_new_tokens": 8, "top_k": None})["max_tokens"] == 8
    for bad, why in [({"top_p": 0}, "top_p must be in"), ({"top_k": 2.5}, "top_k must be an integer"),
                     ({"temperature": "hot"}, "temperature must be a number"),
                     ({"max_new_tokens": 0}, "max_new_tokens must be at least 1")]:
        config.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=why) as e:
            sampling_defaults(tmp_path)
        assert str(config) in str(e.value)
    config.write_text("{temperature")
    with pytest.raises(ValueError, match="generation_config.json is not JSON"):
        sampling_defaults(tmp_path)
    with pytest.raises(ValueError, match="--override-generation-config: repetition_penalty"):
        sampling_defaults(tmp_path, "vllm", {"repetition_penalty": -1})
    with pytest.raises(ValueError, match="not auto, vllm or a folder"):
        RouterSettings(generation_config=str(tmp_path / "missing"))
    for bad in ("{temperature", "[1]"):
        with pytest.raises(ValueError, match="--override-generation-config"):
            RouterSettings(override_generation_config=bad)


def test_a_byte_fallback_tokenizer_leaves_out_every_byte_of_a_character_cut_short():
    """Llama 2's and Mistral's tokenizers fall back to a token a byte, and decode each byte
    of a character cut short as its own U+FFFD (one for each): an output stopped inside €
    ended in two of them. A small tokenizer of that kind is built here."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from services.engine.text.tokenizer import IncrementalDetokenizer
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "b": 5, "▁a": 6}
    vocab.update({f"<0x{b:02X}>": 7 + b for b in range(256)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], byte_fallback=True, unk_token="<unk>",
                                fuse_unk=True))
    core.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    fallback = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    for text in ("a€b", "ab 日本 a", "€€ a", " a 🙂b"):
        ids = fallback.encode(text, add_special_tokens=False)
        for cut in range(1, len(ids) + 1):
            d = IncrementalDetokenizer(fallback)
            out = "".join(d.push([i]) for i in ids[:cut]) + d.flush()
            assert "\ufffd" not in out and text.startswith(out), (text, cut, out)
    # bytes that can never be a character (a lead byte after a lead byte) stay U+FFFD
    lead = fallback.convert_tokens_to_ids("<0xE4>")
    d = IncrementalDetokenizer(fallback)
    assert "".join(d.push([lead]) for _ in range(4)) + d.flush() == "\ufffd" * 3
