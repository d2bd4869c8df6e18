"""Constrained decoding: JSON schemas, regexes, grammars and choices, on llguidance.

A `Constraint` is a frozen, hashable value (it sits inside the frozen sampling settings)::

  json_schema(schema, strict=True)   output is JSON that validates against `schema`
  json_object()                      output is any JSON object
  regex(pattern)                     output matches `pattern` (Rust regex syntax, no look-around)
  grammar(text)                      output is in a Lark grammar (llguidance dialect) or a GBNF one
  choice(options)                    output is exactly one of `options`
  tool_call(tokenizer, tools, choice) the reply is a tool call in the model's format (jaxinfer.text.tool_calls)

A constraint that llguidance cannot honour raises ValueError when it is built (the message names
the keyword or the grammar error), never later and never as a silently unconstrained answer.
Some fail only for a vocabulary or only once generation starts (a choice of 5,000 options, a
regex whose lexer explodes, a grammar with no string at all, a grammar that never ends): the
`Compiler` walks each new constraint PROBE_TOKENS tokens along one path before it is used
(`Compiler.compile`) and raises ValueError with llguidance's reason when the engine gives up on
the way. One that gives up later, on a path the walk did not take, makes the matcher's `error`
say why; `generate` and the serving engine then end that request with `ConstraintError`, never
as a finished answer.

A `Compiler` holds one model's vocabulary (V token byte strings, V the model's logits width) and
turns constraints into per-request `Matcher` objects. Each compiled constraint is kept (an LRU of
template matchers, keyed by the Constraint value) so a schema is compiled once and each request
gets a cheap copy. A matcher, per generated token::

  fill_bitmask(out [U])     the allowed next tokens, U = ceil(V / 32) int32 words, token t allowed
                            iff bit t % 32 of word t // 32 is set (llguidance's and
                            `bitmask.apply_token_bitmask`'s layout); ids past the tokenizer's
                            vocabulary are never allowed; stop ids only where the output may end
  consume(token)            advance past the sampled token
  is_stopped                the grammar is complete and admits nothing more: end the row as a
                            normal stop ("stop"), without sampling a stop token
  is_accepting              the output may end here (stop ids are allowed by the mask)
  forced_tokens()           tokens the grammar forces next (jump-forward); feed them, then consume
  rollback(n), validate(draft)  for speculative decoding

Threads: mask computation (`fill_bitmask`, `fill_bitmask_draft`, `Compiler.fill_bitmasks`) and
grammar compilation drop the GIL inside llguidance's Rust code, so masks can be computed on a host
thread while the main thread waits for the device; `consume`, `validate` and `forced_tokens` keep
it (they are short; `forced_tokens` calls back into the Python tokenizer). Measured in
`python -m experiments.structured`: ~10 us per mask at V = 49152. One matcher must not be used from
two threads at once.

Special tokens (control tokens such as `<|im_end|>`) are never produced as text: a grammar that
wants one names it as `<|im_end|>` (Lark) instead of a quoted string.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import threading
from typing import Any, Mapping, Optional, Sequence, Union

import llguidance
import llguidance.numpy as llg_np
import numpy as np

from jaxinfer.text import tool_calls as tc

# Whitespace allowed between JSON tokens: nothing, one space, or a newline and up to 20 spaces or
# tabs of indentation (llama.cpp's json-schema-to-grammar `space` rule). Bounded so a model cannot
# fill its token budget with whitespace inside an object, the usual failure of unconstrained
# whitespace; pretty-printed JSON up to ten levels of 2-space indentation still fits.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})"

KINDS = ("json_schema", "regex", "grammar", "choice")
_NEEDS_TOKENIZER = "no tokenizer - can't validate"
# Tokens a new constraint is walked along one path before its first use (`Compiler.compile`):
# llguidance's resource limits (2,000 Earley items in a row, 50,000 per step, the lexer's states)
# are hit on the first token or two by the constraints that hit them at all (a 5,000-way choice,
# ((a{100}){100}){100}, a 3,000-property schema); a walk costs ~1 ms per token at V = 49152.
PROBE_TOKENS = 16


class ConstraintError(RuntimeError):
    """The constraint engine (llguidance) gave up while generating: a resource limit reached on
    a path that the admission walk (`Compiler.compile`) did not take. The message says why."""


def _limits() -> "llguidance.LLParserLimits":
    """llguidance's default limits with short error messages: its verbose ones carry the parser
    state and the whole grammar (a client's schema, into a log line or an HTTP error)."""
    return llguidance.LLParserLimits(verbose_errors=False)


def _reason(m: "llguidance.LLMatcher") -> str:
    """llguidance's error message, on one line, without its `<non-verbose/>` marker."""
    text = (m.get_error() or "error").replace("<non-verbose/>", " ")
    return " ".join(text.split())


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What the output must be; build it with json_schema / json_object / regex / grammar / choice."""

    kind: str  # one of KINDS
    source: str  # the schema as JSON text, the regex, the grammar text, or the choices as a JSON list
    grammar: str = dataclasses.field(repr=False)  # llguidance's top-level grammar, checked
    warnings: tuple[str, ...] = dataclasses.field(default=(), compare=False)  # ignored keywords (strict=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind {self.kind!r} is not one of {', '.join(KINDS)}")


def _checked(kind: str, source: str, grammar: str, *, allow_warnings: bool = False) -> Constraint:
    """A Constraint whose grammar llguidance accepts; ValueError naming what it refuses."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    # special tokens (<|im_end|>) exist only in a vocabulary: Compiler.compile checks them
    messages = [m for m in messages if _NEEDS_TOKENIZER not in m]
    if is_error or (messages and not allow_warnings):
        what = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}[kind]
        raise ValueError(f"{what} not supported by the constraint engine (llguidance): " + "; ".join(messages))
    return Constraint(kind=kind, source=source, grammar=grammar, warnings=tuple(messages))


