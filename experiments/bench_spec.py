"""Speed at batch 1: speculative decoding vs plain decoding, and quantized vs float32 weights.

    python experiments/bench_spec.py [--tokens 96] [--repeats 3] [--part spec,quant]

spec:  greedy decode tokens/s of plain `jaxinfer.generate` and of `speculative.generate` with
       prompt lookup and with a truncated-target draft, on (i) a code-editing prompt (the answer
       copies most of the prompt, where lookup shines) and (ii) open text. Greedy, so every
       method produces the same tokens (checked here), and the ratio is pure speed.
quant: plain decode tokens/s with float32, int8 and int4 weights (and the int8 KV cache), with
       the weight bytes each decode step reads.
Each configuration is compiled first (a warm-up call), then the repeats run interleaved
(A B C A B C ...) so load on this shared machine hits all of them alike; medians are reported.
Writes experiments/out/bench_spec.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxinfer  # noqa: E402
from jaxinfer.model import cache as kv  # noqa: E402
from jaxinfer.model import params as P  # noqa: E402
from jaxinfer.model import quantize as Q  # noqa: E402
from jaxinfer.decode import speculative as spec  # noqa: E402
from experiments import jsonfile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CODE_PROMPT = '''<|im_start|>user
Rename the function `compute_stats` to `summarize` and keep everything else the same. Return the whole code.

def compute_stats(values):
    """Return the mean, minimum and maximum of a list of numbers."""
    if not values:
        raise ValueError("values is empty")
    total = 0.0
    lowest = values[0]
    highest = values[0]
    for v in values:
        total += v
        if v < lowest:
            lowest = v
        if v > highest:
            highest = v
    return total / len(values), lowest, highest
<|im_end|>
<|im_start|>assistant
'''
OPEN_PROMPT = "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"


def _median_tps(fns: dict, repeats: int) -> dict:
    """Interleaved repeats of each fn() -> Output; median decode tokens/s and the last output."""
    outs = {name: fn() for name, fn in fns.items()}  # warm-up: compiles
    tps = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            o = fn()
            tps[name].append(o.timings.decode_tokens_per_s)
            outs[name] = o
    return {name: (statistics.median(v), outs[name]) for name, v in tps.items()}


def bench_spec(m, args) -> dict:
    drafts = {}
    if "first" in args.drafts:
        drafts[f"draft-first{args.draft_layers}"] = spec.truncated_draft(m, args.draft_layers)
    distilled = Path(args.draft)
    if "distilled" not in args.drafts:
        pass
    elif distilled.exists():
        drafts[f"draft-distilled{spec.load_draft(str(distilled)).config.n_layers}"] = spec.load_draft(str(distilled))
    else:
        print(f"no distilled draft at {distilled} (run experiments/distill_draft.py); skipping it")
    res = {}
    for pname, prompt in (("code-edit", CODE_PROMPT), ("open-text", OPEN_PROMPT)):
        kw = dict(max_new_tokens=args.tokens, stop_at_eos=False, allow_special=True)  # ChatML prompts
        fns = {"plain": lambda: jaxinfer.generate(m, prompt, chunk_size=args.tokens, **kw),
               "lookup": lambda: spec.generate(m, prompt, method="lookup", k=args.k, rounds_per_chunk=256, **kw)}
        for dname, d in drafts.items():
            fns[dname] = lambda d=d: spec.generate(m, prompt, method="draft", draft=d, k=args.k,
                                                   rounds_per_chunk=256, **kw)
        r = _median_tps(fns, args.repeats)
        base_tps, base_out = r["plain"]
        rows = {}
        for name, (tps, out) in r.items():
            same = out.completions[0].token_ids == base_out.completions[0].token_ids
            st = getattr(out, "stats", None)
            rows[name] = {"tokens_per_s": tps, "speedup": tps / base_tps, "same_tokens_as_plain": same,
                          "acceptance": st.acceptance_rate if st else None,
                          "tokens_per_target_call": st.tokens_per_call if st else 1.0}
            print(f"{pname:>9} {name:>16}: {tps:6.1f} tok/s  x{tps / base_tps:.2f}  "
                  + (f"acceptance {st.acceptance_rate:.2f}, {st.tokens_per_call:.2f} tok/call" if st else "")
                  + ("" if same else "  OUTPUT DIFFERS"), flush=True)
        res[pname] = rows
    return res


def bench_quant(m, args) -> dict:
    cfg = m.config
    models = {"float32": m,
              "int8": dataclasses.replace(m, params=Q.quantize(m.params, cfg, "int8")),
              "int4": dataclasses.replace(m, params=Q.quantize(m.params, cfg, "int4"))}
    models["int8+kv-int8"] = dataclasses.replace(models["int8"], config=cfg.replace(kv_dtype="int8"))
    models = {k: v for k, v in models.items() if k in args.quant_modes.split(",")}
    prompt = "The history of the printing press"
    fns = {name: (lambda mm=mm: jaxinfer.generate(mm, prompt, max_new_tokens=args.tokens, stop_at_eos=False,
                                                  chunk_size=args.tokens)) for name, mm in models.items()}
    r = _median_tps(fns, args.repeats)
    base = r["float32"][0]
    res = {}
    for name, (tps, out) in r.items():
        wb = P.nbytes(models[name].params)
        res[name] = {"tokens_per_s": tps, "ratio_vs_float32": tps / base, "weight_bytes": wb,
                     "kv_bytes_per_token": kv.bytes_per_token(models[name].config),
                     "text": out.texts[0][:60]}
        print(f"{name:>13}: {tps:6.1f} tok/s  x{tps / base:.2f}  weights {wb / 1e6:.1f} MB  "
              f"KV {res[name]['kv_bytes_per_token']} B/token", flush=True)
    return res


def main(argv=None, model=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--draft-layers", type=int, default=4, help="layers of the truncated-target draft")
    p.add_argument("--draft", default=str(ROOT / "checkpoints" / "smollm2-135m-draft-4l"),
                   help="distilled draft checkpoint (experiments/distill_draft.py)")
    p.add_argument("--part", default="spec,quant")
    p.add_argument("--drafts", default="first,distilled", help="draft models to include (comma list)")
    p.add_argument("--quant-modes", default="float32,int8,int4,int8+kv-int8")
    p.add_argument("--out", default=str(ROOT / "experiments" / "out"))
    args = p.parse_args(argv)
    m = model or jaxinfer.load(args.model, layout="stacked")
    out = {"experiment": "bench_spec", "model": args.model, "tokens": args.tokens, "repeats": args.repeats}
    t0 = time.perf_counter()
    if "spec" in args.part:
        out["speculative"] = bench_spec(m, args)
    if "quant" in args.part:
        out["quant"] = bench_quant(m, args)
    out["seconds"] = time.perf_counter() - t0
    jsonfile.write_json(Path(args.out) / "bench_spec.json", out)
    return out


if __name__ == "__main__":
    main()
