"""Tool calls: format detection, parsing (whole and streamed), and the constraint that forces a
call, checked end to end with SmolLM2's real vocabulary and `jsonschema`."""

import itertools
import json
import os

import jsonschema
import numpy as np
import pytest
import tiktoken

import jaxinfer
from jaxinfer.decode import constraints
from jaxinfer.text import tool_calls as tc
from jaxinfer.text.tokenizer import Tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 999},
                                                                        "b": {"type": "integer", "minimum": -9}},
                                      "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: an empty argument list
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {},
                                                                   "additionalProperties": False}) for t in TOOLS}

# How each family's template asks for calls (the lines that teach the format; detection needs only these).
TEMPLATE_LINES = {
    "hermes": ("{{- \"For each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
               "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"),  # Qwen2.5 / Qwen3
    "llama3": ("{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}{{- 'Respond in the format {\"name\": "
               "function name, \"parameters\": dictionary of argument name and its value}.' }}"),  # Llama 3.1 / 3.2
    "mistral": "{%- if message.tool_calls is defined %}{{- \"[TOOL_CALLS] [\" }}",  # Mistral v3 tokenizer templates
}


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


@pytest.fixture(scope="module")
def tok(golden_dir):
    return jaxinfer.load_tokenizer(os.path.join(golden_dir, "hf_text", "smollm2", "tokenizer.json.xz"))


@pytest.fixture(scope="module")
def compiler(tok):
    return constraints.Compiler(tok, stop_ids=[0, 2])


def test_detect_format(tok, golden_dir):
    for fmt, line in TEMPLATE_LINES.items():
        assert tc.detect_format("{% for m in messages %}{{ m.content }}{% endfor %}" + line) == fmt
    assert tc.detect_format(tok.chat_template) is None  # SmolLM2-135M-Instruct: its template ignores tools
    chat = json.load(open(os.path.join(golden_dir, "hf_text", "chat.json")))
    assert all(tc.detect_format(t["template"]) is None for t in chat["templates"].values())
    assert tc.detect_format(None) is None


# (format, model text, expected content, expected [(name, arguments text)])
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("now", "{}")]),
    ("hermes", "<think>\nuse the tool\n</think>\n\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": "
               "{\"nested\": \"}\\\"{\"}}}",  # unclosed at the end (stopped at EOS); braces inside a string
     "<think>\nuse the tool\n</think>", [("add", '{"a": 1, "b": {"nested": "}\\"{"}}')]),
    ("hermes", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("hermes", "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ("hermes", '<tool_call>\n{"arguments": {"a": 2, "b": 3}, "name": "add"}\n</tool_call>',  # keys reversed
     None, [("add", '{"a": 2, "b": 3}')]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
     None, [("get_weather", '{"city": "Oslo", "unit": "celsius"}')]),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "now", "parameters": {}}',
     None, [("add", '{"a": 1, "b": 2}'), ("now", "{}")]),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ("llama3", "The weather is sunny.", "The weather is sunny.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 5, "b": 6}}, {"name": "now", "arguments": {}}]',
     None, [("add", '{"a": 5, "b": 6}'), ("now", "{}")]),
    ("mistral", "Sure.", "Sure.", []),
    ("json", '[{"name": "now", "arguments": {}}]', None, [("now", "{}")]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut by the token limit
     None, [("get_weather", '{"city": "Pa')]),
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_parse(fmt, text, content, calls):
    got_content, got = tc.parse_tool_calls(text, fmt, call_id=_ids())
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
    assert [c["id"] for c in got] == [f"call_{i}" for i in range(len(calls))]
    assert all(c["type"] == "function" for c in got)
    for c in got:
        if c["function"]["arguments"].endswith("}"):
            json.loads(c["function"]["arguments"])


def _replay(fmt, chunks):
    """Stream `chunks`; rebuild (content, calls) from the deltas alone, as an OpenAI client does."""
    p = tc.ToolCallParser(fmt, call_id=_ids())
    deltas = [d for ch in chunks for d in p.feed(ch)] + p.finish()
    content, calls = "", {}
    for d in deltas:
        if "content" in d:
            content += d["content"]
        else:
            t = d["tool_call"]
            if "id" in t:
                assert t["index"] == len(calls) and t["type"] == "function"
                calls[t["index"]] = {"id": t["id"], "type": "function",
                                     "function": {"name": t["function"]["name"], "arguments": t["function"]["arguments"]}}
            else:
                assert set(t) == {"index", "function"} and set(t["function"]) == {"arguments"}
                calls[t["index"]]["function"]["arguments"] += t["function"]["arguments"]
    return content or None, [calls[i] for i in range(len(calls))], deltas


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_streamed_deltas_add_up_to_the_whole(fmt, text, content, calls):
    whole = tc.parse_tool_calls(text, fmt, call_id=_ids())
    rng = np.random.default_rng(len(text))
    for trial in range(4):
        if trial == 0:
            chunks = list(text)  # one character at a time
        else:
            cuts = sorted(rng.choice(np.arange(1, len(text)), size=min(len(text) - 1, 6), replace=False))
            chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        got_content, got_calls, _ = _replay(fmt, chunks)
        assert (got_content, got_calls) == whole, chunks


