"""Tool calls read back from a model's text: whole outputs per tool_choice mode, and an
`auto` stream split into content and calls however its text is chunked."""
from __future__ import annotations

import json

import pytest

from services.router.tool_syntax import SYNTAXES, Marked, split
from services.router.tools import ToolPlan, parse_calls, plan_tools

TEXT = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        ' and <tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call> <tool_call>{oops}'
        '</tool_call> bye <tool_')


def _names(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _arguments(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_whole_outputs_per_mode():
    auto = ToolPlan([], "auto")
    content, calls = parse_calls(auto, TEXT)
    assert _names(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert "<tool_call>{oops}</tool_call>" in content and all(c["id"].startswith("call_") for c in calls)
    assert parse_calls(auto, "just text") == ("just text", [])
    huge = '<tool_call>{"name": "f", "arguments": {"a": ' + "1" * 5000 + "}}</tool_call>"   # past the digit limit
    assert parse_calls(auto, huge) == (huge, [])
    named = ToolPlan([], "named", "{}", "f")
    assert _names(parse_calls(named, '{"a": 1}')[1]) == [("f", {"a": 1})]
    required = ToolPlan([], "required", "{}")
    assert _names(parse_calls(required, '[{"name": "g", "arguments": {"x": 2}}]')[1]) == [("g", {"x": 2})]
    # cut by max_tokens before a call began: its syntax, as text
    assert parse_calls(required, '[{"name": "g", "argu') == ('[{"name": "g", "argu', [])
    many_digits = '{"a": ' + "1" * 5000 + "}"
    assert _arguments(parse_calls(required, f'[{{"name": "g", "arguments": {{}}}}, {{"name": "h", "arguments": '
                                            f'{many_digits}}}]')[1]) == [("g", "{}"), ("h", many_digits)]
    # cut inside a call: the arguments written so far, as a stream has sent them
    cut = '[{"name": "g", "arguments": {"x": 2}}, {"name": "h", "arguments": {}}, {"name": "g", "arguments": {"x'
    content, calls = parse_calls(required, cut)
    assert content is None and _arguments(calls) == [("g", '{"x": 2}'), ("h", "{}"), ("g", '{"x')]
    # the arguments are the text the model wrote, whitespace and all
    spaced = '[ {"name":"g" , "arguments" :{ "s":"a}]\\"{" } } ,\n{"name": "h", "arguments": {"x": 1e999}}] '
    assert _arguments(parse_calls(required, spaced)[1]) == [("g", '{ "s":"a}]\\"{" }'), ("h", '{"x": 1e999}')]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {"s": "a</tool_call>b"}}</tool_call> then',    # the tag in a string
    'x <tool_call>{"name": "f", "arguments": {"s": "a</tool_call> <tool_call>{"name": "g"}</tool_call> y',
    'x <tool_call>not json</tool_call> <tool_call>{"name": "g", "arguments": {}}</tool_call>',
    '<tool_call> {"name": "f", "arguments": {}} </tool_call><tool_call>{"name": "f", "arguments": {"s": "}',
], ids=["tag-in-string", "unclosed-string", "not-json", "cut"])
def test_a_stream_reads_what_a_whole_output_reads(size, text):
    """However chunked, a hermes stream gives the calls and the content the whole
    output's parse gives, where an argument's string holds the closing tag too."""
    stream = SYNTAXES["hermes"].stream()
    pieces = [p for i in range(0, len(text), size) for p in stream.pieces(text[i:i + size])] + stream.close()
    content, calls = split(pieces)
    whole_content, whole_calls = parse_calls(ToolPlan([], "auto"), text)
    assert _names(calls) == _names(whole_calls)
    assert (content.strip() or None) == whole_content


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_an_auto_stream_splits_into_the_same_content_and_calls_however_chunked(size):
    stream = SYNTAXES["hermes"].stream()
    content, calls = [], []
    for i in range(0, len(TEXT), size):
        text, found = split(stream.pieces(TEXT[i:i + size]))
        content.append(text)
        calls += found
    content.append(split(stream.close())[0])
    whole_content, whole_calls = parse_calls(ToolPlan([], "auto"), TEXT)
    assert _names(calls) == _names(whole_calls) and stream.calls == 2
    assert "".join(content) == "Checking.  and  <tool_call>{oops}</tool_call> bye <tool_"
    assert "".join(content).strip() == whole_content


