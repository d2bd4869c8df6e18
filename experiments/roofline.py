"""The decode roofline: memory bandwidth / bytes per token, and where our measured decode sits.

    python experiments/roofline.py [--batches 1,4,16]

A decode step reads every weight once per batch, so one request's tokens/s is at most
bandwidth / weight bytes. Prints that ceiling for Llama 3 8B in fp16 on an H100 and an H200
(vendor-spec bandwidths) and on this machine (bandwidth measured here, in this run), then this
machine's roofline for the loaded model with our measured batch-1 and batched decode on it, and
where batching and smaller weights (quantization) move the ceiling.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `experiments` and `jaxinfer` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from experiments.common import fmt_bytes, plt  # noqa: E402

# Vendor datasheet HBM bandwidths (not measured here): NVIDIA H100 SXM 3.35 TB/s, H200 4.8 TB/s.
VENDOR_BANDWIDTH = {"H100 SXM (spec 3.35 TB/s)": 3.35e12, "H200 (spec 4.8 TB/s)": 4.8e12}
PROMPT = "The capital of France is"


def measure_decode(m, batch: int, new_tokens: int, repeats: int) -> dict:
    """Decode tokens/s of `jaxinfer.generate` for `batch` copies of a prompt (median after a warm-up)."""
    import jaxinfer

    prompts = [PROMPT] * batch
    kw = dict(max_new_tokens=new_tokens, stop_at_eos=False, chunk_size=new_tokens - 1)
    jaxinfer.generate(m, prompts, **kw)  # compile these shapes
    runs = [jaxinfer.generate(m, prompts, **kw).timings for _ in range(repeats)]
    return {"batch": batch, "new_tokens": new_tokens, "repeats": repeats,
            "decode_tokens_per_s": statistics.median(t.decode_tokens_per_s for t in runs),
            "all_tokens_per_s": [t.decode_tokens_per_s for t in runs],
            "prompt_tokens_per_row": runs[0].prompt_tokens // batch}


def figure(result: dict):
    """The two panels (ceilings; this machine's roofline with the measured points) from the numbers."""
    from jaxinfer.inspect import roofline as rl

    md, ceilings, points = result["model"], result["ceilings_llama3_8b_fp16"], result["measured"]
    here, wb, comp = result["bandwidth"]["bandwidth_Bps"], md["weight_nbytes"], md["compute_ceiling"]
    own, kvrow, n_params = md["batch1_memory_ceiling"], md["kv_bytes_per_token"] * md["mean_context"], md["n_params"]
    batches = [q["batch"] for q in points]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.4))
    labels = [c["where"].replace(" (", "\n(") for c in ceilings] + [f"this machine\n{md['name']} {md['dtype']}"]
    vals = [c["tokens_per_s"] for c in ceilings] + [own]
    colors = ["#9ecae9"] * len(VENDOR_BANDWIDTH) + ["#4c78a8", "#f58518"]
    a0.bar(range(len(vals)), vals, color=colors)
    for i, v in enumerate(vals):
        a0.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    a0.scatter([len(vals) - 1], [points[0]["decode_tokens_per_s"]], marker="D", color="black", zorder=3,
               label=f"measured batch {points[0]['batch']}: {points[0]['decode_tokens_per_s']:.1f}")
    a0.set_xticks(range(len(vals)), labels, fontsize=7)
    a0.set_yscale("log")
    a0.set_ylabel("batch-1 decode ceiling, tokens/s (log)")
    a0.set_title("bandwidth / weight bytes (first three: Llama 3 8B fp16)", fontsize=9)
    a0.legend(fontsize=8)
    bs = np.unique(np.geomspace(1, max(64, batches[-1] * 4), 60).round().astype(int))
    mem = np.array([rl.decode_ceiling(here, wb, batch=int(b), cache_bytes_per_row=kvrow) for b in bs])
    a1.plot(bs, np.minimum(mem, comp), color="#4c78a8", lw=2, label=f"roofline {md['dtype']} (measured bandwidth, FLOP/s)")
    for (name, bits), ls in zip([("int8", 8), ("int4", 4)], ["--", ":"]):
        q = [rl.decode_ceiling(here, n_params * bits / 8, batch=int(b), cache_bytes_per_row=kvrow) for b in bs]
        a1.plot(bs, np.minimum(q, comp), color="#4c78a8", ls=ls, lw=1, label=f"{name} weights (formula)")
    a1.scatter([q["batch"] for q in points], [q["decode_tokens_per_s"] for q in points], color="#f58518", zorder=3,
               label="measured jaxinfer decode")
    for q in points:
        a1.annotate(f"{q['percent_of_roofline']:.0f}%", (q["batch"], q["decode_tokens_per_s"]), textcoords="offset points",
                    xytext=(4, -10), fontsize=8)
    a1.set_xscale("log")
    a1.set_yscale("log")
    a1.set_xlabel("batch size (rows decoded together)")
    a1.set_ylabel("decode tokens/s, all rows (log)")
    a1.set_title(f"{md['name']} on this machine: batching climbs the memory line", fontsize=9)
    a1.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    return fig


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,4,16", help="batch sizes to measure (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per decode measurement (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (default %(default)s)")
    p.add_argument("--copy-mib", type=int, default=256, help="array size for the bandwidth measurement (default %(default)s)")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.new_tokens, args.repeats, args.copy_mib = "1,2", 4, 1, 32
    batches = sorted({int(b) for b in args.batches.split(",") if b})
    if not batches or batches[0] < 1 or args.new_tokens < 2 or args.repeats < 1 or args.copy_mib < 1:
        p.error("need batches >= 1, --new-tokens >= 2, --repeats >= 1, --copy-mib >= 1")
    import jaxinfer
    from jaxinfer.model import config as C
    from jaxinfer.model import params as prm
    from jaxinfer.inspect import roofline as rl

    m = common.load_model(args, model)
    cfg = m.config
    bw = common.measure_bandwidth(args.copy_mib * 2 ** 20, repeats=max(3, args.repeats))
    flops = common.measure_matmul_flops(512 if args.smoke else 2048, repeats=max(3, args.repeats))
    here = bw["bandwidth_Bps"]
    print(f"this machine: read bandwidth {here / 1e9:.1f} GB/s (copies: numpy {bw['numpy_copy_Bps'] / 1e9:.1f}, "
          f"jax {bw['jax_copy_Bps'] / 1e9:.1f}; {fmt_bytes(bw['bytes'])} arrays), "
          f"matmul {flops / 1e9:.0f} GFLOP/s")

    # Batch-1 ceilings for Llama 3 8B in fp16.
    big = C.llama3_8b()
    big_bytes = rl.weight_bytes(big, "float16")
    ceilings = [{"where": k, "bandwidth_Bps": v, "source": "vendor spec", "model": "llama3-8b float16",
                 "weight_bytes": big_bytes, "tokens_per_s": rl.decode_ceiling(v, big_bytes)} for k, v in VENDOR_BANDWIDTH.items()]
    ceilings.append({"where": "this machine (measured)", "bandwidth_Bps": here, "source": "measured", "model": "llama3-8b float16",
                     "weight_bytes": big_bytes, "tokens_per_s": rl.decode_ceiling(here, big_bytes)})
    print(f"batch-1 decode ceiling = bandwidth / weight bytes, Llama 3 8B fp16 = {big.n_params / 1e9:.2f}B params "
          f"x 2 bytes = {big_bytes / 1e9:.2f} GB:")
    for c in ceilings:
        print(f"  {c['where']:28s} {c['bandwidth_Bps'] / 1e9:8.1f} GB/s -> {c['tokens_per_s']:8.1f} tokens/s")

    # Our model on this machine: ceiling from the bytes the params actually hold, then measured points.
    wb = prm.nbytes(m.params)
    bpt = jaxinfer.bytes_per_token(cfg)
    ctx = len(m.tokenizer.encode(PROMPT)) + args.new_tokens // 2  # mean context while decoding
    own = rl.decode_ceiling(here, wb, cache_bytes_per_row=bpt * ctx)
    comp = rl.compute_ceiling(flops, cfg.n_params)
    print(f"{cfg.name} {cfg.dtype}: weights {fmt_bytes(wb)} (formula {fmt_bytes(rl.weight_bytes(cfg))}); "
          f"batch-1 ceiling here {own:.1f} tokens/s; compute ceiling {comp:.0f} tokens/s")
    points = []
    for b in batches:
        r = measure_decode(m, b, args.new_tokens, args.repeats)
        r["memory_ceiling"] = rl.decode_ceiling(here, wb, batch=b, cache_bytes_per_row=bpt * ctx)
        r["roofline"] = min(r["memory_ceiling"], comp)
        r["percent_of_roofline"] = 100 * r["decode_tokens_per_s"] / r["roofline"]
        points.append(r)
        print(f"  batch {b:3d}: measured {r['decode_tokens_per_s']:8.1f} tokens/s, roofline {r['roofline']:8.1f} "
              f"-> {r['percent_of_roofline']:5.1f}%", flush=True)
    if len(points) > 1:
        print(f"  batching: batch {points[-1]['batch']} gives {points[-1]['decode_tokens_per_s'] / points[0]['decode_tokens_per_s']:.1f}x "
              f"the tokens/s of batch {points[0]['batch']} (one weight read serves every row)")
    quant = {name: rl.decode_ceiling(here, cfg.n_params * bits / 8, cache_bytes_per_row=bpt * ctx)
             for name, bits in [("bf16", 16), ("int8", 8), ("int4", 4)]}
    print("  smaller weights raise the batch-1 ceiling here: "
          + ", ".join(f"{k} {v:.0f} tokens/s" for k, v in quant.items()) + " (formula, ideal weight bytes)")

    result = {"bandwidth": bw, "matmul_flops_per_s": flops, "ceilings_llama3_8b_fp16": ceilings,
              "model": {"name": cfg.name, "dtype": cfg.dtype, "n_params": cfg.n_params, "weight_nbytes": wb,
                        "weight_bytes_formula": rl.weight_bytes(cfg), "kv_bytes_per_token": bpt, "mean_context": ctx,
                        "batch1_memory_ceiling": own, "compute_ceiling": comp},
              "measured": points, "quantized_batch1_ceilings": quant}
    fig = figure(result)
    common.save("roofline", fig, result, args)
    return result


if __name__ == "__main__":
    main()
