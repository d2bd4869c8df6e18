"""One request path: a closed batch checked and packed before anything compiles, and a scan's
emitted tokens read back per row.

`generate` and speculative decoding both take a batch through `prepare` (prompt ids, stop ids,
PRNG keys, sampling rows, the constraint's compile-and-walk, the cache length) and read every
scan's outputs through `read_emitted`; the serving Engine checks each request with the same
`inputs` functions and `sampling.SamplingParams.__post_init__`. Every refusal a request can meet
is raised by `jaxinfer.decode.inputs` or here, before the first program is compiled. Shape
letters as in `jaxinfer.model.config` (B rows, Tb padded prompt length, S positions per row).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import numpy as np

from jaxinfer.decode import constraints, core, penalties
from jaxinfer.decode.inputs import (Prompts, bucket, check_context, check_int, check_sampling, check_token_ids,
                                    eos_ids_for, pack_prompts, prompt_ids, request_keys, stop_ids_for)
from jaxinfer.decode.sampling import SamplingParams, row_params
from jaxinfer.model.model import Model

MIN_KV_BUCKET = 64  # smallest cache (positions per row)


def initial_rows(keys: jax.Array, sampling: SamplingParams, stop_ids: tuple[int, ...], budget: int, *,
                 eos_ids: tuple[int, ...] = (), extra_stops: tuple[int, ...] = (), vocab_size: int = 1) -> core.Rows:
    """Rows of a closed batch: one setting, one stop set, one budget for every row (host arrays:
    they travel with the first call, no device op compiles for them).

    Args:
      keys: [B] PRNG keys, one per row.
      sampling: the rows' common settings.
      stop_ids: ids that end a row.
      budget: tokens each row may emit.
      eos_ids: the tokenizer's end ids (what `min_tokens` holds back and `ignore_eos` lets through).
      extra_stops: the caller's own stop ids (`stop_tokens`).
      vocab_size: V.
    Returns:
      core.Rows of numpy arrays, [B, ...] each.
    """
    B = keys.shape[0]
    return core.Rows(sampling=row_params(sampling, B), keys=keys, steps=np.zeros((B,), np.int32),
                     stop_ids=core.stop_array([stop_ids] * B), budget=np.full((B,), budget, np.int32),
                     finished=np.zeros((B,), bool),
                     controls=core.controls_for([sampling] * B, [tuple(extra_stops)] * B, eos_ids, vocab_size),
                     mask=core.no_mask(B, vocab_size))


@dataclasses.dataclass
class Batch:
    """A closed batch, checked and packed on the host (before anything compiles)."""

    ids: list[list[int]]  # each prompt's ids
    tokens: np.ndarray  # [B, Tb] right-padded prompts
    lengths: np.ndarray  # [B]
    stop_ids: tuple[int, ...]  # ids that end a row
    max_new_tokens: int
    chunk: int  # prefill chunk
    max_len: int  # S: positions per row in the cache
    rows: core.Rows
    counts: penalties.TokenCounts
    compiler: Optional[constraints.Compiler] = None  # the constraint's, compiled and walked (`Compiler.compile`)


def prepare(model: Model, prompts: Prompts, *, key, seed, max_new_tokens: int, sampling: SamplingParams,
            stop_at_eos: bool, stop_tokens: Sequence[int], allow_special: bool,
            prefill_chunk_size: Optional[int] = None, working_slots: int = 0) -> Batch:
    """Check every argument of a closed batch and pack it, raising before any compile.

    Args:
      model: the model the batch runs on.
      prompts: as `jaxinfer.generate` takes them (text, a list of texts, token-id lists).
      key, seed: one of them, unless sampling is greedy (`inputs.request_keys`).
      max_new_tokens: tokens to generate per row (>= 1).
      sampling: the rows' settings (checked; a constraint is compiled and walked here).
      stop_at_eos, stop_tokens: what ends a row (`inputs.stop_ids_for`); stop_tokens must lie in
        the vocabulary.
      allow_special: read special-token text in string prompts as control tokens.
      prefill_chunk_size: a power of two: prompts padded beyond it are read in chunks of it;
        None: one pass.
      working_slots: positions a row may use past its last token (speculative decoding's
        verify window); they count against the context and the cache length.
    Returns:
      Batch.
    Raises:
      TypeError, ValueError: naming the argument and what is allowed.
    """
    cfg = model.config
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    if prefill_chunk_size is not None and (check_int("prefill_chunk_size", prefill_chunk_size, 1)
                                           & (prefill_chunk_size - 1)):
        raise ValueError(f"prefill_chunk_size must be a power of two (prompts are padded to one), "
                         f"got {prefill_chunk_size}")
    check_sampling(sampling)
    if sampling.constraint is not None and model.tokenizer is None:
        raise ValueError("a constraint needs a model with a tokenizer (its token texts)")
    ids = prompt_ids(model, prompts, allow_special)
    check_context(ids, max_new_tokens, working_slots, cfg)
    check_token_ids(list(stop_tokens) or [0], cfg.vocab_size, "stop_tokens")
    stop_ids = stop_ids_for(model, stop_at_eos, stop_tokens, sampling.ignore_eos)
    compiler = None
    if sampling.constraint is not None:  # one llguidance can't serve is refused here, before any XLA compile
        compiler = constraints.Compiler(model.tokenizer, cfg.vocab_size, stop_ids=stop_ids)
        compiler.compile(sampling.constraint)
    keys = request_keys(len(ids), key, seed, sampling)
    tokens, lengths = pack_prompts(ids)
    Tb = tokens.shape[1]
    row_state = initial_rows(keys, sampling, stop_ids, max_new_tokens, eos_ids=eos_ids_for(model),
                             extra_stops=tuple(stop_tokens), vocab_size=cfg.vocab_size)
    extra = working_slots + 1 if working_slots else 0  # the verify window, and the slot after it
    return Batch(ids=ids, tokens=tokens, lengths=lengths, stop_ids=stop_ids, max_new_tokens=max_new_tokens,
                 chunk=Tb if prefill_chunk_size is None else min(Tb, prefill_chunk_size),
                 max_len=bucket(max(Tb, int(lengths.max()) + max_new_tokens + extra), MIN_KV_BUCKET), rows=row_state,
                 counts=core.host_counts(ids, cfg.vocab_size), compiler=compiler)


def read_emitted(tokens: np.ndarray, logprobs: np.ndarray, count: np.ndarray) -> tuple[list[list[int]],
                                                                                        list[list[float]]]:
    """One scan's outputs, read back into each row's new tokens and their logprobs.

    Args:
      tokens: [n, B, E] int: at each of the scan's n steps, up to E tokens per row.
      logprobs: [n, B, E] float: their log-probabilities.
      count: [n, B] int: how many of the E each row emitted at that step (0 once it stopped).
    Returns:
      (tokens, logprobs): per row, the emitted ones in order.
    """
    n, B = count.shape
    new = [[] for _ in range(B)]
    lps = [[] for _ in range(B)]
    for b in range(B):
        for j in np.flatnonzero(count[:, b]):
            c = int(count[j, b])
            new[b] += tokens[j, b, :c].tolist()
            lps[b] += logprobs[j, b, :c].tolist()
    return new, lps
