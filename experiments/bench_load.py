"""Loading a Hugging Face folder at scale: seconds, GB/s and peak host memory.

    python experiments/bench_load.py [--gb 2.2] [--shard-mb 500] [--smoke]

Writes a synthetic random Llama folder (config.json, bf16 shards `model-0000k-of-0000n.safetensors`
and `model.safetensors.index.json`, as `save_pretrained` lays them out) in a temporary folder, then
loads it with `jaxinfer.load` in a fresh process and reports:
  load_s, gb_per_s           wall time of `jaxinfer.load` (files just written: warm page cache)
  peak_extra_rss_fraction    (peak RSS - RSS before load) / folder size
  transient_fraction         (peak RSS - RSS before load - bytes of the loaded params) / folder size
On a CPU backend the "device" arrays live in host memory, so the loaded bf16 params themselves are
~100% of the folder; transient_fraction is the loader's own overhead (goal < 25%). On a GPU the
params leave the host, and peak_extra_rss_fraction itself is the figure to compare with 25%.
Output: experiments/out/bench_load.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `experiments` and `jaxinfer` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from experiments import jsonfile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def llama_config(d: int, layers: int, ffn: int, vocab: int, heads: int, kv_heads: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
            "hidden_size": d, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": d // heads,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "hidden_act": "silu", "dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}}


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face names and shapes of a Llama ([out, in] for projections)."""
    D, F, V, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    H = c["head_dim"]
    N, K = c["num_attention_heads"], c["num_key_value_heads"]
    out = [("model.embed_tokens.weight", (V, D))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (D,)), (p + "self_attn.q_proj.weight", (N * H, D)),
                (p + "self_attn.k_proj.weight", (K * H, D)), (p + "self_attn.v_proj.weight", (K * H, D)),
                (p + "self_attn.o_proj.weight", (D, N * H)), (p + "post_attention_layernorm.weight", (D,)),
                (p + "mlp.gate_proj.weight", (F, D)), (p + "mlp.up_proj.weight", (F, D)),
                (p + "mlp.down_proj.weight", (D, F))]
    return out + [("model.norm.weight", (D,)), ("lm_head.weight", (V, D))]


def write_folder(folder: Path, cfg: dict, shard_bytes: int, seed: int = 0) -> int:
    """Write config.json + bf16 shards + index; returns the bytes of tensor data. One shard in memory."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    rng = np.random.default_rng(seed)
    block = (rng.standard_normal(1 << 20) * 0.02).astype(ml_dtypes.bfloat16)  # tiled: fast to make

    def tensor(shape):
        n = int(np.prod(shape))
        return np.resize(np.roll(block, int(rng.integers(1 << 20))), n).reshape(shape)

    shards, cur, size = [], {}, 0
    for name, shape in tensor_shapes(cfg):
        nbytes = 2 * int(np.prod(shape))
        if cur and size + nbytes > shard_bytes:
            shards.append(list(cur))
            cur, size = {}, 0
        cur[name] = shape
        size += nbytes
    shards.append(list(cur))
    shapes = dict(tensor_shapes(cfg))
    weight_map, total = {}, 0
    for k, names in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        data = {n: (np.ones(shapes[n], ml_dtypes.bfloat16) if n.endswith("norm.weight") else tensor(shapes[n]))
                for n in names}
        save_file(data, str(folder / fname), metadata={"format": "pt"})
        total += sum(a.nbytes for a in data.values())
        weight_map.update({n: fname for n in names})
        del data
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(folder: str) -> dict:
    """Run in a fresh process: load the folder, measure time and RSS, check a few values."""
    import jax

    import jaxinfer
    from jaxinfer.weights import safetensors_io as st

    jax.numpy.zeros(1).block_until_ready()  # backend up before the baseline
    base = _rss()
    t0 = time.perf_counter()
    m = jaxinfer.load(folder, layout="stacked")  # the layout as stored: no conversion copy
    jax.block_until_ready(m.params)
    load_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    idx = st.index(folder)
    L = m.config.n_layers
    wq = np.asarray(m.params["layers"]["wq"][L - 1])  # [D, N, H]
    stored = st.read(idx[f"model.layers.{L - 1}.self_attn.q_proj.weight"])  # [N*H, D]
    ok = np.array_equal(wq.reshape(wq.shape[0], -1), stored.T)
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(m.params))
    return {"load_s": load_s, "rss_before": base, "peak_rss": peak, "params_bytes": params_bytes,
            "param_dtype": m.config.dtype, "values_match_file": bool(ok), "backend": jax.default_backend(),
            "n_params": m.config.n_params}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=2.2, help="approximate folder size in GB (default 2.2)")
    p.add_argument("--shard-mb", type=int, default=500)
    p.add_argument("--out", default=str(ROOT / "experiments" / "out"))
    p.add_argument("--smoke", action="store_true", help="a tiny folder (seconds), for the test")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return {}
    if args.smoke:
        cfg, shard = llama_config(d=128, layers=4, ffn=256, vocab=1024, heads=4, kv_heads=2), 150_000
    else:  # d 2048, ffn 5632, vocab 32000, 16 heads / 8 kv: 47M per layer, 131M for embed + head
        layers = max(1, round((args.gb * 1e9 / 2 - 2 * 32000 * 2048) / 47.2e6))
        cfg, shard = llama_config(d=2048, layers=layers, ffn=5632, vocab=32000, heads=16, kv_heads=8), args.shard_mb << 20
    with tempfile.TemporaryDirectory(prefix="bench_load_") as tmp:
        folder = Path(tmp) / "model"
        t0 = time.perf_counter()
        data_bytes = write_folder(folder, cfg, shard)
        write_s = time.perf_counter() - t0
        folder_bytes = sum(f.stat().st_size for f in folder.iterdir())
        n_shards = len(list(folder.glob("model-*.safetensors")))
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(folder)],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if proc.returncode:
            raise RuntimeError(f"load process failed:\n{proc.stderr[-4000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
    extra = r["peak_rss"] - r["rss_before"]
    res = {"experiment": "bench_load", "smoke": args.smoke, "folder_bytes": folder_bytes,
           "tensor_bytes": data_bytes, "n_shards": n_shards, "layers": cfg["num_hidden_layers"],
           "write_s": write_s, **r, "gb_per_s": folder_bytes / r["load_s"] / 1e9,
           "peak_extra_rss_bytes": extra, "peak_extra_rss_fraction": extra / folder_bytes,
           "transient_fraction": (extra - r["params_bytes"]) / folder_bytes,
           "load_average_1m": os.getloadavg()[0], "cpu_count": os.cpu_count(),
           "note": "page cache warm (files just written); CPU backend: params live in host RSS"}
    jsonfile.write_json(Path(args.out) / "bench_load.json", res, indent=2)
    print(f"{folder_bytes / 1e9:.2f} GB in {n_shards} shards ({r['param_dtype']}): load {r['load_s']:.1f} s "
          f"= {res['gb_per_s']:.2f} GB/s; peak extra RSS {extra / 1e9:.2f} GB = "
          f"{res['peak_extra_rss_fraction']:.0%} of the folder, of which loaded params "
          f"{r['params_bytes'] / 1e9:.2f} GB; transient {res['transient_fraction']:.1%}; "
          f"values match the file: {r['values_match_file']}")
    return res


if __name__ == "__main__":
    main()