# Outputs of the other --tool-call-parser syntaxes: (text, the calls read from it; none: it is content)
OTHER_SYNTAXES = [
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "arguments": {"tz": "CET"}}',
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("llama3_json", '\n{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', []),          # cut by max_tokens
    ("llama3_json", '{"city": "Paris"} is my answer', []),
    ("llama3_json", "The weather is fine.", []),
    ("pythonic", '[get_weather(city="Paris", days=3, metric=true), clock.get_time(tz="CET", at=[1, {"k": None}])]',
     [("get_weather", {"city": "Paris", "days": 3, "metric": True}), ("clock.get_time", {"tz": "CET", "at": [1, {"k": None}]})]),
    ("pythonic", '[get_weather("Paris")]', []),                   # positional: not a call of named arguments
    ("pythonic", '[get_weather(city=lookup())]', []),             # not a literal
    ("pythonic", "[1] is the answer", []),
    ("pythonic", "Paris is sunny [citation].", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
                '"arguments": {"tz": "CET"}}]', [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time{"tz": "CET"}',
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather"}]', []),
    ("mistral", "The weather is fine.", []),
    ("jamba", '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
              '"arguments": {"tz": "CET"}}]</tool_calls>', [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("jamba", '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Par', []),      # cut: no end mark
    ("jamba", "<tool_calls>[]</tool_calls>", []),
    ("jamba", "The weather is fine.", []),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
     [("get_weather", {"city": "Paris"})]),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}] and more', []),
    ("phi4_mini_json", "The weather is fine.", []),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
                     '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Par', []),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', [("get_weather", {"city": "Paris"})]),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n{"city": "Paris"}'
                    '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', []),                     # no ```json block
    ("deepseek_v3", "The weather is fine.", []),
    ("kimi_k2", '<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0\n<|tool_call_argument_begin|>'
                '{"city": "Tokyo"}<|tool_call_end|>\n<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
                '{"tz": "JST"}<|tool_call_end|>\n<|tool_calls_section_end|>',
     [("get_weather", {"city": "Tokyo"}), ("get_time", {"tz": "JST"})]),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}'
                '<|tool_call_end|><|tool_calls_section_end|>', []),                  # no call id
    ("internlm", '<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>',
     [("get_weather", {"city": "Paris"})]),
    ("internlm", '<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Par', []),
    # nested past Python's stack: text, not a failed request
    ("llama3_json", '{"name": "f", "parameters": ' + "[" * 50000 + "]" * 50000 + "}", []),
    ("pythonic", "[f(x=" + "[" * 50000 + "]" * 50000 + ")]", []),
    # an integer past Python's digit limit, and numbers JSON has no name for: text
    ("llama3_json", '{"name": "f", "parameters": {"a": ' + "1" * 5000 + "}}", []),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": ' + "1" * 5000 + "}", []),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": ' + "1" * 5000 + "}}]", []),
    ("llama3_json", '{"name": "f", "parameters": {"a": NaN}}', []),
    ("pythonic", "[f(a=1e999)]", []),
]


@pytest.mark.parametrize("name, text, expected", OTHER_SYNTAXES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(OTHER_SYNTAXES)])
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_the_other_syntaxes_calls_whole_and_streamed(name, text, expected, size):
    """An output that is calls (after whitespace and Llama's <|python_tag|>, or from
    Mistral's [TOOL_CALLS], Jamba's <tool_calls>, Phi-4-mini's functools, InternLM2's
    plugin action or DeepSeek's and Kimi K2's tool-call tokens) gives them and no
    content; any other is content, streamed at once unless it begins as calls would."""
    syntax = SYNTAXES[name]
    content, calls = syntax.parse(text)
    assert _names(calls) == expected and content == (None if expected else text)
    stream, pieces, early = syntax.stream(), [], []
    for i in range(0, len(text), size):
        pieces += stream.pieces(text[i:i + size])
        early.append(split(pieces)[0])
    pieces += stream.close()
    streamed, streamed_calls = split(pieces)
    assert _names(streamed_calls) == expected and stream.calls == len(expected)
    assert streamed == ("" if expected else text)
    if not (syntax.MARK in text if isinstance(syntax, Marked) else syntax.begins(text)):
        assert size >= len(text) or early[-1]       # content that cannot be calls goes out before the end


