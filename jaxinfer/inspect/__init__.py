"""Looking inside a run: attention maps, sampling darts, token counts, decode ceilings.

  probes.py       attention probabilities, the sampler's distribution, uncached greedy
  activations.py  the named sites over prompts (`jaxinfer.activations`), the logit lens
  corpus.py       a corpus's activations streamed to resumable shards (`jaxinfer.write_activations`)
  attribution.py  attribution patching and exact patching sweeps (`jaxinfer.attribution_patch`,
                  `jaxinfer.patching_sweep`)
  training.py     interventions' params learned with optax (`jaxinfer.train_intervention`)
  linear_probe.py linear (logistic) probes on captured activations, trained with optax
  roofline.py     the memory-bandwidth and compute ceilings of decode
"""
