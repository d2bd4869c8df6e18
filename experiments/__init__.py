"""Runners that answer the questions users ask of jaxinfer, each `python -m experiments.NAME`.

    walkthrough   the teaching figures: tokens, attention, sampling, kv_cache, roofline
    decode        decode tokens/s against the bandwidth roofline (batches, layouts, quantization,
                  peers; `--against TREE_OR_COMMIT` for two trees side by side)
    prefill       long prompts: time to first token, memory, chunk sizes (`--peer llamacpp`)
    serving       the Engine against static batches, Poisson arrivals, HTTP load, llama-server
    speculative   speculative decoding against plain decoding (and distilling a draft)
    structured    constrained JSON: validity and what the constraint costs
    quality       quantization quality, lm-evaluation-harness three ways, parity checks
    weights       loading and converting weights: seconds, GB/s, memory
    devices       many devices: memory of 70B-class shapes per device, decode on fake meshes
    profile       where a step's time goes, per named stage of the data path
    device_check  one prepared run on a lent GPU: correctness and speed against the roofline

Each has `main(argv=None) -> dict`, writes its JSON (and PNG) to --out (experiments/out/) and a
--smoke mode the suite runs; shared code: `_common`, `_measure`, `_serve`, `_peer` (llama.cpp).
"""
