"""Structured output, tool calls, logit bias and penalties through `generate`, the Engine and
`jaxinfer serve` (with the real OpenAI client).

References: `jsonschema` validates every constrained JSON output; each logit control is checked
against a NumPy implementation of its published definition (tests/test_penalties.py, where the
repetition penalty's is checked against transformers' RepetitionPenaltyLogitsProcessor) applied
to the model's own logits from `jaxinfer.logits`, an uncached forward pass that shares no code
with the decode core that applied the control. One model: tiny and random, with SmolLM2's real
tokenizer and chat template, so compiles are cheap; the server listens on 127.0.0.1.
"""

import dataclasses
import json
import os
import re
import types

import jax
import jsonschema
import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import jaxinfer  # noqa: E402
from jaxinfer.decode import constraints  # noqa: E402
from jaxinfer.decode.inputs import chat_ids
from jaxinfer.decode.outputs import Completion
from jaxinfer.decode.sampling import SamplingParams  # noqa: E402
from jaxinfer.model import config as mconfig, params as mparams  # noqa: E402
from jaxinfer.model.model import Model  # noqa: E402
from jaxinfer.serve import protocol as proto, responses as rsp, http_api as srv  # noqa: E402
from jaxinfer.serve.engine import Engine  # noqa: E402
from tests.test_penalties import np_frequency_presence, np_logit_bias, np_min_tokens, np_repetition  # noqa: E402
from tests.tolerances import assert_close, tolerance  # noqa: E402

NAME = "tiny-smollm2-vocab"
EOS = 2  # <|im_end|>, SmolLM2's only stop id

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "email": {"type": ["string", "null"], "maxLength": 16}},
    "required": ["name", "age", "tags"], "additionalProperties": False}

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
PARAMS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tok(golden_dir):
    return jaxinfer.load_tokenizer(os.path.join(golden_dir, "hf_text", "smollm2", "tokenizer.json.xz"))


@pytest.fixture(scope="module")
def model(tok):
    cfg = mconfig.tiny(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=EOS)
    return Model(cfg, mparams.init_params(cfg, jax.random.key(0)), tok)


@pytest.fixture(scope="module")
def served(model):
    engine = srv.make_engine(model, max_slots=4, prefill_chunk=64)
    server, thread, url = srv.serve_in_thread(srv.create_app(engine, model, model_name=NAME))
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield types.SimpleNamespace(url=url, engine=engine, client=client)
    server.should_exit = True
    thread.join(timeout=60)


def gen(model, prompt, max_new_tokens, seed=0, sp=None, **sampling) -> Completion:
    """generate for one prompt with `sp` or SamplingParams(**sampling) (greedy by default)."""
    sp = sp or SamplingParams(**{"temperature": 0.0, **sampling})
    return jaxinfer.generate(model, [prompt], seed=seed, max_new_tokens=max_new_tokens, sampling=sp).completions[0]


def refused(call, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        call(model=NAME, **kw)
    return e.value


# ---- structured output ---------------------------------------------------------------------------

def test_response_format_json_schema_validates_and_equals_generate(served, model):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ids = chat_ids(model.tokenizer, [{"role": "user", "content": "A person:"}])
    for seed in (1, 2, 3):
        r = served.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "A person:"}],
                                                  max_tokens=80, temperature=0.8, seed=seed, response_format=rf)
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)
        ref = gen(model, ids, 80, seed, temperature=0.8, constraint=constraints.json_schema(PERSON))
        assert c.message.content == ref.text and r.usage.completion_tokens == len(ref.token_ids)


