"""Steering in the serving engine: a fixed number of `add` slots per row, filled by each request.

    engine = Engine(model, steering_slots=4)                  # 4 adds per request, at resid_post
    engine.submit(prompt, interventions=[interventions.add("resid_post", 12, v, 4.0)])

The engine's programs are built once (`Engine.warmup`) for fixed shapes, so a request cannot
bring a function, a site or a params shape of its own (`jaxinfer.interventions` would make each
of those a new program). What it can bring is data: the engine keeps, for every decode slot,
n_adds = `steering_slots` `add` slots at each of `Steering.sites` (default resid_post only):

    vectors [B, n_adds, D] float32, scales [B, n_adds] float32, gates [B, n_adds, L] bool  (per site)

(B the engine's decode slots).

These are the `sites.Slot`s of `jaxinfer.interventions.add` (the same function, so the same
program as `generate(interventions=[add(...)])` traces), with the rows stacked over the slots.
A request's adds are written into its slot's rows when it takes the slot; a row without
steering has every gate off, and `sites.apply`'s `where` keeps its values bit for bit. New
vectors, scales or layers are new data: nothing compiles. steering_slots=0 (the default) gives
the programs of an engine without steering (no hooks at all).

What does not fit the fixed form is refused by `check` before the request is admitted, naming
what is wrong: anything but `add` (ablate, patch, project_out, LoReFT, a custom function; a
trained `learnable_add` is an `add` and fits), a site the
engine has no slots at, more adds at a site than its n_adds slots.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional, Sequence

import numpy as np

from jaxinfer.model.interventions import Intervention, add_vector
from jaxinfer.model import sites as sites_lib
from jaxinfer.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Steering:
    """The engine's steering capacity: `slots` adds per request at each of `sites`."""

    slots: int = 0
    sites: tuple[str, ...] = ("resid_post",)

    def __post_init__(self):
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 0:
            raise ValueError(f"steering_slots must be an int >= 0 (0 = no steering), got {self.slots!r}")
        sites = (self.sites,) if isinstance(self.sites, str) else tuple(self.sites)
        if not sites or len(set(sites)) != len(sites):
            raise ValueError(f"steering_sites must name one or more distinct sites, got {self.sites!r}")
        for s in sites:
            sites_lib.check_site(s)
            if sites_lib.SHAPES[s] != ("D",):
                raise ValueError(f"steering_sites: {s} is {sites_lib.shape_letters(s)} per token; steering adds a [D] "
                                 "vector at " + ", ".join(x for x in sites_lib.SITES if sites_lib.SHAPES[x] == ("D",)))
        object.__setattr__(self, "sites", sites)

    @property
    def on(self) -> bool:
        return self.slots > 0


@dataclasses.dataclass(frozen=True)
class RequestSteering:
    """One request's steering as the engine's slot rows (per site, in `Steering.sites` order)."""

    vectors: np.ndarray  # [n_sites, n_adds, D] float32
    scales: np.ndarray  # [n_sites, n_adds] float32
    gates: np.ndarray  # [n_sites, n_adds, L] bool

    def salt(self) -> bytes:
        """A key of this steering for the prefix cache: steered keys/values are shared only
        with requests steered the same way, never with plain ones."""
        h = hashlib.sha256()
        for a in (self.vectors, self.scales, self.gates):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.digest()


class SteeringError(ValueError):
    """A request's steering that does not fit the engine: `index` is the intervention at fault
    (None: the list as a whole) and `field` the part of it ("site", "layer", "vector"; None: the
    whole intervention), so the HTTP server can name the request's field."""

    def __init__(self, message: str, index: Optional[int] = None, field: Optional[str] = None):
        super().__init__(message)
        self.index, self.field = index, field


