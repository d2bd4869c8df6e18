"""What generation returns: a Completion per request, an Output per `generate` call, Timings.

The same Completion type comes out of `generate`, speculative decoding and the serving engine.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from jaxinfer.model.model import Model
from jaxinfer.model.moe import Routing

TopLogprobs = list[tuple[int, float]]  # the most likely tokens at one position: (token id, logprob), best first


@dataclasses.dataclass(frozen=True)
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens (a final stop token included)
    text: str  # decoded new tokens, without the stop token
    logprobs: list[float]  # log p(token) under the model, per new token
    finish_reason: str  # "stop" (a stop token or string), "length" (max_new_tokens) or "cancelled" (serve engine)
    top_logprobs: Optional[list[TopLogprobs]] = None  # per new token, when asked for (serve engine)
    # Scoring the prompt (serve engine, `prompt_logprobs`): per prompt position, log p(token | the
    # tokens before it), None where not scored (the first token, positions before `score_from`).
    prompt_logprobs: Optional[list[Optional[float]]] = None
    prompt_top_logprobs: Optional[list[Optional[TopLogprobs]]] = None
    # Captured sites (`generate(capture=...)`): site -> [n new tokens, layers, *site shape] float32,
    # row k the site at the position whose logits sampled token k; and over the prompt [P, layers, ...]
    activations: Optional[dict] = None
    prompt_activations: Optional[dict] = None
    # The router's choices (`generate(return_routing=True)`, mixture-of-experts models): numpy ids and
    # weights [P + N - 1, L, k], the experts each layer chose at every position the model read (the
    # P prompt tokens, then the generated ones but the last); token_ids[i] came out of row P - 1 + i.
    routing: Optional[Routing] = None


def completion_for(model: Model, prompt_ids: list[int], tokens: Sequence[int], logprobs: Sequence[float],
                   stop_ids: Sequence[int], complete: bool = False) -> "Completion":
    """One row's Completion: its generated tokens [N] and their logprobs [N], cut after the first stop.

    The stop token stays in `token_ids` (and its logprob in `logprobs`) but not in `text`.
    `complete`: the row ended because its constraint's grammar was complete ("stop").
    """
    row = [int(t) for t in tokens]
    stops = set(stop_ids)
    n = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
    reason = "stop" if (n and row[n - 1] in stops) or complete else "length"
    text_ids = row[: n - 1] if n and row[n - 1] in stops else row[:n]
    text = model.tokenizer.decode(text_ids) if model.tokenizer is not None else ""
    return Completion(prompt_ids=list(prompt_ids), token_ids=row[:n], text=text,
                      logprobs=[float(x) for x in logprobs[:n]], finish_reason=reason)


@dataclasses.dataclass(frozen=True)
class Timings:
    prefill_s: float  # prefill incl. first sample (and any compile it triggered)
    decode_s: float  # all decode chunks, wall clock (incl. any compile they triggered)
    ttft_s: float  # call start -> first token on host
    total_s: float
    prompt_tokens: int  # real (unpadded) prompt tokens across the batch
    new_tokens: int  # generated tokens kept across the batch (up to each row's stop / max_new_tokens)
    decode_tokens_per_s: float  # kept tokens from the decode loop / decode time excluding compiles
    n_compilations: int  # XLA executables built (compiled or loaded from disk) for prefill and decode
    compile_s: float = 0.0  # tracing + compiling (or loading from the persistent cache), whole call
    n_cache_loads: int = 0  # of n_compilations, loaded from the persistent compile cache
    decode_tokens: int = 0  # kept tokens from the decode loop (new_tokens minus the prefill's first)

    @classmethod
    def of_run(cls, *, t0: float, t_first: float, t_end: float, prompt_tokens: int,
               completions: Sequence[Completion], decode_tokens: Optional[int] = None, n_compilations: int,
               compile_s: float = 0.0, decode_compile_s: float = 0.0, n_cache_loads: int = 0) -> "Timings":
        """From the clock at the call's start, at the first token on host and at the end.

        decode_tokens: None counts the kept tokens (each row's tokens after its first, up to its
        stop); steps scanned past a stop or max_new_tokens are not tokens anyone gets.
        decode_compile_s: compile time inside the decode chunks, left out of the rate.
        """
        new_tokens = sum(len(c.token_ids) for c in completions)
        if decode_tokens is None:
            decode_tokens = sum(max(0, len(c.token_ids) - 1) for c in completions)
        decode_s = t_end - t_first
        run_s = decode_s - decode_compile_s
        return cls(prefill_s=t_first - t0, decode_s=decode_s, ttft_s=t_first - t0, total_s=t_end - t0,
                   prompt_tokens=prompt_tokens, new_tokens=new_tokens,
                   decode_tokens_per_s=decode_tokens / run_s if run_s > 0 and decode_tokens else float("nan"),
                   n_compilations=n_compilations, compile_s=compile_s, n_cache_loads=n_cache_loads,
                   decode_tokens=decode_tokens)


@dataclasses.dataclass(frozen=True)
class Output:
    completions: list[Completion]
    timings: Timings

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]