def test_json_object_and_guided_extras_on_completions(served):
    comp = served.client.completions.create
    r = comp(model=NAME, prompt="JSON:", max_tokens=80, temperature=0.8, seed=4,
             extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)
    r = comp(model=NAME, prompt="Well?", max_tokens=8, temperature=1.0, seed=1, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].text in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"
    r = comp(model=NAME, prompt="Code:", max_tokens=16, temperature=1.0, seed=2, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = comp(model=NAME, prompt="Pick:", max_tokens=8, temperature=1.0, seed=3,
             extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].text in ("left", "right")
    r = comp(model=NAME, prompt="Age:", max_tokens=8, temperature=1.0, seed=3,
             extra_body={"guided_grammar": 'root ::= "age=" [1-9] [0-9]?'})  # GBNF
    assert re.fullmatch(r"age=[1-9][0-9]?", r.choices[0].text)
    r = comp(model=NAME, prompt="N:", max_tokens=16, temperature=1.0, seed=5,
             extra_body={"guided_json": {"type": "integer", "minimum": 10, "maximum": 99}})
    assert 10 <= json.loads(r.choices[0].text) <= 99


def test_a_schema_the_engine_cannot_honour_is_a_400_naming_the_keyword(served):
    bad = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    e = refused(served.client.chat.completions.create, messages=ASK, max_tokens=8,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad, "strict": False}})
    assert e.status_code == 400 and e.param == "response_format.json_schema.schema" and "uniqueItems" in e.message
    e = refused(served.client.completions.create, prompt="x", max_tokens=8, extra_body={"guided_json": {"not": {}}})
    assert e.param == "guided_json" and '"not"' in e.message
    e = refused(served.client.completions.create, prompt="x", max_tokens=8, extra_body={"guided_regex": "(?=a)b"})
    assert e.param == "guided_regex" and "look-around" in e.message
    e = refused(served.client.completions.create, prompt="x", max_tokens=8,
                extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    assert e.param == "guided_choice" and "send one" in e.message
    e = refused(served.client.completions.create, prompt="x", max_tokens=8,
                extra_body={"guided_grammar": "start: <|no_such_token|>"})  # parses; this vocabulary lacks it
    assert e.param == "guided_grammar" and "no_such_token" in e.message
    e = refused(served.client.chat.completions.create, messages=ASK, max_tokens=8, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.param == "tool_choice" and "nope" in e.message
    broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}]
    e = refused(served.client.chat.completions.create, messages=ASK, max_tokens=8, tools=broken, tool_choice="required")
    assert e.param == "tools" and "uniqueItems" in e.message and "'f'" in e.message


# Constraints the grammar engine gives up on (issue 49): each used to come back over HTTP as a
# normal 200 "stop" answer. (body parameter, its value, the builder, words of llguidance's reason)
GIVES_UP = {
    "choice_of_5000": ("guided_choice", [f"option{i}" for i in range(5000)], constraints.choice, "5001 items; max is 2000"),
    "exploding_regex": ("guided_regex", "((a{100}){100}){100}", constraints.regex, "too many expressions"),
    "never_ends": ("guided_grammar", 'root ::= "a" root', constraints.grammar, "Too many items"),
    "grammar_of_20000": ("guided_grammar", "root ::= " + " | ".join(f'"tok{i}"' for i in range(20000)), constraints.grammar,
                         "20001 items"),
    "matches_nothing": ("guided_regex", r"[^\s\S]", constraints.regex, "admits no output at all"),
    "schema_of_3000": ("guided_json", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}},
                       constraints.json_schema, "items; max is 2000"),
    "self_referential_ref": ("guided_json", {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
                             constraints.json_schema, "admits no output at all"),
}


@pytest.mark.parametrize("case", list(GIVES_UP))
def test_a_constraint_the_engine_gives_up_on_is_refused_before_admission(served, model, case):
    """A 400 naming the parameter and llguidance's reason, streaming or not (nothing admitted:
    the engine's counters do not move), and a ValueError from generate before anything compiles."""
    from jaxinfer.compile_cache import CompileCounter

    param, value, build, words = GIVES_UP[case]
    finished = served.engine.stats().requests_finished
    for stream in (False, True):
        e = refused(served.client.completions.create, prompt="Go:", max_tokens=8, stream=stream,
                    extra_body={param: value})
        assert e.param == param and words in e.message and "cannot be served" in e.message, e.message
    assert served.engine.stats().requests_finished == finished
    with CompileCounter() as compiles, pytest.raises(ValueError, match="cannot be served") as e:
        gen(model, "Go:", 8, constraint=build(value))
    assert words in str(e.value) and compiles.count == 0