def test_jamba_and_deepseek_text_before_the_calls_is_content_and_their_marks_are_special_tokens():
    """Jamba's and DeepSeek's calls may follow text, as Mistral's do; their marks are
    special tokens, so a request with tools keeps them in the text (vLLM's parsers ask
    the same)."""
    jamba = SYNTAXES["jamba"]
    content, calls = jamba.parse('Let me look. <tool_calls>[{"name": "f", "arguments": {}}]</tool_calls>')
    assert content == "Let me look." and _names(calls) == [("f", {})] and jamba.special_tokens
    assert not SYNTAXES["phi4_mini_json"].special_tokens
    deepseek = SYNTAXES["deepseek_v31"]
    content, calls = deepseek.parse("Sure. <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
                                    "<｜tool▁calls▁end｜>")
    assert content == "Sure." and _names(calls) == [("f", {})] and deepseek.special_tokens
    # Kimi K2's call id is its own, as the tool results it reads back name it
    _, calls = SYNTAXES["kimi_k2"].parse("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:3"
                                         "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
    assert [c["id"] for c in calls] == ["functions.f:3"] and _names(calls) == [("f", {})]


def test_mistral_text_before_the_calls_streams_and_the_calls_take_mistrals_ids():
    """Text before [TOOL_CALLS] is content, sent as it comes; each call's id is 9 letters
    and digits, which Mistral's templates check when the tool results come back."""
    mistral = SYNTAXES["mistral"]
    text = 'Let me look. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    content, calls = mistral.parse(text)
    assert content == "Let me look." and _names(calls) == [("get_weather", {"city": "Paris"})]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    stream = mistral.stream()
    assert split(stream.pieces(text[:20])) == ("Let me look. ", []) and stream.pieces(text[20:]) == []
    assert _names(split(stream.close())[1]) == _names(calls) and stream.calls == 1


@pytest.mark.parametrize("one_text", [True, False], ids=["one_text_item", "a_text_item_between_calls"])
def test_output_items_of_an_auto_stream(one_text):
    """Items as the Responses API has them (all the text one item, wherever the calls
    fall) and as Anthropic's content blocks have them (never overlapping: a call ends the
    text before it, and text after it is a block of its own)."""
    from services.router.output_items import ItemStream
    items = ItemStream(ToolPlan([], "auto"), one_text=one_text)
    steps = [s for i in range(0, len(TEXT), 7) for s in items.feed(TEXT[i:i + 7])] + items.close()
    opened = [(s.index, s.kind) for s in steps if s.kind.startswith("open")]
    closed = [(s.index, s.kind) for s in steps if s.kind.startswith("close")]
    texts = {s.index: s.delta for s in steps if s.kind == "close_text"}
    calls = [s.call for s in steps if s.kind == "close_call"]
    assert _names(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    for index, text in texts.items():                   # each text item's deltas add up to it
        assert "".join(s.delta for s in steps if s.kind == "text" and s.index == index) == text
    if one_text:
        assert opened == [(0, "open_text"), (1, "open_call"), (2, "open_call")]
        assert texts == {0: "Checking.  and  <tool_call>{oops}</tool_call> bye <tool_"}
    else:
        assert opened == [(0, "open_text"), (1, "open_call"), (2, "open_text"), (3, "open_call"), (4, "open_text")]
        assert [index for index, _ in closed] == [0, 1, 2, 3, 4]        # each ends before the next begins
        # whitespace goes with the text after it: none is a block alone, none ends the answer
        assert texts == {0: "Checking.", 2: "  and", 4: "  <tool_call>{oops}</tool_call> bye <tool_"}


@pytest.mark.parametrize("size", [1, 3, 8, 1000])
def test_thinking_goes_first_to_an_item_of_its_own_however_chunked(size):
    """--reasoning-parser: the thinking is a reasoning item before the answer's items,
    ended as the answer begins; the calls after it are read from the answer alone; a
    stream that ends inside the block is all reasoning. The whole-output split agrees."""
    from services.router.output_items import ItemStream
    from services.router.reasoning import Thinking
    thinking = Thinking("<think>", "</think>")
    text = "\n<think>Weather? Try <tool_call>.</think>" + TEXT
    items = ItemStream(ToolPlan([], "auto"), thinking=thinking)
    steps = [s for i in range(0, len(text), size) for s in items.feed(text[i:i + size])] + items.close()
    kinds = [s.kind for s in steps if s.kind.startswith(("open", "close"))]
    assert kinds[:3] == ["open_reasoning", "close_reasoning", "open_text"]
    assert "".join(s.delta for s in steps if s.kind == "reasoning") == "Weather? Try <tool_call>."
    assert _names([s.call for s in steps if s.kind == "close_call"]) == \
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert thinking.split(text) == ("Weather? Try <tool_call>.", TEXT)
    unfinished = ItemStream(None, empty_text=True, thinking=Thinking("<think>", "</think>", open_at_start=True))
    steps = [s for i in range(0, 20, size) for s in unfinished.feed("still thinking </th"[i:i + size])]
    steps += unfinished.close()
    assert [s.kind for s in steps if s.kind != "reasoning"] == \
        ["open_reasoning", "close_reasoning", "open_text", "close_text"]      # and the empty answer
    assert "".join(s.delta for s in steps if s.kind == "reasoning") == "still thinking </th"


def test_auto_needs_a_parser_and_the_others_do_not():
    """--no-enable-auto-tool-choice (no parser): "auto", asked for or the default with tools,
    is a 400 naming tool_choice, as vLLM answers without --enable-auto-tool-choice; the
    forced choices are served."""
    from services.router.protocol import APIError, ChatCompletionRequest
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    ask = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    for choice in (None, "auto"):
        req = ChatCompletionRequest.model_validate({**ask, **({"tool_choice": choice} if choice else {})})
        with pytest.raises(APIError) as refused:
            plan_tools(req, True, parser=None)
        assert refused.value.status == 400 and refused.value.param == "tool_choice"
        assert plan_tools(req, True, parser="pythonic").syntax is SYNTAXES["pythonic"]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        assert plan_tools(ChatCompletionRequest.model_validate({**ask, "tool_choice": choice}), True, parser=None)


# token ids as texts: a tag one token (7, 8 and 9) or several (10-14 spell <think> and
# </think> as a tokenizer without them may)
TEXTS = {0: " ", 1: "a", 2: "b", 3: "c", 4: "d", 5: "e", 7: "<think>", 8: "</", 9: "think>",
         10: "<", 11: "think", 12: ">", 13: "\n</", 14: "thi", 15: "nk>\n\n", 16: "></", 17: "<think></think>"}


@pytest.mark.parametrize("size", [1, 2, 100])
def test_thinking_tokens_are_those_inside_the_block_not_its_tags(size):
    """usage's reasoning_tokens, counted token by token as the choice streams: a block
    open from the start or opened by the output's first tokens, after whitespace as the
    text is read, its tags found in the tokens' text however they are split (a token
    holding part of a tag is the tag's); an output that never opens the block has none."""
    from services.router.reasoning import ThinkingTokens
    cases = [(False, [7, 1, 2, 3, 8, 9, 4, 5], 3),       # opened by the output
             (True, [1, 2, 8, 9, 3], 2),                 # open from the start (the prompt ends with <think>)
             (False, [1, 7, 2, 8, 9], 0),                # <think> not at the start: all answer
             (False, [0, 0, 7, 1, 8, 9, 0], 1),          # whitespace before <think>
             (False, [0, 1, 7, 2, 8, 9], 0),
             (True, [1, 8, 1, 2], 4),                    # the end tag never whole: all thinking
             (False, [10, 11, 12, 1, 2, 13, 14, 15, 3], 2),     # tags of several tokens, split otherwise
             (False, [10, 1], 0),                        # "<a": no tag
             (False, [10, 11, 16, 11, 12, 1], 0),        # "<think></think>a", "></" one token (SmolLM2's)
             (False, [17, 1], 0)]                        # both tags in one token
    for open_at_start, tokens, expected in cases:
        counter = ThinkingTokens("<think>", "</think>", open_at_start, TEXTS.__getitem__)
        for i in range(0, len(tokens), size):
            counter.feed(tokens[i:i + size])
        assert counter.count == expected, tokens


def test_continuous_usage_counts_no_more_thinking_than_it_sent():
    """Streamed with continuous usage, a chunk's usage counts the output tokens sent so
    far; a choice's thinking, counted as its tokens arrive, may be ahead of those (n > 1:
    another choice's chunks went first), and is counted no further than them."""
    from services.engine.core.sampling import SamplingParams
    from services.router.choices import usage
    from services.router.generation import Generation
    from services.router.reasoning import ThinkingTokens
    gens = [Generation(f"r-{i}", [1, 2, 3], SamplingParams(max_tokens=8),
                       thinking=ThinkingTokens("<think>", "</think>", True, {**TEXTS, 6: "</think>"}.__getitem__))
            for i in range(2)]
    for gen in gens:
        gen.thinking.feed([1, 2, 3, 4, 6, 5])           # four tokens of thinking, the end tag, an answer
        gen.completion_tokens = 6
    assert usage(gens, 2)["completion_tokens_details"] == {"reasoning_tokens": 8}
    so_far = usage(gens, 2, [6, 2])                      # the second choice's tokens still queued
    assert so_far["completion_tokens"] == 8 and so_far["completion_tokens_details"] == {"reasoning_tokens": 6}


QWEN3_CODER = ('Let me check. <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
               '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call> and <tool_call>\n<function=note>\n'
               '<parameter=text>\nline one\nline two\n<parameter=tag>\nx</parameter>\n</function>\n</tool_call>'
               ' <tool_call>{"name": "f"}</tool_call> done')


@pytest.mark.parametrize("size", [1, 3, 8, 1000])
def test_qwen3_coder_xml_calls_whole_and_streamed(size):
    """Qwen3-Coder's <function=...><parameter=...> calls inside <tool_call> tags, anywhere
    in the text: each value is its text, a string (one wrapping newline trimmed), as vLLM
    0.32 reads it; a parameter left unclosed ends where the next begins; a JSON body is
    no call of this syntax (text). Streamed however chunked, the same calls and content."""
    syntax = SYNTAXES["qwen3_coder"]
    content, calls = syntax.parse(QWEN3_CODER)
    assert _names(calls) == [("get_weather", {"city": "Paris", "days": "3"}),
                             ("note", {"text": "line one\nline two", "tag": "x"})]
    assert content == 'Let me check.  and  <tool_call>{"name": "f"}</tool_call> done'
    stream = syntax.stream()
    pieces = [p for i in range(0, len(QWEN3_CODER), size) for p in stream.pieces(QWEN3_CODER[i:i + size])]
    streamed, streamed_calls = split(pieces + stream.close())
    assert _names(streamed_calls) == _names(calls) and streamed.strip() == content and stream.calls == 2


def test_which_syntaxes_calls_a_grammar_holds_and_which_stream_in_parts():
    """A grammar can hold "auto" calls where the syntax has its tags (hermes', LongCat's
    in tags of its own, Qwen3-Coder's and GLM's XML); only JSON calls stream in parts once
    held. MiniMax-M2's sections have none here."""
    from services.router.tools import ToolPlan
    plans = {name: ToolPlan([], "auto", syntax=SYNTAXES[name]) for name in SYNTAXES}
    assert {n for n, p in plans.items() if p.grammar_calls} == {"hermes", "qwen3_json", "longcat", "qwen3_coder",
                                                                  "qwen3_xml", "glm45", "glm47"}
    assert {n for n, p in plans.items() if p.json_calls} == {"hermes", "qwen3_json", "longcat"}


# (syntax, an output, its calls, its content)
TAGGED = [
    ("glm45", 'Checking. <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n'
              '<arg_key>days</arg_key><arg_value>3</arg_value>\n</tool_call> and <tool_call>get_time</tool_call>'
              ' <tool_call>two words</tool_call> <tool_call>f<arg_key>a</arg_key> junk</tool_call> done',
     [("get_weather", {"city": "Paris", "days": "3"}), ("get_time", {})],
     "Checking.  and  <tool_call>two words</tool_call> <tool_call>f<arg_key>a</arg_key> junk</tool_call> done"),
    ("minimax_m2", 'Sure. <minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">\nParis\n'
                   '</parameter>\n<parameter name=\'days\'>3</parameter>\n</invoke>\n<invoke name=get_time>'
                   '</invoke>\n</minimax:tool_call> then <minimax:tool_call><invoke name="f">x</invoke> y'
                   '</minimax:tool_call> end',
     [("get_weather", {"city": "Paris", "days": "3"}), ("get_time", {})],
     'Sure.  then <minimax:tool_call><invoke name="f">x</invoke> y</minimax:tool_call> end'),
    ("longcat", 'Hi <longcat_tool_call>{"name": "f", "arguments": {"a": 1}}</longcat_tool_call>'
                ' <tool_call>{"name": "g", "arguments": {}}</tool_call>',
     [("f", {"a": 1})], 'Hi  <tool_call>{"name": "g", "arguments": {}}</tool_call>'),
    ("qwen3_json", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', [("f", {"a": 1})], None),
]


@pytest.mark.parametrize("size", [1, 3, 8, 1000])
@pytest.mark.parametrize("name, text, expected, content", TAGGED, ids=[t[0] for t in TAGGED])
def test_glm_minimax_and_longcat_tagged_calls_whole_and_streamed(name, text, expected, content, size):
    """GLM-4.5/4.7's <arg_key>/<arg_value> calls (a name alone where it has no arguments;
    a body that is not a name and pairs alone is text), MiniMax-M2's <invoke> calls, one or
    more a section, names quoted or not, and LongCat's hermes calls in tags of its own (a
    hermes tag is text to it): values are strings, as vLLM 0.32 reads them. Streamed
    however chunked, the same calls and content."""
    syntax = SYNTAXES[name]
    whole_content, calls = syntax.parse(text)
    assert _names(calls) == expected and whole_content == content
    stream = syntax.stream()
    pieces = [p for i in range(0, len(text), size) for p in stream.pieces(text[i:i + size])]
    streamed, streamed_calls = split(pieces + stream.close())
    assert _names(streamed_calls) == expected and (streamed.strip() or None) == content
    assert stream.calls == len(expected) and syntax.special_tokens


def test_every_tool_call_parser_the_router_takes_has_a_syntax():
    import dataclasses
    from services.common.settings import RouterSettings
    (choices,) = [f.metadata["choices"] for f in dataclasses.fields(RouterSettings) if f.name == "tool_call_parser"]
    assert set(choices) == set(SYNTAXES)


def test_a_strict_level_needs_calls_a_grammar_can_hold():
    """--tool-strict-level function or parameter holds every auto call by a grammar: the
    router refuses to start with it where no grammar can hold the parser's calls, or auto
    is off; a tool's own strict then changes nothing (grammar_for_calls says when)."""
    from services.router.tools import ToolPlan, check_strict_level
    check_strict_level("parameter", "longcat")
    check_strict_level("function", "qwen3_coder")
    check_strict_level("auto", "minimax_m2")
    for parser in ("minimax_m2", "pythonic", None):
        with pytest.raises(ValueError, match="hermes, qwen3_json, longcat, qwen3_coder"):
            check_strict_level("function", parser)
    strict = {"type": "function", "function": {"name": "f", "strict": True}}
    loose = {"type": "function", "function": {"name": "g"}}
    assert ToolPlan([loose, strict], "auto").grammar_for_calls("auto")
    assert not ToolPlan([loose], "auto").grammar_for_calls("auto") and ToolPlan([loose], "auto").grammar_for_calls("function")
    assert not ToolPlan([strict], "required", "{}").grammar_for_calls("parameter")


@pytest.mark.parametrize("size", [1, 7, 1000])
def test_one_call_asked_gives_the_first_call_whole_and_streamed(size):
    """parallel_tool_calls false under "auto": the first call only, whole and streamed
    however chunked (for hermes a grammar also ends the output after it:
    test_structured_output), with the text around the calls kept as content."""
    plan = ToolPlan([{"type": "function", "function": {"name": "get_weather"}}], "auto", one_call=True)
    content, calls = parse_calls(plan, TEXT)
    assert _names(calls) == [("get_weather", {"city": "Paris"})]
    assert plan.grammar_for_calls("auto") and not ToolPlan([], "auto").grammar_for_calls("auto")
    stream = plan.stream()
    pieces = [p for i in range(0, len(TEXT), size) for p in stream.pieces(TEXT[i:i + size])] + stream.close()
    streamed, streamed_calls = split(pieces)
    assert _names(streamed_calls) == _names(calls) and stream.calls == 1
    assert streamed.strip() == content


HELD = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris</tool_call>\\"", "days": [1, {"n": 2}]}}\n'
        '</tool_call> and <tool_call>{"name": "get_time", "arguments": {}}</tool_call> done')


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_calls_a_grammar_holds_stream_their_arguments_as_they_come(size):
    """Calls a grammar holds (a strict tool, one call asked, a format beside the tools):
    each opens with its name as soon as the name is written, then its arguments stream
    as they come, braces, quotes and the closing tag inside strings included; a whole
    output gives the same calls and content, and a call cut by max_tokens ends with what
    it had, both ways."""
    from services.router.tool_syntax import CallPart
    plan = ToolPlan([], "auto", held=True)
    for text, names in ((HELD, ["get_weather", "get_time"]), (HELD[:70], ["get_weather"])):
        content, calls = parse_calls(plan, text)
        assert [c["function"]["name"] for c in calls] == names
        stream, pieces = plan.stream(), []
        for i in range(0, len(text), size):
            got = stream.pieces(text[i:i + size])
            pieces += got
            if size < 5 and any(isinstance(p, CallPart) and p.kind == "open" for p in got):
                assert not any(isinstance(p, CallPart) and p.kind == "close" for p in got)   # open before whole
        pieces += stream.close()
        parts = [p for p in pieces if isinstance(p, CallPart)]
        assert [(p.kind, p.index) for p in parts if p.kind != "arguments"] == \
            [(kind, k) for k in range(len(names)) for kind in ("open", "close")]
        for k, call in enumerate(calls):
            assert "".join(p.text for p in parts if p.kind == "arguments" and p.index == k) == \
                call["function"]["arguments"] == [p for p in parts if p.kind == "close"][k].call["function"]["arguments"]
        assert "".join(p for p in pieces if isinstance(p, str)).strip() == content
    assert json.loads(parse_calls(plan, HELD)[1][0]["function"]["arguments"]) == \
        {"city": 'Pa}ris</tool_call>"', "days": [1, {"n": 2}]}
    assert parse_calls(plan, HELD[:70])[1][0]["function"]["arguments"] == HELD[:70].split('"arguments": ')[1]
    assert parse_calls(plan, "Just text <tool_call>\n{\"na") == ("Just text <tool_call>\n{\"na", [])


