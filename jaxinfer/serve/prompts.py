"""A request's prompts as token ids: /v1/completions' `prompt` (text or ids), /v1/chat/completions'
`messages` (rendered by the model's chat template), and how many tokens to generate within the
context. Each refusal is a 400 naming the parameter.
"""

from __future__ import annotations

import json
import re
from typing import Optional

from jaxinfer.decode.inputs import chat_ids, check_token_ids
from jaxinfer.serve import fields
from jaxinfer.serve.api_errors import bad
from jaxinfer.text.tool_calls import FUNCTION_NAME

CALL_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # a tool call's id (and a tool message's tool_call_id)


def _encode(model, text: str, what: str) -> list[int]:
    if not text:
        raise bad("prompt", f"'{what}' is empty; a prompt needs at least one token")
    fields.check_unicode(text, "prompt", what)
    try:  # special-token text is the control token, as /tokenize, HF tokenizers and vLLM read it (`tokenize`)
        return model.tokenizer.encode_prompt(text, allow_special=True)
    except ValueError as e:
        raise bad("prompt", str(e)) from None


def token_ids(q: list, vocab: int, what: str, param: str = "prompt") -> list[int]:
    """A list of token ids; a non-integer element is named by its own index."""
    for j, t in enumerate(q):
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad(param, f"{what}[{j}] must be an integer token id, got {type(t).__name__} {fields.show(t)}",
                      "invalid_type")
    try:
        return check_token_ids(q, vocab, what)
    except ValueError as e:
        raise bad(param, str(e)) from None


def completion_prompts(body: dict, model) -> list[list[int]]:
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
    if fields.is_number(p[0]):  # a flat list of token ids: one prompt
        return [token_ids(p, vocab, "prompt")]
    out = []
    for i, q in enumerate(p):
        if isinstance(q, str):
            out.append(_encode(model, q, f"prompt[{i}]"))
        elif isinstance(q, list) and q:
            out.append(token_ids(q, vocab, f"prompt[{i}]"))
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
    return fields.check_unicode(c, where)


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
            fields.check_unicode(args, f"{where}[{j}].function.arguments")
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(args, dict):
            raise bad(f"{where}[{j}].function.arguments", f"{where}[{j}].function.arguments must be a JSON object "
                      "(as text)", "invalid_type")
        out.append({"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
    return out


def chat_prompts(body: dict, model, tools: Optional[list], add_generation_prompt: bool = True) -> list[list[int]]:
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


def requested_length(body: dict, chat: bool) -> tuple[Optional[int], str]:
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
        v = fields.integer(body, name, None, lo, 1 << 30)
        if v is not None:
            given[name] = v
    if "max_new_tokens" in given:
        return given["max_new_tokens"], "max_new_tokens"
    if len(set(given.values())) > 1:
        raise bad("max_tokens", f"'max_completion_tokens' is {given['max_completion_tokens']} and 'max_tokens' is "
                  f"{given['max_tokens']}: they name the same limit; send one of them")
    return next(((v, k) for k, v in given.items()), (None, "max_tokens"))


def fit_length(prompts: list[list[int]], max_tokens: Optional[int], length_param: str, context: int, chat: bool) -> int:
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
