"""OpenAI's HTTP API, the request side: a JSON body -> a validated `Job`, or an `ApiError`.

Pure functions over dicts; nothing here touches the engine or the network. Every refusal names
the parameter (OpenAI's error object: message, type, param, code). A parameter that would change
the result but is not implemented (beam search, best_of, suffix, the legacy `functions`) is
refused with a 400 naming it, never silently ignored; parameters that change nothing (user,
metadata, num_beams: 1, ...) are accepted, and so are the spellings other servers and harnesses
use for the same thing (max_new_tokens for max_tokens: beside max_tokens it wins, as
lm-evaluation-harness's `--model hf` lets a task's max_new_tokens win; vLLM's extra sampling
parameters). The fields are read by fields.py, the prompts and chat messages by prompts.py,
jaxinfer's `steering` and `hidden_states` by extensions.py, structured output and tools by
structured.py.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any, Optional

from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.serve import fields, prompts, structured
from jaxinfer.serve.api_errors import ApiError, bad
from jaxinfer.serve.extensions import (MAX_HIDDEN_STATES_BYTES, Extensions, HiddenStates, read_hidden_states,
                                       read_steering)

__all__ = ["ApiError", "bad", "Job", "parse", "tokenize", "detokenize", "Extensions", "HiddenStates",
           "MAX_HIDDEN_STATES_BYTES", "MAX_N", "MAX_TOP_LOGPROBS"]

MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit (vLLM's too)
MAX_N = 16

# Accepted and without effect on the tokens (or validated below).
_HARMLESS = {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream",
             "stream_options", "n", "seed", "stop", "temperature", "top_p", "top_k", "min_p", "max_tokens",
             "max_new_tokens", "echo", "logprobs", "top_logprobs", "max_completion_tokens", "prompt", "messages",
             "num_beams", "logit_bias", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens",
             "ignore_eos", "steering", "hidden_states", *structured.PARAMS}


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
    hidden_states: Optional[HiddenStates] = None  # the `hidden_states` extension (scoring call only)

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
        refuse("num_beams", f"beam search is not implemented; only num_beams: 1 (sampling), got {fields.show(nb)}")
    for name in body:
        if name in ("functions", "function_call", "suffix", "best_of"):
            continue
        if name in structured.TOOL_PARAMS:
            if not chat and body[name] is not None:
                raise bad(name, f"'{name}' belongs to /v1/chat/completions", "unknown_parameter")
            continue
        if name not in _HARMLESS:
            raise bad(name, f"unrecognized request argument {fields.show(name)}", "unknown_parameter")


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
    prompt_ids = (prompts.chat_prompts(body, model, tools.tools if tools else None) if chat
                  else prompts.completion_prompts(body, model))
    stream = bool(fields.get(body, "stream", (bool,), False, "a boolean"))
    so = fields.get(body, "stream_options", (dict,), {}, "an object")
    include_usage = bool(so.get("include_usage", False))
    if so and not stream:
        raise bad("stream_options", "'stream_options' is only allowed with stream: true")
    n = fields.integer(body, "n", 1, 1, MAX_N)
    echo = bool(fields.get(body, "echo", (bool,), False, "a boolean"))
    if chat and echo:
        raise bad("echo", "'echo' is not supported by /v1/chat/completions (it would change the reply's text); "
                  "use /v1/completions to score or echo a prompt", "unsupported_parameter")
    if chat:
        want = bool(fields.get(body, "logprobs", (bool,), False, "a boolean"))
        top = fields.integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
        if top is not None and not want:
            raise bad("top_logprobs", "'top_logprobs' needs logprobs: true")
        logprobs = (top or 0) if want else None
    else:
        logprobs = fields.integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    if logprobs is not None and stream:
        raise bad("logprobs", "logprobs are not streamed by this server; use stream: false",
                  "unsupported_parameter")
    asked, length_param = prompts.requested_length(body, chat)
    if asked == 0 and not echo:
        raise bad(length_param, f"'{length_param}' must be >= 1 (0 is only the scoring call: echo: true)")
    if asked == 0 and stream:
        raise bad("stream", "the scoring call (max_tokens: 0) is not streamed")
    max_tokens = prompts.fit_length(prompt_ids, asked, length_param, context, chat)
    seed = fields.seed(body)
    sampling = fields.sampling_params(body, model.config.vocab_size, constraint)
    if sampling.min_tokens > max_tokens:
        raise bad("min_tokens", f"'min_tokens' ({sampling.min_tokens}) is more than {length_param} ({max_tokens})")
    if constraint is not None and max_tokens == 0:
        raise bad(constraint_param, f"'{constraint_param}' constrains generated text; the scoring call "
                  "(max_tokens: 0) generates none")
    ext = extensions if extensions is not None else Extensions()
    steers = read_steering(body, model, ext)
    hidden = read_hidden_states(body, model, ext, chat=chat, echo=echo, max_tokens_asked=asked,
                                values=sum(map(len, prompt_ids)) * n)
    return Job(prompts=prompt_ids, max_tokens=max_tokens, sampling=sampling,
               seed=seed if seed is not None else secrets.randbits(31),
               n=n, stop=fields.stop(body), logprobs=logprobs, echo=echo, stream=stream,
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
    ids it got here or by sending the text. (Chat messages stay plain text: `prompts.chat_prompts`.)
    `{"messages": [...], "add_generation_prompt": true}` gives the ids the chat endpoint would run.
    """
    body = _endpoint_body(body, TOKENIZE_KEYS, "/tokenize")
    strs = bool(fields.get(body, "return_token_strs", (bool,), False, "a boolean"))
    if ("prompt" in body) == ("messages" in body):
        raise bad("prompt", "send exactly one of 'prompt' (text) and 'messages' (a chat)",
                  "missing_required_parameter")
    if "messages" in body:
        gen = bool(fields.get(body, "add_generation_prompt", (bool,), True, "a boolean"))
        return prompts.chat_prompts(body, model, None, add_generation_prompt=gen)[0], strs
    text = body["prompt"]
    if not isinstance(text, str):
        raise bad("prompt", f"'prompt' must be a string, got {type(text).__name__}", "invalid_type")
    fields.check_unicode(text, "prompt")
    special = bool(fields.get(body, "add_special_tokens", (bool,), True, "a boolean"))
    ids = model.tokenizer.encode(text)  # special-token text is the control token, as in prompts.py
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
    ids = prompts.token_ids(q, model.config.vocab_size, "tokens", "tokens")
    try:
        model.tokenizer.check_representable(ids)
    except ValueError as e:
        raise bad("tokens", str(e)) from None
    return ids
