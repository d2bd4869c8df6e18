"""How long does loading weights take, and how much memory: a Hugging Face folder, a checkpoint, a GGUF?

    python -m experiments.weights [--gb 2.2] [--shard-mb 500]    # a synthetic sharded Llama folder
    python -m experiments.weights --convert [--models gemma3-270m smollm2-135m]

load (default): a random bf16 Llama folder of about --gb GB in `save_pretrained`'s layout (shards
and their index), loaded by `jaxinfer.load` in a fresh process: seconds, GB/s (page cache warm),
peak extra RSS and the loader's transient overhead (peak RSS - RSS before - the loaded params),
each over the folder size (goal < 25%); values checked against the file. --convert: per model and
dtype `checkpoint.convert`, its size, `jaxinfer.load` from the checkpoint against from the source
(medians of --repeats) and the max |logit difference| (0 in float32). Writes weights.json
(weights_convert.json).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

import jaxinfer
from experiments import _common
from experiments._common import ROOT
from jaxinfer.weights import checkpoint, hub
from jaxinfer.weights import safetensors_io as st


def llama_config(d: int, layers: int, ffn: int, vocab: int, heads: int, kv_heads: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": d,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": d // heads, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face names and shapes of a Llama ([out, in] for projections)."""
    D, F, V, H = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    N, K = c["num_attention_heads"], c["num_key_value_heads"]
    out = [("model.embed_tokens.weight", (V, D))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (D,)), (p + "self_attn.q_proj.weight", (N * H, D)),
                (p + "self_attn.k_proj.weight", (K * H, D)), (p + "self_attn.v_proj.weight", (K * H, D)),
                (p + "self_attn.o_proj.weight", (D, N * H)), (p + "post_attention_layernorm.weight", (D,)),
                (p + "mlp.gate_proj.weight", (F, D)), (p + "mlp.up_proj.weight", (F, D)), (p + "mlp.down_proj.weight", (D, F))]
    return out + [("model.norm.weight", (D,)), ("lm_head.weight", (V, D))]