# A grammar that passes admission (the walk's 16 one-letter tokens stay inside the 24 letters) and
# gives up once a sampled path reaches the 5,000-way choice.
LATE = "start: /[a-z]{24}/ (" + " | ".join(f'"x{i}"' for i in range(5000)) + ")"


def test_a_constraint_that_gives_up_mid_generation_fails_that_request_alone(served, model):
    """Never a "stop": a 500 naming the parameter and llguidance's reason, an error object ending
    the stream, a ConstraintError from generate; a request beside it is served as if alone."""
    import concurrent.futures

    import httpx

    kw = dict(model=NAME, prompt="Go:", max_tokens=40, temperature=1.0, seed=3)
    neighbour = dict(model=NAME, prompt="The weather today", max_tokens=24, temperature=0.8, seed=1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(served.client.completions.create, **neighbour)
        with pytest.raises(openai.InternalServerError) as e:
            served.client.completions.create(extra_body={"guided_grammar": LATE}, **kw)
        r = beside.result()
    err = e.value.body
    assert e.value.status_code == 500 and err["code"] == "constraint_failed" and err["param"] == "guided_grammar"
    assert "5001 items" in err["message"] and "gave up after" in err["message"], err
    assert r.choices[0].text == gen(model, "The weather today", 24, seed=1, temperature=0.8).text
    with httpx.stream("POST", served.url + "/v1/completions", json={**kw, "stream": True, "guided_grammar": LATE},
                      timeout=120) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert resp.status_code == 200 and events[-1]["error"]["code"] == "constraint_failed", events[-1]
    assert all(c["finish_reason"] is None for ev in events[:-1] for c in ev["choices"])  # never "stop"
    text = "".join(c["text"] for ev in events[:-1] for c in ev["choices"])
    assert re.fullmatch("[a-z]*", text)
    with pytest.raises(constraints.ConstraintError, match="5001 items"):
        gen(model, "Go:", 40, seed=3, temperature=1.0, constraint=constraints.grammar(LATE))
    assert served.engine.healthy


def test_min_tokens_with_a_constraint_is_refused(served):
    """A guided_choice is complete after its option: min_tokens cannot lengthen it (it used to
    return the 1-token answer silently)."""
    e = refused(served.client.completions.create, prompt="Well?", max_tokens=16,
                extra_body={"guided_choice": ["yes", "no"], "min_tokens": 8})
    assert e.param == "min_tokens" and "constraint" in e.message
    e = refused(served.client.chat.completions.create, messages=ASK, max_tokens=16, tools=TOOLS,
                tool_choice="required", extra_body={"min_tokens": 2})
    assert e.param == "min_tokens"
    with pytest.raises(ValueError, match="min_tokens=8 cannot be combined with a constraint"):
        SamplingParams(min_tokens=8, constraint=constraints.choice(["yes", "no"]))


def test_logit_bias_keys_are_ascii_digits(served):
    """"١٢" (Arabic-Indic digits) used to be read as token 12, while "+12" was refused."""
    for key in ("\u0661\u0662", "\uff11\uff12", "+12", " 12"):
        e = refused(served.client.completions.create, prompt="x", max_tokens=2, logit_bias={key: 5})
        assert e.param == "logit_bias", key


# ---- tool calls ----------------------------------------------------------------------------------

def _check_calls(calls):
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def _streamed(client, **kw):
    """A streamed chat reply reassembled: (content, [(name, arguments)], ids, finish_reason)."""
    content, calls, ids, finish = "", {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or ():
            if tc.id:
                ids[tc.index] = tc.id
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], ids, finish


@pytest.mark.parametrize("choice, parallel", [({"type": "function", "function": {"name": "get_weather"}}, None),
                                              ("required", None), ("required", False)])
def test_forced_tool_calls_validate_and_stream_the_same(served, choice, parallel):
    kw = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0.8, seed=5,
              **({"parallel_tool_calls": parallel} if parallel is not None else {}))
    r = served.client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    calls = c.message.tool_calls
    assert len(calls) >= 1 and (len(calls) == 1 or choice == "required" and parallel is None)
    if isinstance(choice, dict):
        assert [x.function.name for x in calls] == ["get_weather"]
    _check_calls(calls)
    content, streamed, ids, finish = _streamed(served.client, **kw)
    assert streamed == [(x.function.name, x.function.arguments) for x in calls]  # the same seed, the same call
    assert content == "" and finish == "tool_calls" and len(set(ids.values())) == len(calls)


