"""Incremental detokenization, stop strings and sampling-parameter validation."""
import pytest

from services.engine.text.tokenizer import IncrementalDetokenizer, StopMatcher, load_tokenizer, token_bytes
from services.router.protocol import APIError
from services.router.sampling import resolve_sampling


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
