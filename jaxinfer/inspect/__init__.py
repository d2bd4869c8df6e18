"""Looking inside a run: attention maps, sampling darts, token counts, decode ceilings.

  probes.py    attention probabilities, the sampler's distribution, uncached greedy
  roofline.py  the memory-bandwidth and compute ceilings of decode
"""
