"""Host-side inputs of the decode core: what callers pass becomes checked arrays.

Prompts (text, chat messages or token ids) become id lists and a padded [B, Tb] array; seeds or
keys become one PRNG key per request; stop ids are collected; every argument is checked (a
TypeError or ValueError naming it) before anything is compiled. Nothing here runs on the device
except building keys. Shape letters as in `jaxinfer.model.config`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.decode.sampling import SamplingParams, row_keys
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.model import Model
from jaxinfer.text.tool_calls import detect_format

MIN_BUCKET = 16  # smallest padded prompt length


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= n (and >= minimum)."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))




def check_context(ids: list[list[int]], max_new_tokens: int, working_slots: int, cfg: ModelConfig) -> None:
    """Raise ValueError if a prompt plus `max_new_tokens` plus `working_slots` exceeds the context."""
    for i, p in enumerate(ids):
        need = len(p) + max_new_tokens + working_slots
        if need > cfg.max_seq_len:
            extra = f" and {working_slots} working slots" if working_slots else ""
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens}{extra} that "
                             f"needs {need} positions, beyond the context length {cfg.max_seq_len}")


def pack_prompts(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of mixed lengths -> (tokens [B, Tb] int32, zero-padded to a bucket; lengths [B] int32)."""
    lengths = np.array([len(p) for p in ids], np.int32)
    tokens = np.zeros((len(ids), bucket(int(lengths.max()))), np.int32)
    for b, p in enumerate(ids):
        tokens[b, : len(p)] = p
    return tokens, lengths


Prompts = Union[str, Sequence[str], Sequence[Sequence[int]]]


def check_text(text: str, what: str) -> str:
    """A prompt string must be non-empty and valid Unicode: a lone surrogate (what Python makes of
    invalid UTF-8 bytes in argv) would otherwise be silently replaced when encoding."""
    if not text:
        raise ValueError(f"{what} is empty; a prompt needs at least one token")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate {text[e.start]!r} at character {e.start} (invalid "
                         "UTF-8 in the input?); pass valid Unicode text") from None
    return text


def _is_id_sequence(x) -> bool:
    """A flat sequence of token ids: a 1-D integer array, or a non-empty list/tuple of ints."""
    if hasattr(x, "ndim") and hasattr(x, "dtype"):
        return x.ndim == 1
    return (isinstance(x, (list, tuple)) and len(x) > 0
            and all(isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in x))


def encode_text(tokenizer, text: str, allow_special: bool = False) -> list[int]:
    """Ids of user text. Special-token text in it ("<|im_end|>", "<end_of_turn>") is encoded as the
    plain characters it is, unless `allow_special`: a prompt or a chat message can then never
    close its own turn or open a system turn. (tiktoken's default is to refuse such text; plain
    text is chosen here so that documents that merely mention these strings still work.)"""
    if allow_special:
        return tokenizer.encode(text, allowed_special="all", disallowed_special=())
    return tokenizer.encode(text, allowed_special=set(), disallowed_special=())


def _plain_only(tokenizer, text: str, what: str) -> None:
    """ValueError when `text` holds control-token text (it would be a control token if written
    into the template's own text)."""
    if encode_text(tokenizer, text, allow_special=True) != encode_text(tokenizer, text):
        raise ValueError(f"{what} contains control-token text (such as a turn marker); it is written into the "
                         "prompt as the template's own text, so it may hold none")


