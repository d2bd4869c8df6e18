"""Chat templates: a model's own Jinja template, rendered as transformers renders it.

Where the template comes from (first found wins):
  * `chat_template.jinja` in a Hugging Face folder (what transformers writes today);
  * `tokenizer_config.json`'s `chat_template`: a string, or a list of {"name", "template"} (the
    one named "default" is used, as transformers does when no name is asked for);
  * a GGUF's `tokenizer.chat_template`.

Rendering matches `tokenizer.apply_chat_template(messages, tokenize=False, ...)`: the same sandboxed
environment (`ImmutableSandboxedEnvironment`, trim_blocks, lstrip_blocks, loop controls), the same
`tojson` filter (non-ASCII kept, no HTML escaping), the same globals (`raise_exception`,
`strftime_now`, a `namespace` that refuses underscore names, `dict`) and the same variables
(`messages`, `tools`, `documents`, `add_generation_prompt`, the special-token strings such as
`bos_token` / `eos_token`, and any extra keyword the caller passes, e.g. `date_string`).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any, Optional, Sequence, Union

TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(ValueError):
    """A chat template could not be found or rendered (including its own raise_exception)."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The jinja2 Template for `source`, in transformers' sandboxed environment."""
    import jinja2

    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from e


@functools.lru_cache(maxsize=1)
def _environment():
    """transformers' environment: sandboxed, trim_blocks, lstrip_blocks, loop controls, its globals."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = _namespace_class()
    return env


def _namespace_class():
    """jinja2's namespace, refusing underscore names (as transformers' sandbox does)."""
    import jinja2.utils

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")

    return Namespace


def _generation_extension():
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders its body."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return Generation


def _plain(value: Any) -> Any:
    """JSON-like copies of the caller's data, so the template can neither see nor change the originals."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, str):  # subclasses (enums, numpy scalars) carry methods: keep the base value
        return str.__str__(value)
    if isinstance(value, (int, float)):
        return float(value) if isinstance(value, float) else int(value)
    raise TypeError("chat template data must be JSON-like (dict, list, str, number, bool, None), "
                    f"got {type(value).__name__}")


def render(template: str, messages: Sequence[dict], *, add_generation_prompt: bool = False,
           special_tokens: Optional[dict[str, str]] = None, tools: Optional[list] = None,
           documents: Optional[list] = None, **kwargs) -> str:
    """Render a conversation with a chat template, as transformers' apply_chat_template(tokenize=False).

    Args:
      template: the Jinja source.
      messages: [{"role": ..., "content": ...}, ...].
      add_generation_prompt: end with the header that starts the assistant's turn.
      special_tokens: {"bos_token": "<s>", "eos_token": "</s>", ...} made visible to the template.
      tools, documents: passed through (JSON schemas / dicts), None when absent.
      **kwargs: extra template variables (e.g. date_string); they override special_tokens.
    Returns:
      The prompt text.
    """
    import jinja2

    for m in messages:
        if not isinstance(m, dict):
            raise TypeError(f"chat messages must be dicts with 'role' and 'content', got {m!r}")
    variables = {**(special_tokens or {}), **kwargs}
    try:
        return compile_template(template).render(
            messages=_plain(list(messages)), tools=_plain(tools), documents=_plain(documents),
            add_generation_prompt=add_generation_prompt, **_plain(variables))
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template refused the conversation: {e}") from e


def select(template: Union[str, list, dict, None], name: Optional[str] = None) -> Optional[str]:
    """The template source from a tokenizer_config `chat_template` value (a string or named list)."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}
    if not isinstance(template, dict):
        raise ChatTemplateError("chat_template must be a string or a list of named templates, "
                                f"got {type(template).__name__}")
    key = name or "default"
    if key not in template:
        raise ChatTemplateError(f"no chat template named {key!r}; this model has {sorted(template)}")
    return template[key]


def read_folder_template(path: str) -> Optional[str]:
    """A Hugging Face folder's chat template: chat_template.jinja, else tokenizer_config.json's."""
    jinja = os.path.join(path, TEMPLATE_FILE)
    if os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    cfg = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(cfg):
        with open(cfg, encoding="utf-8") as f:
            return select(json.load(f).get("chat_template"))
    return None
