"""What the forward may not be differentiated through, refused by name.

The uncached pass over whole sequences is differentiable (`jaxinfer.functional`). The cached
pass is not: paged attention and the fused prefill attention read a row's context from the KV
pages in loops over a data-dependent number of blocks (JAX cannot reverse-differentiate them), an
int8 cache rounds what it stores (a zero gradient), and a row's earlier tokens enter as the cache,
an input, not as a function of the weights. Where such a loop happens to be a single block, JAX
would differentiate it quietly and answer with a partial or zero gradient; `no_gradient` turns
any attempt into a `NotDifferentiableError` naming the path instead. The forward computation is
unchanged: inside `jax.jit` the function runs as it is (the wrapper is a `jax.custom_vjp` whose
forward is the function itself and whose backward raises).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np


class NotDifferentiableError(TypeError):
    """A path through the model that has no gradient (quantized weights, the cached pass, the
    decode scan), refused by name before anything is compiled."""


def no_gradient(what: str) -> Callable[[Callable], Callable]:
    """Decorator: `fn` computes as before; differentiating through it raises NotDifferentiableError.

    Array arguments (any pytree leaf that is an array or a tracer) become the custom_vjp's inputs;
    everything else (floats, ints, None, static fields) stays static, as the caller passed it.
    `what` names the path in the error.
    """
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            leaves, tree = jax.tree.flatten((args, kwargs))
            dynamic = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]

            def call(*arrays):
                full = list(leaves)
                for i, x in zip(dynamic, arrays):
                    full[i] = x
                a, kw = jax.tree.unflatten(tree, full)
                return fn(*a, **kw)

            guarded = jax.custom_vjp(call)
            guarded.defvjp(lambda *arrays: (call(*arrays), None), functools.partial(_refuse, what))
            return guarded(*(leaves[i] for i in dynamic))
        return wrapped
    return wrap


def _refuse(what: str, residuals, cotangent):
    raise NotDifferentiableError(
        f"{what} is not differentiable: it reads the KV cache (loops over a data-dependent number of blocks, int8 "
        "rounding, earlier tokens as an input); differentiate the uncached pass over the whole sequence instead "
        "(jaxinfer.functional.run)")
