"""jaxinfer: LLM inference in JAX, readable like a textbook.

The data path, one module per step:
  text -> tokens          tokenizer.py  (tiktoken)
  weights                 hub.py (fetch), gguf_io.py (read), params.py (layout), models.py (load)
  tokens -> logits        model.py      (embedding, attention blocks under lax.scan, LM head)
  KV cache                cache.py
  logits -> token         sampling.py
  the loop                generate.py   (jitted prefill, lax.scan decode)
  looking inside          probes.py (attention, darts, token counts), roofline.py (decode ceilings)
"""

from jaxinfer.cache import KVCache, bytes_per_token, init_cache
from jaxinfer.config import ModelConfig
from jaxinfer.generate import Completion, Output, Timings, generate, logits
from jaxinfer.models import Model, load
from jaxinfer.probes import attention
from jaxinfer.sampling import GREEDY, SamplingParams, sample

__all__ = ["KVCache", "bytes_per_token", "init_cache", "ModelConfig", "Completion", "Output", "Timings",
           "generate", "logits", "Model", "load", "attention", "GREEDY", "SamplingParams", "sample"]
__version__ = "0.1.0"
