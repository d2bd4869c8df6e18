"""Quality of each quantization mode against the float32 model, on held-out real text.

    python experiments/quality.py [--windows 4] [--window 512]

Text: experiments/data/pydoc_heldout.txt (sections of the Python reference manual from CPython's
`pydoc_data`, PSF License; regenerate with experiments/data/make_text.py). Nothing was tuned on it.
The text is cut into windows of `--window` tokens; each window is one forward pass per mode, so
positions = windows x (window - 1) next-token predictions (>= 2,000 by default).

Per mode: top-1 agreement with float32's argmax, mean KL(p_fp32 || p_mode) in nats, perplexity of
the text, and weight / KV bytes per token. Writes experiments/out/quality.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxinfer  # noqa: E402
from experiments import jsonfile  # noqa: E402
from jaxinfer.model import cache as kv  # noqa: E402
from jaxinfer.model import forward as mdl  # noqa: E402
from jaxinfer.model import params as P  # noqa: E402
from jaxinfer.model import quantize as Q  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "experiments" / "data" / "pydoc_heldout.txt"

# name -> (weight mode, KV-cache dtype)
MODES = {"float32": (None, None), "int8": ("int8", None), "int4": ("int4", None),
         "kv-int8": (None, "int8"), "int8+kv-int8": ("int8", "int8"), "int4+kv-int8": ("int4", "int8")}


def main(argv=None, model=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--out", default=str(ROOT / "experiments" / "out"))
    args = p.parse_args(argv)
    m = model or jaxinfer.load(args.model, layout="stacked")
    cfg = m.config
    ids = m.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
    W = args.window
    if len(ids) < args.windows * W:
        raise ValueError(f"{TEXT.name} has {len(ids)} tokens, fewer than {args.windows} x {W}")
    windows = np.asarray(ids[: args.windows * W], np.int32).reshape(args.windows, W)

    results, ref_logp = {}, None
    for name, (wmode, kvmode) in MODES.items():
        t0 = time.perf_counter()
        params = m.params if wmode is None else Q.quantize(m.params, cfg, wmode)
        mcfg = cfg.replace(kv_dtype=kvmode)
        # Whole window through the cache, so an int8 cache's rounding is in the logits.
        fwd = jax.jit(lambda p, t, c, mcfg=mcfg: mdl.forward(
            p, t, mdl.default_positions(*t.shape), c, mcfg)[0])
        logps = []
        for w in windows:
            cache = kv.init_cache(mcfg, 1, W)
            logits = fwd(params, jnp.asarray(w)[None], cache)[0, :-1]  # predictions for tokens 1..W-1
            logps.append(np.asarray(jax.nn.log_softmax(logits, -1)))
        logp = np.concatenate(logps)  # [P, V]
        targets = windows[:, 1:].reshape(-1)
        nll = -logp[np.arange(len(targets)), targets]
        row = {"positions": int(len(targets)), "perplexity": float(np.exp(nll.mean())),
               "weight_bytes": P.nbytes(params), "kv_bytes_per_token": kv.bytes_per_token(mcfg),
               "seconds": time.perf_counter() - t0}
        if ref_logp is None:
            ref_logp = logp
        row["top1_agreement"] = float(np.mean(logp.argmax(-1) == ref_logp.argmax(-1)))
        row["mean_kl"] = float(np.mean(np.sum(np.exp(ref_logp) * (ref_logp - logp), -1)))
        results[name] = row
        print(f"{name:>14}: top-1 {row['top1_agreement']:.4f}  KL {row['mean_kl']:.5f}  "
              f"ppl {row['perplexity']:.3f}  weights {row['weight_bytes'] / 1e6:.1f} MB  "
              f"KV {row['kv_bytes_per_token']} B/token  ({row['seconds']:.0f} s)", flush=True)

    base = results["float32"]
    print("\n| mode | top-1 vs fp32 | mean KL (nats) | perplexity | ppl ratio | weight MB | weights x | KV B/token |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['top1_agreement']:.4f} | {r['mean_kl']:.5f} | {r['perplexity']:.3f} | "
              f"{r['perplexity'] / base['perplexity']:.4f} | {r['weight_bytes'] / 1e6:.1f} | "
              f"{r['weight_bytes'] / base['weight_bytes']:.3f} | {r['kv_bytes_per_token']} |")
    out = {"experiment": "quality", "model": args.model, "text": str(TEXT.relative_to(ROOT)),
           "windows": args.windows, "window": W, "results": results}
    jsonfile.write_json(Path(args.out) / "quality.json", out)
    return out


if __name__ == "__main__":
    main()
