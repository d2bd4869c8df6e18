"""Per-device memory of Llama 3 70B sharded over 8 devices, from shapes only (nothing allocated).

  python experiments/memory_70b.py [--dtype bfloat16] [--max-len 8192]

Prints weights and KV-cache bytes per device for each (data, model) mesh of 8 devices, using
`jaxinfer.sharding.memory_report` (jax.eval_shape on an AbstractMesh), and writes
experiments/out/memory_70b.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer.model import config  # noqa: E402
from jaxinfer import sharding as shd  # noqa: E402

GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-len", type=int, default=8192)
    args = ap.parse_args()
    cfg = config.llama3_70b(dtype=args.dtype)
    rows = []
    print(f"{cfg.name} ({cfg.n_params / 1e9:.1f} B params, {args.dtype}), {args.max_len:,}-token cache per row")
    print(f"{'mesh':>10} {'rows':>4} {'weights/dev GiB':>16} {'cache/dev GiB':>14} {'total/dev GiB':>14}  replicated")
    for data, model in [(1, 8), (2, 4), (4, 2), (8, 1)]:
        for batch in sorted({1, data, 8}):
            r = shd.memory_report(cfg, data, model, batch_size=batch, max_len=args.max_len)
            rows.append(dict(data=data, model=model, batch=batch, weights_total=r.weights_total,
                             weights_per_device=r.weights_per_device, cache_total=r.cache_total,
                             cache_per_device=r.cache_per_device, reasons=dict(r.reasons)))
            print(f"{f'{data}x{model}':>10} {batch:>4} {r.weights_per_device / GIB:>16.2f} "
                  f"{r.cache_per_device / GIB:>14.3f} {r.per_device / GIB:>14.2f}  {', '.join(r.reasons) or '-'}")
    print(f"unsharded: weights {rows[0]['weights_total'] / GIB:.1f} GiB, cache "
          f"{rows[0]['cache_total'] / GIB:.3f} GiB per row")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "memory_70b.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"model": cfg.name, "dtype": args.dtype, "max_len": args.max_len, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
