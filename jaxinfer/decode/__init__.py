"""Logits -> tokens, and the loop around them.

  sampling.py     sample(logits, keys, SamplingParams) -> tokens
  penalties.py    logit bias, repetition / frequency / presence penalties, min_tokens, ignore_eos
  constraints.py  JSON schema, regex, grammar and choice constraints (llguidance) -> token bitmasks
  bitmask.py      apply_token_bitmask(logits, bitmask): disallowed tokens get -inf on the device
  requests.py     host-side request plumbing: prompts -> ids, seeds -> keys, stop ids, result types
  generate.py     the jitted prefill and the lax.scan decode loop
  speculative.py  speculative decoding (n-gram lookup or a draft model)
"""