# Keywords whose value is a subschema, a list of them, or a map of name -> subschema.
_SUB_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
            "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that lists `properties` (or
    `patternProperties`) and says nothing of `additionalProperties` gets `"additionalProperties":
    false`: only the listed properties are generated. Whatever the closed schema admits, the
    original admits too; it stops a sampled object from growing invented keys until the token
    budget runs out (vLLM's guidance backend does the same with `no-additional-properties`; OpenAI's
    strict mode requires it)."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for k in _SUB_ONE:
        if isinstance(out.get(k), Mapping):
            out[k] = closed_objects(out[k])
    for k in _SUB_LIST:
        if isinstance(out.get(k), list):
            out[k] = [closed_objects(x) for x in out[k]]
    for k in _SUB_MAP:
        if isinstance(out.get(k), Mapping):
            out[k] = {name: closed_objects(x) for name, x in out[k].items()}
    if (("properties" in out or "patternProperties" in out) and "additionalProperties" not in out
            and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


def json_schema(schema: Union[Mapping[str, Any], str, bool], *, strict: bool = True,
                whitespace: Optional[str] = JSON_WHITESPACE, extra_properties: bool = False) -> Constraint:
    """Output is JSON that validates against a JSON schema (Draft 2020-12).

    Object properties come out in the order the schema lists them. An object schema that lists
    its properties and does not mention `additionalProperties` generates only those properties
    (`closed_objects`) unless extra_properties=True; the output validates against the schema
    either way.

    Args:
      schema: the schema, as a dict, JSON text, or `True` (any JSON value).
      strict: True: a keyword the engine cannot enforce (`uniqueItems`, `not`, `if`/`then`,
        `dependentRequired`, `contains`, an unknown `format`, a remote `$ref`, overlapping
        `patternProperties`, non-disjoint `oneOf` ...) raises ValueError naming it. False: such
        keywords are ignored (everything else is still enforced) and listed in `.warnings`.
      whitespace: regex for the whitespace allowed between JSON tokens (at most one match per
        place); None allows any run of whitespace. Default JSON_WHITESPACE.
      extra_properties: True: JSON Schema's own default, an object may also carry properties
        the schema does not list (a sampled object may then invent keys until its budget ends).
    Returns:
      A Constraint.
    Raises:
      ValueError: the schema is not JSON, not an object, or asks for something unsupported.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"JSON schema is not valid JSON: {e}") from None
    if schema is True:
        schema = {}
    if schema is False or not isinstance(schema, Mapping):
        raise ValueError(f"JSON schema must be an object (or true), got {type(schema).__name__} {schema!r:.60}")
    schema = dict(schema)
    # key order is kept: it is the order properties are generated in
    source = json.dumps(schema, ensure_ascii=False)
    defaults = {} if whitespace is None else {"whitespace_pattern": whitespace}
    generated = source if extra_properties else json.dumps(closed_objects(schema), ensure_ascii=False)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(generated, defaults=defaults,
                                                            overrides={"lenient": not strict})
    return _checked("json_schema", source, grammar, allow_warnings=not strict)


def json_object(*, whitespace: Optional[str] = JSON_WHITESPACE) -> Constraint:
    """Output is a JSON object (any keys and values): OpenAI's `{"type": "json_object"}`.

    Args:
      whitespace: as in `json_schema`.
    Returns:
      A Constraint.
    """
    return json_schema({"type": "object"}, whitespace=whitespace)


def regex(pattern: str) -> Constraint:
    """Output matches `pattern` in full (Rust `regex` syntax: no look-around, no back-references).

    Args:
      pattern: the regular expression.
    Returns:
      A Constraint.
    Raises:
      ValueError: the pattern is not a string or does not parse (the parser's message says where).
    """
    if not isinstance(pattern, str):
        raise ValueError(f"regex must be a string, got {type(pattern).__name__}")
    return _checked("regex", pattern, llguidance.LLMatcher.grammar_from_regex(pattern))


def grammar(text: str) -> Constraint:
    """Output is in a context-free grammar: Lark (llguidance's dialect, with `%json{...}`
    sub-grammars and `<|special|>` tokens) or GBNF (llama.cpp's `root ::= ...`).

    Args:
      text: the grammar; Lark starts at `start`, GBNF at `root`.
    Returns:
      A Constraint.
    Raises:
      ValueError: the grammar does not parse or uses an unsupported feature.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("grammar must be a non-empty string (Lark or GBNF)")
    try:
        g = llguidance.grammar_from("grammar", text)
    except ValueError as e:
        raise ValueError(f"grammar does not parse: {e}") from None
    return _checked("grammar", text, g)


def choice(options: Sequence[str]) -> Constraint:
    """Output is exactly one of `options` (vLLM's `guided_choice`).

    Args:
      options: a non-empty list of distinct strings.
    Returns:
      A Constraint.
    """
    if isinstance(options, str) or not isinstance(options, Sequence) or not options:
        raise ValueError("choice needs a non-empty list of strings")
    bad = [o for o in options if not isinstance(o, str)]
    if bad:
        raise ValueError(f"choice options must be strings, got {bad[:3]!r}")
    if len(set(options)) != len(options):
        raise ValueError("choice options must be distinct")
    lark = "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
    return _checked("choice", json.dumps(list(options), ensure_ascii=False), llguidance.LLMatcher.grammar_from_lark(lark))


def special_token_ids(tokenizer) -> list[int]:
    """Ids of the control tokens: text never produces them (only special-token parsing does),
    plus the BOS and stop ids. The grammar engine keeps these apart from text.

    Args:
      tokenizer: a jaxinfer Tokenizer.
    Returns:
      Sorted token ids.
    """
    ids = {i for i in (tokenizer.bos_id, tokenizer.eos_id, *tokenizer.stop_ids) if i is not None}
    for text in tokenizer.encoding.special_tokens_set:
        as_special = tokenizer.encode(text)
        if len(as_special) == 1 and tokenizer.encode(text, allowed_special=set(), disallowed_special=()) != as_special:
            ids.add(as_special[0])
    return sorted(ids)


def special_token_texts(tokenizer) -> frozenset[str]:
    """The text of each control token (see `special_token_ids`): a grammar names these as
    `<text>`, never as a quoted string.

    Args:
      tokenizer: a jaxinfer Tokenizer.
    Returns:
      The set of texts, e.g. `{"<|im_start|>", "<|im_end|>", ...}`.
    """
    return frozenset(p.decode("utf-8", errors="replace") for p in tokenizer.pieces(special_token_ids(tokenizer)))


def _piece(tokenizer, i: int) -> bytes:
    try:
        return tokenizer.pieces([i])[0]
    except (KeyError, ValueError):
        return b""


class _Vocabulary:
    """What llguidance's LLTokenizer reads from a tokenizer: one byte string per model id, the
    special ids, the end-of-sequence id, and a text -> ids function (used for forced tokens)."""

    is_tokenizer_wrapper = True  # llguidance's duck-typing marker

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        known = min(vocab_size, tokenizer.vocab_size or tokenizer.n_vocab)
        try:
            pieces = tokenizer.pieces(range(known))
        except (KeyError, ValueError):  # ids the encoding skips
            pieces = [_piece(tokenizer, i) for i in range(known)]
        self.tokens = pieces + [b""] * (vocab_size - known)  # b"": never allowed
        self.special_token_ids = [i for i in special_token_ids(tokenizer) if i < known]
        self.eos_token_id = stop_ids[0]
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        try:
            return self._tokenizer.encode(text, allowed_special=set(), disallowed_special=())
        except ValueError:  # bytes the vocabulary cannot spell: no forced tokens (llguidance copes)
            return []


class Matcher:
    """One request's position in its constraint (a copy of the compiled grammar).

    Not thread-safe: use each matcher from one thread at a time.
    """

    def __init__(self, inner: "llguidance.LLMatcher", vocab_size: int):
        self._m = inner
        self.vocab_size = vocab_size
        self.mask_words = math.ceil(vocab_size / 32)

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into `out` (drops the GIL while computing).

        Args:
          out: int32 [U] (or [1, U]), C-contiguous, U = ceil(V / 32). When the grammar is
            complete (or the matcher is in error) only the stop ids are allowed.
        """
        row = _check_bitmask(out.reshape(1, -1) if out.ndim == 1 else out, 1, self.mask_words)
        llg_np.fill_next_token_bitmask(self._m, row, 0)

    def fill_bitmask_draft(self, draft: Sequence[int], out: np.ndarray) -> None:
        """Masks at each position of a speculative draft: row 0 before draft[0], row k before
        draft[k] (assuming draft[:k] accepted). Rows past the first disallowed draft token are
        left as they were. The matcher's state is unchanged.

        Args:
          draft: the K drafted token ids.
          out: int32 [K + 1, U], C-contiguous.
        """
        out = _check_bitmask(out, len(draft) + 1, self.mask_words)
        self._m.unsafe_compute_mask_ptr_with_draft_token(out.ctypes.data, self.mask_words * 4, list(draft))

    def consume(self, token: int) -> bool:
        """Advance past one sampled token.

        Returns:
          False if the grammar does not allow `token` here; the matcher is then in error
          (`error` says why) and its masks allow only the stop ids.
        """
        return self._m.consume_token(int(token))

    def consume_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance past several tokens (forced ones, or an accepted draft); False as in `consume`."""
        return self._m.consume_tokens([int(t) for t in tokens])

    def validate(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar allows from here (the state is unchanged)."""
        return self._m.validate_tokens([int(t) for t in tokens])

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, tokenized canonically (llguidance's fast-forward:
        it holds back a last token that a longer token could extend). Not consumed: feed them to
        the model, then `consume_tokens` them. Empty when the next token is the model's choice."""
        return self._m.compute_ff_tokens()

    def rollback(self, n: int) -> None:
        """Undo the last `n` consumed tokens (rejected speculative tokens)."""
        if not self._m.rollback(int(n)):
            raise ValueError(f"cannot roll back {n} tokens: {self._m.get_error() or 'fewer were consumed'}")

    def reset(self) -> None:
        """Back to the start of the constraint."""
        self._m.reset()

    @property
    def is_stopped(self) -> bool:
        """The output is complete and nothing may follow (also true in error)."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output may end here."""
        return self._m.is_accepting()

    @property
    def error(self) -> Optional[str]:
        """Why the matcher is in error (a disallowed token, a resource limit), else None."""
        if not self._m.is_error():
            return None
        return _reason(self._m)


def probe(m: "llguidance.LLMatcher", mask_words: int, stop_ids: Sequence[int],
          steps: int = PROBE_TOKENS) -> Optional[str]:
    """Walk a fresh matcher `steps` tokens along one path, as generation would: each step
    computes the mask, then takes the lowest-id token it allows (not a stop id, unless the
    grammar names only that), until the output may end.

    Args:
      m: a fresh llguidance matcher (consumed: pass a copy).
      mask_words: U, the int32 words of a mask.
      stop_ids: the ids that end the output.
      steps: tokens to walk at most.
    Returns:
      Why the constraint cannot be served (no output at all, or llguidance's error and after
      how many tokens), or None.
    """
    mask = np.zeros((1, mask_words), np.int32)
    stops = np.asarray(sorted(stop_ids), np.int64)
    for n in range(steps + 1):
        if m.is_error():
            return _gave_up(m, n)
        if m.is_accepting() or n == steps:
            return None
        llg_np.fill_next_token_bitmask(m, mask, 0)
        if m.is_error():
            return _gave_up(m, n)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        if allowed.size == 0:
            return "it admits no output at all (no text matches it)"
        text = np.setdiff1d(allowed, stops)  # a stop id here is one the grammar names (not accepting)
        m.consume_token(int(text[0] if text.size else allowed[0]))
    return None


def _gave_up(m: "llguidance.LLMatcher", n: int) -> str:
    """Why a matcher in error after `n` walked tokens cannot be served."""
    if n == 0 and _reason(m).startswith("NoExtensionBias"):  # stopped before the first token
        return "it admits no output at all (no text matches it)"
    where = "on its first token" if n == 0 else f"after {n} token{'s' if n != 1 else ''}"
    return f"the constraint engine (llguidance) gives up {where}: {_reason(m)}"


def _check_bitmask(out: np.ndarray, rows: int, words: int) -> np.ndarray:
    if not isinstance(out, np.ndarray) or out.dtype != np.int32 or out.shape != (rows, words) \
            or not out.flags["C_CONTIGUOUS"]:
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"bitmask must be a C-contiguous int32 array of shape ({rows}, {words}), got {got}")
    return out


class Compiler:
    """Constraints -> matchers for one model: its tokenizer and its logits width V."""

    def __init__(self, tokenizer, vocab_size: Optional[int] = None, *, stop_ids: Optional[Sequence[int]] = None,
                 cache_size: int = 128, threads: Optional[int] = None):
        """Build the token trie llguidance searches (~0.2 s for 49k tokens; do it once per model).

        Args:
          tokenizer: a jaxinfer Tokenizer (`model.tokenizer`).
          vocab_size: V, the model's logits width; ids from the tokenizer's size up to V are
            never allowed. Default: the tokenizer's vocabulary size.
          stop_ids: ids that end the output where the grammar allows it; default the
            tokenizer's stop ids (or its EOS).
          cache_size: compiled constraints kept (least recently used dropped first), and as many
            refused ones.
          threads: threads for `fill_bitmasks`; default llguidance's rule, 80% of the CPUs this
            process may use (at most 32). With one thread the rows are filled in turn: on a 2-core
            machine that is faster than a thread pool (8 rows: 0.05 ms against 0.25 ms).
        Raises:
          ValueError: no stop id, or a stop id outside [0, V).
        """
        vocab_size = int(vocab_size if vocab_size is not None else (tokenizer.vocab_size or tokenizer.n_vocab))
        stops = list(stop_ids) if stop_ids is not None else list(tokenizer.stop_ids or
                                                                 ([tokenizer.eos_id] if tokenizer.eos_id is not None else []))
        if not stops:
            raise ValueError("constrained decoding needs at least one stop id (the tokenizer has none; pass stop_ids)")
        bad = [i for i in stops if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"stop ids {bad} are outside the vocabulary [0, {vocab_size})")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.vocab_size = vocab_size
        self.mask_words = math.ceil(vocab_size / 32)
        self.stop_ids = tuple(stops)
        self._tokenizer = llguidance.LLTokenizer(_Vocabulary(tokenizer, vocab_size, stops), eos_token=stops)
        self._cache: collections.OrderedDict[Constraint, llguidance.LLMatcher] = collections.OrderedDict()
        # Refusals are kept too (constraint -> message): a client that resends a grammar the engine
        # gives up on costs a dict lookup, not another compile and walk (up to ~1 s each).
        self._refused: collections.OrderedDict[Constraint, str] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        if threads is None:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            threads = min(32, max(1, cpus * 4 // 5))
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._threads = threads
        self._executor: Optional[llguidance.LLExecutor] = None

    def compile(self, constraint: Constraint) -> None:
        """Compile `constraint` for this vocabulary now (else `matcher` does it on first use),
        and walk it PROBE_TOKENS tokens along one path (`probe`): both are done once per
        constraint, which is kept for the requests that use it.

        Raises:
          ValueError: the grammar cannot be built for this tokenizer (e.g. a special token it
            lacks), admits no output at all, or the constraint engine gives up on the walk (a
            resource limit), with llguidance's message.
        """
        self._template(constraint)

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher at the start of `constraint` (compiled once, then copied)."""
        return Matcher(self._template(constraint).deep_copy(), self.vocab_size)

    def _template(self, constraint: Constraint) -> "llguidance.LLMatcher":
        if not isinstance(constraint, Constraint):
            raise ValueError(f"expected a Constraint (jaxinfer.constraints.json_schema(...) etc.), "
                             f"got {type(constraint).__name__}")
        with self._lock:
            m = self._cache.get(constraint)
            if m is not None:
                self._cache.move_to_end(constraint)
                return m
            refused = self._refused.get(constraint)
        if refused is not None:
            raise ValueError(refused)
        # drops the GIL while it builds
        m = llguidance.LLMatcher(self._tokenizer, constraint.grammar, log_level=0, limits=_limits())
        if m.is_error():
            refused = f"{constraint.kind} constraint cannot be compiled for this tokenizer: {_reason(m)}"
        else:
            problem = probe(m.deep_copy(), self.mask_words, self.stop_ids)
            refused = None if problem is None else f"{constraint.kind} constraint cannot be served: {problem}"
        if refused is not None:
            with self._lock:
                self._refused[constraint] = refused
                while len(self._refused) > self._cache_size:
                    self._refused.popitem(last=False)
            raise ValueError(refused)
        with self._lock:
            self._cache[constraint] = m
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return m

    @property
    def cached(self) -> int:
        """How many compiled constraints are kept."""
        return len(self._cache)

    def allocate_bitmask(self, batch: int) -> np.ndarray:
        """An all-allowed int32 bitmask [batch, U] (all ones: unconstrained rows)."""
        return np.full((batch, self.mask_words), -1, dtype=np.int32)

    def fill_bitmasks(self, matchers: Sequence[Optional[Matcher]], out: np.ndarray) -> None:
        """Masks for a batch, computed in parallel threads with the GIL dropped.

        Args:
          matchers: one per row; None for an unconstrained row (its mask is set to all ones).
          out: int32 [B, U], C-contiguous, B = len(matchers).
        """
        out = _check_bitmask(out, len(matchers), self.mask_words)
        rows = []
        for i, m in enumerate(matchers):
            if m is None:
                out[i] = -1
            else:
                rows.append((m._m, i))
        if self._threads == 1 or len(rows) == 1:
            for m, i in rows:
                llg_np.fill_next_token_bitmask(m, out, i)
        elif rows:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(self._threads)
            llg_np.fill_next_token_bitmask_par(self._executor, rows, out)


# ---- tool calls: a reply that is a call in the model's format (jaxinfer.text.tool_calls) ----

def _call_schema(name: str, params: dict, args_key: str) -> dict:
    return {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE},
            "type": "object", "properties": {"name": {"const": name}, args_key: closed_objects(params)},
            "required": ["name", args_key], "additionalProperties": False}


def tool_call(tokenizer, tools: Sequence[Mapping[str, Any]], tool_choice: Any,
              fmt: Optional[str] = None, *, parallel: bool = True) -> Optional[Constraint]:
    """The constraint that makes the reply a tool call in the model's format, with arguments
    that validate against the function's `parameters` schema.

    Args:
      tokenizer: the model's Tokenizer (its chat template picks the format; control tokens such
        as `[TOOL_CALLS]` are named by id in the grammar).
      tools: OpenAI `tools`: [{"type": "function", "function": {"name", "description",
        "parameters"}}, ...].
      tool_choice: "none" or "auto" (no constraint: returns None), "required" (one or more calls
        to any of the tools; one for the llama3 format), or {"type": "function", "function":
        {"name": ...}} (exactly one call to that function).
      fmt: one of tc.FORMATS; default `tc.detect_format(tokenizer.chat_template)`, else "json".
      parallel: False limits "required" to one call (OpenAI's parallel_tool_calls).
    Returns:
      A Constraint, or None.
    Raises:
      ValueError: malformed tools or tool_choice, an unknown function name, or a parameters
        schema the constraint engine cannot enforce (the tool and keyword are named).
    """
    if tool_choice in (None, "none", "auto"):
        return None
    funcs = tc.functions(tools)
    if not funcs:
        raise ValueError(f"tool_choice {tool_choice!r} needs at least one tool in `tools`")
    if tool_choice == "required":
        chosen, single = funcs, not parallel
    elif isinstance(tool_choice, Mapping) and isinstance(tool_choice.get("function"), Mapping):
        name = tool_choice["function"].get("name")
        chosen = [f for f in funcs if f[0] == name]
        if not chosen:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                             f"({', '.join(n for n, _ in funcs)})")
        single = True
    else:
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")
    fmt = fmt or tc.detect_format(tokenizer.chat_template) or "json"
    if fmt not in tc.FORMATS:
        raise ValueError(f"tool-call format {fmt!r} is not one of {', '.join(tc.FORMATS)}")
    for name, params in chosen:  # each parameters schema on its own, for an error that names the tool
        try:
            json_schema(params)
        except ValueError as e:
            raise ValueError(f"tool {name!r} parameters: {e}") from None
    key = tc.ARGS_KEY[fmt]
    schemas = [_call_schema(n, p, key) for n, p in chosen]
    ids = special_token_ids(tokenizer)
    special = {p.decode("utf-8", "replace"): i for i, p in zip(ids, tokenizer.pieces(ids))}

    def lit(text: str) -> str:  # a control token by id, ordinary text as a string
        return f"<[{special[text]}]>" if text in special else json.dumps(text)

    fn_rules = [f"fn_{k}: %json {json.dumps(s, ensure_ascii=False)}" for k, s in enumerate(schemas)]
    fn = "fn: " + " | ".join(f"fn_{k}" for k in range(len(schemas)))
    if fmt == "hermes":
        calls = "call" if single else 'call ("\\n" call)*'
        lark = [f"start: {calls}", f'call: {lit(tc.HERMES_OPEN)} "\\n" fn "\\n" {lit(tc.HERMES_CLOSE)}', fn, *fn_rules]
    elif fmt == "llama3":
        lark = ["start: fn", fn, *fn_rules]
    else:
        array = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}, "type": "array",
                 "items": {"anyOf": [{k: v for k, v in s.items() if k != "x-guidance"} for s in schemas]},
                 "minItems": 1, **({"maxItems": 1} if single else {})}
        head = f"{lit(tc.TOOL_CALLS_TOKEN)} " if fmt == "mistral" else ""
        lark = [f"start: {head}%json {json.dumps(array, ensure_ascii=False)}"]
    return grammar("\n".join(lark))
