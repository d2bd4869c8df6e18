"""Where a server's resident memory goes, and giving back what is freed.

    memory.resident()               # bytes resident now (VmRSS), None off Linux
    memory.release()                # return freed heap to the OS (glibc malloc_trim)
    memory.breakdown(engine)        # resident, live arrays, weights, pool, the rest

On a CPU the weights and the KV pool are plain host memory, so a server is resident for at
least both. What came on top, measured on SmolLM2-135M (float32, per_layer layout, a 2-core
CPU; docs/serving.md "Start-up"): the stacked weights that the per_layer conversion replaced
(0.75 GB freed but kept by the allocator), and each program's compile (0.3-0.7 GB of LLVM's
working memory per per_layer program, freed but kept: glibc hands freed memory back only at
the top of a heap, and XLA compiles on several threads, each with its own heap). `release()`
asks the allocator to give back every free page (`malloc_trim(0)`); the engine calls it after
warmup and whenever its loop falls idle, the CLI after the load.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
from typing import Optional

import jax


def resident() -> Optional[int]:
    """Bytes this process has resident now (Linux /proc/self/status VmRSS), None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name)
        lib.malloc_trim  # glibc only (not musl, not macOS)
        return lib
    except (OSError, AttributeError, TypeError):
        return None


def release() -> int:
    """Hand the heap memory that is free back to the OS (glibc's `malloc_trim(0)`; nothing on
    other C libraries). Returns the resident bytes it gave back (0 when unknown)."""
    lib = _libc()
    if lib is None:
        return 0
    before = resident() or 0
    lib.malloc_trim(0)
    return max(0, before - (resident() or 0))


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Resident memory by owner, in bytes (`breakdown`)."""

    resident: int  # VmRSS
    arrays: int  # every live jax array (weights, pool, the engine's token counts, ...)
    weights: int
    pool: int
    other: int  # resident - arrays: interpreter, libraries, executables, allocator slack

    def __str__(self) -> str:
        g = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
        return (f"resident {g(self.resident)}: weights {g(self.weights)}, KV pool {g(self.pool)}, other arrays "
                f"{g(self.arrays - self.weights - self.pool)}, the rest {g(self.other)}")


def breakdown(engine) -> Breakdown:
    """Where `engine`'s process keeps its resident memory (on a CPU, arrays are host memory)."""
    from jaxinfer.model.params import nbytes

    arrays = sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())
    rss = resident() or 0
    return Breakdown(resident=rss, arrays=arrays, weights=nbytes(engine.model.params),
                     pool=engine.runner.cache.nbytes, other=rss - arrays)
