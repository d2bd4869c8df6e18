"""Constrained decoding on llguidance, with SmolLM2's real vocabulary (its tokenizer.json).

Masks are checked against brute force over the vocabulary (which token byte strings can extend
the output), and constrained random walks against the `jsonschema` validator.
"""

import dataclasses
import json
import os

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import jaxinfer
from jaxinfer.decode import bitmask as bm
from jaxinfer.decode import constraints

V_MODEL = 49152 + 64  # a logits width past the tokenizer's 49152 tokens, as padded model heads have


@pytest.fixture(scope="module")
def tok(golden_dir):
    return jaxinfer.load_tokenizer(os.path.join(golden_dir, "hf_text", "smollm2", "tokenizer.json.xz"))


@pytest.fixture(scope="module")
def compiler(tok):
    return constraints.Compiler(tok, V_MODEL, stop_ids=[0, 2])  # <|endoftext|>, <|im_end|>


def _allowed(m: constraints.Matcher) -> set[int]:
    out = np.zeros(m.mask_words, np.int32)
    m.fill_bitmask(out)
    return set(np.nonzero(np.unpackbits(out.view(np.uint8), bitorder="little")[:m.vocab_size])[0].tolist())


def _text_tokens(tok):
    """id -> bytes for ordinary (non-special) tokens."""
    special = set(constraints.special_token_ids(tok))
    return {i: p for i, p in enumerate(tok.pieces(range(tok.vocab_size))) if i not in special and p}


# -- constraint values and refusals ------------------------------------------------------------

def test_constraints_are_hashable_values():
    a = constraints.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = constraints.json_schema('{"type": "object", "properties": {"x": {"type": "integer"}}}')
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert constraints.json_schema({"type": "integer"}, whitespace=None) != constraints.json_schema({"type": "integer"})
    assert constraints.choice(["a", "b"]) != constraints.choice(["b", "a"])
    assert constraints.json_object().kind == "json_schema" and constraints.regex("a+").kind == "regex"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.source = "x"


@pytest.mark.parametrize("schema, named", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, '"not"'),
    ({"if": {"type": "string"}, "then": {"minLength": 1}}, '"if", "then"'),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "string", "format": "credit-card"}, "Unknown format: credit-card"),
    ({"$ref": "https://example.com/person.json"}, "https://example.com/person.json"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "object", "patternProperties": {"^a": {}, "^ab": {}}}, "not disjoint"),
    ({"type": "strnig"}, "Invalid type: strnig"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
])
def test_unsupported_schema_is_refused_by_name(schema, named):
    with pytest.raises(ValueError, match="JSON schema not supported") as e:
        constraints.json_schema(schema)
    assert named in str(e.value)


def test_lenient_schema_lists_what_it_ignores():
    c = constraints.json_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, strict=False)
    assert any("uniqueItems" in w for w in c.warnings)
    with pytest.raises(ValueError, match="Invalid type"):  # a broken schema is refused even then
        constraints.json_schema({"type": "strnig"}, strict=False)


@pytest.mark.parametrize("build, match", [
    (lambda: constraints.json_schema("{not json"), "not valid JSON"),
    (lambda: constraints.json_schema([1, 2]), "must be an object"),
    (lambda: constraints.json_schema(False), "must be an object"),
    (lambda: constraints.regex("a(b"), "unclosed group"),
    (lambda: constraints.regex(r"(a)\1"), "regex not supported"),
    (lambda: constraints.regex(3), "must be a string"),
    (lambda: constraints.grammar("start: foo"), 'unknown name: "foo"'),
    (lambda: constraints.grammar('root ::= "a'), "grammar does not parse"),
    (lambda: constraints.grammar(""), "non-empty"),
    (lambda: constraints.choice([]), "non-empty list"),
    (lambda: constraints.choice("ab"), "non-empty list"),
    (lambda: constraints.choice(["a", 1]), "must be strings"),
    (lambda: constraints.choice(["a", "a"]), "distinct"),
])
def test_bad_constraints_raise_value_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_common_schema_annotations_are_accepted():
    constraints.json_schema({"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "T", "description": "d",
                   "type": "object", "properties": {"when": {"type": "string", "format": "date-time", "default": "x",
                                                             "examples": ["2024-01-01T00:00:00Z"]},
                                                    "p": {"$ref": "#/$defs/P"}},
                   "$defs": {"P": {"type": "integer", "minimum": 0}}})


# -- masks -------------------------------------------------------------------------------------

def test_choice_masks_match_brute_force(tok, compiler):
    options = ["yes", "no", "maybe not", "nope"]
    m = compiler.matcher(constraints.choice(options))
    text = _text_tokens(tok)
    out = b""
    for target in tok.encode("maybe not"):
        want = {i for i, p in text.items() if any(o.encode().startswith(out + p) for o in options)}
        if any(o.encode() == out for o in options):
            want |= {0, 2}
        if m.forced_tokens():  # the rest is forced: llguidance allows only its canonical tokenization
            assert _allowed(m) == {m.forced_tokens()[0]} and _allowed(m) <= want, out
        else:
            assert _allowed(m) == want, out
        assert m.consume(target)
        out += tok.pieces([target])[0]
    assert m.is_stopped and m.is_accepting
    assert _allowed(m) == {0, 2}  # complete: only the stop ids


