"""jaxinfer's extensions of OpenAI's request body: `steering` (add vectors to the residual stream
while generating) and `hidden_states` (the scoring call returns activations). Each refusal is a
400 naming the field, raised before admission.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np

from jaxinfer.serve import fields
from jaxinfer.serve.api_errors import bad

# The `hidden_states` of one response, encoded: refused beyond this size (`--max-hidden-states-bytes`).
MAX_HIDDEN_STATES_BYTES = 64 << 20
# Bytes one hidden-state value takes in a response, by (encoding_format, dtype): base64 is 4
# characters per 3 bytes; a JSON float has up to 17 significant digits, a sign, a point, an
# exponent and a comma ("-1.2345678901234567e-05,"), 24 characters at most.
HIDDEN_VALUE_BYTES = {("float", "float32"): 24, ("base64", "float32"): 4 * 4 / 3, ("base64", "float16"): 2 * 4 / 3}


@dataclasses.dataclass(frozen=True)
class Extensions:
    """What the server offers beyond OpenAI's API (`steering`, `hidden_states`): the engine's
    steering capacity, the named vectors loaded at start, and the hidden-state sites."""

    steering: Any = None  # serve.steering.Steering, or None (no steering)
    vectors: Any = dataclasses.field(default_factory=dict)  # name -> [D] float32 (`--steering-vectors`)
    saes: Any = dataclasses.field(default_factory=dict)  # name -> jaxinfer.sae.SAE (`--sae NAME=PATH`)
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


def read_steering(body: dict, model, ext: Extensions) -> tuple:
    """The `steering` extension: [{"layer", "site", "vector" | "name", "scale"}] -> add interventions;
    an entry {"sae", "features", "strength_multiplier"} steers by SAE features (`_sae_steering`).

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
        if "sae" in e:  # feature steering: Neuronpedia's form, one add of the features' summed directions
            out.append(_sae_steering(e, at, ext))
            continue
        unknown = sorted(set(e) - _STEER_KEYS)
        if unknown:
            raise bad(f"{at}.{unknown[0]}", f"{at} has an unknown field {unknown[0]!r}; its fields are layer, site, "
                      "vector or name, scale", "unknown_parameter")
        layers = e.get("layer")
        flat = layers if isinstance(layers, list) else [layers]
        if not flat or not all(isinstance(x, int) and not isinstance(x, bool) for x in flat):
            raise bad(f"{at}.layer", f"{at}.layer must be a layer index (an int) or a non-empty list of them, "
                      f"got {fields.show(layers)}", "invalid_type")
        if ("vector" in e) == ("name" in e):
            raise bad(at, f"{at} needs exactly one of 'vector' (a list of {cfg.d_model} numbers) and 'name' "
                      "(a vector loaded with --steering-vectors)", "missing_required_parameter")
        if "name" in e:
            name = e["name"]
            if not isinstance(name, str) or name not in ext.vectors:
                names = sorted(ext.vectors)
                have = (f"the server has {', '.join(map(repr, names[:20]))}" + (" ..." if len(names) > 20 else "")
                        if names else "the server has no named vectors (--steering-vectors FILE)")
                raise bad(f"{at}.name", f"{at}.name {fields.show(name)} is not a loaded steering vector; {have}")
            vec = ext.vectors[name]
        else:
            raw = e["vector"]
            if not isinstance(raw, list) or not all(fields.is_number(x) for x in raw):
                raise bad(f"{at}.vector", f"{at}.vector must be a list of numbers only", "invalid_type")
            vec = np.asarray([_as_float(x) for x in raw], np.float64)
        scale = e.get("scale", 1.0)
        if not fields.is_number(scale):
            raise bad(f"{at}.scale", f"{at}.scale must be a finite number, got {fields.show(scale)}", "invalid_type")
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


_SAE_KEYS = {"sae", "features", "strength_multiplier"}
_FEATURE_KEYS = {"index", "strength", "layer"}


