"""The typed field readers of a request body: numbers, integers, strings, stop strings, the seed,
logit_bias and the sampling parameters. Each refusal is a 400 naming the field and what it takes.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from jaxinfer.decode import penalties
from jaxinfer.decode.inputs import SEED_LIMIT
from jaxinfer.decode.sampling import MIN_TOKENS_WITH_CONSTRAINT, SamplingParams
from jaxinfer.serve.api_errors import bad

# Stop strings: vLLM and SGLang take any number; lm-evaluation-harness appends the EOS string to a
# task's `until` list, so 5+ is common. Each is checked against the tail of the text per token, so
# their count and length bound the per-token work.
MAX_STOP = 32
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = penalties.MAX_LOGIT_BIAS  # entries: the engine's fixed bias width (no size compiles a program)


def show(v: Any) -> str:
    """A short printable form of a client's value (a 400-digit number or a long string is cut)."""
    text = repr(v) if not isinstance(v, int) or abs(v) < 10 ** 30 else f"an integer of {len(str(abs(v)))} digits"
    return text if len(text) <= 60 else text[:57] + "..."


def get(body: dict, name: str, kinds: tuple, default: Any, what: str) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise bad(name, f"'{name}' must be {what}, got {v!r}", "invalid_type")
    if not isinstance(v, kinds):
        raise bad(name, f"'{name}' must be {what}, got {type(v).__name__} {show(v)}", "invalid_type")
    return v


def number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = get(body, name, (int, float), default, "a number")
    # Compared before any float(): a 400-digit integer does not fit a float (OverflowError).
    if not (lo <= v <= hi):  # also false for NaN
        raise bad(name, f"'{name}' must be a number in [{lo}, {hi}], got {show(v)}")
    return float(v)


def integer(body: dict, name: str, default: Optional[int], lo: int, hi: int) -> Optional[int]:
    v = get(body, name, (int,), default, "an integer")
    if v is not None and not lo <= v <= hi:
        raise bad(name, f"'{name}' must be an integer in [{lo}, {hi}], got {show(v)}")
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


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def stop(body: dict) -> tuple[str, ...]:
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


def seed(body: dict) -> Optional[int]:
    v = get(body, "seed", (int,), None, "an integer")
    if v is not None and not 0 <= v < SEED_LIMIT:
        raise bad("seed", f"'seed' {show(v)} is out of range: a seed is an integer in [0, 2**32) "
                  f"(0 to {SEED_LIMIT - 1})")
    return v


def logit_bias(body: dict, vocab: int) -> tuple:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} -> sorted (id, bias) pairs."""
    lb = get(body, "logit_bias", (dict,), {}, "an object mapping token ids to biases")
    if len(lb) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens, got {len(lb)}")
    for k, v in lb.items():  # ASCII digits only: `\d` and int() also read "١٢" (Arabic-Indic) as 12
        if not re.fullmatch(r"[0-9]{1,9}", k) or int(k) >= vocab:
            raise bad("logit_bias", f"'logit_bias' keys must be token ids in [0, {vocab}) written as strings, "
                      f"got {show(k)}")
        if not is_number(v) or not penalties.BIAS_RANGE[0] <= v <= penalties.BIAS_RANGE[1]:
            raise bad("logit_bias", f"logit_bias[{k!r}] must be a number in [-100, 100], got {show(v)}")
    try:
        return penalties.check_logit_bias({int(k): float(v) for k, v in lb.items()})
    except ValueError as e:
        raise bad("logit_bias", str(e)) from None


def sampling_params(body: dict, vocab: int, constraint) -> SamplingParams:
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise bad("top_p", "'top_p' must be in (0, 1], got 0")
    top_k = integer(body, "top_k", 0, -1, 1 << 20)  # vLLM: -1 (or 0) = off
    rep = get(body, "repetition_penalty", (int, float), 1.0, "a number > 0 (1 = off)")
    if not 0 < rep <= 1e6:
        raise bad("repetition_penalty", f"'repetition_penalty' must be a number > 0 (1 = off), got {show(rep)}")
    min_tokens = integer(body, "min_tokens", 0, 0, 1 << 30)
    if min_tokens and constraint is not None:
        raise bad("min_tokens", f"'min_tokens': {MIN_TOKENS_WITH_CONSTRAINT.format(min_tokens)}",
                  "unsupported_value")
    return SamplingParams(temperature=number(body, "temperature", 1.0, 0.0, 2.0), top_p=top_p,
                          top_k=max(top_k, 0), min_p=number(body, "min_p", 0.0, 0.0, 0.999),
                          frequency_penalty=number(body, "frequency_penalty", 0.0, *penalties.PENALTY_RANGE),
                          presence_penalty=number(body, "presence_penalty", 0.0, *penalties.PENALTY_RANGE),
                          repetition_penalty=float(rep), min_tokens=min_tokens,
                          ignore_eos=bool(get(body, "ignore_eos", (bool,), False, "a boolean")),
                          logit_bias=logit_bias(body, vocab), constraint=constraint)
