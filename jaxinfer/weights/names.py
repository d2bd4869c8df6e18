"""Weight-name tables: how a checkpoint's stored tensors map onto jaxinfer's params.

A table is a tuple of `Rule`s, one stored tensor each: its name pattern, the jaxinfer param it
fills, its stored shape in the shape letters, and what is done to it, named in words. `expand`
turns a table into one model's `Placement`s; `check_shape` is the shape check every reader makes
before a tensor is read; `host_value` applies a placement's words on the host. The Hugging Face
reader (`hf.py`) and the GGUF reader (`gguf.py`) each declare their table beside their reader.

Rule fields (strings, read by `expand`):
  name: the stored name; "{i}" the layer, "{e}" a routed expert (one rule, one tensor per expert),
    other "{...}" words the reader's naming (`naming=`: how a folder names its experts).
  shape: the stored (numpy-order) shape, "N*H, D"; alternatives joined by " | ".
  transforms: words applied in order: host functions the reader names (`steps=`, "rope_rows(N,
    Hn+Hr)", a call's arguments are sizes), then "transpose" ([out, in] -> [in, out]), then
    "plus_one" (an RMSNorm that multiplies by 1 + w: the 1 folded in). A word may end in
    " if FLAG": applied where the model has FLAG. After them, the value is reshaped to the param's
    (layer) slice, e.g. q_proj [N*H, D] -> transpose -> wq[l] [D, N, H].
  when: flags that must all hold ("qkv_bias", "mla and not q_lora"; "" always).
  layer: for a name with "{i}", the param's leading index, a size expression in i ("i",
    "i - first_dense"); a name without "{i}" is a top-level param (embed, final_norm, lm_head).
  at: leading offsets into the (layer) slice where the value goes ("e, Fe": expert e's up half);
    "" fills the whole slice. A value placed `at` keeps its stored shape (transposed, where
    "transpose"); such a rule takes no host words.
Sizes are the shape letters of `jaxinfer.model.config` plus `i`, `e` and `first_dense`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import operator
from typing import Callable, Mapping, Optional

import numpy as np

DEVICE_WORDS = ("transpose", "plus_one")  # applied last; the HF reader runs them on device for large tensors


@dataclasses.dataclass(frozen=True)
class Rule:
    """One stored tensor -> one jaxinfer param (or part of one); fields as the module docstring says."""

    key: str
    name: str
    shape: str
    transforms: tuple[str, ...] = ()
    when: str = ""
    layer: str = "i"
    at: str = ""


@dataclasses.dataclass(frozen=True)
class Placement:
    """One stored tensor of one model: where it goes and what is done to it (`expand`)."""

    key: str  # jaxinfer param name ("wq", "embed" ...)
    layer: Optional[int]  # the leading index of a stacked layer param; None for a top-level one
    name: str  # the stored tensor's name
    shapes: tuple[tuple[int, ...], ...]  # the stored shape (or its allowed alternatives)
    steps: tuple[Callable[[np.ndarray], np.ndarray], ...] = ()  # host functions, in order
    words: tuple[str, ...] = ()  # every applied word, for messages and for the reader's own checks
    transpose: bool = False
    plus_one: bool = False
    shape: Optional[tuple[int, ...]] = None  # the value's shape where it fills part of its slice, else None
    at: tuple[int, ...] = ()  # its leading offsets in the slice

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return self.shapes[0]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def size(expr: str, sizes: Mapping[str, int]):
    """The value of a size expression ("N*(Hn+Hv)", "e, Fe") over `sizes`: names, ints, + - * //
    and tuples; anything else is a table bug."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Tuple):
            return tuple(ev(n) for n in node.elts)
        if isinstance(node, ast.Name):
            return sizes[node.id]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"size expression {expr!r}: {ast.dump(node)} is not a size")

    return ev(_parse(expr))


@functools.lru_cache(maxsize=None)
def _parse(expr: str) -> ast.Expression:
    return ast.parse(expr, mode="eval")