def check(interventions: Optional[Sequence], steering: Steering, cfg: ModelConfig,
          what: str = "interventions") -> Optional[RequestSteering]:
    """A request's interventions as its slot rows, or None when it has none.

    Args:
      interventions: a list of `jaxinfer.interventions` (only `add` fits the engine), or None.
      steering: the engine's capacity.
      cfg: the model's config (D, L).
      what: the list's name in error messages (the HTTP server's is "steering").
    Returns:
      RequestSteering, or None for no interventions.
    Raises:
      TypeError / SteeringError (a ValueError) naming what does not fit, before anything runs.
    """
    if interventions is None:
        return None
    if isinstance(interventions, Intervention):
        raise TypeError("interventions must be a list of jaxinfer.interventions.add(...) (one request's)")
    items = list(interventions)
    if not items:
        return None
    if not steering.on:
        raise ValueError("this engine has no steering slots: build it with Engine(steering_slots=K) "
                         "(jaxinfer serve --steering-slots K) to steer requests")
    n_adds, D, L = steering.slots, cfg.d_model, cfg.n_layers
    n = len(steering.sites)
    request = RequestSteering(vectors=np.zeros((n, n_adds, D), np.float32), scales=np.zeros((n, n_adds), np.float32),
                              gates=np.zeros((n, n_adds, L), bool))
    used = [0] * n
    for i, x in enumerate(items):
        at = f"{what}[{i}]"
        if not isinstance(x, Intervention):
            raise TypeError(f"{at} is a {type(x).__name__}, not an Intervention")
        if x.fn is not add_vector:
            raise SteeringError(f"{at} is {x!r}: the engine applies only add(...) (steering vectors) in "
                                "its fixed programs (a trained interventions.learnable_add is one); ablate, patch, "
                                "project_out, loreft and custom functions run in jaxinfer.generate(..., "
                                "interventions=...)", i)
        if x.site not in steering.sites:
            raise SteeringError(f"{at} adds at {x.site!r}; this engine steers at {', '.join(steering.sites)} "
                                "(Engine(steering_sites=...))", i, "site")
        try:
            layers = sites_lib.check_layers(x.layers, cfg, f"{at} layers")
        except ValueError as e:
            raise SteeringError(str(e), i, "layer") from None
        v = np.asarray(x.params["vector"], np.float32)
        if v.shape != (D,):
            raise SteeringError(f"{at}: the vector must be {D} numbers (the model's width), got shape {v.shape}",
                                i, "vector")
        s = steering.sites.index(x.site)
        if used[s] == n_adds:
            raise SteeringError(f"{sum(it.site == x.site for it in items if isinstance(it, Intervention))} adds "
                                f"at {x.site}: this engine has {n_adds} steering slots per request at each site")
        k = used[s]
        used[s] += 1
        request.vectors[s, k], request.scales[s, k] = v, np.float32(x.params["scale"])
        request.gates[s, k, list(layers)] = True
    return request


def check_hidden_sites(hidden_sites, cfg: ModelConfig) -> tuple[str, ...]:
    """The Engine's `hidden_sites` (a site name or several) as a tuple, each a site this family has
    and one the engine can serve: attn_pattern ([N, S] per token, S the pool table's width) is not."""
    hidden_sites = (hidden_sites,) if isinstance(hidden_sites, str) else tuple(hidden_sites)
    for s in hidden_sites:
        sites_lib.check_site_for(s, cfg)
        if s == "attn_pattern":
            raise ValueError("hidden_sites: attn_pattern is not served; read it with jaxinfer.activations or "
                             "generate(capture=...)")
    return hidden_sites


def idle_hooks(steering: Steering, cfg: ModelConfig, n_rows: int) -> Optional[sites_lib.Hooks]:
    """Host hooks for n_rows rows with every gate off (None when steering is off): the
    template of the engine's per-slot hooks."""
    if not steering.on:
        return None
    D, L = cfg.d_model, cfg.n_layers
    slots = tuple(sites_lib.Slot(params={"scale": np.zeros((n_rows,), np.float32),
                                         "vector": np.zeros((n_rows, D), np.float32)},
                                 gate=np.zeros((n_rows, L), bool), site=site, fn=add_vector)
                  for site in steering.sites for _ in range(steering.slots))
    return sites_lib.Hooks(slots=slots)


