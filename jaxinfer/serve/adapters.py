"""LoRA adapters in the serving engine: K fixed slots of stacked A and B, each request naming one.

    engine = Engine(model, lora_slots=4, max_lora_rank=16)
    engine.load_adapter("french", "adapters/french")          # a PEFT folder or a `lora.Adapter`
    engine.submit("Bonjour", adapter="french")
    engine.unload_adapter("french")                           # its slot is free for another

The engine's params carry `params["lora"]` for all seven targets with K slots, allocated once
(`stacks`: zeros, every rank padded to r = max_lora_rank):

    A [L, K, r, in]   B^T [L, K, r, out]   scale [L, K]   (per target, `jaxinfer.model.lora`'s form;
                                                       A and B float32 or bfloat16: `Engine(lora_dtype=)`)

Loading writes an adapter's tensors (zero-padded to r; zeros for the targets it leaves alone)
into a free slot with one jitted program of fixed shapes that donates the stacks (`_write`: the
slot is data), built when the engine is; unloading writes zeros the same way, so a freed slot
adds nothing. Neither compiles after the engine is built. Each decode slot's adapter index
(`Hooks.adapter_ids` [B], -1: the base model) is data of the mixed and decode programs, so
requests switching adapters change data only.

A request holds its adapter from `submit` until it ends: unloading an adapter that an unfinished
request holds is refused (ValueError naming the requests' count), as is loading into full slots.
The prefix cache keeps adapters apart: a request's page hashes start from its adapter's `salt`
(the name and a digest of its padded tensors), so pages written under one adapter are never
reused under another, nor under a new adapter loaded later under the same name.

Shape letters: L layers, K adapter slots, r the slots' rank, B the engine's decode slots.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sharding
from jaxinfer.model import lora
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params
from jaxinfer.weights import peft

AdapterSource = Union[str, os.PathLike, lora.Adapter]


class AdapterError(ValueError):
    """A load, unload or request the slots refuse; `field` is what is at fault, by the names of
    vLLM's endpoints ("lora_name", "lora_path"), so the HTTP server can name it."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def stacks(cfg: ModelConfig, slots: int, rank: int, dtype=np.float32) -> Params:
    """`params["lora"]` of `slots` empty adapter slots of rank `rank`, all seven targets (zeros), A and
    B in `dtype` (`lora.DTYPES`), the scales float32."""
    L, out = cfg.n_layers, {}
    for t in lora.TARGETS:
        O, I = lora.shape_of(t, cfg)
        out[t] = {"a": jnp.zeros((L, slots, rank, I), dtype), "b": jnp.zeros((L, slots, rank, O), dtype),
                  "scale": jnp.zeros((L, slots), jnp.float32)}
    return out


def _write_one(stack: Params, slot: jax.Array, tensors: Params) -> Params:
    """The stacks with slot `slot` replaced by `tensors` ({t: a [L, r, in], b (B^T) [L, r, out], scale [L]})."""
    return {t: {k: stack[t][k].at[:, slot].set(tensors[t][k]) for k in ("a", "b", "scale")} for t in stack}


# One program for every load and unload: the slot is an argument, the stacks are donated.
_write = jax.jit(_write_one, donate_argnums=0)