def test_a_forced_tool_call_cut_by_max_tokens_returns_what_was_written(served, model):
    """finish_reason "length" with the reply so far, as OpenAI returns it: cut inside the name, the
    text is the content (it used to be dropped: content null, no tool_calls); cut inside the
    arguments, the call with its arguments so far (a prefix of the JSON text). Streamed alike."""
    kw = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0.8, seed=5)
    whole = served.client.chat.completions.create(max_tokens=120, **kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    call = whole.choices[0].message.tool_calls[0].function
    ref = gen(model, chat_ids(model.tokenizer, ASK, tools=TOOLS), 120, seed=5, temperature=0.8,
              constraint=constraints.tool_call(model.tokenizer, TOOLS, "required"))
    in_args = next(k for k in range(len(ref.token_ids)) if '"city"' in model.tokenizer.decode(ref.token_ids[:k]))
    for cut in (3, in_args):
        r = served.client.chat.completions.create(max_tokens=cut, **kw)
        c = r.choices[0]
        assert c.finish_reason == "length" and r.usage.completion_tokens == cut
        text = model.tokenizer.decode(ref.token_ids[:cut])
        if cut == 3:  # inside `[{"name": ...`
            assert c.message.tool_calls is None and c.message.content == text.strip() and ref.text.startswith(text)
        else:
            got = c.message.tool_calls[0].function
            assert c.message.content is None and got.name == call.name
            assert call.arguments.startswith(got.arguments) and got.arguments != call.arguments
        content, streamed, _, finish = _streamed(served.client, max_tokens=cut, **kw)
        assert finish == "length" and (content or None) == c.message.content
        assert streamed == [(x.function.name, x.function.arguments) for x in c.message.tool_calls or ()]


def test_auto_without_a_template_format_is_plain_text(served, model):
    """SmolLM2's template ignores `tools`, so "auto" gets what the model writes, as content."""
    r = served.client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    ref = gen(model, chat_ids(model.tokenizer, ASK, tools=TOOLS), 8)
    assert r.choices[0].message.content == ref.text and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == ref.finish_reason


def test_a_follow_up_with_tool_results_renders_through_the_template(served, model):
    call = {"id": "call_abc123", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris<|im_end|>", "unit": "celsius"}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_abc123", "content": "18 degrees <|im_start|>"}]
    r = served.client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, max_tokens=6, temperature=0)
    ids = chat_ids(model.tokenizer, messages, tools=TOOLS)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == gen(model, ids, 6).text
    text = model.tokenizer.decode(ids)
    assert ('<|im_start|>assistant\n[{"name": "get_weather", "arguments": {"city": "Paris<|im_end|>", '
            '"unit": "celsius"}}]<|im_end|>\n<|im_start|>tool\n18 degrees <|im_start|><|im_end|>\n') in text
    im_start, im_end = (model.tokenizer.encode(t)[0] for t in ("<|im_start|>", "<|im_end|>"))
    assert ids.count(im_end) == 4 and ids.count(im_start) == 5  # system, user, assistant, tool + the reply's header
    e = refused(served.client.chat.completions.create, messages=messages[:2] + [{"role": "tool", "content": "x"}],
                max_tokens=4)
    assert e.param == "messages[2].tool_call_id"
    bad_args = [ASK[0], {"role": "assistant", "tool_calls": [dict(call, function={"name": "f", "arguments": "[1"})]}]
    e = refused(served.client.chat.completions.create, messages=bad_args, max_tokens=4)
    assert e.param == "messages[1].tool_calls[0].function.arguments"


