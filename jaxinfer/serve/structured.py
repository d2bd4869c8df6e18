"""OpenAI's HTTP API, structured output and tools: which constraint a request body asks for.

  response_format      {"type": "text"} | {"type": "json_object"} |
                       {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
  guided_json, guided_regex, guided_choice, guided_grammar   vLLM's extra parameters
  structured_outputs   vLLM's newer spelling: {"json" | "regex" | "choice" | "grammar" | "json_object"}
  guided_whitespace_pattern (or structured_outputs.whitespace_pattern)   JSON whitespace regex
  tools, tool_choice   "required" and a named function constrain the reply to a call
                       (`constraints.tool_call`); "auto" reads the model's own format

At most one of these may constrain a request. A schema the constraint engine cannot honour is a
400 naming the parameter and the keyword, never an unconstrained answer. OpenAI's `strict: false`
is served strictly too: llguidance's lenient mode would ignore such keywords without a word.

Pure functions over dicts, as protocol.py; every refusal is an ApiError naming the parameter.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional

from jaxinfer.decode import constraints
from jaxinfer.decode.constraints import Constraint
from jaxinfer.text import tool_calls

# Body parameters this module reads (protocol.py accepts them on both endpoints; tools on chat).
PARAMS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "guided_whitespace_pattern", "guided_decoding_backend", "structured_outputs")
TOOL_PARAMS = ("tools", "tool_choice", "parallel_tool_calls")
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a response_format / function name


class Refusal(ValueError):
    """A bad structured-output or tool parameter: `param` names it (protocol.py makes it a 400)."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclasses.dataclass(frozen=True)
class Tools:
    """What a chat request's `tools` and `tool_choice` ask for."""

    tools: Optional[list]  # the OpenAI tool definitions the template sees (None: none shown)
    constraint: Optional[Constraint]  # set for "required" and a named function
    reply_format: Optional[str]  # how the reply is read into tool_calls (tool_calls.FORMATS), None: plain text


def _schema(schema: Any, param: str, whitespace: Optional[str]) -> Constraint:
    if not isinstance(schema, (dict, str, bool)):
        raise Refusal(param, f"'{param}' must be a JSON schema (an object), got {type(schema).__name__}",
                      "invalid_type")
    try:
        return constraints.json_schema(schema, strict=True, whitespace=whitespace)
    except ValueError as e:
        raise Refusal(param, f"'{param}': {e}", "unsupported_schema") from None


def _build(kind: str, value: Any, param: str, whitespace: Optional[str]) -> Constraint:
    """One constraint from vLLM's spelling: json / json_object / regex / choice / grammar."""
    if kind == "json":
        return _schema(value, param, whitespace)
    if kind == "json_object":
        if value is not True:
            raise Refusal(param, f"'{param}' must be true", "invalid_type")
        return _schema({"type": "object"}, param, whitespace)
    if kind == "choice" and not (isinstance(value, list) and value and all(isinstance(x, str) for x in value)):
        raise Refusal(param, f"'{param}' must be a non-empty list of strings", "invalid_type")
    if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
        raise Refusal(param, f"'{param}' must be a non-empty string", "invalid_type")
    build = {"regex": constraints.regex, "choice": constraints.choice, "grammar": constraints.grammar}[kind]
    try:
        return build(value)
    except ValueError as e:
        raise Refusal(param, f"'{param}': {e}", "unsupported_value") from None


def _response_format(rf: Any, whitespace: Optional[str]) -> Optional[Constraint]:
    if not isinstance(rf, dict):
        raise Refusal("response_format", "'response_format' must be an object with a 'type'", "invalid_type")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _schema({"type": "object"}, "response_format", whitespace)
    if kind != "json_schema":
        raise Refusal("response_format", f"'response_format.type' must be 'text', 'json_object' or 'json_schema', "
                      f"got {str(kind)[:40]!r}")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise Refusal("response_format.json_schema", "'response_format.json_schema' must be an object "
                      "{name, schema, strict}", "invalid_type")
    name = js.get("name")
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise Refusal("response_format.json_schema.name", "'response_format.json_schema.name' must be 1-64 "
                      "letters, digits, '_' or '-'")
    if js.get("strict") not in (None, True, False):
        raise Refusal("response_format.json_schema.strict", "'response_format.json_schema.strict' must be a "
                      "boolean", "invalid_type")
    if js.get("schema") is None:
        raise Refusal("response_format.json_schema.schema", "'response_format.json_schema.schema' is required",
                      "missing_required_parameter")
    return _schema(js["schema"], "response_format.json_schema.schema", whitespace)