def test_ids_past_the_tokenizer_and_stop_ids(tok, compiler):
    m = compiler.matcher(constraints.regex("[a-z]+"))
    allowed = _allowed(m)
    assert allowed and max(allowed) < tok.vocab_size  # ids 49152.. of the wider head: never
    assert 0 not in allowed and 2 not in allowed  # nothing generated yet: cannot stop
    assert m.consume(tok.encode("abc")[0])
    allowed = _allowed(m)
    assert {0, 2} <= allowed and not m.is_stopped and m.is_accepting  # may stop, may go on
    assert m.consume(2) and m.is_stopped  # the stop id ends it


def test_special_tokens_are_not_text(tok, compiler):
    # the bytes "<|im_end|>" as text never come from the control token 2 ...
    m = compiler.matcher(constraints.regex(r"<\|im_end\|>x"))
    assert 2 not in _allowed(m)
    assert m.consume_tokens(tok.encode("<|im_end|>x", allowed_special=set(), disallowed_special=()))
    assert m.is_stopped
    # ... and a grammar asks for the control token by name
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= constraints.special_token_texts(tok)
    m = compiler.matcher(constraints.grammar("start: <|im_end|>"))
    assert _allowed(m) == {2}
    with pytest.raises(ValueError, match="unknown special token"):
        compiler.compile(constraints.grammar("start: <|no_such_token|>"))


def test_forced_tokens_rollback_and_validate(tok, compiler):
    schema = {"type": "object", "properties": {"temperature_celsius": {"type": "number"}},
              "required": ["temperature_celsius"], "additionalProperties": False}
    m = compiler.matcher(constraints.json_schema(schema))
    assert m.consume_tokens(tok.encode('{"'))
    forced = m.forced_tokens()
    assert forced and b"".join(tok.pieces(forced)) in b'temperature_celsius"'  # a canonical prefix
    assert m.consume_tokens(forced)
    before = _allowed(m)
    rest = tok.encode('temperature_celsius": 21.5}')[len(forced):]
    assert m.validate(rest) == len(rest)  # all allowed, state unchanged
    assert _allowed(m) == before
    assert m.consume_tokens(rest) and m.is_stopped
    m.rollback(len(rest))
    assert not m.is_stopped and _allowed(m) == before
    bad = tok.encode('temperature_celsius": "hot"}')[len(forced):]
    assert m.validate(bad) < len(bad)
    assert not m.consume_tokens(bad) and m.error and "doesn't satisfy the grammar" in m.error
    assert _allowed(m) == {0, 2}  # in error only the stop ids remain


@pytest.mark.parametrize("threads", [1, 2])  # rows in turn, and llguidance's thread pool
def test_batched_and_draft_masks_equal_single_ones(tok, compiler, threads):
    compiler = constraints.Compiler(tok, V_MODEL, stop_ids=[0, 2], threads=threads)
    cs = [constraints.json_object(), None, constraints.regex("[0-9]{2,4}"), constraints.choice(["left", "right"])]
    ms = [compiler.matcher(c) if c else None for c in cs]
    assert ms[0].consume_tokens(tok.encode('{"a": '))
    out = compiler.allocate_bitmask(4)
    out[1] = 0
    compiler.fill_bitmasks(ms, out)
    assert (out[1] == -1).all()
    for i in (0, 2, 3):
        single = np.zeros(compiler.mask_words, np.int32)
        ms[i].fill_bitmask(single)
        np.testing.assert_array_equal(out[i], single)
    draft = tok.encode("[1, 2]")
    masks = np.zeros((len(draft) + 1, compiler.mask_words), np.int32)
    ms[0].fill_bitmask_draft(draft, masks)
    for k, t in enumerate(draft):
        np.testing.assert_array_equal(masks[k], np.packbits(
            np.isin(np.arange(32 * compiler.mask_words), sorted(_allowed(ms[0]))), bitorder="little").view(np.int32))
        assert ms[0].consume(t)
    with pytest.raises(ValueError, match=r"shape \(4, 1538\)"):
        compiler.fill_bitmasks(ms, np.zeros((4, 3), np.int32))


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "pet": {"enum": ["cat", "dog", None]}},
     "required": ["name", "age", "pet"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"anyOf": [{"type": "integer", "maximum": 99, "minimum": -99},
               {"type": "string", "pattern": "^[a-c]{1,3}$"}]},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_constrained_random_walks_validate(tok, compiler, schema):
    """A fake model with random logits, masked and sampled: every finished output validates."""
    c = constraints.json_schema(schema)
    rng = np.random.default_rng(0)
    for seed in range(3):
        m = compiler.matcher(c)
        ids = []
        for _ in range(200):
            if m.is_stopped:
                break
            allowed = np.array(sorted(_allowed(m)))
            logits = rng.standard_normal(allowed.size) * 3
            t = int(allowed[np.argmax(logits)])  # argmax of random logits over the allowed set
            if t in (0, 2):
                break
            assert m.consume(t)
            ids.append(t)
        else:
            pytest.fail(f"no end in 200 tokens: {tok.decode(ids)!r}")
        assert m.is_accepting, tok.decode(ids)
        jsonschema.validate(json.loads(tok.decode(ids)), schema)


