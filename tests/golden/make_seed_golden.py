"""Golden sampled tokens: what `generate` draws for fixed seeds, so published seeds keep reproducing.

Recorded once with the jaxinfer commit named in the output file (before the decode core was
unified); tests/test_generate.py checks that today's `generate` draws the same tokens.
Run: python tests/golden/make_seed_golden.py  (writes tests/golden/seed_golden.json)
"""
import json, os, subprocess

import jaxinfer
from jaxinfer import SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
SETTINGS = [dict(temperature=0.8), dict(temperature=1.0, top_k=40), dict(temperature=0.7, top_p=0.9),
            dict(temperature=1.2, min_p=0.05), dict(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02)]


def main():
    m = jaxinfer.load("smollm2-135m", layout="stacked")
    rows = []
    for s in SETTINGS:
        out = jaxinfer.generate(m, PROMPTS, seed=[11, 22, 33], max_new_tokens=16, sampling=SamplingParams(**s),
                                stop_at_eos=False)
        rows.append({"sampling": s, "seeds": [11, 22, 33], "tokens": [c.token_ids for c in out.completions]})
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    with open(os.path.join(HERE, "seed_golden.json"), "w") as f:
        json.dump({"commit": commit, "model": "smollm2-135m", "prompts": PROMPTS, "max_new_tokens": 16,
                   "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