def _whitespace(body: dict) -> Optional[str]:
    so = body.get("structured_outputs")
    given = [(p, v) for p, v in (("guided_whitespace_pattern", body.get("guided_whitespace_pattern")),
                                 ("structured_outputs.whitespace_pattern",
                                  so.get("whitespace_pattern") if isinstance(so, dict) else None)) if v is not None]
    if not given:
        return constraints.JSON_WHITESPACE
    param, ws = given[-1]
    if not isinstance(ws, str):
        raise Refusal(param, f"'{param}' must be a regular expression (a string)", "invalid_type")
    return ws


def constraint_of(body: dict) -> tuple[Optional[Constraint], Optional[str]]:
    """The constraint a body asks for (response_format, guided_*, structured_outputs), and the
    parameter it came from; (None, None) when the output is free.

    Raises:
      Refusal: a malformed or unsupported one, or more than one.
    """
    ws = _whitespace(body)
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise Refusal("guided_decoding_backend", "'guided_decoding_backend' must be a string", "invalid_type")
    found: list[tuple[Constraint, str]] = []
    if body.get("response_format") is not None:
        c = _response_format(body["response_format"], ws)
        if c is not None:
            found.append((c, "response_format"))
    for kind in ("json", "regex", "choice", "grammar"):
        if body.get(f"guided_{kind}") is not None:
            found.append((_build(kind, body[f"guided_{kind}"], f"guided_{kind}", ws), f"guided_{kind}"))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise Refusal("structured_outputs", "'structured_outputs' must be an object", "invalid_type")
        for key, v in so.items():
            if v is not None and v is not False and key not in _STRUCTURED_KEYS + ("whitespace_pattern",):
                raise Refusal(f"structured_outputs.{key}", f"'structured_outputs.{key}' is not supported by this "
                              f"server (supported: {', '.join(_STRUCTURED_KEYS)}, whitespace_pattern)",
                              "unsupported_parameter")
        for key in _STRUCTURED_KEYS:
            if so.get(key) is not None and so.get(key) is not False:
                found.append((_build(key, so[key], f"structured_outputs.{key}", ws), f"structured_outputs.{key}"))
    if len(found) > 1:
        raise Refusal(found[1][1], f"'{found[0][1]}' and '{found[1][1]}' both constrain the output; send one")
    return found[0] if found else (None, None)


def tools_of(body: dict, tokenizer) -> Optional[Tools]:
    """What `tools` / `tool_choice` / `parallel_tool_calls` ask for (None without tools).

    tool_choice "none": the tools are not shown and the reply is plain text. "auto" (the default
    with tools): the tools go to the chat template and the reply is read in the template's own
    format (hermes, llama3, mistral), or is plain text when the template has none. "required" and
    {"type": "function", "function": {"name"}}: the reply is constrained to such a call, in the
    template's format or, without one, as a JSON array of calls (as vLLM does);
    parallel_tool_calls false makes "required" one call.

    Raises:
      Refusal: malformed tools or tool_choice, or a parameters schema the engine cannot enforce.
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise Refusal("parallel_tool_calls", "'parallel_tool_calls' must be a boolean", "invalid_type")
    if tools is not None and not isinstance(tools, list):
        raise Refusal("tools", "'tools' must be a list of {type: function, function: {name, parameters}}",
                      "invalid_type")
    if not (choice is None or choice in ("none", "auto", "required")
            or (isinstance(choice, dict) and choice.get("type", "function") == "function"
                and isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str))):
        raise Refusal("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}", "invalid_type")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise Refusal("tool_choice", f"'tool_choice' {json.dumps(choice)[:80]} needs 'tools'")
        return None
    try:
        tool_calls.check_tools(tools)
    except ValueError as e:
        raise Refusal("tools", str(e)) from None
    if choice == "none":
        return Tools(tools=None, constraint=None, reply_format=None)
    fmt = tool_calls.detect_format(tokenizer.chat_template)
    if choice in (None, "auto"):
        return Tools(tools=tools, constraint=None, reply_format=fmt)
    try:
        c = constraints.tool_call(tokenizer, tools, choice, fmt, parallel=parallel is not False)
    except ValueError as e:
        raise Refusal("tool_choice" if "tool_choice" in str(e) else "tools", str(e)) from None
    return Tools(tools=tools, constraint=c, reply_format=fmt or "json")