class AdapterSlots:
    """The engine's adapter slots: which adapter each holds, the requests holding them, the writes."""

    def __init__(self, cfg: ModelConfig, slots: int, max_rank: int, dtype="float32"):
        self.dtype = lora.storage_dtype(dtype)  # A and B's storage (the scales stay float32)
        for name, v, low in (("lora_slots", slots, 0), ("max_lora_rank", max_rank, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if slots:
            lora.check_model(cfg)
        self.cfg, self.slots, self.max_rank = cfg, slots, max_rank
        self.names: list[Optional[str]] = [None] * slots  # the adapter each slot holds (None: free)
        self.salts: list[bytes] = [b""] * slots  # each slot's prefix-cache salt
        self.holders: list[list] = [[] for _ in range(slots)]  # each slot's requests (`Request`s) not yet done
        self._lock = threading.Lock()  # `names` and `holders` are read by submit on callers' threads

    @property
    def on(self) -> bool:
        return self.slots > 0

    def loaded(self) -> tuple[str, ...]:
        """The adapters loaded, in slot order."""
        return tuple(n for n in self.names if n is not None)

    def empty(self) -> Params:
        """The empty stacks (`stacks`), built with one write so the write program exists from here on."""
        return _write(stacks(self.cfg, self.slots, self.max_rank, self.dtype), np.int32(0), self._zeros())

    def _zeros(self) -> Params:
        L, r = self.cfg.n_layers, self.max_rank
        out = {}
        for t in lora.TARGETS:
            O, I = lora.shape_of(t, self.cfg)
            out[t] = {"a": np.zeros((L, r, I), self.dtype), "b": np.zeros((L, r, O), self.dtype),
                      "scale": np.zeros((L,), np.float32)}
        return out

    def check(self, name: str, source: AdapterSource) -> Params:
        """An adapter read (a PEFT folder) or taken (an `Adapter`), checked against the base model
        and the slots, as the slot's tensors zero-padded to the slots' rank. Raises ValueError
        (`peft.PeftError` for the adapter itself) naming what is wrong, before anything runs."""
        if not self.on:
            raise ValueError("this engine has no LoRA slots: build it with Engine(lora_slots=K, max_lora_rank=r) "
                             "(jaxinfer serve --max-loras K --max-lora-rank r)")
        if not isinstance(name, str) or not name:
            raise AdapterError(f"lora_name must be a non-empty string, got {name!r}", "lora_name")
        if isinstance(source, lora.Adapter):
            adapter = source
        elif isinstance(source, (str, os.PathLike)):
            if not os.path.isdir(source):
                raise AdapterError(f"lora_path {str(source)!r} is not a folder (a PEFT adapter folder expected)",
                                   "lora_path")
            adapter = peft.read(source, self.cfg)
        else:
            raise TypeError(f"adapter {name!r}: a PEFT folder or a jaxinfer.lora.Adapter expected, got "
                            f"{type(source).__name__}")
        peft._check_adapter(name, adapter, self.cfg)
        tensors = self._zeros()
        for t, w in adapter.weights.items():
            r = int(np.shape(w["a"])[1])
            if r > self.max_rank:
                raise AdapterError(f"adapter {name!r}: {t} has rank {r}, above max_lora_rank={self.max_rank}",
                                   "lora_path")
            tensors[t]["a"][:, :r] = np.asarray(w["a"], np.float32)
            tensors[t]["b"][:, :r] = np.swapaxes(np.asarray(w["b"], np.float32), 1, 2)  # B [L, out, r] -> B^T
            tensors[t]["scale"][:] = np.asarray(w["scale"], np.float32)
        return tensors

    def with_slots(self, model):
        """`model` with the empty stacks as its `params["lora"]` (unchanged without slots); adapters
        attached to it before are dropped (load them with `load_adapter`)."""
        if not self.on:
            return model
        if sharding.params_mesh(model.params) is not None:
            raise ValueError("lora_slots: LoRA adapters on a model sharded over a mesh are not supported yet")
        return dataclasses.replace(model, params={**model.params, "lora": self.empty()}, adapters=())

    def load(self, params: Params, name: str, tensors: Params) -> Params:
        """`params` with `tensors` (`check`'s) written into a free slot of its stacks.

        `params["lora"]` is donated. Raises ValueError when the name is loaded already or every slot is taken."""
        with self._lock:
            if name in self.names:
                raise AdapterError(f"lora_name {name!r} is loaded already (unload it first to replace it)",
                                   "lora_name")
            if None not in self.names:
                raise AdapterError(f"every LoRA slot is taken ({self.slots}: {', '.join(self.loaded())}); unload "
                                   "one first (or start the engine with more lora_slots / --max-loras)", "lora_name")
            slot = self.names.index(None)
            h = hashlib.sha256(name.encode())
            for t in lora.TARGETS:
                for k in ("a", "b", "scale"):
                    h.update(np.ascontiguousarray(tensors[t][k]).tobytes())
            self.names[slot], self.salts[slot], self.holders[slot] = name, h.digest(), []
        return {**params, "lora": _write(params["lora"], np.int32(slot), tensors)}

    def unload(self, params: Params, name: str) -> Params:
        """`params` with adapter `name`'s slot zeroed (`params["lora"]` donated); the slot is free after.

        Raises ValueError for a name not loaded, or one a request that has not ended holds."""
        with self._lock:
            slot = self._slot(name, "lora_name")
            busy = [r for r in self.holders[slot] if not r.done]
            if busy:
                raise AdapterError(f"lora_name {name!r} is in use by {len(busy)} request(s) not yet finished; "
                                   "unload it once they end", "lora_name")
            self.names[slot], self.salts[slot], self.holders[slot] = None, b"", []
        return {**params, "lora": _write(params["lora"], np.int32(slot), self._zeros())}

    def take(self, name: Optional[str], request=None) -> tuple[int, bytes]:
        """A request's adapter: (its slot, -1 for None; its prefix-cache salt). With `request` (a
        `Request`), it holds the slot until it is done (`unload` refuses meanwhile). Raises
        ValueError naming the adapters loaded when `name` is not one of them."""
        if name is None:
            return -1, b""
        with self._lock:
            slot = self._slot(name, "adapter")
            if request is not None:
                self.holders[slot] = [r for r in self.holders[slot] if not r.done] + [request]
            return slot, self.salts[slot]

    def _slot(self, name, field: str) -> int:
        if not isinstance(name, str) or name not in self.names:
            have = ", ".join(self.loaded()) or "none"
            raise AdapterError(f"{field} {name!r} is not a loaded LoRA adapter (loaded: {have})", field)
        return self.names.index(name)


def salted(salt: bytes, adapter_salt: bytes) -> bytes:
    """A request's prefix-cache salt: its steering's and its adapter's (b"" when it has neither)."""
    if not adapter_salt:
        return salt
    return hashlib.sha256(b"lora:" + adapter_salt + salt).digest()
