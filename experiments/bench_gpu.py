"""Decode at the HBM roofline: Llama 3 8B shapes with random bf16 weights on one accelerator.

    python experiments/bench_gpu.py                      # on a GPU/TPU: llama3_8b preset, bf16
    python experiments/bench_gpu.py --preset tiny        # anywhere (CI smoke test on CPU)

Weight values do not matter for speed, so the params are random (`params.init_params`), built on
the device. In the same run it measures device-to-device copy bandwidth (a jitted copy of a
large array: bytes read + bytes written over time), then decode tokens/s at batch 1 / 8 / 64 and
the % of that roofline (tokens/s x bytes read per step / tokens per step / bandwidth; bytes per
step = all weights + every row's filled KV cache), and prefill tokens/s at a 2048-token prompt.
Writes experiments/out/bench-gpu-<time>.json. Budget: well under 5 minutes on an H100/H200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

import jaxinfer  # noqa: E402
from jaxinfer.model import cache as kv  # noqa: E402
from jaxinfer.model import config as C  # noqa: E402
from experiments import common  # noqa: E402
from jaxinfer.model import params as P  # noqa: E402
from jaxinfer.model.model import Model  # noqa: E402

PRESETS = {"llama3_8b": C.llama3_8b, "tiny": C.tiny, "smollm2_135m": C.smollm2_135m}


def main(argv=None) -> dict:
    on_accel = jax.default_backend() != "cpu"
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3_8b" if on_accel else "tiny", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per row for decode")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=2048, help="prefill prompt length (batch 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--copy-gib", type=float, default=4.0 if on_accel else 0.25)
    ap.add_argument("--quick", action="store_true", help="CI smoke: batch 1,2; 8 new tokens; prefill 64")
    ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "out"))
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.new_tokens, args.prefill, args.repeats, args.prompt = "1,2", 8, 64, 2, 8
    batches = [int(b) for b in args.batches.split(",")]
    t_start = time.perf_counter()

    cfg = PRESETS[args.preset](dtype=args.dtype)
    if args.prefill + 1 > cfg.max_seq_len or args.prompt + args.new_tokens > cfg.max_seq_len:
        raise ValueError(f"--prefill {args.prefill} / --prompt + --new-tokens exceed {cfg.name}'s "
                         f"context length {cfg.max_seq_len}")
    dev = jax.devices()[0]
    print(f"{dev.platform} {dev.device_kind}: {cfg.name} {args.dtype}, {cfg.n_params / 1e9:.2f} B params",
          flush=True)
    measured = common.measure_bandwidth(int(args.copy_gib * 2**30), args.repeats, dtype="bfloat16",
                                        host_copy=False)
    bw = measured["jax_copy_Bps"]  # read + write, as vendors quote their bandwidth
    print(f"device copy bandwidth: {bw / 1e9:.1f} GB/s (read only: {measured['jax_read_Bps'] / 1e9:.1f})",
          flush=True)
    params = jax.jit(P.init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), args.dtype)
    jax.block_until_ready(params)
    model = Model(config=cfg, params=params)
    weight_bytes = P.nbytes(params)
    print(f"random weights built: {weight_bytes / 1e9:.2f} GB ({time.perf_counter() - t_start:.0f} s)", flush=True)

    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(3, cfg.vocab_size, n).tolist()
    results = {"decode": {}, "prefill": {}}
    for b in batches:
        prompts = [ids(args.prompt) for _ in range(b)]
        gen = lambda: jaxinfer.generate(model, prompts, max_new_tokens=args.new_tokens, stop_at_eos=False,
                                        chunk_size=min(32, args.new_tokens))
        first = gen()  # compiles
        tps = [gen().timings.decode_tokens_per_s for _ in range(args.repeats)]
        filled = args.prompt + args.new_tokens / 2
        step_bytes = weight_bytes + b * filled * kv.bytes_per_token(cfg)
        roof = b * bw / step_bytes
        med = float(np.median(tps))
        results["decode"][b] = {"tok_s": med, "all": tps, "roofline_tok_s": roof, "pct_roofline": 100 * med / roof,
                                "bytes_per_step": step_bytes, "compilations_first_call": first.timings.n_compilations}
        print(f"decode batch {b:3d}: {med:10.1f} tokens/s  roofline {roof:10.1f}  {100 * med / roof:5.1f}%", flush=True)
    p_ids = [ids(args.prefill)]
    jaxinfer.generate(model, p_ids, max_new_tokens=1, stop_at_eos=False)
    pts = [jaxinfer.generate(model, p_ids, max_new_tokens=1, stop_at_eos=False).timings.prefill_s
           for _ in range(args.repeats)]
    results["prefill"] = {"tokens": args.prefill, "tok_s": args.prefill / float(np.median(pts)), "s_all": pts}
    print(f"prefill {args.prefill} tokens: {results['prefill']['tok_s']:.0f} tokens/s", flush=True)

    report = {"device": f"{dev.platform} {dev.device_kind}", "preset": cfg.name, "dtype": args.dtype,
              "copy_bandwidth_GBps": bw / 1e9, "weight_bytes": weight_bytes, "prompt": args.prompt,
              "new_tokens": args.new_tokens, "results": results, "jax": jax.__version__,
              "wall_s": time.perf_counter() - t_start}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench-gpu-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {path} ({report['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
