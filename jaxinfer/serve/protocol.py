"""OpenAI's HTTP API, the request side: a JSON body -> a validated `Job`, or an `ApiError`.

Pure functions over dicts; nothing here touches the engine or the network. Every refusal names
the parameter (OpenAI's error object: message, type, param, code). A parameter that would change
the result but is not implemented (beam search, best_of, suffix, the legacy `functions`) is
refused with a 400 naming it, never silently ignored; parameters that change nothing (user,
metadata, num_beams: 1, ...) are accepted, and so are the spellings other servers and harnesses
use for the same thing (max_new_tokens for max_tokens: beside max_tokens it wins, as
lm-evaluation-harness's `--model hf` lets a task's max_new_tokens win; vLLM's extra sampling
parameters). Structured output and tools are read by structured.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
from typing import Any, Optional

import numpy as np

from jaxinfer.decode import penalties
from jaxinfer.decode.inputs import SEED_LIMIT, chat_ids, check_token_ids
from jaxinfer.decode.sampling import MIN_TOKENS_WITH_CONSTRAINT, SamplingParams
from jaxinfer.serve import structured
from jaxinfer.text.tool_calls import FUNCTION_NAME

# Stop strings: vLLM and SGLang take any number; lm-evaluation-harness appends the EOS string to a
# task's `until` list, so 5+ is common. Each is checked against the tail of the text per token, so
# their count and length bound the per-token work.
MAX_STOP = 32
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit (vLLM's too)
MAX_N = 16
CALL_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # a tool call's id (and a tool message's tool_call_id)
MAX_LOGIT_BIAS = penalties.MAX_LOGIT_BIAS  # entries: the engine's fixed bias width (no size compiles a program)
# The `hidden_states` of one response, encoded: refused beyond this size (`--max-hidden-states-bytes`).
MAX_HIDDEN_STATES_BYTES = 64 << 20
# Bytes one hidden-state value takes in a response, by (encoding_format, dtype): base64 is 4
# characters per 3 bytes; a JSON float has up to 17 significant digits, a sign, a point, an
# exponent and a comma ("-1.2345678901234567e-05,"), 24 characters at most.
HIDDEN_VALUE_BYTES = {("float", "float32"): 24, ("base64", "float32"): 4 * 4 / 3, ("base64", "float16"): 2 * 4 / 3}

# Accepted and without effect on the tokens (or validated below).
_HARMLESS = {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream",
             "stream_options", "n", "seed", "stop", "temperature", "top_p", "top_k", "min_p", "max_tokens",
             "max_new_tokens", "echo", "logprobs", "top_logprobs", "max_completion_tokens", "prompt", "messages",
             "num_beams", "logit_bias", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens",
             "ignore_eos", "steering", "hidden_states", *structured.PARAMS}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error",
                              404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                              429: "rate_limit_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: Optional[str], message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclasses.dataclass(frozen=True)
class Job:
    """One validated request: prompts as token ids and how to continue each of them."""

    prompts: list[list[int]]  # token ids per prompt (chat: the one rendered conversation)
    max_tokens: int  # 0 only for the scoring call (echo)
    sampling: SamplingParams
    seed: int  # choice i of a prompt samples with seed + i
    n: int
    stop: tuple[str, ...]
    logprobs: Optional[int]  # None = off; k = the k most likely tokens per position as well
    echo: bool
    stream: bool
    include_usage: bool
    chat: bool
    constraint_param: Optional[str] = None  # the parameter the sampling constraint came from
    tool_format: Optional[str] = None  # chat with tools: how replies are read into tool_calls (None: plain text)
    interventions: tuple = ()  # the `steering` extension: jaxinfer.interventions.add(...) per entry
    hidden_states: Optional["HiddenStates"] = None  # the `hidden_states` extension (scoring call only)


# ---- typed field readers ---------------------------------------------------------------------

def _show(v: Any) -> str:
    """A short printable form of a client's value (a 400-digit number or a long string is cut)."""
    text = repr(v) if not isinstance(v, int) or abs(v) < 10 ** 30 else f"an integer of {len(str(abs(v)))} digits"
    return text if len(text) <= 60 else text[:57] + "..."


