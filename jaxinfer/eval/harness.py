"""The `jaxinfer` model of lm-evaluation-harness: the serving engine in process, no server.

    python -m jaxinfer.eval --model jaxinfer --model_args model=smollm2-135m,max_slots=8 --tasks hellaswag

    import lm_eval, jaxinfer.eval.harness            # the import registers the name "jaxinfer"
    lm_eval.simple_evaluate(model="jaxinfer", model_args="model=smollm2-135m", tasks=["hellaswag"])

How the name is found: lm-eval 0.4.13 looks models up only in its own registry
(`lm_eval.api.registry.model_registry`, filled from the MODEL_MAPPING table of
`lm_eval/models/__init__.py` and by `@register_model` when a module is imported). Its registry
can hold an `importlib.metadata.EntryPoint` as a lazy target, but nothing in the package ever
calls `entry_points()`, so an installed plugin is not discovered: an entry point in our
pyproject.toml would do nothing. Hence `python -m jaxinfer.eval`, which imports this module
(registering the name) and then runs lm-eval's own command line with the same arguments
(`lm_eval.__main__.cli_evaluate`). Before registering, `lm_eval.models` is imported: lm-eval fills
its built-in table only when the registry is empty, so registering first would hide `hf` & co.

Model arguments (`--model_args key=value,...`):
  model          (required) anything `jaxinfer.load` takes: a known name, a .gguf file, a
                 Hugging Face folder, a jaxinfer checkpoint
  max_slots      requests the engine runs together (default 8)
  max_length     the model's context as the harness sees it (default 2048, as lm-eval's API
                 models; at most the model's): rolling windows are this long, longer inputs lose
                 tokens from the left, as in `--model hf`. The engine is sized for it, and its decode
                 step slows down with the context width: pass what the tasks need
  kv_memory      KV pool size, e.g. 2GiB (default: the engine's)
  prefill_chunk  prompt tokens prefilled per engine step (default 512)
  dtype, quant, kv_cache   as `jaxinfer.load`
  seed           seed of every generation request (default 1234, the seed lm-eval's API models send)
  max_gen_toks   tokens generated when a task does not say (default 256, as `--model hf`)
  compile_cache  folder of JAX's persistent compilation cache (default jaxinfer's); "none": off
  batch_size, max_batch_size, device: lm-eval passes them; ignored (the engine batches up to
                 max_slots requests; JAX picks the device)

What runs where. loglikelihood: lm-eval's own `TemplateLM` tokenizes (its `_encode_pair`), then
every pair is one prefill-only engine request through `jaxinfer.score` (batched, choices of one
context share its KV pages through the prefix cache, identical pairs scored once; the greedy
check comes from the same prefill). loglikelihood_rolling: the harness's windows
(`get_rolling_token_windows` + `make_disjoint_window`, context_len 1, max_length tokens), all
documents' windows scored in one `score` call. generate_until: lm-eval's `normalize_gen_kwargs`
reads each request's settings (until, max_gen_toks / max_new_tokens, do_sample, temperature,
top_p, top_k, num_beams: 1); the EOS text joins the stop strings (as `--model hf` does); every
request is submitted at once and the engine batches them; settings that would change the result
and are not implemented (beam search, penalties) are refused by name.
"""

from __future__ import annotations

import logging
from typing import Optional

import lm_eval.models  # noqa: F401  (fills lm-eval's built-in table first; see the module docstring)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxinfer.decode.sampling import GREEDY, SamplingParams
from jaxinfer.eval import scoring

log = logging.getLogger(__name__)

DEFAULT_SEED = 1234  # lm-eval's API models send this seed with every request
DEFAULT_MAX_GEN_TOKS = 256  # `--model hf`'s default
DEFAULT_MAX_LENGTH = 2048  # lm-eval's API models' default context
# generation settings read here; anything else in a task's generation_kwargs is refused by name
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")
_IGNORED_KEYS = ("do_sample",)  # folded into temperature by normalize_gen_kwargs


def _bytes(v) -> Optional[int]:
    if v is None or isinstance(v, int):
        return v
    from jaxinfer.cli import _parse_bytes

    return _parse_bytes(str(v))


