"""Tool calls: a model's own tool-call text <-> OpenAI's `tool_calls`, whole or streamed, and the
constraint that makes the model call a tool.

Formats (detected from the chat template the model was trained with)::

  hermes   Qwen2.5, Qwen3 (and Hermes-style templates): one block per call,
             <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
  llama3   Llama 3.1 / 3.2 / 3.3 JSON tool calling: the whole reply is one call,
             {"name": "f", "parameters": {...}}, optionally after <|python_tag|>
             (several calls separated by ";" are accepted when parsing)
  mistral  Mistral (v3 tokenizer templates): [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
  json     no format in the template (SmolLM2-135M-Instruct's template ignores `tools`): used
           only to force a call, as vLLM does: [{"name": "f", "arguments": {...}}, ...]

`arguments` in the result is the JSON text the model wrote for the arguments value, unchanged, so
streamed fragments concatenate to exactly the non-streamed string. Text outside the calls is the
message `content` (None when only whitespace).

Not supported: Llama's built-in tools (`<|python_tag|>brave_search.call(...)`), Mistral's newer
`[TOOL_CALLS]name[ARGS]{...}` layout, pythonic tool calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
from typing import Any, Callable, Mapping, Optional, Sequence

FORMATS = ("hermes", "llama3", "mistral", "json")
ARGS_KEY = {"hermes": "arguments", "llama3": "parameters", "mistral": "arguments", "json": "arguments"}
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS_TOKEN = "[TOOL_CALLS]"
# the head of a call object written name-first: `{"name": "f", "arguments": ` up to the value
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule for a function's name
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*(?=\S)')
_FIRST_KEY = re.compile(r'\{\s*"((?:[^"\\]|\\.)*)"')


def detect_format(chat_template: Optional[str]) -> Optional[str]:
    """The tool-call format a chat template teaches, or None when it has none.

    Args:
      chat_template: the model's Jinja chat template text (Tokenizer.chat_template).
    Returns:
      "hermes", "llama3", "mistral", or None.
    """
    t = chat_template or ""
    if TOOL_CALLS_TOKEN in t:
        return "mistral"
    if HERMES_OPEN in t and HERMES_CLOSE in t:
        return "hermes"
    if "<|start_header_id|>" in t and '"parameters"' in t:
        return "llama3"
    return None


def new_call_id(fmt: str) -> str:
    """A fresh tool-call id: OpenAI-style `call_` + 24 random characters; 9 alphanumerics for
    Mistral, whose chat templates refuse any other length."""
    alphabet = string.ascii_letters + string.digits
    n = 9 if fmt == "mistral" else 24
    tail = "".join(secrets.choice(alphabet) for _ in range(n))
    return tail if fmt == "mistral" else "call_" + tail


# -- scanning JSON values that are still being written ------------------------------------------


class _ValueScan:
    """Finds where a JSON value starting at `start` ends, resuming as the text grows."""

    def __init__(self, start: int):
        self.start = self.pos = start
        self.depth = 0
        self.in_str = self.esc = False
        self.end: Optional[int] = None

    def advance(self, text: str, final: bool) -> Optional[int]:
        if self.end is not None:
            return self.end
        if text[self.start] not in "{[":  # a scalar: complete once something follows it
            try:
                _, end = json.JSONDecoder().raw_decode(text, self.start)
            except ValueError:
                return None
            if end < len(text) or final:
                self.end = end
            return self.end
        i = self.pos
        while i < len(text):
            ch = text[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
                    break
            i += 1
        self.pos = i
        return self.end


@dataclasses.dataclass
class _Call:
    start: int  # index of the call object's "{"
    obj: _ValueScan
    name: Optional[str] = None
    args: Optional[_ValueScan] = None  # the arguments value, when written name-first
    id: Optional[str] = None
    sent_args: int = 0  # characters of arguments already streamed
    whole_args: Optional[str] = None  # arguments from a complete object written in another order


class ToolCallParser:
    """Model text in, OpenAI tool-call deltas out (`feed` per text delta, then `finish`).

    The same parser gives the whole result (`parse_tool_calls`), so streamed deltas always add
    up to the non-streamed answer.
    """

    def __init__(self, fmt: str, *, call_id: Optional[Callable[[], str]] = None):
        """Args:
          fmt: one of FORMATS (see `detect_format`).
          call_id: makes each call's id; default `new_call_id(fmt)`.
        """
        if fmt not in FORMATS:
            raise ValueError(f"tool-call format {fmt!r} is not one of {', '.join(FORMATS)}")
        self.fmt = fmt
        self._call_id = call_id or (lambda: new_call_id(fmt))
        self._text = ""
        self._pos = 0  # text before this is settled (emitted as content, or consumed by a call)
        self._marker_at = 0  # end of the last call marker (<tool_call>, [TOOL_CALLS]) seen
        self._opened_at = 0  # where the text of the calls being read began (its marker, "[" or "{")
        self._state = "start"
        self._calls: list[_Call] = []
        self._content: list[str] = []  # content emitted so far (leading whitespace dropped)
        self._held_ws = ""  # trailing whitespace held until more content follows it

    # -- public API --

    def feed(self, delta: str) -> list[dict]:
        """Consume more model text.

        Returns:
          Deltas in order: {"content": str} or {"tool_call": {"index", "id", "type",
          "function": {"name", "arguments"}}} (first delta of a call: id, type and name, arguments
          "") then {"tool_call": {"index", "function": {"arguments": fragment}}}.
        """
        self._text += delta
        return self._run(final=False)

    def finish(self) -> list[dict]:
        """The output is complete: flush what was held back (same kinds of deltas as `feed`)."""
        return self._run(final=True)

    @property
    def content(self) -> Optional[str]:
        """The content so far (None while empty)."""
        return "".join(self._content) or None

    @property
    def tool_calls(self) -> list[dict]:
        """The tool calls so far, as OpenAI's message.tool_calls entries."""
        out = []
        for c in self._calls:
            if c.name is None:
                continue
            if c.whole_args is not None:
                args = c.whole_args
            else:
                end = c.args.end if c.args.end is not None else len(self._text)
                args = self._text[c.args.start:end]
            out.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}})
        return out

    # -- the state machine --

    def _run(self, final: bool) -> list[dict]:
        out: list[dict] = []
        while True:
            before = (self._state, self._pos, len(self._calls))
            out += getattr(self, "_st_" + self._state)(final)
            if (self._state, self._pos, len(self._calls)) == before:
                return out

    def _st_start(self, final):
        rest = self._text[self._pos:]
        stripped = rest.lstrip()
        if self.fmt == "hermes":
            self._state = "content"
        elif self.fmt == "mistral":
            self._state = "content"
        elif not stripped:
            if final:
                self._state = "content"
        elif self.fmt == "llama3":
            self._opened_at = self._pos + len(rest) - len(stripped)
            if stripped.startswith(_PYTHON_TAG):
                self._pos += len(rest) - len(stripped) + len(_PYTHON_TAG)
                self._state = "open"
            elif _PYTHON_TAG.startswith(stripped) and not final:
                pass  # could still become <|python_tag|>
            elif stripped.startswith("{"):
                m = _FIRST_KEY.match(stripped)
                if m and m.group(1) == "name":
                    self._pos += len(rest) - len(stripped)
                    self._state = "open"
                elif m or final:
                    self._state = "content_only"
            else:
                self._state = "content_only"
        else:  # json: a bare array
            if stripped.startswith("["):
                self._opened_at = self._pos + len(rest) - len(stripped)
                self._pos += len(rest) - len(stripped) + 1
                self._state = "open"
            else:
                self._state = "content_only"
        return []

    def _st_content_only(self, final):
        return self._emit_content(len(self._text), final)

    def _st_content(self, final):
        marker = HERMES_OPEN if self.fmt == "hermes" else TOOL_CALLS_TOKEN
        at = self._text.find(marker, self._pos)
        if at < 0:
            end = len(self._text)
            if not final:  # hold back what could be the start of the marker
                for k in range(min(len(marker) - 1, end - self._pos), 0, -1):
                    if marker.startswith(self._text[end - k:]):
                        end -= k
                        break
            return self._emit_content(end, final)
        out = self._emit_content(at, final)
        self._opened_at = at
        self._pos = self._marker_at = at + len(marker)
        if self.fmt == "mistral":
            self._state = "mistral_array"
        else:
            self._state = "open"
        return out

    def _st_mistral_array(self, final):
        rest = self._text[self._pos:]
        stripped = rest.lstrip()
        if stripped.startswith("["):
            self._pos += len(rest) - len(stripped) + 1
            self._state = "open"
        elif stripped or final:  # not the layout we know: the marker and what follows are content
            self._pos = self._marker_at - len(TOOL_CALLS_TOKEN)
            self._state = "content_only"
        return []

    def _st_open(self, final):
        rest = self._text[self._pos:]
        stripped = rest.lstrip()
        if stripped.startswith("{"):
            start = self._pos + len(rest) - len(stripped)
            self._calls.append(_Call(start=start, obj=_ValueScan(start)))
            self._pos = start
            self._state = "call"
        elif stripped or final:  # no call object: the text is content
            if self.fmt == "hermes":  # keep the marker as text, look for the next one after it
                self._pos = self._marker_at - len(HERMES_OPEN)
                out = self._emit_content(self._marker_at, final)
                self._state = "content"
                return out
            if self._first_of_container() == len(self._calls):  # no call read since it opened:
                self._pos = self._opened_at  # its opening ("[", a marker) is content too
            self._state = "content_only"
        return []

    def _st_call(self, final):
        i = len(self._calls) - 1
        c = self._calls[i]
        out = []
        if c.name is None:
            m = _HEAD.match(self._text, c.start)
            if m:
                c.name = json.loads(f'"{m.group(1)}"')
                c.id = self._call_id()
                c.args = _ValueScan(m.end())
                out.append({"tool_call": {"index": self._index(i), "id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": ""}}})
        if c.args is not None:
            end = c.args.advance(self._text, final)
            out += self._args_delta(i, end if end is not None else len(self._text))
        obj_end = c.obj.advance(self._text, final)
        if obj_end is None:
            if final and c.name is None:  # cut before its name was whole (max_tokens): no call, and
                self._calls.pop()  # the text written so far is the content, the reply's valid prefix
                if not any(x.name is not None for x in self._calls[self._first_of_container():]):
                    c.start = self._opened_at
                self._pos = c.start
                self._state = "content_only"
            return out
        if c.name is None:  # complete but not written name-first: parse it whole
            try:
                obj = json.loads(self._text[c.start:obj_end])
            except ValueError:
                obj = None
            args = obj.get(ARGS_KEY[self.fmt], obj.get("arguments")) if isinstance(obj, dict) else None
            if isinstance(obj, dict) and isinstance(obj.get("name"), str) and args is not None:
                c.name, c.id = obj["name"], self._call_id()
                c.whole_args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                out.append({"tool_call": {"index": self._index(i), "id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.whole_args}}})
            else:  # not a call after all: its text is content
                self._calls.pop()
                out += self._emit_content(obj_end, final)
        self._pos = obj_end
        self._state = "after"
        return out

    def _st_after(self, final):
        rest = self._text[self._pos:]
        stripped = rest.lstrip()
        skip = len(rest) - len(stripped)
        if self.fmt == "hermes":
            at = self._text.find(HERMES_CLOSE, self._pos)
            if at >= 0:
                self._pos = at + len(HERMES_CLOSE)
                self._state = "content"
            elif final:
                self._pos = len(self._text)
            return []
        if not stripped:
            return []
        sep = ";" if self.fmt == "llama3" else ","
        if stripped[0] == sep:
            self._pos += skip + 1
            self._state = "open"
        elif stripped[0] == "]" and self.fmt != "llama3":
            self._pos += skip + 1
            self._state = "content_only"
        else:
            self._pos += skip
            self._state = "content_only"
        return []

    # -- helpers --

    def _first_of_container(self) -> int:
        """Index of the first call read since the current marker / array opened."""
        return next((k for k, x in enumerate(self._calls) if x.start >= self._opened_at), len(self._calls))

    def _index(self, i: int) -> int:
        return sum(1 for c in self._calls[:i] if c.name is not None)

    def _args_delta(self, i: int, end: int) -> list[dict]:
        c = self._calls[i]
        frag = self._text[c.args.start + c.sent_args:end]
        if not frag:
            return []
        c.sent_args += len(frag)
        return [{"tool_call": {"index": self._index(i), "function": {"arguments": frag}}}]

    def _emit_content(self, end: int, final: bool) -> list[dict]:
        piece = self._text[self._pos:end] if end > self._pos else ""
        self._pos = max(self._pos, end)
        text = self._held_ws + piece
        if not self._content:
            text = text.lstrip()
        body = text.rstrip()
        self._held_ws = text[len(body):]
        if not body:
            return []
        self._content.append(body)
        return [{"content": body}]


def parse_tool_calls(text: str, fmt: Optional[str], *, call_id: Optional[Callable[[], str]] = None
                     ) -> tuple[Optional[str], list[dict]]:
    """Split a finished model reply into content and OpenAI tool calls.

    Args:
      text: the decoded reply (special tokens kept as text, e.g. "[TOOL_CALLS]").
      fmt: one of FORMATS, or None (no tool format: all of it is content).
      call_id: makes each call's id; default `new_call_id(fmt)`.
    Returns:
      (content or None, [{"id", "type": "function", "function": {"name", "arguments"}}, ...]).
    """
    if fmt is None:
        return (text.strip() or None), []
    p = ToolCallParser(fmt, call_id=call_id)
    p.feed(text)
    p.finish()
    return p.content, p.tool_calls


# -- forcing a call -----------------------------------------------------------------------------


def functions(tools: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict]]:
    """(name, parameters schema) of each OpenAI tool; ValueError naming a malformed one."""
    out = []
    for k, t in enumerate(tools or ()):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise ValueError(f"tools[{k}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"tools[{k}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        params = fn.get("parameters")
        if params is None:  # OpenAI: no parameters means an empty parameter list
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, Mapping):
            raise ValueError(f"tools[{k}].function.parameters must be a JSON schema object")
        out.append((name, dict(params)))
    names = [n for n, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"tools name the function(s) {dup} more than once")
    return out


def check_tools(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The function names of OpenAI `tools`, each definition checked.

    Raises:
      ValueError: a malformed definition (named by its index) or a name used twice.
    """
    return [name for name, _ in functions(tools)]
