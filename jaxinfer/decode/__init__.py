"""Logits -> tokens, and the loop around them.

  sampling.py     sample(logits, keys, SamplingParams | RowParams) -> tokens: the one sampler
  penalties.py    logit bias, repetition / frequency / presence penalties, min_tokens, ignore_eos
  constraints.py  JSON schema, regex, grammar, choice and tool-call constraints (llguidance) -> token bitmasks
  bitmask.py      apply_token_bitmask(logits, bitmask): disallowed tokens get -inf on the device
  core.py         the one decode core: the jitted prefill, the lax.scan decode and the mixed step (new
                  prompts' chunks beside a decode step) over the paged cache
  inputs.py       host-side inputs: prompts -> ids, seeds -> keys, stop ids, every argument checked
  outputs.py      Completion, Output, Timings
  generate.py     `generate` and `logits`: a closed batch on the core
  speculative.py  speculative decoding (n-gram lookup or a draft model) as a step function of the core
"""