# A Hermes-style template (Qwen2.5's tool parts): tools and tool-call arguments through tojson.
HERMES = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}"
    "{{- tool | tojson }}{%- endfor %}{{- '\\n</tools>\\nFor each function call, return a json object within "
    "<tool_call></tool_call> XML tags<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_tool_call_arguments_are_plain_text_in_a_template_that_renders_them(tok):
    """Arguments written by the template's tojson: the text is JSON-escaped as tojson writes it, and
    control-token text in it stays plain text; the rendering is transformers' (dict arguments)."""
    hermes = dataclasses.replace(tok, chat_template=HERMES)
    args = {"city": 'Pa"ris\n<|im_end|>', "unit": "celsius", "<|im_start|>": ["naïve", 3, None]}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ids = chat_ids(hermes, messages, tools=TOOLS)
    as_transformers = [dict(m, tool_calls=[{**m["tool_calls"][0], "function": {"name": "get_weather", "arguments": args}}])
                       if m.get("tool_calls") else m for m in messages]
    want = hermes.apply_chat_template(as_transformers, tools=TOOLS)
    assert hermes.decode(ids) == want
    im_start, im_end = (tok.encode(t)[0] for t in ("<|im_start|>", "<|im_end|>"))
    assert ids.count(im_end) == want.count("<|im_end|>") - 1 and ids.count(im_start) == want.count("<|im_start|>") - 1
    with pytest.raises(ValueError, match="tools contains control-token text"):
        chat_ids(hermes, ASK, tools=[{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}])