def _template_messages(tokenizer, messages: list[dict], hold, tool_format: Optional[str]) -> list[dict]:
    """The messages as the template sees them: each content (and each string inside a tool call's
    arguments) replaced by `hold(text)`; tool calls as the template reads them, or, for a template
    that does not render tool calls, appended to the content in the JSON form a forced call takes."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise TypeError(f"message {i} content must be a string, got {type(content).__name__}")
        calls = m.get("tool_calls") or []
        if content is None and not calls:
            raise TypeError(f"message {i} content must be a string (None only beside tool_calls)")
        parsed = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"message {i} tool_calls[{j}] must be {{'id', 'type': 'function', "
                                 "'function': {'name', 'arguments'}}")
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    raise ValueError(f"message {i} tool_calls[{j}] arguments are not JSON") from None
            if not isinstance(args, dict):
                raise ValueError(f"message {i} tool_calls[{j}] arguments must be a JSON object")
            _plain_only(tokenizer, fn["name"], f"message {i} tool_calls[{j}] function name")
            _plain_only(tokenizer, str(c.get("id", "")), f"message {i} tool_calls[{j}] id")
            parsed.append((c.get("id"), fn["name"], args))
        tm = {k: m[k] for k in ("role", "tool_call_id", "name") if k in m}
        for k in ("tool_call_id", "name"):
            if k in tm:
                _plain_only(tokenizer, str(tm[k]), f"message {i} {k}")
        if parsed and tool_format is None:  # the template ignores tool_calls: the calls become text
            text = json.dumps([{"name": n, "arguments": a} for _, n, a in parsed], ensure_ascii=False)
            content, parsed = (content + "\n" if content else "") + text, []
        tm["content"] = hold(content) if content else content
        if parsed:
            tm["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": n, "arguments": _hold_strings(a, hold)}}
                                for cid, n, a in parsed]
        out.append(tm)
    return out


def _hold_strings(value, hold):
    """`value` (JSON-like) with every string, dict keys included, replaced by hold(string)."""
    if isinstance(value, str):
        return hold(value)
    if isinstance(value, dict):
        return {hold(k): _hold_strings(v, hold) for k, v in value.items()}
    if isinstance(value, list):
        return [_hold_strings(v, hold) for v in value]
    return value


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
             tools: Optional[list[dict]] = None) -> list[int]:
    """Ids of a conversation rendered with the tokenizer's chat template, where the control tokens
    are only those the template itself writes: message contents, and the strings inside tool-call
    arguments, are encoded as plain text.

    Each such text is rendered as a placeholder built from a private-use character that occurs in
    no message, tool and not in the template; the template's text between placeholders is encoded
    with special tokens, the texts without. A placeholder holds a '"', so one the template wrote
    through `tojson` (as templates write tool-call arguments) shows as '\\"' and gets the text
    JSON-escaped, as `tojson` would have written it.

    Args:
      tokenizer: a Tokenizer with a chat template.
      messages: [{"role", "content"}, ...]; an assistant message may carry OpenAI `tool_calls`
        ([{"id", "type": "function", "function": {"name", "arguments"}}], arguments a JSON object
        or its text; content None beside them) and a tool message `tool_call_id` / `name`.
        Templates without a tool-call format (`tool_calls.detect_format`) get the calls as the
        assistant's text, `[{"name": ..., "arguments": {...}}]`, the form a forced call takes.
      add_generation_prompt: end with the header that starts the assistant's turn.
      tools: OpenAI tool definitions passed to the template (as transformers' `tools=`); their
        text, tool names and call ids may hold no control-token text (ValueError).
    Returns:
      The prompt's token ids (BOS first when the model wants it).
    """
    if tools:
        _plain_only(tokenizer, json.dumps(tools, ensure_ascii=False), "tools")
    used = set(tokenizer.chat_template or "").union(json.dumps([messages, tools], ensure_ascii=False))
    mark = next((c for c in map(chr, range(0xE000, 0xF900)) if c not in used), None)
    if mark is None:
        raise ValueError("the messages use every private-use character (U+E000..U+F8FF); one must be free "
                         "to tell message contents from the chat template's text")
    pieces: list[str] = []

    def hold(text: str) -> str:
        pieces.append(text)
        return f'{mark}{len(pieces) - 1}"{mark}'

    shown = _template_messages(tokenizer, messages, hold, detect_format(tokenizer.chat_template))
    rendered = tokenizer.apply_chat_template(shown, add_generation_prompt=add_generation_prompt,
                                             **({"tools": tools} if tools else {}))
    ids: list[int] = []
    at, found, template_text = 0, set(), []
    for m in re.finditer(re.escape(mark) + r'(\d+)(\\?)"' + re.escape(mark), rendered):
        k = int(m.group(1))
        text = json.dumps(pieces[k], ensure_ascii=False)[1:-1] if m.group(2) else pieces[k]
        template_text.append(rendered[at:m.start()])
        ids += encode_text(tokenizer, template_text[-1], allow_special=True) + encode_text(tokenizer, text)
        at = m.end()
        found.add(k)
    template_text.append(rendered[at:])
    ids += encode_text(tokenizer, template_text[-1], allow_special=True)
    if len(found) < len(pieces) or any(mark in t for t in template_text):
        raise ValueError("the chat template dropped or changed a message (or a tool call's arguments); cannot "
                         "tell its content from the template's control tokens")
    return tokenizer.with_bos(ids)


def prompt_ids(model: Model, prompts: Prompts, allow_special: bool = False) -> list[list[int]]:
    """Prompts -> one id list per prompt. A string, a flat list / 1-D array of ids (one prompt, as
    `logits` takes), or a list of strings / id lists / 1-D arrays (a batch). Special-token text in
    a string is plain text unless `allow_special` (see `encode_text`)."""
    if isinstance(prompts, (bytes, bytearray)):
        raise TypeError("prompts must be text (str) or token ids, got bytes; decode it first (b.decode('utf-8'))")
    if isinstance(prompts, str) or _is_id_sequence(prompts):
        prompts = [prompts]
    if hasattr(prompts, "ndim") and prompts.ndim == 2:
        prompts = list(prompts)
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a list of strings or a list of token-id lists, got "
                        f"{type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty; pass a string, a list of strings or a list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids")
            ids = model.tokenizer.encode_prompt(check_text(p, f"prompt {i}"), allow_special=allow_special)
        elif isinstance(p, (list, tuple)) or (hasattr(p, "ndim") and p.ndim == 1):
            ids = check_token_ids(p, model.config.vocab_size, f"prompt {i}")
        else:
            raise TypeError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__} {p!r:.40}")
        out.append(ids)
    return out


def eos_ids_for(model: Model) -> tuple[int, ...]:
    """The model's own end-of-sequence ids: the tokenizer's stop ids, else the config's eos."""
    base = model.tokenizer.stop_ids if model.tokenizer is not None else (model.config.eos_token_id,)
    return tuple(sorted({int(t) for t in base if t is not None}))


def stop_ids_for(model: Model, stop_at_eos: bool, stop_tokens: Sequence[int], ignore_eos: bool = False
                 ) -> tuple[int, ...]:
    """The token ids that end a row: the model's eos ids (unless ignore_eos) plus stop_tokens;
    none at all without stop_at_eos."""
    if not stop_at_eos:
        return ()
    base = () if ignore_eos else eos_ids_for(model)
    return tuple(sorted({int(t) for t in (*base, *stop_tokens) if t is not None}))


SEED_LIMIT = 2 ** 32  # a seed is an int in [0, 2**32): the uint32 that jax.random.key takes
_SEED_RULE = "a seed is an int in [0, 2**32), or one such int per prompt"


def check_int(name: str, value, low: int, high: Optional[int] = None) -> int:
    """`value` as an int in [low, high], or a TypeError / ValueError naming `name`. bool is not an
    int here (True would silently mean 1); numpy integers are."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return int(value)


def check_seed(seed, n: int) -> np.ndarray:
    """One uint32 seed per prompt from `seed` (an int, or a sequence of n ints), each in [0, 2**32).

    Raises TypeError for anything else (str, float, bool, None, a key) and ValueError for an int
    out of range or a wrong count, before anything is loaded or compiled.
    """
    def one(s, what: str) -> int:
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"{what} must be an int, got {type(s).__name__} {s!r}; {_SEED_RULE} "
                            "(or pass key=jax.random.key(...))")
        if not 0 <= int(s) < SEED_LIMIT:
            raise ValueError(f"{what} {int(s)} is out of range; {_SEED_RULE}")
        return int(s)

    if isinstance(seed, (int, np.integer, bool, np.bool_)):
        seeds = [one(seed, "seed")] * n
    elif isinstance(seed, (list, tuple, np.ndarray)) and np.ndim(seed) == 1:
        seeds = [one(s, f"seed[{i}]") for i, s in enumerate(seed)]
        if len(seeds) != n:
            raise ValueError(f"got {len(seeds)} seeds for {n} prompts; pass one int or one per prompt")
    else:
        raise TypeError(f"seed must be an int or a list of ints (one per prompt), got {type(seed).__name__} "
                        f"{seed!r}; {_SEED_RULE}")
    return np.asarray(seeds, np.uint32)


def check_key(key) -> jax.Array:
    """A typed PRNG key of shape [] from `key`: a typed key (`jax.random.key(0)`) or raw uint32
    key data of the default implementation's shape (`jax.random.PRNGKey(0)`, shape [2])."""
    raw_shape = jax.random.key_data(jax.random.key(0)).shape
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(f"key must be a single PRNG key (shape ()), got shape {key.shape}; row b "
                             "samples with fold_in(key, b)")
        return key
    if dtype is not None and np.dtype(dtype) == np.uint32 and tuple(key.shape) == raw_shape:
        return jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
    what = f"{type(key).__name__} {key!r}" if dtype is None else f"an array of {dtype} shape {tuple(key.shape)}"
    raise TypeError(f"key must be a PRNG key (jax.random.key(n)) or raw uint32 key data of shape {raw_shape} "
                    f"(jax.random.PRNGKey(n)), got {what}; for an integer pass seed= instead")


def check_sampling(sampling) -> SamplingParams:
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a jaxinfer.SamplingParams (e.g. SamplingParams(temperature=0.8, "
                        f"top_p=0.95)), got {type(sampling).__name__}")
    return sampling


def request_keys(n: int, key: Optional[jax.Array], seed, sampling: SamplingParams) -> jax.Array:
    """One PRNG key per request [n]: fold_in(key, b) for a key, key(seed_b) for seeds."""
    check_sampling(sampling)
    if key is not None and seed is not None:
        raise ValueError("pass either key or seed, not both")
    if key is not None:
        key = check_key(key)
        return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n, dtype=jnp.uint32))
    if seed is None:
        if not sampling.greedy:
            raise ValueError("sampling with temperature > 0 needs a key or a seed (there is no default "
                             "PRNG key); pass seed=0 for reproducible samples")
        seed = 0  # greedy decoding draws no random numbers; the keys are never used
    return row_keys(check_seed(seed, n))


def check_sequence(token_ids: Sequence[int], cfg: ModelConfig) -> list[int]:
    """One sequence to score in a single uncached pass: valid ids, within the context length."""
    ids = check_token_ids(token_ids, cfg.vocab_size)
    if len(ids) > cfg.max_seq_len:
        raise ValueError(f"{len(ids)} tokens exceed the context length {cfg.max_seq_len}")
    return ids


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str = "token_ids") -> list[int]:
    """token ids -> a non-empty list of ints in [0, vocab_size), or ValueError naming `what`."""
    if hasattr(token_ids, "dtype") and not np.issubdtype(np.dtype(token_ids.dtype), np.integer):
        raise TypeError(f"{what} must hold integer token ids, got an array of {token_ids.dtype}")
    for t in token_ids if not hasattr(token_ids, "dtype") else ():
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"{what} must be a list of int token ids, got an element {t!r} "
                            f"({type(t).__name__})")
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError(f"{what} is empty; a prompt needs at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} has token ids {bad[:5]} outside [0, {vocab_size})")
    return ids