def _get(body: dict, name: str, kinds: tuple, default: Any, what: str) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise bad(name, f"'{name}' must be {what}, got {v!r}", "invalid_type")
    if not isinstance(v, kinds):
        raise bad(name, f"'{name}' must be {what}, got {type(v).__name__} {_show(v)}", "invalid_type")
    return v


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = _get(body, name, (int, float), default, "a number")
    # Compared before any float(): a 400-digit integer does not fit a float (OverflowError).
    if not (lo <= v <= hi):  # also false for NaN
        raise bad(name, f"'{name}' must be a number in [{lo}, {hi}], got {_show(v)}")
    return float(v)


def _int(body: dict, name: str, default: Optional[int], lo: int, hi: int) -> Optional[int]:
    v = _get(body, name, (int,), default, "an integer")
    if v is not None and not lo <= v <= hi:
        raise bad(name, f"'{name}' must be an integer in [{lo}, {hi}], got {_show(v)}")
    return v


def check_unicode(text: str, param: str, what: Optional[str] = None) -> str:
    """`text` if it is valid Unicode; a 400 naming `param` for a lone surrogate (JSON "\\ud800"),
    which the tokenizer would otherwise silently replace."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(param, f"'{what or param}' holds a lone surrogate U+{ord(text[e.start]):04X} at character "
                  f"{e.start}; send valid Unicode (UTF-16 surrogates come in pairs)") from None
    return text


def _refuse_unimplemented(body: dict, chat: bool) -> None:
    """400 for parameters that would change the result but are not implemented, and unknown ones."""
    def refuse(name, why):
        raise bad(name, f"'{name}' is not supported by this server ({why})", "unsupported_parameter")

    for name in ("functions", "function_call"):
        if body.get(name) not in (None, "none"):
            refuse(name, "the legacy function-calling parameters; send 'tools' and 'tool_choice'")
    if body.get("suffix"):
        refuse("suffix", "insertion is not implemented")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        refuse("best_of", "best-of reranking is not implemented")
    nb = body.get("num_beams")
    if nb is not None and not (type(nb) is int and nb == 1):
        refuse("num_beams", f"beam search is not implemented; only num_beams: 1 (sampling), got {_show(nb)}")
    for name in body:
        if name in ("functions", "function_call", "suffix", "best_of"):
            continue
        if name in structured.TOOL_PARAMS:
            if not chat and body[name] is not None:
                raise bad(name, f"'{name}' belongs to /v1/chat/completions", "unknown_parameter")
            continue
        if name not in _HARMLESS:
            raise bad(name, f"unrecognized request argument {_show(name)}", "unknown_parameter")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise bad("stop", "'stop' must be a non-empty string or a list of non-empty strings", "invalid_type")
    if len(v) > MAX_STOP:
        raise bad("stop", f"'stop' takes at most {MAX_STOP} strings, got {len(v)}")
    for i, s in enumerate(v):
        check_unicode(s, "stop", f"stop[{i}]")
        if len(s) > MAX_STOP_CHARS:
            raise bad("stop", f"a stop string is at most {MAX_STOP_CHARS} characters; stop[{i}] has {len(s)}")
    return tuple(v)


def _seed(body: dict) -> Optional[int]:
    v = _get(body, "seed", (int,), None, "an integer")
    if v is not None and not 0 <= v < SEED_LIMIT:
        raise bad("seed", f"'seed' {_show(v)} is out of range: a seed is an integer in [0, 2**32) "
                  f"(0 to {SEED_LIMIT - 1})")
    return v


def _logit_bias(body: dict, vocab: int) -> tuple:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} -> sorted (id, bias) pairs."""
    lb = _get(body, "logit_bias", (dict,), {}, "an object mapping token ids to biases")
    if len(lb) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens, got {len(lb)}")
    for k, v in lb.items():  # ASCII digits only: `\d` and int() also read "١٢" (Arabic-Indic) as 12
        if not re.fullmatch(r"[0-9]{1,9}", k) or int(k) >= vocab:
            raise bad("logit_bias", f"'logit_bias' keys must be token ids in [0, {vocab}) written as strings, "
                      f"got {_show(k)}")
        if not _is_number(v) or not penalties.BIAS_RANGE[0] <= v <= penalties.BIAS_RANGE[1]:
            raise bad("logit_bias", f"logit_bias[{k!r}] must be a number in [-100, 100], got {_show(v)}")
    try:
        return penalties.check_logit_bias({int(k): float(v) for k, v in lb.items()})
    except ValueError as e:
        raise bad("logit_bias", str(e)) from None


