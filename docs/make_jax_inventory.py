"""Write the small intersphinx inventories the docs build reads offline.

The docs link to JAX (and a few NumPy and Python names) through intersphinx, but neither this
machine nor CI can reach docs.jax.dev, so `conf.py` points intersphinx at inventories committed in
`docs/_inventories/` instead of the published `objects.inv` files. This script writes them in
Sphinx's inventory format (version 2: four header lines, then zlib-compressed lines of
`name domain:role priority uri dispname`), for exactly the names our pages and docstrings
reference, each pointing at its real page on the project's documentation site.

Run it again after referencing a new name (the build fails on a reference it cannot resolve):

    python docs/make_jax_inventory.py
"""

from __future__ import annotations

import pathlib
import zlib

HERE = pathlib.Path(__file__).resolve().parent / "_inventories"

# (name, role, uri relative to the site root); "$" in a uri stands for the name, as in Sphinx.
JAX = [
    ("jax", "module", "jax.html#module-$"),
    ("jax.numpy", "module", "jax.numpy.html#module-$"),
    ("jax.lax", "module", "jax.lax.html#module-$"),
    ("jax.random", "module", "jax.random.html#module-$"),
    ("jax.sharding", "module", "jax.sharding.html#module-$"),
    ("jax.profiler", "module", "jax.profiler.html#module-$"),
    ("jax.distributed", "module", "jax.distributed.html#module-$"),
    ("jax.Array", "class", "_autosummary/jax.Array.html#$"),
    ("jax.ShapeDtypeStruct", "class", "_autosummary/jax.ShapeDtypeStruct.html#$"),
    ("jax.jit", "function", "_autosummary/jax.jit.html#$"),
    ("jax.eval_shape", "function", "_autosummary/jax.eval_shape.html#$"),
    ("jax.named_scope", "function", "_autosummary/jax.named_scope.html#$"),
    ("jax.make_mesh", "function", "_autosummary/jax.make_mesh.html#$"),
    ("jax.devices", "function", "_autosummary/jax.devices.html#$"),
    ("jax.make_array_from_callback", "function", "_autosummary/jax.make_array_from_callback.html#$"),
    ("jax.default_matmul_precision", "function", "_autosummary/jax.default_matmul_precision.html#$"),
    ("jax.distributed.initialize", "function", "_autosummary/jax.distributed.initialize.html#$"),
    ("jax.lax.scan", "function", "_autosummary/jax.lax.scan.html#$"),
    ("jax.lax.cond", "function", "_autosummary/jax.lax.cond.html#$"),
    ("jax.lax.while_loop", "function", "_autosummary/jax.lax.while_loop.html#$"),
    ("jax.lax.dynamic_slice", "function", "_autosummary/jax.lax.dynamic_slice.html#$"),
    ("jax.lax.dynamic_update_slice", "function", "_autosummary/jax.lax.dynamic_update_slice.html#$"),
    ("jax.random.key", "function", "_autosummary/jax.random.key.html#$"),
    ("jax.random.PRNGKey", "function", "_autosummary/jax.random.PRNGKey.html#$"),
    ("jax.random.fold_in", "function", "_autosummary/jax.random.fold_in.html#$"),
    ("jax.sharding.Mesh", "class", "jax.sharding.html#$"),
    ("jax.sharding.AbstractMesh", "class", "jax.sharding.html#$"),
    ("jax.sharding.NamedSharding", "class", "jax.sharding.html#$"),
    ("jax.sharding.PartitionSpec", "class", "jax.sharding.html#$"),
]

NUMPY = [
    ("numpy", "module", "reference/index.html#module-$"),
    ("numpy.ndarray", "class", "reference/generated/numpy.ndarray.html#$"),
    ("numpy.dtype", "class", "reference/generated/numpy.dtype.html#$"),
]

PYTHON = [
    ("collections.abc.Callable", "class", "library/collections.abc.html#$"),
    ("collections.abc.Sequence", "class", "library/collections.abc.html#$"),
    ("collections.abc.Mapping", "class", "library/collections.abc.html#$"),
    ("collections.abc.Iterator", "class", "library/collections.abc.html#$"),
    ("collections.abc.Iterable", "class", "library/collections.abc.html#$"),
    ("collections.abc.AsyncIterator", "class", "library/collections.abc.html#$"),
    ("os.PathLike", "class", "library/os.html#$"),
    ("pathlib.Path", "class", "library/pathlib.html#$"),
    ("logging.Logger", "class", "library/logging.html#$"),
    ("asyncio", "module", "library/asyncio.html#module-$"),
    ("dataclasses.dataclass", "function", "library/dataclasses.html#$"),
    ("ValueError", "exception", "library/exceptions.html#$"),
    ("RuntimeError", "exception", "library/exceptions.html#$"),
    ("KeyboardInterrupt", "exception", "library/exceptions.html#$"),
]

INVENTORIES = {
    "jax.inv": ("JAX", JAX),
    "numpy.inv": ("NumPy", NUMPY),
    "python.inv": ("Python", PYTHON),
}


def inventory_bytes(project: str, entries) -> bytes:
    """One inventory file in Sphinx's version-2 format."""
    header = (f"# Sphinx inventory version 2\n# Project: {project}\n# Version: \n"
              "# The remainder of this file is compressed using zlib.\n").encode()
    lines = "".join(f"{name} py:{role} 1 {uri} -\n" for name, role, uri in sorted(entries))
    return header + zlib.compress(lines.encode())


def main() -> None:
    HERE.mkdir(exist_ok=True)
    for filename, (project, entries) in INVENTORIES.items():
        (HERE / filename).write_bytes(inventory_bytes(project, entries))
        print(f"wrote {HERE / filename}: {len(entries)} names")


if __name__ == "__main__":
    main()