def test_streaming_sends_name_before_arguments_finish():
    text = CASES[0][1]
    _, _, deltas = _replay("hermes", list(text))
    first_args = next(i for i, d in enumerate(deltas) if "tool_call" in d and "id" not in d["tool_call"])
    assert "id" in deltas[first_args - 1]["tool_call"]  # the header comes first
    n_fragments = sum(1 for d in deltas if d.get("tool_call", {}).get("index") == 0 and "id" not in d["tool_call"])
    assert n_fragments > 10  # arguments really stream, character by character here
    content = [d["content"] for d in deltas if "content" in d]
    assert "".join(content) == "Let me check." and not any(c[-1].isspace() for c in content)  # whitespace held


def test_streaming_real_token_deltas(tok):
    """Token by token through SmolLM2's tokenizer, as the server streams."""
    text = CASES[5][1]
    ids = tok.encode(text)
    chunks = [tok.decode([i]) for i in ids]
    assert "".join(chunks) == text
    content, calls, _ = _replay("llama3", chunks)
    assert (content, calls) == tc.parse_tool_calls(text, "llama3", call_id=_ids())


@pytest.mark.parametrize("fmt", tc.FORMATS)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_parse_and_validate(tok, compiler, fmt, choice):
    """Random logits under the constraint: every finished reply is a call, in the format, with
    arguments valid for the named function's schema."""
    c = constraints.tool_call(tok, TOOLS, choice, fmt=fmt)
    rng = np.random.default_rng(1)
    mask = compiler.allocate_bitmask(1)
    for _ in range(3):
        m = compiler.matcher(c)
        ids = []
        for _ in range(300):
            if m.is_stopped:
                break
            compiler.fill_bitmasks([m], mask)
            allowed = np.nonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:compiler.vocab_size])[0]
            t = int(allowed[np.argmax(rng.standard_normal(allowed.size))])
            if t in (0, 2):
                break
            assert m.consume(t)
            ids.append(t)
        else:
            pytest.fail(f"no end in 300 tokens: {tok.decode(ids)!r}")
        text = tok.decode(ids)
        content, calls = tc.parse_tool_calls(text, fmt)
        assert content is None and calls, text
        if isinstance(choice, dict):
            assert [x["function"]["name"] for x in calls] == ["get_weather"], text
        for x in calls:
            jsonschema.validate(json.loads(x["function"]["arguments"]), SCHEMAS[x["function"]["name"]])


def test_control_token_markers_are_named_by_id(tok):
    """When the vocabulary has <tool_call> as a control token (as llama.cpp marks Qwen's), the
    grammar asks for that token, and the parser reads its decoded text."""
    enc = tok.encoding
    special = {t: enc.encode_single_token(t) for t in enc.special_tokens_set}
    qwenish = Tokenizer(encoding=tiktoken.Encoding(
        name="smollm2+tool_call", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
        special_tokens={**special, "<tool_call>": enc.n_vocab, "</tool_call>": enc.n_vocab + 1}),
        bos_id=tok.bos_id, eos_id=tok.eos_id, stop_ids=tok.stop_ids, chat_template=TEMPLATE_LINES["hermes"])
    open_id = qwenish.encode("<tool_call>")[0]
    assert open_id in constraints.special_token_ids(qwenish)
    c = constraints.tool_call(qwenish, TOOLS, {"type": "function", "function": {"name": "now"}})
    assert f"<[{open_id}]>" in c.source
    m = constraints.Compiler(qwenish).matcher(c)
    ids = qwenish.encode('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert ids[0] == open_id and m.consume_tokens(ids) and m.is_stopped
    assert tc.parse_tool_calls(qwenish.decode(ids), "hermes", call_id=_ids())[1][0]["function"]["name"] == "now"


@pytest.mark.parametrize("tools, choice, match", [
    (TOOLS, {"type": "function", "function": {"name": "fly"}}, "names function 'fly', which is not in tools"),
    (TOOLS, "sometimes", "tool_choice must be"),
    ([], "required", "needs at least one tool"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "required", "function.name must be"),
    ([{"type": "retrieval"}], "required", r"tools\[0\] must be"),
    (TOOLS[:1] * 2, "required", "more than once"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}], "required",
     "tool 'f' parameters: JSON schema not supported"),
])
def test_bad_tools_are_refused(tok, tools, choice, match):
    with pytest.raises(ValueError, match=match):
        constraints.tool_call(tok, tools, choice)


def test_none_and_auto_do_not_constrain(tok):
    assert constraints.tool_call(tok, TOOLS, "auto") is None
    assert constraints.tool_call(tok, TOOLS, "none") is None
    assert tc.parse_tool_calls("  hi  ", None) == ("hi", [])
    ids = {tc.new_call_id("hermes") for _ in range(20)} | {tc.new_call_id("mistral")}
    assert len(ids) == 21 and any(len(i) == 9 and i.isalnum() for i in ids)