def test_output_items_of_calls_a_grammar_holds():
    """Responses' and Messages' items of such a stream: the call's item opens with its
    name, its arguments follow as deltas, and it closes with all of them."""
    from services.router.output_items import ItemStream
    items = ItemStream(ToolPlan([], "auto", held=True), one_text=False)
    steps = [s for i in range(0, len(HELD), 4) for s in items.feed(HELD[i:i + 4])] + items.close()
    kinds = [(s.kind, s.index) for s in steps if s.kind not in ("text", "arguments")]
    assert kinds == [("open_text", 0), ("close_text", 0), ("open_call", 1), ("close_call", 1), ("open_text", 2),
                     ("close_text", 2), ("open_call", 3), ("close_call", 3), ("open_text", 4), ("close_text", 4)]
    for index in (1, 3):
        (closed,) = [s for s in steps if s.kind == "close_call" and s.index == index]
        assert "".join(s.delta for s in steps if s.kind == "arguments" and s.index == index) == closed.delta
    assert json.loads([s for s in steps if s.kind == "close_call"][0].delta)["days"] == [1, {"n": 2}]



@pytest.mark.parametrize("tail", ["<", "<tool_", "<tool_call>", '<tool_call>\n{"na'])
def test_a_held_call_cut_after_another_leaves_no_text(tail):
    """A grammar lets only a call begin with its tag: cut by max_tokens after a call, the
    next call's beginning is no text (it was `<` as content), streamed or whole; before
    any call the same tail is text (a format's answer may hold it)."""
    plan = ToolPlan([], "auto", held=True)
    text = 'Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call>\n' + tail
    for size in (1, 3, 1000):
        stream = plan.stream()
        pieces = [p for i in range(0, len(text), size) for p in stream.pieces(text[i:i + size])] + stream.close()
        assert "".join(p for p in pieces if isinstance(p, str)) == "Sure."
    assert parse_calls(plan, text)[0] == "Sure." and len(parse_calls(plan, text)[1]) == 1
    assert parse_calls(plan, "Sure. " + tail) == ("Sure. " + tail, [])


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_whole_items_are_the_streams_items_in_its_order(size):
    """Responses' and Messages' whole answers are built from the items a stream of the
    same output makes: text after a call comes after it (Messages: a block of its own),
    and a call cut short is the stream's too."""
    from services.router.output_items import ItemStream, whole_items
    text = 'I will look. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> Then more. <tool_call>{"name": "g"'
    for kw in (dict(one_text=False), dict(empty_text=True)):
        for held in (False, True):
            plan = ToolPlan([], "auto", held=held)
            items = ItemStream(plan, **kw)
            steps = [s for i in range(0, len(text), size) for s in items.feed(text[i:i + size])] + items.close()
            streamed = sorted((s for s in steps if s.kind.startswith("close_")), key=lambda s: s.index)
            whole = whole_items(ItemStream(plan, **kw), text)
            assert [(s.kind, s.index, s.delta) for s in whole] == [(s.kind, s.index, s.delta) for s in streamed]
            blocks = ["close_text", "close_call", "close_text"] if "one_text" in kw else ["close_text", "close_call"]
            assert [s.kind for s in whole] == blocks        # Responses: all the text one item, first

