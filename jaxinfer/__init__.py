"""jaxinfer: LLM inference in JAX, readable like a textbook.

The folders follow the data path a prompt takes (jaxinfer/ARCHITECTURE.md has the whole map):
  text/      text -> tokens             tokenizer.py (tiktoken), spm.py, chat.py, stream.py, tool_calls.py
  weights/   files -> a Model           hub.py (fetch), gguf.py, hf.py, checkpoint.py, load.py
  model/     tokens -> logits           config.py, params.py, model.py, forward.py, attention.py,
                                        cache.py (paged KV cache), layout.py, quantize.py, rope.py
  decode/    logits -> tokens, looped   sampling.py, penalties.py, constraints.py, bitmask.py,
                                        core.py (the one decode core), inputs.py, outputs.py,
                                        generate.py, speculative.py
  serve/     many requests at once      engine.py, runner.py, live.py, scheduler.py, pages.py,
                                        request.py, http_api.py (OpenAI's HTTP API)
  inspect/   looking inside             probes.py (attention, darts), roofline.py (ceilings),
                                        activations.py (sites, logit lens), corpus.py (activation shards),
                                        attribution.py (attribution patching, patching sweeps),
                                        training.py (interventions learned with optax), linear_probe.py
  sae/       sparse autoencoders        formats.py (SAELens, Gemma Scope), model.py (encode, decode), features.py,
                                        steer.py (sae_add, sae_clamp), train.py (optax, orbax)
  eval/      scoring and benchmarks     scoring.py (score: batched loglikelihoods), harness.py (lm-eval),
                                        rollouts.py (rollout, teacher_forced_logprobs: RL)
  lora/      LoRA adapters              read / attach PEFT folders, train with optax, save_peft
  sharding.py (many devices), compile_cache.py (persistent XLA cache), cli.py (the command line),
  functional.py (the forward as a differentiable function: jax.grad through a run)
"""

from jaxinfer.decode import constraints, speculative
from jaxinfer.decode.generate import generate, logits, routing
from jaxinfer.decode.outputs import Completion, Output, Timings
from jaxinfer.decode.sampling import GREEDY, SamplingParams, sample
from jaxinfer.eval.rollouts import Rollouts, rollout, teacher_forced_logprobs
from jaxinfer.eval.scoring import Score, score
from jaxinfer.inspect.probes import attention
from jaxinfer.inspect.activations import LogitLens, activations, logit_lens
from jaxinfer.inspect.attribution import attribution_patch, patching_sweep
from jaxinfer.inspect.corpus import write_activations
from jaxinfer.inspect.training import train_intervention
from jaxinfer.model import interventions, layout, quantize
from jaxinfer.model.cache import KVCache, bytes_per_token, init_cache
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.model import Model
from jaxinfer.model.sites import SITES, Capture
from jaxinfer.weights.load import load
from jaxinfer.weights.load_tokenizer import load_tokenizer
from jaxinfer import functional, lora, sae, sharding

__all__ = ["KVCache", "bytes_per_token", "init_cache", "ModelConfig", "Completion", "Output", "Timings",
           "generate", "logits", "routing", "score", "Score", "rollout", "Rollouts", "teacher_forced_logprobs", "Model",
           "load", "load_tokenizer", "attention", "GREEDY",
           "SamplingParams", "sample", "speculative", "sharding", "quantize", "layout", "constraints",
           "activations", "logit_lens", "LogitLens", "write_activations", "interventions", "Capture", "SITES", "lora",
           "functional", "attribution_patch", "patching_sweep", "train_intervention", "sae"]
__version__ = "0.1.0"