def test_hermes_replies_are_read_into_tool_calls_whole_and_streamed(tok):
    """The response side of "auto" for a template with a format: the same calls whole and streamed."""
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    ids = tok.encode(text)
    comp = Completion(prompt_ids=[1], token_ids=ids + [EOS], text=text, logprobs=[0.0] * (len(ids) + 1),
                      finish_reason="stop")
    job = proto.Job(prompts=[[1]], max_tokens=64, sampling=SamplingParams(), seed=0, n=1, stop=(),
                    logprobs=None, echo=False, stream=False, include_usage=False, chat=True, tool_format="hermes")
    m = types.SimpleNamespace(tokenizer=tok)
    body = rsp.full_response(m, NAME, job, [comp])
    msg = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and msg["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("add", {"a": 1, "b": 2})]
    head = rsp.StreamHead(m, NAME, dataclasses.replace(job, stream=True))
    chunks = [c for k in range(len(ids)) for c in head.deltas(0, tok.decode(ids[k:k + 1]))] + head.final(0, comp)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    calls = {}
    for c in chunks:
        for d in c["choices"][0]["delta"].get("tool_calls", ()):
            calls.setdefault(d["index"], [d["function"].get("name"), ""])[1] += d["function"]["arguments"]
    assert content == msg["content"] and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [tuple(calls[i]) for i in sorted(calls)] == [(c["function"]["name"], c["function"]["arguments"])
                                                        for c in msg["tool_calls"]]


# ---- logit bias and penalties --------------------------------------------------------------------

def test_logit_bias_bans_and_forces_a_token(served, model):
    prompt = "The weather today"
    ref = gen(model, prompt, 8)
    banned = ref.token_ids[0]
    kw = dict(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    r = served.client.completions.create(logit_bias={str(banned): -100}, **kw)
    out = gen(model, prompt, 8, logit_bias={banned: -100})
    assert banned not in out.token_ids and r.choices[0].text == out.text != ref.text
    hello = model.tokenizer.encode(" hello")
    assert len(hello) == 1
    r = served.client.completions.create(logit_bias={str(hello[0]): 100}, logprobs=1, **kw)
    assert r.choices[0].text == " hello" * 8 and r.choices[0].logprobs.tokens == [" hello"] * 8
    assert gen(model, prompt, 8, logit_bias={hello[0]: 100}).token_ids == hello * 8


@pytest.mark.parametrize("controls", [
    dict(frequency_penalty=1.2, presence_penalty=0.4, repetition_penalty=1.3),
    dict(min_tokens=4, logit_bias={EOS: 30.0}),
    dict(ignore_eos=True, logit_bias={EOS: 30.0}),
])
def test_penalties_through_the_server_equal_generate(served, model, controls):
    prompt = "The cat sat on the mat. The cat sat on the"
    extra = {k: v for k, v in controls.items() if k in ("repetition_penalty", "min_tokens", "ignore_eos")}
    kw = {k: v for k, v in controls.items() if k in ("frequency_penalty", "presence_penalty")}
    if "logit_bias" in controls:
        kw["logit_bias"] = {str(t): v for t, v in controls["logit_bias"].items()}
    r = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0.8, seed=7,
                                         extra_body=extra, **kw)
    ref = gen(model, prompt, 10, 7, temperature=0.8, **controls)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    if "min_tokens" in controls:
        assert ref.token_ids.index(EOS) == 4 and ref.finish_reason == "stop"
    if "ignore_eos" in controls:
        assert EOS not in ref.token_ids and ref.finish_reason == "length"


def numpy_controls(logits: np.ndarray, sp: SamplingParams, prompt: list, generated: list) -> np.ndarray:
    """One row's logits [V] after the controls, from the NumPy definitions, in the sampler's order."""
    x = np_logit_bias(logits[None].astype(np.float32), [dict(sp.logit_bias)])
    x = np_repetition(x, [prompt + generated], [sp.repetition_penalty])
    x = np_frequency_presence(x, [generated], [sp.frequency_penalty], [sp.presence_penalty])
    return np_min_tokens(x, [len(generated)], [sp.min_tokens], [sp.ignore_eos], [EOS], [[]])[0]


CONTROLS = {  # LEVER: a bias that makes the prompt's greedy token win again and again, so a penalty has work
    "logit_bias": dict(logit_bias={11: 6.0, 30: -50.0, 1000: 3.5}),
    "frequency_penalty": dict(frequency_penalty=1.5, logit_bias="LEVER"),
    "presence_penalty": dict(presence_penalty=2.0, logit_bias="LEVER"),
    "repetition_penalty": dict(repetition_penalty=1.8, logit_bias="LEVER"),
    "repetition_penalty_below_1": dict(repetition_penalty=0.5),
    "negative_frequency_penalty": dict(frequency_penalty=-2.0, presence_penalty=-1.0),
    "min_tokens": dict(min_tokens=5, logit_bias={EOS: 40.0}),
    "ignore_eos": dict(ignore_eos=True, logit_bias={EOS: 40.0}),
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_each_control_picks_the_argmax_of_its_numpy_definition(model, name):
    """Greedy: every token generate picks is the argmax of the NumPy-processed real logits, and its
    reported logprob is log_softmax of those logits (the distribution sampled from). The control
    must change some greedy token (against the bias alone), or the check would not see it."""
    prompt = model.tokenizer.encode("The cat sat on the mat. The cat sat on the mat. The cat")
    controls = dict(CONTROLS[name])
    if controls.get("logit_bias") == "LEVER":
        controls["logit_bias"] = {int(np.argmax(np.asarray(jaxinfer.logits(model, prompt))[-1])): 3.0}
    sp = SamplingParams(temperature=0.0, **controls)
    bias_only = SamplingParams(temperature=0.0, logit_bias=sp.logit_bias if name != "logit_bias" else {})
    out = gen(model, prompt, 12, sp=sp)
    toks = out.token_ids
    rows = np.asarray(jaxinfer.logits(model, prompt + toks[:-1]))[len(prompt) - 1:]
    tol = tolerance(rows)
    changed = 0
    for t, tok in enumerate(toks):
        want = numpy_controls(rows[t], sp, prompt, toks[:t])
        top2 = np.sort(want[np.isfinite(want)])[-2:]
        if top2[1] - top2[0] > 2 * tol:  # not a near tie: the argmax is exact
            assert tok == int(np.argmax(want)), (name, t, tok, int(np.argmax(want)))
        fin = want[np.isfinite(want)].astype(np.float64)
        logp = want - (fin.max() + np.log(np.exp(fin - fin.max()).sum()))  # float64 log-sum-exp
        assert_close(out.logprobs[t], logp[tok], scale=np.abs(fin).max(), what=f"logprob {t}")
        changed += int(np.argmax(numpy_controls(rows[t], bias_only, prompt, toks[:t])) != tok)
    assert changed, f"{name} never changed the greedy token: the check would not see it"
    if name == "min_tokens":
        assert toks.index(EOS) == 5 and out.finish_reason == "stop"
    if name == "ignore_eos":
        assert EOS not in toks and out.finish_reason == "length" and len(toks) == 12


def test_numpy_repetition_definition_is_transformers(golden_dir):
    """The NumPy definition the checks above use, against transformers' processor (golden file)."""
    g = np.load(os.path.join(golden_dir, "penalties_golden.npz"))
    want = np_repetition(g["logits"], [list(r) for r in g["input_ids"]], g["penalty"])
    assert_close(want, g["expected"], what="NumPy repetition penalty vs transformers")


# ---- reproducibility -----------------------------------------------------------------------------

@pytest.mark.usefixtures("optimized")
def test_same_request_same_tokens_in_generate_the_engine_and_the_server(served, model):
    """(prompt, constraint, sampling, seed) -> the same tokens alone, beside other requests arriving
    at other steps, and through the server. Its time goes into running ~100 sampling steps, each
    sorting the whole vocabulary for top-p, rather than into compiling: XLA's usual optimisation."""
    specs = [("A person:", SamplingParams(temperature=0.8, constraint=constraints.json_schema(PERSON)), 11),
             ("Anything", SamplingParams(temperature=1.0, top_p=0.9), 12),
             ("Digits:", SamplingParams(temperature=0.9, constraint=constraints.regex(r"[0-9]{2,6}"), frequency_penalty=1.0), 13),
             ("The cat", SamplingParams(temperature=0.7, repetition_penalty=1.4, logit_bias={11: 4.0}), 14)]
    refs = [gen(model, p, 100, s, sp) for p, sp, s in specs]
    engine = Engine(model, max_slots=4, prefill_chunk=64)  # stepped by hand: arrivals at chosen steps
    arrive = {0: [0], 2: [1], 3: [2], 6: [3]}
    reqs = {}
    for step in range(2000):
        for i in arrive.get(step, ()):
            p, sp, s = specs[i]
            reqs[i] = engine.submit(p, max_new_tokens=100, sampling=sp, seed=s)
        engine.step()
        if len(reqs) == len(specs) and all(r.done for r in reqs.values()):
            break
    for i, ref in enumerate(refs):
        got = reqs[i].result()
        assert got.token_ids == ref.token_ids and got.text == ref.text, i
    assert refs[0].finish_reason == refs[2].finish_reason == "stop"
    jsonschema.validate(json.loads(refs[0].text), PERSON)
    r = served.client.completions.create(model=NAME, prompt="A person:", max_tokens=100, temperature=0.8, seed=11,
                                         extra_body={"guided_json": PERSON})
    assert r.choices[0].text == refs[0].text