REQUIRED = ('[ {"name": "get_weather", "arguments": {"city": "Pa}]ris\\"{", "days": [1, {"n": 2}]}},\n'
            '{"arguments": {}, "name": "get_time"}, {"name": "get_weather", "arguments": {"city": "Ro')


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_required_calls_stream_their_arguments_as_they_come(size):
    """A "required" output's calls, as vLLM streams them: each opens once its name is
    whole and its arguments have begun, its arguments stream as the model writes them
    (brackets and quotes inside strings are theirs), a call cut by max_tokens ends with
    what it had, and a whole output gives the same calls; cut before any call began, it
    is text (chat's content), and Responses' and Messages' items get no text of it."""
    from services.router.output_items import ItemStream
    from services.router.tool_syntax import CallPart
    plan = ToolPlan([], "required", "{}")
    content, calls = parse_calls(plan, REQUIRED)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time", "get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Pa}]ris"{', "days": [1, {"n": 2}]}
    assert calls[2]["function"]["arguments"] == '{"city": "Ro'
    stream, pieces = plan.stream(), []
    for i in range(0, len(REQUIRED), size):
        got = stream.pieces(REQUIRED[i:i + size])
        pieces += got
        if size < 5 and any(isinstance(p, CallPart) and p.kind == "open" and p.index == 0 for p in got):
            assert not any(isinstance(p, CallPart) and p.kind == "close" for p in got)   # open before whole
    pieces += stream.close()
    assert [(p.kind, p.index) for p in pieces if p.kind != "arguments"] == \
        [(kind, k) for k in range(3) for kind in ("open", "close")]
    for k, call in enumerate(calls):
        assert "".join(p.text for p in pieces if p.kind == "arguments" and p.index == k) == \
            call["function"]["arguments"] == [p for p in pieces if p.kind == "close"][k].call["function"]["arguments"]
    items = ItemStream(plan, one_text=False)
    steps = [s for i in range(0, len(REQUIRED), size) for s in items.feed(REQUIRED[i:i + size])] + items.close()
    assert [s.kind for s in steps if s.kind != "arguments"] == ["open_call", "close_call"] * 3
    cut = '[{"name": "get_wea'
    assert parse_calls(plan, cut) == (cut, [])
    stream = plan.stream()
    assert [p for i in range(0, len(cut), size) for p in stream.pieces(cut[i:i + size])] + stream.close() == [cut]
    items = ItemStream(plan, empty_text=True)
    assert [s.kind for s in items.feed(cut) + items.close()] == ["open_text", "close_text"]

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'