@register_model("jaxinfer")
class JaxinferLM(TemplateLM):
    """lm-evaluation-harness's LM interface over a jaxinfer Engine (see the module docstring)."""

    def __init__(self, model=None, *, max_slots: int = 8, max_length: Optional[int] = None, kv_memory=None,
                 prefill_chunk: int = 512, dtype: Optional[str] = None, quant: Optional[str] = None,
                 kv_cache: Optional[str] = None, seed: int = DEFAULT_SEED, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 compile_cache: Optional[str] = None, pretrained=None, batch_size=None, max_batch_size=None,
                 device=None, **unknown):
        """
        Args: the model arguments of the module docstring; `model` may also be a loaded
        jaxinfer Model (`pretrained` is accepted as another spelling of `model`).
        """
        super().__init__()
        if unknown:
            raise ValueError(f"unknown model_args for jaxinfer: {sorted(unknown)}; allowed: model, max_slots, "
                             "max_length, kv_memory, prefill_chunk, dtype, quant, kv_cache, seed, max_gen_toks, "
                             "compile_cache")
        model = model if model is not None else pretrained
        if model is None:
            raise ValueError("model_args needs model=NAME_OR_PATH (a known name, .gguf, Hugging Face folder or "
                             "jaxinfer checkpoint)")
        import jaxinfer
        from jaxinfer.serve.engine import Engine

        if not isinstance(model, jaxinfer.Model):
            if compile_cache is None or str(compile_cache).lower() != "none":
                from jaxinfer.compile_cache import enable_persistent_cache

                try:
                    enable_persistent_cache(compile_cache)
                except (ValueError, OSError) as e:  # an optimisation: never fatal
                    log.warning("compile cache off (%s); every program is compiled afresh", e)
            self.model_name = str(model)
            model = jaxinfer.load(str(model), dtype=dtype, quant=quant, kv_cache=kv_cache, layout="stacked")
        else:
            self.model_name = model.config.name
        if model.tokenizer is None:
            raise ValueError("lm-eval needs the model's tokenizer; this model has none")
        context = model.config.max_seq_len
        self._max_length = min(DEFAULT_MAX_LENGTH, context) if max_length is None else int(max_length)
        if not 2 <= self._max_length <= context:
            raise ValueError(f"max_length must be in [2, {context}] (the model's context), got {max_length!r}")
        # + 1: a pair of max_length + 1 tokens is scored (the last token is never an input in the
        # harness's models; the engine reads it all the same).
        self.engine = Engine(model, max_slots=int(max_slots), kv_memory=_bytes(kv_memory),
                             max_len=min(self._max_length + 1, context), prefill_chunk=int(prefill_chunk))
        self.model = model
        self.tokenizer = model.tokenizer
        self.seed = int(seed)
        self.max_gen_toks = int(max_gen_toks)

    # ---- tokens (TemplateLM) ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return scoring.prefix_token_id(self.tokenizer)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.model_name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        """Ids as the Hugging Face tokenizer gives them to `--model hf`: BOS where the model wants one,
        unless add_special_tokens is False."""
        return scoring.encode(self.tokenizer, string, bos=add_special_tokens is not False)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    def chat_template(self, chat_template=False) -> Optional[str]:
        return self.tokenizer.chat_template if chat_template is not False and chat_template is not None else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

    # ---- requests -----------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids) -> (logprob, is_greedy)."""
        if not requests:
            return []
        scores = scoring.score(self.engine, [(ctx, cont) for _, ctx, cont in requests],
                               max_length=self._max_length + 1)
        out = []
        for (key, _, _), s in zip(requests, scores):
            answer = (s.logprob, s.is_greedy)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Per document, the sum of log p over its tokens, in the harness's disjoint windows."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for w in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length, context_len=1)):
                windows.append((None, *w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue every context until a stop string, EOS or max_gen_toks; all requests submitted
        at once."""
        eos = self.tok_decode([self.eot_token_id])
        jobs = []
        for context, gen_kwargs in (req.args for req in requests):
            jobs.append((context, *self._generation(gen_kwargs, eos)))
        handles = []
        try:
            for context, until, max_gen, sampling in jobs:
                room = self._max_length - max_gen
                ids = self.tok_encode(context)[-room:]
                handles.append(self.engine.submit(ids, max_new_tokens=max_gen, sampling=sampling, seed=self.seed,
                                                  stop=until))
            self.engine.run_until_idle()
            texts = [h.result().text for h in handles]
        finally:
            for h in handles:
                h.cancel()
        out = []
        for req, (_, until, _, _), text in zip(requests, jobs, texts):
            text = postprocess_generated_text(text, until, None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    def _generation(self, gen_kwargs: dict, eos: str) -> tuple[list[str], int, SamplingParams]:
        """A task's generation_kwargs -> (stop strings, max new tokens, sampling), or ValueError."""
        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"generation kwargs must be a dict, got {type(gen_kwargs).__name__}")
        kw = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kw.pop("until", None), eos)
        until = [s for s in until if s]
        max_gen = int(kw.pop("max_gen_toks"))
        if not 1 <= max_gen < self._max_length:
            raise ValueError(f"max_gen_toks={max_gen} must be in [1, {self._max_length - 1}] (max_length "
                             f"{self._max_length} leaves room for the context)")
        beams = kw.pop("num_beams", 1)
        if beams != 1:
            raise ValueError(f"num_beams={beams!r}: beam search is not implemented; only num_beams: 1")
        do_sample = kw.pop("do_sample", False)
        temperature = float(kw.pop("temperature", 0.0))
        settings = {k: kw.pop(k) for k in _SAMPLING_KEYS[1:] if k in kw}
        for k in _IGNORED_KEYS:
            kw.pop(k, None)
        if kw:
            raise ValueError(f"generation_kwargs {sorted(kw)} are not supported by the jaxinfer model (allowed: "
                             "until, max_gen_toks / max_new_tokens / max_tokens, do_sample, temperature, top_p, "
                             "top_k, min_p, num_beams: 1)")
        if not do_sample or temperature == 0.0:
            return until, max_gen, GREEDY
        return until, max_gen, SamplingParams(temperature=temperature, top_p=float(settings.get("top_p", 1.0)),
                                              top_k=int(settings.get("top_k", 0) or 0),
                                              min_p=float(settings.get("min_p", 0.0)))
