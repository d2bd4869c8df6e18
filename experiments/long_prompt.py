"""Peak memory and time of one long prompt: prefill of ~8,000 tokens on SmolLM2.

    PYTHONPATH=. python experiments/long_prompt.py --tokens 8000

Prints one JSON line: prompt tokens, load / prefill (time to first token) / total seconds, and
peak RSS (resource.getrusage ru_maxrss) after the load and at the end. One run, not a benchmark.
"""

import argparse
import json
import resource
import time


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    args = ap.parse_args()

    import jaxinfer

    t0 = time.perf_counter()
    model = jaxinfer.load(args.model)
    load_s, rss_load = time.perf_counter() - t0, peak_rss_mb()
    sentence = model.tokenizer.encode(" The quick brown fox jumps over the lazy dog near the river bank.")
    ids = (sentence * (args.tokens // len(sentence) + 1))[: args.tokens]
    t1 = time.perf_counter()
    out = jaxinfer.generate(model, [ids], max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    print(json.dumps({"prompt_tokens": len(ids), "load_s": round(load_s, 1), "ttft_s": round(out.timings.ttft_s, 1),
                      "compile_s": round(getattr(out.timings, "compile_s", float("nan")), 1),
                      "generate_s": round(time.perf_counter() - t1, 1), "peak_rss_after_load_mb": round(rss_load),
                      "peak_rss_mb": round(peak_rss_mb()), "text": out.completions[0].text}))


if __name__ == "__main__":
    main()