@pytest.mark.parametrize("held", [False, True], ids=["whole_calls", "held_calls"])
@pytest.mark.parametrize("text, expected", [
    (CALL % "Paris" + "\n" + CALL % "Rome", None),
    ("Sure. " + CALL % "Paris" + "\n" + CALL % "Rome" + "\n\n", "Sure."),
    ("\n" + CALL % "Paris" + "\n Then more.  ", "Then more."),
    ("  Just text.\n", "Just text.")])
def test_an_auto_answers_content_is_the_same_streamed_and_whole(text, expected, held):
    """The content of an "auto" answer with calls is the text outside them without the
    whitespace at its ends, streamed however chunked as whole: the newlines between calls
    are no content, streamed or not (a stream sent them, where the whole answer had
    none); Responses' and Messages' items alike get no text item of whitespace alone."""
    from services.router.output_items import ItemStream
    plan = ToolPlan([], "auto", held=held)
    content, calls = parse_calls(plan, text)
    for size in (1, 3, 1000):
        stream = plan.stream()
        pieces = [p for i in range(0, len(text), size) for p in stream.pieces(text[i:i + size])] + stream.close()
        streamed = "".join(p for p in pieces if isinstance(p, str))
        assert streamed == (content or ""), (size, streamed, content)
        items = ItemStream(plan, one_text=False)
        steps = [s for i in range(0, len(text), size) for s in items.feed(text[i:i + size])] + items.close()
        assert all(s.delta.strip() for s in steps if s.kind == "close_text")
    assert content == expected and len(calls) == text.count("<tool_call>")


