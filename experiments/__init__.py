"""Runners that answer the questions users ask of jaxinfer, each `python -m experiments.NAME`.

    walkthrough   the teaching figures: tokens, attention, sampling, kv_cache, roofline
    decode        decode tokens/s against the bandwidth roofline (batches, layouts, quantization,
                  peers; `--against TREE_OR_COMMIT` for two trees side by side)
    prefill       long prompts: time to first token, memory, chunk sizes (`--peer llamacpp`)
    serving       the Engine against static batches, Poisson arrivals, HTTP load, llama-server
    startup       start-up seconds and memory of `jaxinfer serve` / `generate`, the Engine's host loop
    speculative   speculative decoding against plain decoding (and distilling a draft)
    structured    constrained JSON: validity and what the constraint costs
    quality       quantization quality, lm-evaluation-harness three ways, parity checks
    weights       loading and converting weights: seconds, GB/s, memory
    devices       many devices: memory of 70B-class shapes per device, decode on fake meshes
    moe           mixture-of-experts kernels, decode and prefill against the active-bytes roofline
    steering      a steering vector's effect by scale, and what steering and capture cost
    logit_lens    what each layer would predict, read through the final norm and the unembedding
    profile       where a step's time goes, per named stage of the data path
    device_check  one prepared run on a lent GPU: correctness and speed against the roofline

Each has `main(argv=None) -> dict`, writes its JSON (and PNG) to --out (experiments/out/) and a
--smoke mode the suite runs. Shared code: `_common` (arguments, output, fresh processes, memory),
`_measure` (timing, bandwidth, rooflines), `_serve` (workloads, the Engine loop, HTTP clients,
server processes), `_peer` (llama.cpp).
"""