def test_bitmask_applies_on_device(tok, compiler):
    m = compiler.matcher(constraints.choice(["true", "false"]))
    mask = compiler.allocate_bitmask(1)
    compiler.fill_bitmasks([m], mask)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((1, V_MODEL)), jnp.float32)
    masked = np.asarray(bm.apply_token_bitmask(logits, jnp.asarray(mask)))[0]
    assert set(np.nonzero(np.isfinite(masked))[0].tolist()) == _allowed(m)


def test_gguf_tokenizer_gives_the_same_masks(tok, compiler):
    """The tokenizer `jaxinfer.load_tokenizer("smollm2-135m")` reads from the GGUF (a different
    Tokenizer class, control tokens from GGUF token types) compiles to the same masks."""
    gguf = constraints.Compiler(jaxinfer.load_tokenizer("smollm2-135m"), V_MODEL, stop_ids=[0, 2])
    c = constraints.json_schema(SCHEMAS[0])
    a, b = compiler.matcher(c), gguf.matcher(c)
    for t in tok.encode('{"name": "Ann", "age": 7, "pet": null}'):
        assert _allowed(a) == _allowed(b)
        assert a.consume(t) and b.consume(t)
    assert a.is_stopped and b.is_stopped


def test_compiled_once_and_cache_bounded(tok):
    comp = constraints.Compiler(tok, cache_size=2)
    assert comp.vocab_size == tok.vocab_size and comp.stop_ids == tok.stop_ids
    a, b, c = constraints.regex("a"), constraints.regex("b"), constraints.regex("c")
    comp.matcher(a), comp.matcher(a), comp.matcher(b)
    assert comp.cached == 2
    comp.matcher(c)
    assert comp.cached == 2
    with pytest.raises(ValueError, match="expected a Constraint"):
        comp.matcher({"type": "object"})
    with pytest.raises(ValueError, match=r"stop ids \[99999\] are outside"):
        constraints.Compiler(tok, stop_ids=[99999])


def test_objects_generate_only_listed_properties_unless_asked(tok, compiler):
    """A schema silent on additionalProperties generates only its listed keys (a sampled object
    cannot invent keys until its budget ends); extra_properties=True is JSON Schema's default."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "array", "items": {
                                                   "type": "object", "properties": {"c": {"type": "boolean"}}}}},
              "required": ["a"]}
    closed = constraints.closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["b"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed
    assert constraints.closed_objects({"type": "object"}) == {"type": "object"}  # nothing listed: any keys
    assert constraints.closed_objects({"properties": {"x": {}}, "additionalProperties": True})["additionalProperties"] is True

    def accepts(c, text):
        m = compiler.matcher(c)
        ids = tok.encode(text)
        return m.validate(ids) == len(ids)

    listed, extra = '{"a": 1, "b": [{"c": true}]}', '{"a": 1, "zz": 2}'
    nested_extra = '{"a": 1, "b": [{"c": true, "d": 1}]}'
    assert accepts(constraints.json_schema(schema), listed)
    assert not accepts(constraints.json_schema(schema), extra) and not accepts(constraints.json_schema(schema), nested_extra)
    loose = constraints.json_schema(schema, extra_properties=True)
    assert accepts(loose, extra) and accepts(loose, nested_extra)
    for text in (listed, extra, nested_extra):
        jsonschema.validate(json.loads(text), schema)  # all valid: closing only narrows what is generated


def test_compile_walks_a_new_constraint_and_keeps_its_refusal(tok):
    """A constraint llguidance gives up on (or that admits no output) is a ValueError from
    `compile` with llguidance's reason, before any request uses it; the refusal is kept."""
    compiler = constraints.Compiler(tok, tok.vocab_size, stop_ids=[2])
    with pytest.raises(ValueError, match="admits no output at all"):
        compiler.compile(constraints.regex(r"[^\s\S]"))
    with pytest.raises(ValueError, match=r"gives up after 1 token: .*5001 items; max is 2000"):
        compiler.compile(constraints.choice([f"option{i}" for i in range(5000)]))
    assert "<non-verbose/>" not in compiler._refused[constraints.choice([f"option{i}" for i in range(5000)])]
    with pytest.raises(ValueError, match="5001 items"):  # from the kept refusal
        compiler.matcher(constraints.choice([f"option{i}" for i in range(5000)]))
    compiler.compile(constraints.grammar('root ::= ("a" | "b") root'))  # no end, but nothing to give up on: "length"
