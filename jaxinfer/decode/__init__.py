"""Logits -> tokens, and the loop around them.

  sampling.py     sample(logits, keys, SamplingParams) -> tokens
  requests.py     host-side request plumbing: prompts -> ids, seeds -> keys, stop ids, result types
  generate.py     the jitted prefill and the lax.scan decode loop
  speculative.py  speculative decoding (n-gram lookup or a draft model)
"""