def test_one_call_asked_of_held_calls_is_counted_as_a_call():
    """parallel_tool_calls false with calls a grammar holds: the stream counts its call,
    so a streamed chat answer ends with finish reason tool_calls as the whole one does;
    were a second call written, its parts would be dropped."""
    from services.router.tool_syntax import CallPart
    plan = ToolPlan([], "auto", one_call=True, held=True)
    stream = plan.stream()
    pieces = stream.pieces(HELD) + stream.close()
    assert stream.calls == 1 and {p.index for p in pieces if isinstance(p, CallPart)} == {0}
    assert [c["function"]["name"] for c in parse_calls(plan, HELD)[1]] == ["get_weather"]


def test_values_written_as_text_take_their_schemas_types():
    """tool_values, as vLLM's parser engine types a text value: the first type the schema
    allows that the text reads as (null, integer, number, boolean, object, array, string);
    one no type fits, or a property the tool does not describe, stays text."""
    from services.router.tool_values import typed_arguments
    parameters = {"type": "object", "properties": {
        "days": {"type": "integer"}, "ratio": {"type": "number"}, "on": {"type": "boolean"},
        "tags": {"type": "array"}, "opts": {"type": "object"}, "code": {"type": "string"},
        "maybe": {"type": ["integer", "null"]}, "unit": {"enum": ["c", "f"]}, "mixed": {"anyOf": [
            {"type": "integer"}, {"type": "string"}]}, "huge": {"type": "number"}}}
    got = typed_arguments({"days": " 3\n", "ratio": "2.50", "on": "True", "tags": '["a", 1]', "opts": '{"k": null}',
                           "code": "007", "maybe": "null", "unit": "c", "mixed": "x1", "huge": "1e999",
                           "loose": "5", "bad": "notanint"}, parameters)
    assert got == {"days": 3, "ratio": 2.5, "on": True, "tags": ["a", 1], "opts": {"k": None}, "code": "007",
                   "maybe": None, "unit": "c", "mixed": "x1", "huge": "1e999", "loose": "5", "bad": "notanint"}
    assert typed_arguments({"days": "x"}, {"properties": {"days": {"type": "integer"}}}) == {"days": "x"}
    assert typed_arguments({"a": "1"}, None) == {"a": "1"}


