"""Admission: a request's arguments checked and turned into its host state, then queued for the loop.

`Admission.admit` runs on the caller's thread (`Engine.submit`): every argument is checked (a
ValueError naming it before anything runs), the request's key is derived as `generate` derives
row 0's, its slot row is packed, and it goes into the `Inbox`. The loop takes the inbox's
submissions and cancels, in order, at its next step (`Admission.drain`), so only the loop's
thread touches the scheduler and the held requests.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Callable, Optional, Sequence, Union

import jax
import numpy as np

from jaxinfer.decode import constraints
from jaxinfer.decode import inputs
from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.model import sites
from jaxinfer.model.model import Model
from jaxinfer.serve import steering
from jaxinfer.serve.adapters import AdapterSlots, salted
from jaxinfer.serve.held import HeldRequests
from jaxinfer.serve.live import MAX_STOP_TOKENS, Live
from jaxinfer.serve.request import Request
from jaxinfer.serve.runner import MAX_TOP_LOGPROBS
from jaxinfer.serve.scheduler import Seq
from jaxinfer.serve.steering import Steering
from jaxinfer.text.stream import Detokenizer, StopStrings


def request_key(key, seed, sampling: SamplingParams) -> np.ndarray:
    """The request's PRNG key data [k], derived exactly as `generate` derives row 0's key."""
    return np.asarray(jax.random.key_data(inputs.request_keys(1, key, seed, sampling)[0]))


class Inbox:
    """Submissions and cancels from any thread, kept in order for the loop's next step; it wakes
    an idle background loop."""

    def __init__(self):
        # ("submit", Live), ("cancel", request id) or ("update", new params: `updates.Update`)
        self._items: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition()

    def put(self, kind: str, item) -> None:
        with self._lock:
            self._items.append((kind, item))
        self.wake()

    def take(self) -> list[tuple[str, object]]:
        """Everything queued, oldest first; the inbox is empty after."""
        with self._lock:
            items, self._items = self._items, []
        return items

    def put_back(self, items: list[tuple[str, object]]) -> None:
        """Return items taken but not handled to the front of the inbox, in their order."""
        with self._lock:
            self._items[:0] = items

    def queued(self) -> int:
        """Submissions not yet taken by the loop."""
        with self._lock:
            return sum(1 for kind, _ in self._items if kind == "submit")

    def wake(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def wait(self, timeout: float, stopping: Callable[[], bool]) -> None:
        """Wait up to `timeout` seconds for an item or a `wake`, unless one is queued or `stopping()`."""
        with self._wake:
            if not self._items and not stopping():
                self._wake.wait(timeout=timeout)


class Admission:
    """Checks requests, builds their host state and queues them (see the module docstring)."""

    def __init__(self, model: Model, *, steering: Steering, hidden_sites: tuple[str, ...],
                 eos_ids: tuple[int, ...], max_len: int, pack_row: Callable[[Live], object],
                 counting_compiles: Callable[[], contextlib.AbstractContextManager],
                 adapters: Optional[AdapterSlots] = None):
        """
        Args:
          model, steering, hidden_sites, eos_ids, max_len, adapters: the engine's.
          pack_row: packs a request's slot row (`Runner.pack_row`), here rather than in the loop.
          counting_compiles: a context in which programs built count as built while serving.
        """
        self.model, self.cfg = model, model.config
        self.steering, self.hidden_sites, self.eos_ids, self.max_len = steering, hidden_sites, eos_ids, max_len
        self._pack_row, self._counting_compiles = pack_row, counting_compiles
        self.adapters = adapters
        self.inbox = Inbox()
        self._ids = itertools.count()
        self._compiler: Optional[constraints.Compiler] = None  # built when the first constraint comes

    def admit(self, prompt: Union[str, Sequence[int]], *, drive: Callable[[], bool], running: Callable[[], bool],
              max_new_tokens: int, sampling: SamplingParams,
              seed: Optional[int], key: Optional[jax.Array], stop_tokens: Sequence[int], stop: Sequence[str],
              stop_at_eos: bool, logprobs: int, prompt_logprobs: Optional[int], score_from: int,
              interventions: Optional[Sequence], hidden_states: Optional[tuple],
              adapter: Optional[str] = None) -> Request:
        """`Engine.submit` past its health check: the arguments (see there) checked, the request
        queued for the loop; `drive` and `running` are what its `Request` is handed (one engine
        step; whether a loop runs). Raises ValueError before anything is queued."""
        max_new_tokens = inputs.check_int("max_new_tokens", max_new_tokens, 0 if prompt_logprobs is not None else 1)
        inputs.check_sampling(sampling)
        logprobs = inputs.check_int("logprobs", logprobs, 0, MAX_TOP_LOGPROBS)
        if prompt_logprobs is not None:
            prompt_logprobs = inputs.check_int("prompt_logprobs", prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        if stop and self.model.tokenizer is None:
            raise ValueError("stop strings need a model with a tokenizer")
        stops = StopStrings(stop) if stop else None
        if not isinstance(prompt, str) and (len(prompt) == 0 or isinstance(prompt[0], (list, tuple))):
            raise ValueError("prompt must be a string or one list of token ids")
        ids = inputs.prompt_ids(self.model, [prompt])[0]
        score_from = inputs.check_int("score_from", score_from, 1, max(1, len(ids)))
        steering_rows = steering.check(interventions, self.steering, self.cfg)
        hidden = self._check_hidden(hidden_states, prompt_logprobs)
        self._check_adapter(adapter)
        extra = tuple(int(t) for t in stop_tokens) if not isinstance(stop_tokens, (str, bytes)) else None
        if (extra is None or any(not 0 <= t < self.cfg.vocab_size for t in extra)
                or len(extra) > MAX_STOP_TOKENS):
            raise ValueError(f"stop_tokens must be at most {MAX_STOP_TOKENS} token ids in [0, {self.cfg.vocab_size}), "
                             f"got {list(stop_tokens)[:8]!r}")
        stop_ids = inputs.stop_ids_for(self.model, stop_at_eos, extra, sampling.ignore_eos)
        bad = [t for t, _ in sampling.logit_bias if t >= self.cfg.vocab_size]
        if bad:
            raise ValueError(f"logit_bias names token ids {bad[:5]} outside [0, {self.cfg.vocab_size})")
        matcher = self.constraints().matcher(sampling.constraint) if sampling.constraint is not None else None
        self.check_fits(len(ids), max_new_tokens)
        with self._counting_compiles():
            key_data = request_key(key, seed, sampling)
        rid = next(self._ids)
        req = Request(rid, ids, max_new_tokens, drive=drive, running=running, on_cancel=self._cancel)
        adapter_slot, adapter_salt = self.adapters.take(adapter, req) if adapter is not None else (-1, b"")
        tok = self.model.tokenizer
        recompute_from = score_from if prompt_logprobs is not None else None
        if hidden is not None:  # every prompt position is computed (none taken from the prefix cache)
            recompute_from = 1
        counts = in_prompt = None
        if sampling.penalized:
            counts, in_prompt = np.zeros((self.cfg.vocab_size,), np.int32), np.zeros((self.cfg.vocab_size,), bool)
            in_prompt[np.asarray(ids, np.int64)] = True
        live = Live(seq=Seq(rid=rid, prompt=list(ids), max_new_tokens=max_new_tokens, recompute_from=recompute_from,
                            cache_salt=salted(b"" if steering_rows is None else steering_rows.salt(), adapter_salt)),
                    req=req, key_data=key_data, sampling=sampling, stop_ids=stop_ids, stop=stops,
                    detok=Detokenizer(tok.decode) if tok is not None else None, n_top=logprobs,
                    prompt_logprobs=prompt_logprobs, score_from=score_from, extra_stops=extra, matcher=matcher,
                    counts=counts, in_prompt=in_prompt, steering=steering_rows, hidden=hidden,
                    adapter=adapter_slot)
        self._pack_row(live)
        self.inbox.put("submit", live)
        return req

    def _check_adapter(self, adapter: Optional[str]) -> None:
        """submit's adapter: None, or the name of an adapter loaded (ValueError naming them)."""
        if adapter is None:
            return
        if self.adapters is None or not self.adapters.on:
            raise ValueError(f"adapter {adapter!r}: this engine has no LoRA slots (Engine(lora_slots=K, "
                             "max_lora_rank=r); jaxinfer serve --lora name=path)")
        self.adapters.take(adapter)

    def _check_hidden(self, hidden_states, prompt_logprobs) -> Optional[tuple[str, tuple[int, ...]]]:
        """submit's hidden_states as (site, layers), checked (None: off)."""
        if hidden_states is None:
            return None
        if prompt_logprobs is None:
            raise ValueError("hidden_states come from the scoring pass: pass prompt_logprobs too")
        if not (isinstance(hidden_states, (tuple, list)) and len(hidden_states) == 2):
            raise TypeError(f"hidden_states must be (site, layers), got {hidden_states!r}")
        site, layers = hidden_states
        if site not in self.hidden_sites:
            raise ValueError(f"hidden_states site {site!r}: this engine returns "
                             f"{', '.join(self.hidden_sites) or 'no hidden states'} (Engine(hidden_sites=...))")
        layers = tuple(int(x) for x in sites.check_layers(layers, self.cfg, "hidden_states layers"))
        return site, layers

    def constraints(self) -> constraints.Compiler:
        """The constraint compiler for this model's vocabulary (built on first use: it reads every
        token's text)."""
        if self._compiler is None:
            if self.model.tokenizer is None:
                raise ValueError("a constraint needs a model with a tokenizer (its token texts)")
            self._compiler = constraints.Compiler(self.model.tokenizer, self.cfg.vocab_size, stop_ids=self.eos_ids)
        return self._compiler

    def check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        """Raise ValueError if a request of this size can never run in this engine."""
        inputs.check_context([[0] * n_prompt], max_new_tokens, 0, self.cfg)
        need = n_prompt + max_new_tokens
        if need > self.max_len:
            raise ValueError(f"prompt of {n_prompt} tokens + max_new_tokens={max_new_tokens} = {need} "
                             f"exceeds the engine's max_len {self.max_len}")

    def _cancel(self, req: Request) -> None:
        self.inbox.put("cancel", req.id)

    def drain(self, held: HeldRequests, dead: Optional[str]):
        """The loop takes in what was queued since its last step: submissions are held (or fail at
        once when the engine is `dead`: why), cancels end their requests, up to the first weight
        update: that is returned (the items after it stay queued, `serve.updates`); else None."""
        items = self.inbox.take()
        for i, (kind, item) in enumerate(items):
            if kind == "update":
                self.inbox.put_back(items[i + 1:])
                return item
            if kind == "submit":
                if dead is not None:
                    item.req.fail(f"the engine failed: {dead}")
                    continue
                held.hold(item)
            elif item in held:
                held.finish(held[item], "cancelled")
        return None