def _sampling(body: dict, vocab: int, constraint) -> SamplingParams:
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise bad("top_p", "'top_p' must be in (0, 1], got 0")
    top_k = _int(body, "top_k", 0, -1, 1 << 20)  # vLLM: -1 (or 0) = off
    rep = _get(body, "repetition_penalty", (int, float), 1.0, "a number > 0 (1 = off)")
    if not 0 < rep <= 1e6:
        raise bad("repetition_penalty", f"'repetition_penalty' must be a number > 0 (1 = off), got {_show(rep)}")
    min_tokens = _int(body, "min_tokens", 0, 0, 1 << 30)
    if min_tokens and constraint is not None:
        raise bad("min_tokens", f"'min_tokens': {MIN_TOKENS_WITH_CONSTRAINT.format(min_tokens)}",
                  "unsupported_value")
    return SamplingParams(temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=top_p,
                          top_k=max(top_k, 0), min_p=_number(body, "min_p", 0.0, 0.0, 0.999),
                          frequency_penalty=_number(body, "frequency_penalty", 0.0, *penalties.PENALTY_RANGE),
                          presence_penalty=_number(body, "presence_penalty", 0.0, *penalties.PENALTY_RANGE),
                          repetition_penalty=float(rep), min_tokens=min_tokens,
                          ignore_eos=bool(_get(body, "ignore_eos", (bool,), False, "a boolean")),
                          logit_bias=_logit_bias(body, vocab), constraint=constraint)


def _encode(model, text: str, what: str) -> list[int]:
    if not text:
        raise bad("prompt", f"'{what}' is empty; a prompt needs at least one token")
    check_unicode(text, "prompt", what)
    try:  # special-token text is the control token, as /tokenize, HF tokenizers and vLLM read it (`tokenize`)
        return model.tokenizer.encode_prompt(text, allow_special=True)
    except ValueError as e:
        raise bad("prompt", str(e)) from None


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _ids(q: list, vocab: int, what: str, param: str = "prompt") -> list[int]:
    """A list of token ids; a non-integer element is named by its own index."""
    for j, t in enumerate(q):
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad(param, f"{what}[{j}] must be an integer token id, got {type(t).__name__} {_show(t)}",
                      "invalid_type")
    try:
        return check_token_ids(q, vocab, what)
    except ValueError as e:
        raise bad(param, str(e)) from None


