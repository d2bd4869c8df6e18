"""Backend-specific fast paths behind the model's portable functions.

Each module here is picked by backend, dtype and shape from the function the rest of the model
calls, and is tested on any machine against the portable XLA path it replaces:

  prefill_attention   a prompt chunk's attention through fused (cuDNN flash) attention on GPUs:
                      the chunk's own causal block, then its rows' earlier context read from the
                      KV pages in large blocks, merged by their log-sum-exps (`jaxinfer.model.forward`
                      picks it per layer in place of `jaxinfer.model.attention.paged_attention`).
  int8_matmul         weight-only int8 matmul as one Pallas kernel (Triton on GPUs): int8 read
                      once, dequantized in registers (`jaxinfer.model.forward.linear` picks it).

Shape letters as in `jaxinfer.model.config`.
"""