def _sae_steering(e: dict, at: str, ext: Extensions):
    """One `steering` entry naming SAE features, as Neuronpedia's steering takes them:
    {"sae": NAME, "features": [{"index", "strength", "layer"?}], "strength_multiplier"?} ->
    `jaxinfer.sae.sae_add` (one add of sum strength * W_dec[index], scaled by the multiplier)."""
    from jaxinfer.sae import steer

    unknown = sorted(set(e) - _SAE_KEYS)
    if unknown:
        raise bad(f"{at}.{unknown[0]}", f"{at} has an unknown field {unknown[0]!r}; an SAE entry's fields are sae, "
                  "features, strength_multiplier", "unknown_parameter")
    name = e["sae"]
    if not isinstance(name, str) or name not in ext.saes:
        names = sorted(ext.saes)
        have = f"the server has {', '.join(map(repr, names))}" if names else "the server has no SAEs (--sae NAME=PATH)"
        raise bad(f"{at}.sae", f"{at}.sae {fields.show(name)} is not a loaded SAE; {have}")
    sae = ext.saes[name]
    feats = e.get("features")
    if not isinstance(feats, list) or not feats:
        raise bad(f"{at}.features", f"{at}.features must be a non-empty list of {{index, strength}} objects",
                  "invalid_type")
    indices, strengths = [], []
    for j, f in enumerate(feats):
        fat = f"{at}.features[{j}]"
        if not isinstance(f, dict) or set(f) - _FEATURE_KEYS or "index" not in f:
            raise bad(fat, f"{fat} must be an object {{index, strength, layer (optional)}}", "invalid_type")
        index, strength = f["index"], f.get("strength", 1.0)
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < sae.d_sae:
            raise bad(f"{fat}.index", f"{fat}.index must be a feature index in [0, {sae.d_sae}), got "
                      f"{fields.show(index)}")
        if not fields.is_number(strength) or not math.isfinite(_as_float(strength)):
            raise bad(f"{fat}.strength", f"{fat}.strength must be a finite number, got {fields.show(strength)}")
        if "layer" in f and f["layer"] != sae.layer:
            raise bad(f"{fat}.layer", f"{fat}.layer {fields.show(f['layer'])}: the SAE {name!r} reads layer "
                      f"{sae.layer}")
        indices.append(index)
        strengths.append(_as_float(strength))
    multiplier = e.get("strength_multiplier", 1.0)
    if not fields.is_number(multiplier) or not math.isfinite(_as_float(multiplier)):
        raise bad(f"{at}.strength_multiplier", f"{at}.strength_multiplier must be a finite number, got "
                  f"{fields.show(multiplier)}")
    try:
        with np.errstate(over="ignore"):
            return steer.sae_add(sae, indices, strengths, multiplier=_as_float(multiplier))
    except ValueError as err:  # a feature named twice; a direction beyond float32
        raise bad(f"{at}.features", f"{at}.features: {err}") from None


def _as_float(x) -> float:
    """A JSON number as a float: an int too large for one is inf (refused as not finite)."""
    try:
        return float(x)
    except OverflowError:
        return float("inf")


def read_hidden_states(body: dict, model, ext: Extensions, *, chat: bool, echo: bool, max_tokens_asked,
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
    known = ("layers", "site", "encoding_format", "dtype")
    unknown = sorted(set(v) - set(known))
    if unknown:
        raise bad(f"hidden_states.{unknown[0]}", f"hidden_states has an unknown field {unknown[0]!r}; its fields are "
                  f"{', '.join(known)}", "unknown_parameter")
    site = v.get("site", ext.hidden_sites[0])
    if site not in ext.hidden_sites:
        raise bad("hidden_states.site", f"hidden_states.site {fields.show(site)}: this server returns "
                  f"{', '.join(ext.hidden_sites)}")
    n = model.config.n_layers
    layers = v.get("layers")
    ints = isinstance(layers, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
    if not ints or not layers or any(not 0 <= x < n for x in layers) or len(set(layers)) != len(layers):
        raise bad("hidden_states.layers", f"hidden_states.layers must be a non-empty list of distinct layer indices "
                  f"in [0, {n}), got {fields.show(layers)}")
    encoding = v.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad("hidden_states.encoding_format", f"hidden_states.encoding_format must be 'float' (JSON numbers) or "
                  f"'base64' (little-endian bytes), got {fields.show(encoding)}")
    dtype = v.get("dtype", "float32")
    if dtype not in ("float32", "float16") or (encoding == "float" and dtype != "float32"):
        raise bad("hidden_states.dtype", f"hidden_states.dtype must be 'float32' or, with encoding_format 'base64', "
                  f"'float16', got {fields.show(dtype)}"
                  + (" with encoding_format 'float'" if dtype == "float16" else ""))
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