def _shape(expr: str, sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(size(f"({expr},)", sizes))


def holds(when: str, flags: Mapping[str, bool]) -> bool:
    """Whether every flag of `when` ("a and not b") holds; an unknown flag is a table bug (KeyError)."""
    out = True
    for term in filter(None, (t.strip() for t in when.split(" and "))):
        negate = term.startswith("not ")
        out &= flags[term[4:] if negate else term] != negate
    return out


def expand(table: tuple[Rule, ...], sizes: Mapping[str, int], flags: Mapping[str, bool], *,
           i: Optional[int] = None, naming: Optional[Mapping[str, str]] = None,
           steps: Optional[Mapping[str, Callable[..., np.ndarray]]] = None) -> list[Placement]:
    """The placements of the rules that hold, in table order.

    Args:
      table: the rules (layer rules with `i`, top-level ones without).
      sizes: the shape letters' values.
      flags: what the model (or layer i) has, for `when` and "if" words.
      i: the layer, for rules whose name holds "{i}".
      naming: the reader's naming words for the name patterns ("block", "gate" ...).
      steps: host functions by word; a word "w(a, b)" calls steps["w"](x, a, b) with sizes a, b.
    """
    sizes = dict(sizes, i=i) if i is not None else dict(sizes)
    naming, steps = naming or {}, steps or {}
    out = []
    for rule in table:
        if not holds(rule.when, flags):
            continue
        experts = range(sizes["X"]) if "{e}" in rule.name else (None,)
        for e in experts:
            s = dict(sizes, e=e) if e is not None else sizes
            out.append(_place(rule, s, flags, layer=i, expert=e, naming=naming, steps=steps))
    return out


def _place(rule: Rule, sizes: dict, flags, *, layer, expert, naming: dict, steps: dict) -> Placement:
    """One tensor's placement by `rule` at this layer and expert (None where the rule has none)."""
    i, e = layer, expert
    fns, words, device = [], [], []
    for word in rule.transforms:
        word, _, flag = word.partition(" if ")
        if flag and not holds(flag, flags):
            continue
        words.append(word)
        if word in DEVICE_WORDS:
            device.append(word)
            continue
        if device:
            raise ValueError(f"rule {rule.name!r}: {word!r} comes after {device}; host words come first")
        fname, _, args = word.partition("(")
        fns.append(_bind(steps[fname], size(f"({args[:-1]},)", sizes) if args else ()))
    if rule.at and fns:
        raise ValueError(f"rule {rule.name!r}: a rule placed `at` takes no host words ({words})")
    if device not in ([], ["transpose"], ["plus_one"], ["transpose", "plus_one"]):
        raise ValueError(f"rule {rule.name!r}: device words {device} (transpose, then plus_one)")
    shapes = tuple(_shape(alt, sizes) for alt in rule.shape.split(" | "))
    return Placement(
        key=rule.key, layer=size(rule.layer, sizes) if "{i}" in rule.name else None,
        name=rule.name.format(i=i, e=e, **naming), shapes=shapes, steps=tuple(fns), words=tuple(words),
        transpose="transpose" in device, plus_one="plus_one" in device,
        shape=(shapes[0][::-1] if "transpose" in device else shapes[0]) if rule.at else None,
        at=size(f"({rule.at},)", sizes) if rule.at else ())


def _bind(fn: Callable[..., np.ndarray], args: tuple) -> Callable[[np.ndarray], np.ndarray]:
    return fn if not args else lambda a, **kw: fn(a, *args, **kw)


def shape_error(p: Placement, found: tuple[int, ...]) -> Optional[str]:
    """None where `found` is the placement's stored shape (or one of its alternatives), else the
    message: the tensor, the shape found and the shape expected."""
    found = tuple(int(n) for n in found)
    if found in p.shapes:
        return None
    expected = " or ".join(str(s) for s in p.shapes)
    return f"tensor {p.name!r} has shape {found}, expected {expected}"


def host_value(p: Placement, a: np.ndarray) -> np.ndarray:
    """A stored tensor after the placement's host words (not transpose / plus_one: `finish`)."""
    for fn in p.steps:
        a = fn(a)
    return a


def finish(p: Placement, a: np.ndarray) -> np.ndarray:
    """transpose, then plus_one (in float32), on the host."""
    a = a.T if p.transpose else a
    return a.astype(np.float32) + 1.0 if p.plus_one else a


def part(p: Placement, slice_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the value's shape, with size-1 axes in front up to the slice's rank; its start offsets in
    the slice) for a placement that fills part of its (layer) slice, or the whole of it."""
    if p.shape is None:
        return tuple(slice_shape), (0,) * len(slice_shape)
    full = (1,) * (len(slice_shape) - len(p.shape)) + tuple(p.shape)
    return full, tuple(p.at) + (0,) * (len(slice_shape) - len(p.at))


def fill_host(placements: list[Placement], read: Callable[[Placement], np.ndarray], specs: dict,
              progress: Optional[Callable[[int, int], None]] = None, total: Optional[int] = None) -> dict:
    """The params pytree as numpy float32 (layers stacked), each placement's value read by `read`
    (host words applied), finished and written into its param.

    specs: `params.param_specs(cfg)` in the stacked layout; total: the count `progress` reports
    against (the number of placements by default).
    """
    out: dict = {"layers": {}}
    total = len(placements) if total is None else total
    for done, p in enumerate(placements, 1):
        dest = out["layers"] if p.layer is not None else out
        if p.key not in dest:
            spec = specs["layers"][p.key] if p.layer is not None else specs[p.key]
            dest[p.key] = np.empty(spec.shape, np.float32)
        v = finish(p, read(p)).astype(np.float32)
        if p.layer is None:
            dest[p.key][...] = v.reshape(dest[p.key].shape)
        else:
            shape, at = part(p, dest[p.key].shape[1:])
            dest[p.key][p.layer][tuple(slice(o, o + n) for o, n in zip(at, shape))] = v.reshape(shape)
        if progress:
            progress(done, total)
    return out