def _prompts(body: dict, model) -> list[list[int]]:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of token-id lists."""
    p = body.get("prompt")
    vocab = model.config.vocab_size
    if p is None:
        raise bad("prompt", "'prompt' is required", "missing_required_parameter")
    if isinstance(p, str):
        return [_encode(model, p, "prompt")]
    if not isinstance(p, list) or not p:
        raise bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                  "token-id lists (non-empty)", "invalid_type")
    if _is_number(p[0]):  # a flat list of token ids: one prompt
        return [_ids(p, vocab, "prompt")]
    out = []
    for i, q in enumerate(p):
        if isinstance(q, str):
            out.append(_encode(model, q, f"prompt[{i}]"))
        elif isinstance(q, list) and q:
            out.append(_ids(q, vocab, f"prompt[{i}]"))
        else:
            raise bad("prompt", f"prompt[{i}] must be a string or a non-empty list of token ids", "invalid_type")
    return out


def _text_content(c, where: str, *, optional: bool = False) -> Optional[str]:
    """A message's content: a string or text parts (joined); None only where `optional`."""
    if c is None and optional:
        return None
    if isinstance(c, list):  # content parts: text only
        if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
            raise bad(where, "only text content parts are supported", "unsupported_parameter")
        c = "".join(x["text"] for x in c)
    if not isinstance(c, str):
        raise bad(where, f"{where} must be a string", "invalid_type")
    return check_unicode(c, where)


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's OpenAI tool_calls, each {id, type, function: {name, arguments}}
    with the arguments' JSON text parsed (chat templates read them as objects)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad(where, f"'{where}' must be a list", "invalid_type")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or c.get("type", "function") != "function":
            raise bad(f"{where}[{j}]", f"{where}[{j}] must be {{id, type: 'function', function: {{name, arguments}}}}",
                      "invalid_type")
        cid, name, args = c.get("id"), fn.get("name"), fn.get("arguments")
        if not (isinstance(cid, str) and CALL_ID.fullmatch(cid)):
            raise bad(f"{where}[{j}].id", f"{where}[{j}].id must be 1-128 letters, digits, '_', '-', '.' or ':'")
        if not (isinstance(name, str) and FUNCTION_NAME.fullmatch(name)):
            raise bad(f"{where}[{j}].function.name", f"{where}[{j}].function.name must be 1-64 letters, digits, "
                      "'_', '.' or '-'")
        if isinstance(args, str):
            check_unicode(args, f"{where}[{j}].function.arguments")
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(args, dict):
            raise bad(f"{where}[{j}].function.arguments", f"{where}[{j}].function.arguments must be a JSON object "
                      "(as text)", "invalid_type")
        out.append({"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
    return out


def _messages(body: dict, model, tools: Optional[list], add_generation_prompt: bool = True) -> list[list[int]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects",
                  "missing_required_parameter" if msgs is None else "invalid_type")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}].role", f"messages[{i}] needs a role of system, developer, user, assistant "
                      "or tool", "invalid_type")
        role = "system" if m["role"] == "developer" else m["role"]
        calls = _tool_calls(m["tool_calls"], i) if role == "assistant" and m.get("tool_calls") else []
        msg = {"role": role, "content": _text_content(m.get("content"), f"messages[{i}].content", optional=bool(calls))}
        if calls:
            msg["tool_calls"] = calls
        if role == "tool":
            tid = m.get("tool_call_id")
            if not (isinstance(tid, str) and CALL_ID.fullmatch(tid)):
                raise bad(f"messages[{i}].tool_call_id", f"messages[{i}] (role tool) needs the tool_call_id of the "
                          "call it answers (1-128 letters, digits, '_', '-', '.' or ':')",
                          "missing_required_parameter" if tid is None else "invalid_value")
            msg["tool_call_id"] = tid
        clean.append(msg)
    if model.tokenizer is None or not model.tokenizer.chat_template:
        raise bad("messages", "this model has no chat template; use /v1/completions")
    try:  # control tokens only where the template writes them; contents and arguments are plain text
        return [chat_ids(model.tokenizer, clean, add_generation_prompt=add_generation_prompt, tools=tools)]
    except (ValueError, TypeError) as e:
        raise bad("tools" if str(e).startswith("tools ") else "messages", str(e)) from None


def _max_tokens(body: dict, chat: bool) -> tuple[Optional[int], str]:
    """The requested length and the name it came under.

    max_new_tokens (vLLM's and the harnesses' spelling) and chat's max_completion_tokens mean
    max_tokens. When max_new_tokens is sent beside another of them, max_new_tokens wins:
    lm-evaluation-harness's local-completions always sends max_tokens (a task's max_gen_toks, else
    its default of 256) and passes a task's own generation_kwargs, max_new_tokens included, in the
    same body; `--model hf` generates max_new_tokens in that case, and so does this server. Chat's
    max_completion_tokens and max_tokens that disagree are refused (neither is more specific).
    """
    names = (("max_completion_tokens",) if chat else ()) + ("max_tokens", "max_new_tokens")
    given = {}
    for name in names:
        lo = 1 if chat or name == "max_completion_tokens" else 0  # 0 is the completions scoring call
        v = _int(body, name, None, lo, 1 << 30)
        if v is not None:
            given[name] = v
    if "max_new_tokens" in given:
        return given["max_new_tokens"], "max_new_tokens"
    if len(set(given.values())) > 1:
        raise bad("max_tokens", f"'max_completion_tokens' is {given['max_completion_tokens']} and 'max_tokens' is "
                  f"{given['max_tokens']}: they name the same limit; send one of them")
    return next(((v, k) for k, v in given.items()), (None, "max_tokens"))


