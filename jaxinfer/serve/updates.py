"""Weight updates: new params for a running engine, applied between steps, compiling nothing.

`Engine.update_params(params)` hands the engine new arrays of the same tree, shapes, dtypes and
shardings as its own (`check_params`: anything else is refused by name, before anything runs;
host arrays are placed on the engine's shardings). Every program takes the params as an
argument, so the same executables run the new arrays: nothing compiles.

The update travels through the inbox in order with the submissions (`Admission.drain` stops at
it), so every request submitted after the call runs on the new weights alone. The requests
submitted before it, by `in_flight`:

  "finish"     (the default) end on the old weights: the update waits until they have all
               ended, and the requests submitted meanwhile wait in the inbox for it. Every
               completion then comes from one set of weights, as an RL trainer's importance
               ratios assume (vLLM calls this pausing with "wait").
  "recompute"  go on at once with the new weights: the iteration under way is read (its tokens
               were sampled with the old ones), then every request holding a slot is recomputed
               from its prompt and tokens so far with the new (as after a preemption); the tokens
               it already returned stay, so its completion mixes the two. For a server that must
               not stall behind long requests.

Either way the prefix cache is emptied: its pages hold keys and values of the old weights.
Non-finite weights are refused only when asked (`check_finite`: it reads every weight back to
the host); otherwise a NaN shows up as each request's InvalidLogitsError, as it would for any
other cause.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Optional

import jax
import numpy as np

from jaxinfer.model.params import Params
from jaxinfer.serve.admission import Admission
from jaxinfer.serve.flights import Flights
from jaxinfer.serve.held import HeldRequests
from jaxinfer.serve.pages import PagePool
from jaxinfer.serve.recovery import Recovery
from jaxinfer.serve.scheduler import Scheduler

if TYPE_CHECKING:
    from jaxinfer.serve.runner import Runner

IN_FLIGHT = ("finish", "recompute")  # what happens to the requests submitted before an update


def check_params(old: Params, new: Params, *, check_finite: bool = False) -> Params:
    """`new`, checked to be `old`'s twin, on the device: same tree, and leaf for leaf the same
    shape, dtype and (device arrays) sharding; host arrays (NumPy) are placed on old's shardings.

    Args:
      old: the params the programs were built for.
      new: their replacement.
      check_finite: also refuse a floating leaf holding NaN or inf (reads it on the host).
    Returns:
      The new params, every leaf a device array on old's leaf's sharding.
    Raises:
      ValueError: naming the first leaf (its path in the tree) that is missing, extra, or differs
        in shape, dtype or sharding, or (check_finite) holds NaN or inf. TypeError: a leaf that
        is not an array.
    """
    old_leaves, old_tree = jax.tree_util.tree_flatten_with_path(old)
    new_leaves, new_tree = jax.tree_util.tree_flatten_with_path(new)
    if old_tree != new_tree:
        have = {jax.tree_util.keystr(p) for p, _ in old_leaves}
        got = {jax.tree_util.keystr(p) for p, _ in new_leaves}
        missing, extra = sorted(have - got), sorted(got - have)
        what = "; ".join([f"missing {', '.join(missing[:4])}"] * bool(missing)
                         + [f"unexpected {', '.join(extra[:4])}"] * bool(extra))
        raise ValueError(f"params: the new tree differs from the engine's: {what or 'its node types differ'} "
                         f"(e.g. float weights for int8 ones); a new tree needs a new Engine")
    placed, to_place = [], []
    for (path, a), (_, b) in zip(old_leaves, new_leaves):
        name = f"params{jax.tree_util.keystr(path)}"
        if not (hasattr(b, "shape") and hasattr(b, "dtype")):
            raise TypeError(f"{name}: expected an array, got {type(b).__name__}")
        if tuple(b.shape) != tuple(a.shape):
            raise ValueError(f"{name}: shape {tuple(b.shape)}, the engine's is {tuple(a.shape)} "
                             f"(new shapes need a new Engine)")
        if np.dtype(b.dtype) != np.dtype(a.dtype):
            raise ValueError(f"{name}: dtype {np.dtype(b.dtype).name}, the engine's is {np.dtype(a.dtype).name}")
        if isinstance(b, jax.Array):
            if b.is_deleted():
                raise ValueError(f"{name}: the array was deleted (donated to a call?)")
            if b.sharding != a.sharding:
                raise ValueError(f"{name}: sharding {b.sharding}, the engine's is {a.sharding} "
                                 f"(pass host arrays to have them placed, or put them on its sharding)")
        else:
            to_place.append(len(placed))
        if check_finite and np.issubdtype(np.dtype(b.dtype), np.inexact) and not np.all(np.isfinite(np.asarray(b))):
            raise ValueError(f"{name}: holds NaN or inf")
        placed.append(b)
    if to_place:  # one transfer for every host leaf
        moved = jax.device_put([placed[i] for i in to_place], [old_leaves[i][1].sharding for i in to_place])
        for i, x in zip(to_place, moved):
            placed[i] = x
    return jax.tree.unflatten(new_tree, placed)


@dataclasses.dataclass(kw_only=True)
class Update:
    """New params on their way through the inbox; `applied` is set when the steps run them."""

    params: Params
    in_flight: str  # one of IN_FLIGHT
    applied: threading.Event = dataclasses.field(default_factory=threading.Event)
    version: int = 0  # the engine's params version once applied


class ParamsUpdates:
    """Checks updates, queues them, and applies each between steps (see the module docstring);
    `apply_ready` runs at the start of each step, on the loop's thread."""

    def __init__(self, *, runner: Runner, admission: Admission, pool: PagePool, scheduler: Scheduler,
                 held: HeldRequests, flights: Flights, recovery: Recovery, keep_lora: bool = False):
        self.runner, self.admission, self.pool, self.scheduler = runner, admission, pool, scheduler
        self.held, self.flights, self.recovery = held, flights, recovery
        # An engine with LoRA slots keeps its adapters (`params["lora"]`, `serve.adapters`): an
        # update replaces the base weights, and the stacks as they are when it is applied stay.
        self.keep_lora = keep_lora
        self.version = 0  # updates applied
        self.pending: Optional[Update] = None  # taken from the inbox, waiting for its requests to end

    def request(self, params: Params, in_flight: str, check_finite: bool) -> Update:
        """Check new params (raises before anything is queued) and queue them behind the inbox's items."""
        if in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT}, got {in_flight!r}")
        old = self.runner.model.params
        if self.keep_lora:
            old = {k: v for k, v in old.items() if k != "lora"}
            params = {k: v for k, v in params.items() if k != "lora"} if isinstance(params, dict) else params
        update = Update(params=check_params(old, params, check_finite=check_finite), in_flight=in_flight)
        self.admission.inbox.put("update", update)
        return update

    def intake(self, dead: Optional[str]) -> None:
        """A step's intake: the inbox's submissions and cancels up to the next update; that update
        applied once its `in_flight` allows, then the items queued after it, and so on."""
        while True:
            if self.pending is not None:
                if self.pending.in_flight == "finish" and not (self.flights.under_way is None
                                                                and self.scheduler.idle()):
                    return  # the requests before it end first; the ones after wait in the inbox
                self._apply(self.pending)
                self.pending = None
            self.pending = self.admission.drain(self.held, dead)
            if self.pending is None:
                return

    def _apply(self, update: Update) -> None:
        if update.in_flight == "recompute":
            flight = self.flights.take()
            if flight is not None:  # its tokens came from the old weights: handed out as they are
                try:
                    self.flights.collect(flight)
                except Exception as e:  # noqa: BLE001 - any fault in a step: fail its requests, recover
                    self.recovery.recover(flight.touched, e)
            for seq in list(self.scheduler.running):  # their keys and values are the old weights'
                self.scheduler.preempt(seq)
            self.runner.forget_slots()
        params = update.params
        if self.keep_lora:
            params = {**params, "lora": self.runner.model.params["lora"]}
        self.runner.replace_params(params)
        self.admission.model = self.runner.model  # (it reads the tokenizer; the old arrays are freed)
        self.pool.forget()
        self.version += 1
        update.version = self.version
        update.applied.set()