def write_folder(folder: Path, cfg: dict, shard_bytes: int, seed: int = 0) -> int:
    """config.json + bf16 shards + their index (one shard in memory at a time): the tensor bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    rng = np.random.default_rng(seed)
    block = (rng.standard_normal(1 << 20) * 0.02).astype(ml_dtypes.bfloat16)  # tiled: fast to make
    shapes, shards, cur, size = dict(tensor_shapes(cfg)), [], [], 0
    for name, shape in tensor_shapes(cfg):
        nbytes = 2 * int(np.prod(shape))
        if cur and size + nbytes > shard_bytes:
            shards, cur, size = shards + [cur], [], 0
        cur, size = cur + [name], size + nbytes
    shards.append(cur)
    weight_map, total = {}, 0
    for k, names in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        data = {n: np.ones(shapes[n], ml_dtypes.bfloat16) if n.endswith("norm.weight") else
                np.resize(np.roll(block, int(rng.integers(1 << 20))), int(np.prod(shapes[n]))).reshape(shapes[n])
                for n in names}
        save_file(data, str(folder / fname), metadata={"format": "pt"})
        total += sum(a.nbytes for a in data.values())
        weight_map.update(dict.fromkeys(names, fname))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def child(folder: str) -> dict:
    """In a fresh process: load the folder, time it, its RSS, and a few values against the file."""
    jax.numpy.zeros(1).block_until_ready()  # the backend up before the baseline
    base = _common.rss_bytes()
    t0 = time.perf_counter()
    m = jaxinfer.load(folder, layout="stacked")  # the layout as stored: no conversion copy
    jax.block_until_ready(m.params)
    load_s = time.perf_counter() - t0
    L = m.config.n_layers
    wq = np.asarray(m.params["layers"]["wq"][L - 1])  # [D, N, H]
    stored = st.read(st.index(folder)[f"model.layers.{L - 1}.self_attn.q_proj.weight"])  # [N*H, D]
    return {"load_s": load_s, "rss_before": base, "peak_rss": _common.max_rss_bytes(),
            "params_bytes": sum(x.nbytes for x in jax.tree.leaves(m.params)), "param_dtype": m.config.dtype,
            "values_match_file": bool(np.array_equal(wq.reshape(wq.shape[0], -1), stored.T)),
            "n_params": m.config.n_params}


def load_folder(args) -> dict:
    if args.smoke:
        cfg, shard = llama_config(d=128, layers=4, ffn=256, vocab=1024, heads=4, kv_heads=2), 150_000
    else:  # d 2048, ffn 5632, vocab 32000, 16 heads / 8 kv: 47M per layer, 131M for embed + head
        layers = max(1, round((args.gb * 1e9 / 2 - 2 * 32000 * 2048) / 47.2e6))
        cfg, shard = llama_config(d=2048, layers=layers, ffn=5632, vocab=32000, heads=16, kv_heads=8), args.shard_mb << 20
    with tempfile.TemporaryDirectory(prefix="weights_") as tmp:
        folder = Path(tmp) / "model"
        t0 = time.perf_counter()
        data_bytes = write_folder(folder, cfg, shard)
        write_s = time.perf_counter() - t0
        folder_bytes = sum(f.stat().st_size for f in folder.iterdir())
        n_shards = len(list(folder.glob("model-*.safetensors")))
        r = _common.run_json([sys.executable, "-m", "experiments.weights", "--child", str(folder)])
    extra = r["peak_rss"] - r["rss_before"]
    res = {"folder_bytes": folder_bytes, "tensor_bytes": data_bytes, "n_shards": n_shards,
           "layers": cfg["num_hidden_layers"], "write_s": write_s, **r, "gb_per_s": folder_bytes / r["load_s"] / 1e9,
           "peak_extra_rss_fraction": extra / folder_bytes,
           "transient_fraction": (extra - r["params_bytes"]) / folder_bytes}
    print(f"{folder_bytes / 1e9:.2f} GB in {n_shards} shards ({r['param_dtype']}): load {r['load_s']:.1f} s = "
          f"{res['gb_per_s']:.2f} GB/s; peak extra RSS {res['peak_extra_rss_fraction']:.0%} of the folder, transient "
          f"{res['transient_fraction']:.1%}; values match the file: {r['values_match_file']}")
    return res


def convert(args) -> dict:
    def timed(fn):
        t = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t

    rows = []
    for name in args.models:
        src = str(hub.fetch(name)) if name in hub.KNOWN_MODELS else name
        probe = jaxinfer.load(src, layout="stacked")
        ids = probe.tokenizer.encode("The capital of France is") if probe.tokenizer else [1, 5, 9, 13, 17]
        for dtype in args.dtypes:
            with tempfile.TemporaryDirectory(prefix="ckpt_") as tmp:
                out = os.path.join(tmp, "ckpt")
                t0 = time.perf_counter()
                res = checkpoint.convert(src, out, dtype=dtype)
                t_convert = time.perf_counter() - t0
                load = {k: median(timed(lambda p=p, dt=dtype: jaxinfer.load(p, dtype=dt, layout="stacked"))[1]
                                  for _ in range(args.repeats)) for k, p in (("ckpt", out), ("source", src))}
                a, b = (np.asarray(jaxinfer.logits(jaxinfer.load(p, dtype=dtype, layout="stacked"), ids))
                        for p in (out, src))
            rows.append({"model": name, "dtype": dtype, "params": res.n_params, "convert_s": t_convert,
                         "size_mb": res.bytes_on_disk / 1e6, "load_ckpt_median_s": load["ckpt"],
                         "load_source_median_s": load["source"], "load_ratio_source_over_ckpt": load["source"] / load["ckpt"],
                         "max_logit_diff_ckpt_vs_source": float(np.abs(a - b).max())})
            print(rows[-1], flush=True)
    return {"rows": rows}


def main(argv=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--gb", type=float, default=2.2, help="load: approximate folder size in GB")
    p.add_argument("--shard-mb", type=int, default=500, help="load: shard size")
    p.add_argument("--convert", action="store_true", help="checkpoints: convert, then load against the source")
    p.add_argument("--models", nargs="+", default=["gemma3-270m", "smollm2-135m"], help="convert: names or paths")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="convert: stored dtypes")
    p.add_argument("--repeats", type=int, default=3, help="convert: loads timed (medians)")
    p.add_argument("--child", help="(internal) load this folder and print the measurement")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return {}
    if args.convert:
        if args.smoke:
            args.models, args.dtypes, args.repeats = [str(ROOT / "tests" / "golden" / "tiny_hf" / "llama")], ["float32"], 1
        result = convert(args)
        _common.save("weights_convert", result, args)
    else:
        result = load_folder(args)
        _common.save("weights", result, args)
    return result


if __name__ == "__main__":
    main()