def write_row(hooks: sites_lib.Hooks, row: int, request: Optional[RequestSteering], steering: Steering) -> None:
    """Write one request's steering (None: gates off) into row `row` of host `hooks` (in place)."""
    n_adds = steering.slots
    for j, slot in enumerate(hooks.slots):
        s, k = divmod(j, n_adds)
        if request is None:
            slot.gate[row] = False
            slot.params["vector"][row] = 0
            slot.params["scale"][row] = 0
        else:
            slot.gate[row] = request.gates[s, k]
            slot.params["vector"][row] = request.vectors[s, k]
            slot.params["scale"][row] = request.scales[s, k]


VECTOR_FILES = (".npz", ".safetensors")  # what --steering-vectors reads
_VECTOR_DTYPES = ("float16", "bfloat16", "float32", "float64")


def read_vectors(path: str) -> dict[str, np.ndarray]:
    """Named steering vectors from a file, checked without the model: name -> [D] float32.

    Args:
      path: a .npz (numpy.savez: one array per name; object arrays are refused, never unpickled)
        or a .safetensors file (one tensor per name).
    Returns:
      {name: vector}, each one finite float vector (rank 1). Raises ValueError naming the file and
      the entry at fault. `check_widths` checks them against the model's width.
    """
    if not path.endswith(VECTOR_FILES):
        raise ValueError(f"steering vectors file {path!r}: expected a {' or '.join(VECTOR_FILES)} file of "
                         "name -> [D] vectors")
    raw = {}
    try:
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as f:
                if not hasattr(f, "files"):  # a lone .npy array under a .npz name
                    raise ValueError("it is one .npy array, not a .npz archive of named arrays (numpy.savez)")
                for name in f.files:
                    try:
                        raw[name] = f[name]
                    except ValueError as e:  # an object array: loading it would unpickle
                        raise ValueError(f"entry {name!r} cannot be read without unpickling it ({e}); save float "
                                         "arrays (numpy.savez(path, name=vector))") from None
        else:
            from safetensors.numpy import load_file

            raw = load_file(path)
    except Exception as e:  # noqa: BLE001 - a file that is not what its name says: one message naming it
        raise ValueError(f"steering vectors file {path!r}: {e}") from None
    if not raw:
        raise ValueError(f"steering vectors file {path!r} holds no vectors")
    out = {}
    for name, a in raw.items():
        a = np.asarray(a)
        if a.ndim != 1 or a.dtype.name not in _VECTOR_DTYPES:
            raise ValueError(f"steering vectors file {path!r}: entry {name!r} has shape {a.shape} ({a.dtype}); every "
                             f"entry must be one [D] vector of floats ({', '.join(_VECTOR_DTYPES)})")
        a = a.astype(np.float32)
        if not np.all(np.isfinite(a)):
            raise ValueError(f"steering vectors file {path!r}: entry {name!r} holds NaN or inf")
        out[name] = a
    return out


def check_widths(vectors: dict[str, np.ndarray], d_model: int, path: str) -> None:
    """Every vector of `read_vectors(path)` is [D] = [d_model]; else ValueError naming the entry."""
    for name, a in vectors.items():
        if a.shape != (d_model,):
            raise ValueError(f"steering vectors file {path!r}: entry {name!r} has shape {a.shape}; every vector "
                             f"must be [D] = [{d_model}] floats (the model's width)")


def load_vectors(path: str, d_model: int) -> dict[str, np.ndarray]:
    """Named steering vectors from a file: name -> [D] float32 (`jaxinfer serve --steering-vectors`).

    Args:
      path: a .npz (numpy.savez: one array per name) or a .safetensors file (one tensor per name).
      d_model: the model's width D; every vector must be [D], finite.
    Returns:
      {name: vector}. Raises ValueError naming the file and the bad entry.
    """
    vectors = read_vectors(path)
    check_widths(vectors, d_model, path)
    return vectors
