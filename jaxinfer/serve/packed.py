"""Many small per-row arrays as two: one int32 [B, n_i] and one float32 [B, n_f].

A device call's cost on the host grows with its argument count (each array is flattened, checked
and copied on its own: ~2,600 arguments cost sglang-jax ~34 ms per step), and so does reading
results back. The engine's per-slot state (tokens, lengths, page table, sampling settings, keys,
stop ids, logit bias, budgets...) is ~25 arrays of a few numbers per row; `Packing` lays them
side by side in two arrays, which the host fills and the program slices apart again (free).

    packing = Packing.of(template)          # a pytree of [B, ...] arrays (any values)
    ints, floats = packing.pack(tree)       # host (numpy) or inside a program (jax.numpy)
    tree = packing.unpack(ints, floats)     # the same pytree again
    packing.columns("rows.budget")          # where one leaf sits: (0 or 1, slice)

Leaves may be int32, uint32 (bitcast), bool (0/1) or float32. `lead` leading axes are kept
(1: [B, ...]; 2: [T, B, ...] for a scan's outputs). A Packing is hashable: programs take it as
a static argument.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_INT, _FLOAT = 0, 1


@dataclasses.dataclass(frozen=True)
class Leaf:
    name: str  # the leaf's path, e.g. "rows.budget"
    dtype: str  # "int32", "uint32", "bool" or "float32"
    shape: tuple[int, ...]  # trailing shape (after the lead axes)
    where: int  # _INT or _FLOAT: which packed array
    start: int  # first column
    size: int  # columns


@dataclasses.dataclass(frozen=True)
class Packing:
    treedef: Any
    leaves: tuple[Leaf, ...]
    widths: tuple[int, int]  # (n_i, n_f)
    lead: int = 1

    @classmethod
    def of(cls, template, lead: int = 1) -> "Packing":
        """The packing of pytrees shaped like `template` (arrays or ShapeDtypeStructs)."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(template)
        leaves, widths = [], [0, 0]
        for path, x in flat:
            dtype = np.dtype(x.dtype).name
            if dtype not in ("int32", "uint32", "bool", "float32"):
                raise TypeError(f"cannot pack {jax.tree_util.keystr(path)} of dtype {dtype}")
            where = _FLOAT if dtype == "float32" else _INT
            shape = tuple(x.shape[lead:])
            size = int(np.prod(shape, dtype=np.int64))
            leaves.append(Leaf(_name(path), dtype, shape, where, widths[where], size))
            widths[where] += size
        return cls(treedef, tuple(leaves), (widths[0], widths[1]), lead)

    def columns(self, name: str) -> tuple[int, slice]:
        """(0 for the int array or 1 for the float one, the columns) of the leaf `name`."""
        for leaf in self.leaves:
            if leaf.name == name:
                return leaf.where, slice(leaf.start, leaf.start + leaf.size)
        raise KeyError(f"no leaf {name!r}; leaves: {[leaf.name for leaf in self.leaves]}")

    def pack(self, tree):
        """(ints [*lead, n_i] int32, floats [*lead, n_f] float32) of `tree`: numpy arrays for
        numpy leaves, jax arrays inside a program."""
        flat = jax.tree_util.tree_leaves(tree)
        xp = np if all(isinstance(x, (np.ndarray, np.generic)) for x in flat) else jnp
        lead = np.shape(flat[0])[:self.lead]
        parts: tuple[list, list] = ([], [])
        for leaf, x in zip(self.leaves, flat):
            x = xp.reshape(xp.asarray(x), lead + (leaf.size,))
            if leaf.dtype == "uint32":
                x = x.view(np.int32) if xp is np else jax.lax.bitcast_convert_type(x, jnp.int32)
            elif leaf.dtype == "bool":
                x = x.astype(np.int32)
            parts[leaf.where].append(x)
        out = []
        for where, dtype in ((_INT, np.int32), (_FLOAT, np.float32)):
            out.append(xp.concatenate(parts[where], axis=-1) if parts[where] else xp.zeros(lead + (0,), dtype))
        return out[0], out[1]

    def unpack(self, ints, floats):
        """The pytree packed in (ints, floats) (numpy views on the host, slices in a program)."""
        xp = np if isinstance(ints, np.ndarray) else jnp
        arrays = (ints, floats)
        lead = ints.shape[:self.lead]
        out = []
        for leaf in self.leaves:
            x = arrays[leaf.where][..., leaf.start:leaf.start + leaf.size].reshape(lead + leaf.shape)
            if leaf.dtype == "uint32":
                x = x.view(np.uint32) if xp is np else jax.lax.bitcast_convert_type(x, jnp.uint32)
            elif leaf.dtype == "bool":
                x = x != 0
            out.append(x)
        return jax.tree_util.tree_unflatten(self.treedef, out)


def _name(path) -> str:
    return jax.tree_util.keystr(path).lstrip(".").replace("']['", ".").replace("['", "").replace("']", "")