def _fit(prompts: list[list[int]], max_tokens: Optional[int], length_param: str, context: int, chat: bool) -> int:
    """max_tokens within the context: the default is the room left (chat) or 16 (completions, as
    OpenAI), cut to the room left; an explicit one beyond it is refused as OpenAI refuses it."""
    longest = max(len(p) for p in prompts)
    need = 0 if max_tokens == 0 else 1
    if longest + need > context:
        where = "messages" if chat else "prompt"
        room = f"at most {context - need} prompt tokens" + (" leave room for one new token" if need else "")
        raise bad(where, f"the {'conversation' if chat else 'prompt'} has {longest} tokens; this server's context "
                  f"is {context} tokens (prompt + max_tokens), so {room}", "context_length_exceeded")
    if max_tokens is None:
        return context - longest if chat else min(16, context - longest)
    if longest + max_tokens > context:
        raise bad(length_param, f"the prompt has {longest} tokens and {length_param} is {max_tokens}: "
                  f"{longest + max_tokens} is beyond this server's context of {context} tokens; ask for at most "
                  f"{context - longest}", "context_length_exceeded")
    return max_tokens


@dataclasses.dataclass(frozen=True)
class Extensions:
    """What the server offers beyond OpenAI's API (`steering`, `hidden_states`): the engine's
    steering capacity, the named vectors loaded at start, and the hidden-state sites."""

    steering: Any = None  # serve.steering.Steering, or None (no steering)
    vectors: Any = dataclasses.field(default_factory=dict)  # name -> [D] float32 (`--steering-vectors`)
    hidden_sites: tuple = ()
    max_hidden_states_bytes: int = MAX_HIDDEN_STATES_BYTES  # one response's hidden states, encoded


@dataclasses.dataclass(frozen=True)
class HiddenStates:
    """The `hidden_states` extension of one scoring request: what to return and how."""

    site: str
    layers: tuple[int, ...]  # sorted, distinct
    encoding_format: str = "float"  # "float": nested JSON lists; "base64": little-endian bytes [T, layers, *site]
    dtype: str = "float32"  # of the base64 bytes: "float32" or "float16" ("float" is always float32)


_STEER_KEYS = {"layer", "site", "vector", "name", "scale"}


def _steering(body: dict, model, ext: Extensions) -> tuple:
    """The `steering` extension: [{"layer", "site", "vector" | "name", "scale"}] -> add interventions.

    Here only the JSON's shape is checked (objects, known fields, `vector` xor `name`, numbers);
    the values are checked by `interventions.add` and `steering.check`, the engine's own checks.
    Every fault is a 400 naming the entry's field (steering[i].vector, ...), before admission."""
    from jaxinfer.model import interventions
    from jaxinfer.serve import steering

    v = body.get("steering")
    if v is None:
        return ()
    st = ext.steering
    if st is None or not st.on:
        raise bad("steering", "'steering' is not enabled on this server: start it with --steering-slots K",
                  "unsupported_parameter")
    if not isinstance(v, list):
        raise bad("steering", "'steering' must be a list of {layer, site, vector or name, scale} objects",
                  "invalid_type")
    cfg = model.config
    out = []
    for i, e in enumerate(v):
        at = f"steering[{i}]"
        if not isinstance(e, dict):
            raise bad(at, f"{at} must be an object {{layer, site, vector or name, scale}}", "invalid_type")
        unknown = sorted(set(e) - _STEER_KEYS)
        if unknown:
            raise bad(f"{at}.{unknown[0]}", f"{at} has an unknown field {unknown[0]!r}; its fields are layer, site, "
                      "vector or name, scale", "unknown_parameter")
        layers = e.get("layer")
        flat = layers if isinstance(layers, list) else [layers]
        if not flat or not all(isinstance(x, int) and not isinstance(x, bool) for x in flat):
            raise bad(f"{at}.layer", f"{at}.layer must be a layer index (an int) or a non-empty list of them, "
                      f"got {_show(layers)}", "invalid_type")
        if ("vector" in e) == ("name" in e):
            raise bad(at, f"{at} needs exactly one of 'vector' (a list of {cfg.d_model} numbers) and 'name' "
                      "(a vector loaded with --steering-vectors)", "missing_required_parameter")
        if "name" in e:
            name = e["name"]
            if not isinstance(name, str) or name not in ext.vectors:
                names = sorted(ext.vectors)
                have = (f"the server has {', '.join(map(repr, names[:20]))}" + (" ..." if len(names) > 20 else "")
                        if names else "the server has no named vectors (--steering-vectors FILE)")
                raise bad(f"{at}.name", f"{at}.name {_show(name)} is not a loaded steering vector; {have}")
            vec = ext.vectors[name]
        else:
            raw = e["vector"]
            if not isinstance(raw, list) or not all(_is_number(x) for x in raw):
                raise bad(f"{at}.vector", f"{at}.vector must be a list of numbers only", "invalid_type")
            vec = np.asarray([_as_float(x) for x in raw], np.float64)
        scale = e.get("scale", 1.0)
        if not _is_number(scale):
            raise bad(f"{at}.scale", f"{at}.scale must be a finite number, got {_show(scale)}", "invalid_type")
        try:
            with np.errstate(over="ignore"):  # beyond float32: inf, which add refuses by name
                out.append(interventions.add(e.get("site", "resid_post"), sorted(flat), vec, _as_float(scale)))
        except ValueError as err:  # add's own checks: the site, the vector, the scale, then the layers
            field = next((f for f, start in (("vector", "add: vector"), ("scale", "add: scale"),
                                             ("layer", "add: layers")) if str(err).startswith(start)), "site")
            raise bad(f"{at}.{field}", f"{at}.{field}: {err}") from None
    try:
        steering.check(out, st, cfg, what="steering")
    except steering.SteeringError as err:
        param = "steering" if err.index is None else f"steering[{err.index}]" + (f".{err.field}" if err.field else "")
        raise bad(param, str(err)) from None
    return tuple(out)