def test_a_text_valued_syntaxs_calls_are_typed_by_the_tools_whole_and_streamed():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}},
             {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
                 "text": {"type": "string"}}}}}]
    plan = ToolPlan(tools, "auto", syntax=SYNTAXES["qwen3_coder"])
    _, calls = parse_calls(plan, QWEN3_CODER)
    assert _names(calls) == [("get_weather", {"city": "Paris", "days": 3}),
                             ("note", {"text": "line one\nline two", "tag": "x"})]
    stream = plan.stream()
    pieces = [p for i in range(0, len(QWEN3_CODER), 5) for p in stream.pieces(QWEN3_CODER[i:i + 5])] + stream.close()
    assert _names(split(pieces)[1]) == _names(calls)


def test_required_calls_keep_the_tools_own_definitions_where_their_references_resolve():
    """tool_choice required nests each tool's parameters in one schema: a Pydantic-style
    `"$ref": "#/$defs/Unit"` then resolved against that schema's root and was refused
    (Pointer '/$defs/Unit' does not exist); definitions move to the root, and a name two
    tools define differently is refused by name."""
    from services.engine.text import json_schema
    from services.router.protocol import APIError, ChatCompletionRequest
    units = {"$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}}, "type": "object",
             "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
             "required": ["city", "unit"]}

    def ask(*parameters):
        return ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": p}}
                      for i, p in enumerate(parameters)]})
    plan = plan_tools(ask(units, units), True)
    schema = json_schema.parse(plan.schema)
    assert schema["$defs"]["Unit"]["enum"] == ["c", "f"]
    assert json_schema.output_violation(plan.schema, '[{"name": "f0", "arguments": {"city": "x", "unit": "c"}}]') \
        is None
    other = {**units, "$defs": {"Unit": {"type": "integer"}}}
    with pytest.raises(APIError, match="Unit"):
        plan_tools(ask(units, other), True)


@pytest.mark.parametrize("syntax,text", [
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nhi\n</function>\n"
                    "</tool_call>"),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">1</parameter>\n'
                   '<parameter name="b">hi\n</invoke>\n</minimax:tool_call>')])
def test_a_last_parameter_left_unclosed_ends_with_its_function(syntax, text):
    """A model that writes the last parameter without its closing tag: its value runs to
    the end of the function (vLLM's reads it so); it was dropped, silently."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}}]
    _, calls = parse_calls(ToolPlan(tools, "auto", syntax=SYNTAXES[syntax]), text)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1, "b": "hi"}]