def _as_float(x) -> float:
    """A JSON number as a float: an int too large for one is inf (refused as not finite)."""
    try:
        return float(x)
    except OverflowError:
        return float("inf")


def _hidden_states(body: dict, model, ext: Extensions, chat: bool, echo: bool, max_tokens_asked,
                   values: int) -> Optional[HiddenStates]:
    """The `hidden_states` extension of the scoring call: {"layers": [...], "site": ...,
    "encoding_format": "float" | "base64", "dtype": "float32" | "float16"}. `values`: the prompt
    tokens the response returns (every prompt, n times); their hidden states, encoded, must fit
    `ext.max_hidden_states_bytes`, checked here, before anything runs."""
    v = body.get("hidden_states")
    if v is None:
        return None
    if chat or not echo or max_tokens_asked != 0:
        raise bad("hidden_states", "'hidden_states' belongs to the scoring call: /v1/completions with echo: true "
                  "and max_tokens: 0", "unsupported_parameter")
    if not ext.hidden_sites:
        raise bad("hidden_states", "'hidden_states' is not enabled on this server: start it with --hidden-states "
                  "(e.g. resid_post)", "unsupported_parameter")
    if not isinstance(v, dict):
        raise bad("hidden_states", "'hidden_states' must be an object {layers: [...], site: ...}", "invalid_type")
    fields = ("layers", "site", "encoding_format", "dtype")
    unknown = sorted(set(v) - set(fields))
    if unknown:
        raise bad(f"hidden_states.{unknown[0]}", f"hidden_states has an unknown field {unknown[0]!r}; its fields are "
                  f"{', '.join(fields)}", "unknown_parameter")
    site = v.get("site", ext.hidden_sites[0])
    if site not in ext.hidden_sites:
        raise bad("hidden_states.site", f"hidden_states.site {_show(site)}: this server returns "
                  f"{', '.join(ext.hidden_sites)}")
    n = model.config.n_layers
    layers = v.get("layers")
    ints = isinstance(layers, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
    if not ints or not layers or any(not 0 <= x < n for x in layers) or len(set(layers)) != len(layers):
        raise bad("hidden_states.layers", f"hidden_states.layers must be a non-empty list of distinct layer indices "
                  f"in [0, {n}), got {_show(layers)}")
    encoding = v.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad("hidden_states.encoding_format", f"hidden_states.encoding_format must be 'float' (JSON numbers) or "
                  f"'base64' (little-endian bytes), got {_show(encoding)}")
    dtype = v.get("dtype", "float32")
    if dtype not in ("float32", "float16") or (encoding == "float" and dtype != "float32"):
        raise bad("hidden_states.dtype", f"hidden_states.dtype must be 'float32' or, with encoding_format 'base64', "
                  f"'float16', got {_show(dtype)}" + (" with encoding_format 'float'" if dtype == "float16" else ""))
    from jaxinfer.model.sites import site_shape

    width = math.prod(site_shape(site, model.config))
    size = math.ceil(values * len(layers) * width * HIDDEN_VALUE_BYTES[encoding, dtype])
    if size > ext.max_hidden_states_bytes:
        smaller = "" if dtype == "float16" else "; base64 float16 takes " + (
            f"{math.ceil(values * len(layers) * width * HIDDEN_VALUE_BYTES['base64', 'float16']):,} bytes")
        raise bad("hidden_states", f"hidden_states of {values} prompt tokens x {len(layers)} layers x {width} values "
                  f"as {encoding} {dtype} take {size:,} bytes, over this server's limit of "
                  f"{ext.max_hidden_states_bytes:,} bytes (--max-hidden-states-bytes){smaller}; ask for fewer "
                  "layers or tokens", "hidden_states_too_large")
    return HiddenStates(site=site, layers=tuple(sorted(layers)), encoding_format=encoding, dtype=dtype)


def parse(body: Any, model, *, chat: bool, context: Optional[int] = None,
          extensions: Optional[Extensions] = None) -> Job:
    """Validate a /v1/completions (chat=False) or /v1/chat/completions body against `model`.

    Args:
      body: the decoded JSON body.
      model: the served Model (its tokenizer, chat template and vocabulary).
      chat: True for /v1/chat/completions.
      context: the most tokens (prompt + max_tokens) one request may hold; default the model's
        context length.
      extensions: what the server offers of `steering` and `hidden_states` (None: neither).
    Returns:
      the Job. Raises ApiError (400) naming the parameter at fault.
    """
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object", "invalid_json")
    context = model.config.max_seq_len if context is None else context
    _refuse_unimplemented(body, chat)
    if chat and "prompt" in body:
        raise bad("prompt", "'prompt' belongs to /v1/completions; chat takes 'messages'", "unknown_parameter")
    if not chat and "messages" in body:
        raise bad("messages", "'messages' belongs to /v1/chat/completions", "unknown_parameter")
    try:
        constraint, constraint_param = structured.constraint_of(body)
        tools = structured.tools_of(body, model.tokenizer) if chat else None
    except structured.Refusal as e:
        raise bad(e.param, str(e), e.code) from None
    if tools is not None and tools.constraint is not None:
        if constraint is not None:
            raise bad("tool_choice", f"tool_choice {json.dumps(body.get('tool_choice'))[:80]} constrains the reply "
                      f"to a tool call, and so does '{constraint_param}'; send one of them")
        constraint, constraint_param = tools.constraint, "tool_choice"
    if constraint is not None and model.tokenizer is None:
        raise bad(constraint_param, f"'{constraint_param}' needs a model with a tokenizer")
    prompts = _messages(body, model, tools.tools if tools else None) if chat else _prompts(body, model)
    stream = bool(_get(body, "stream", (bool,), False, "a boolean"))
    so = _get(body, "stream_options", (dict,), {}, "an object")
    include_usage = bool(so.get("include_usage", False))
    if so and not stream:
        raise bad("stream_options", "'stream_options' is only allowed with stream: true")
    n = _int(body, "n", 1, 1, MAX_N)
    echo = bool(_get(body, "echo", (bool,), False, "a boolean"))
    if chat and echo:
        raise bad("echo", "'echo' is not supported by /v1/chat/completions (it would change the reply's text); "
                  "use /v1/completions to score or echo a prompt", "unsupported_parameter")
    if chat:
        want = bool(_get(body, "logprobs", (bool,), False, "a boolean"))
        top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
        if top is not None and not want:
            raise bad("top_logprobs", "'top_logprobs' needs logprobs: true")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    if logprobs is not None and stream:
        raise bad("logprobs", "logprobs are not streamed by this server; use stream: false",
                  "unsupported_parameter")
    asked, length_param = _max_tokens(body, chat)
    if asked == 0 and not echo:
        raise bad(length_param, f"'{length_param}' must be >= 1 (0 is only the scoring call: echo: true)")
    if asked == 0 and stream:
        raise bad("stream", "the scoring call (max_tokens: 0) is not streamed")
    max_tokens = _fit(prompts, asked, length_param, context, chat)
    seed = _seed(body)
    sampling = _sampling(body, model.config.vocab_size, constraint)
    if sampling.min_tokens > max_tokens:
        raise bad("min_tokens", f"'min_tokens' ({sampling.min_tokens}) is more than {length_param} ({max_tokens})")
    if constraint is not None and max_tokens == 0:
        raise bad(constraint_param, f"'{constraint_param}' constrains generated text; the scoring call "
                  "(max_tokens: 0) generates none")
    ext = extensions if extensions is not None else Extensions()
    steers = _steering(body, model, ext)
    hidden = _hidden_states(body, model, ext, chat, echo, asked, sum(map(len, prompts)) * n)
    return Job(prompts=prompts, max_tokens=max_tokens, sampling=sampling,
               seed=seed if seed is not None else secrets.randbits(31),
               n=n, stop=_stop(body), logprobs=logprobs, echo=echo, stream=stream,
               include_usage=include_usage, chat=chat, constraint_param=constraint_param,
               tool_format=tools.reply_format if tools is not None else None, interventions=steers,
               hidden_states=hidden)


# ---- the tokenizer endpoints (vLLM's shapes; lm-evaluation-harness's `tokenizer_backend=remote`) ----

TOKENIZE_KEYS = {"model", "prompt", "add_special_tokens", "return_token_strs", "messages", "add_generation_prompt"}


def _endpoint_body(body, allowed: set, endpoint: str) -> dict:
    """A tokenizer endpoint's body: a JSON object with only the `allowed` keys."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object", "invalid_type")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0], f"unknown parameter {unknown[0]!r}; {endpoint} takes {sorted(allowed)}",
                  "unknown_parameter")
    return body


def tokenize(body, model) -> tuple[list[int], bool]:
    """POST /tokenize: (token ids, whether to return their texts).

    `{"prompt": text, "add_special_tokens": true}` gives the ids /v1/completions runs for that
    text, which both read as a Hugging Face tokenizer (and vLLM) does: special-token text
    ("<|im_end|>") is the control token, and add_special_tokens puts BOS first where the model
    wants it. One rule for both because lm-evaluation-harness's remote tokenizer relies on it: it
    finds the EOS and BOS ids by tokenizing their text here, and it scores a document either by the
    ids it got here or by sending the text. (Chat messages stay plain text: `_messages`.)
    `{"messages": [...], "add_generation_prompt": true}` gives the ids the chat endpoint would run.
    """
    body = _endpoint_body(body, TOKENIZE_KEYS, "/tokenize")
    strs = bool(_get(body, "return_token_strs", (bool,), False, "a boolean"))
    if ("prompt" in body) == ("messages" in body):
        raise bad("prompt", "send exactly one of 'prompt' (text) and 'messages' (a chat)",
                  "missing_required_parameter")
    if "messages" in body:
        gen = bool(_get(body, "add_generation_prompt", (bool,), True, "a boolean"))
        return _messages(body, model, None, add_generation_prompt=gen)[0], strs
    text = body["prompt"]
    if not isinstance(text, str):
        raise bad("prompt", f"'prompt' must be a string, got {type(text).__name__}", "invalid_type")
    check_unicode(text, "prompt")
    special = bool(_get(body, "add_special_tokens", (bool,), True, "a boolean"))
    ids = model.tokenizer.encode(text)  # special-token text is the control token, as in `_encode`
    return (model.tokenizer.with_bos(ids) if special else ids), strs


def detokenize(body, model) -> list[int]:
    """POST /detokenize: `{"tokens": [ids]}` -> the ids (checked; may be empty)."""
    body = _endpoint_body(body, {"model", "tokens"}, "/detokenize")
    q = body.get("tokens")
    if not isinstance(q, list):
        raise bad("tokens", "'tokens' must be a list of token ids",
                  "missing_required_parameter" if q is None else "invalid_type")
    if not q:
        return []
    ids = _ids(q, model.config.vocab_size, "tokens", "tokens")
    try:
        model.tokenizer.check_representable(ids)
    except ValueError as e:
        raise bad("tokens", str(e)) from None
    return ids
