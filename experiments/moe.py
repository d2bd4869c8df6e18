"""Mixture-of-experts decode and prefill against the roofline of the bytes each token actually reads.

    python -m experiments.moe                  # --layers 4: ~13 GB of float32 weights, ~15 min; run it alone
    python -m experiments.moe --only kernels   # one layer's experts through each kernel
    python -m experiments.moe --smoke          # tiny shapes, seconds (tests/test_moe.py)

A random-weight model of Qwen3-30B-A3B's layer shapes (--layers of its 48) beside its dense twin:
the same attention and head, one MLP of width top_k x expert width, so a token reads the same bytes
in both. kernels: one layer's experts for 1, 8, 32 and 512 tokens through the "blocks" kernel at
its own and at fixed block sizes, a gather of the chosen experts then a batched matmul, and
`ragged_dot`; ms per call and GB/s of the distinct chosen experts' bytes. decode: tokens/s at
--batches against bandwidth x rows / (bytes read per step + rows x KV bytes per row), where a step
reads of each layer the union of the experts its rows chose (`generate(return_routing=True)`).
prefill: one --prefill-token prompt, tokens/s and GFLOP/s of the active parameters. Method and
latest figures: docs/moe.md. Writes <out>/moe.json.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from experiments import _common, _measure
from jaxinfer.inspect import roofline
from jaxinfer.model import config as C
from jaxinfer.model import moe
from jaxinfer.model.cache import bytes_per_token
from jaxinfer.model.model import Model
from jaxinfer.model.params import init_params

SECTIONS = ("kernels", "decode", "prefill")


def _configs(args):
    """(MoE config, its dense twin): same attention and head, one MLP of width k x Fe."""
    if args.smoke:
        cfg = C.tiny_moe(moe=C.MoEConfig(n_experts=8, top_k=2, expert_ffn_dim=32, norm_top_k=True), max_seq_len=1024)
    else:
        cfg = C.qwen3_30b_a3b(n_layers=args.layers, max_seq_len=4096)
    cfg = cfg.replace(dtype=args.dtype, layout="per_layer")
    return cfg, cfg.replace(name=cfg.name + "-dense-twin", moe=None, ffn_dim=cfg.moe.top_k * cfg.moe.expert_ffn_dim)


def _models(moe_cfg, dense_cfg) -> dict:
    """Random params in the per_layer layout; the twin shares the MoE model's embedding and head."""
    moe_p = init_params(moe_cfg, jax.random.key(0))
    dense_p = init_params(dense_cfg.replace(vocab_size=1), jax.random.key(1))  # its own layers only
    dense_p = dict(dense_p, embed=moe_p["embed"], lm_head=moe_p["lm_head"])
    return {"moe": Model(config=moe_cfg, params=moe_p), "dense": Model(config=dense_cfg, params=dense_p)}


# Kernels --------------------------------------------------------------------------------------

def _gather_experts(x, routing, w_gate_up, w_down):
    """The chosen experts' weights gathered per slot (`jnp.take`), then one batched matmul each."""
    N, k = routing.ids.shape
    flat = routing.ids.reshape(-1)
    h = jnp.einsum("QD,QOD->QO", jnp.repeat(x, k, axis=0), jnp.take(w_gate_up, flat, axis=0))
    g, u = jnp.split(h, 2, axis=-1)
    y = jnp.einsum("QF,QDF->QD", jax.nn.silu(g) * u, jnp.take(w_down, flat, axis=0))
    return jnp.einsum("NkD,Nk->ND", y.reshape(N, k, -1), routing.weights)


def kernels(cfg, bw: float, args) -> list[dict]:
    """One layer's experts through each kernel at several token counts: ms per call, GB/s of the
    distinct chosen experts' bytes, and the largest difference from the first kernel's output."""
    m, D = cfg.moe, cfg.d_model
    X, Fe, k = m.n_experts, m.expert_ffn_dim, m.top_k
    key = jax.random.key(2)
    w_gu = (jax.random.normal(key, (X, 2 * Fe, D), jnp.float32) / np.sqrt(D)).astype(cfg.dtype)
    w_d = (jax.random.normal(jax.random.fold_in(key, 1), (X, D, Fe), jnp.float32) / np.sqrt(Fe)).astype(cfg.dtype)
    router = jax.random.normal(jax.random.fold_in(key, 2), (X, D), jnp.float32) / np.sqrt(D)
    expert_bytes = (w_gu.nbytes + w_d.nbytes) / X
    rows = []
    for n in ((1, 8) if args.smoke else (1, 8, 32, 512)):
        x = jax.random.normal(jax.random.fold_in(key, 100 + n), (n, D), jnp.float32).astype(cfg.dtype)
        r = moe.route(x, router, None, m)
        union = len(np.unique(np.asarray(r.ids)))
        rule = moe.block_rows(n * k, X)
        # every arm takes the weights as arguments: a jitted closure would hold a copy as constants
        arms = {f"blocks (rule: {rule} rows)": lambda x, r, wg, wd: moe.experts(x, r, wg, wd, "blocks")}
        for b in (1, 4, 16, 32, 64):  # other block sizes, up to 1024 blocks a call
            if b != rule and n * k <= 1024 * b:
                arms[f"blocks {b} rows"] = lambda x, r, wg, wd, b=b: moe.experts(x, r, wg, wd, "blocks", block=b)
        if n * k <= 64:  # the gathered weights are a copy: 64 slots of Qwen3-30B-A3B are 1.2 GB
            arms["gather + batched matmul"] = _gather_experts
        if n == 1:  # dense over all experts: 128 x the work
            arms["ragged_dot (dense on CPU)"] = lambda x, r, wg, wd: moe.experts(x, r, wg, wd, "ragged")
        want = None
        for name, fn in arms.items():
            f = jax.jit(fn)
            y = f(x, r, w_gu, w_d).block_until_ready()
            want = y if want is None else want
            reps = 1 if name.startswith("ragged") and not args.smoke else args.repeats
            t = _measure.median_seconds(lambda: f(x, r, w_gu, w_d).block_until_ready(), reps)
            read_Bps = union * expert_bytes / t
            rows.append({"tokens": n, "slots": n * k, "distinct_experts": union, "kernel": name, "ms": t * 1e3,
                         "GBps_of_distinct_experts": read_Bps / 1e9, "fraction_of_bandwidth": read_Bps / bw,
                         "max_abs_diff_vs_first": float(jnp.max(jnp.abs(y - want)))})
            print(f"  {n:4d} tokens {union:4d} experts  {name:28s} {t * 1e3:9.2f} ms  {read_Bps / 1e9:6.1f} GB/s "
                  f"({read_Bps / bw:.0%} of bandwidth)", flush=True)
    return rows


# Decode and prefill --------------------------------------------------------------------------

def _union_per_layer(model, prompts, new_tokens: int) -> float:
    """Mean over decode steps and layers of how many distinct experts the batch's rows chose."""
    out = jaxinfer.generate(model, prompts, max_new_tokens=new_tokens, stop_at_eos=False, return_routing=True)
    P = len(prompts[0])
    ids = np.stack([c.routing.ids[P:] for c in out.completions])  # [B, steps, L, k]: decode inputs
    B, S, L, k = ids.shape
    return float(np.mean([len(np.unique(ids[:, s, l])) for s in range(S) for l in range(L)]))


def _step_bytes(cfg, union: float) -> float:
    """Weight bytes one decode step reads: the active parameters, with `union` experts per layer
    in place of top_k (a dense config: its active parameters)."""
    extra = 0 if cfg.moe is None else cfg.n_layers * (union - cfg.moe.top_k) * 3 * cfg.d_model * cfg.moe.expert_ffn_dim
    return (cfg.n_active_params + extra) * jnp.dtype(cfg.dtype).itemsize


def _interleaved(models: dict, prompts, new_tokens: int, repeats: int, timing) -> dict:
    """`timing` of `generate` per model, the models alternating (after one call each that compiles)."""
    return _measure.interleaved({name: lambda m=m: timing(jaxinfer.generate(
        m, prompts, max_new_tokens=new_tokens, stop_at_eos=False).timings) for name, m in models.items()}, repeats)


def decode(models: dict, bw: float, args) -> list[dict]:
    """Decode tokens/s at each batch size, MoE and dense twin alternating, against the roofline."""
    rng = np.random.default_rng(0)
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        prompts = [rng.integers(3, min(1000, models["moe"].config.vocab_size), args.prompt).tolist() for _ in range(B)]
        union = _union_per_layer(models["moe"], prompts, min(args.new_tokens, 8))
        rates = _interleaved(models, prompts, args.new_tokens, args.repeats, lambda t: t.decode_tokens_per_s)
        for name, model in models.items():
            cfg, step = model.config, _step_bytes(model.config, union)
            kv = bytes_per_token(cfg) * (args.prompt + args.new_tokens / 2)  # mean positions a step's attention reads
            roof = roofline.decode_ceiling(bw, step, batch=B, cache_bytes_per_row=kv)
            got = float(np.median(rates[name]))
            rows.append({"model": cfg.name, "batch": B, "tokens_per_s": got, "runs": rates[name],
                         "experts_per_layer_read": union if name == "moe" else None,
                         "weight_bytes_per_step": step, "kv_bytes_per_row": kv, "roofline_tokens_per_s": roof,
                         "fraction_of_roofline": got / roof})
            print(f"  batch {B:3d} {name:5s} {got:8.2f} tokens/s, roofline {roof:8.2f} ({got / roof:.0%})"
                  + (f"; {union:.1f} of {cfg.moe.n_experts} experts read per layer" if name == "moe" else ""),
                  flush=True)
    return rows


def prefill(models: dict, args) -> list[dict]:
    """One prompt of --prefill tokens (prefill and its first token), MoE and dense twin alternating."""
    prompt = np.random.default_rng(1).integers(3, min(1000, models["moe"].config.vocab_size), args.prefill).tolist()
    times = _interleaved(models, [prompt], 1, args.repeats, lambda t: t.prefill_s)
    rows = []
    for name, model in models.items():
        t = float(np.median(times[name]))
        flops = 2 * model.config.n_active_params * len(prompt)
        rows.append({"model": model.config.name, "tokens": len(prompt), "seconds": t, "runs": times[name],
                     "tokens_per_s": len(prompt) / t, "active_GFLOP_per_s": flops / t / 1e9})
        print(f"  prefill {len(prompt)} tokens {name:5s} {t:7.2f} s, {len(prompt) / t:8.1f} tokens/s, "
              f"{flops / t / 1e9:6.1f} GFLOP/s of active parameters", flush=True)
    return rows


def main(argv=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections (repeatable; default all)")
    p.add_argument("--layers", type=int, default=4, help="layers of the Qwen3-30B-A3B-shaped model (default %(default)s)")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=32, help="decode tokens per row per run (default %(default)s)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row for decode (default %(default)s)")
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill run (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure, median (default %(default)s)")
    p.add_argument("--dtype", default="float32", help="weight dtype (default %(default)s)")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.new_tokens, args.prompt, args.prefill, args.repeats = "1,4", 6, 8, 16, 1
    sections = args.only or SECTIONS
    moe_cfg, dense_cfg = _configs(args)
    bw = _measure.bandwidth(2**20 if args.smoke else 2**30, 5)["read_Bps"]
    print(f"{moe_cfg.name}, {moe_cfg.n_layers} layers, {moe_cfg.dtype}: {moe_cfg.n_params / 1e9:.2f}B parameters, "
          f"{moe_cfg.n_active_params / 1e9:.3f}B active; twin {dense_cfg.n_params / 1e9:.3f}B; "
          f"read bandwidth {bw / 1e9:.1f} GB/s", flush=True)
    result = {"config": moe_cfg.name, "layers": moe_cfg.n_layers, "dtype": moe_cfg.dtype, "n_params": moe_cfg.n_params,
              "n_active_params": moe_cfg.n_active_params, "bandwidth_Bps": bw}
    if "kernels" in sections:
        print("kernels: one layer's experts", flush=True)
        result["kernels"] = kernels(moe_cfg, bw, args)
    models = _models(moe_cfg, dense_cfg) if "decode" in sections or "prefill" in sections else {}  # after the kernels'
    if "decode" in sections:
        print("decode", flush=True)
        result["decode"] = decode(models, bw, args)
    if "prefill" in sections:
        print("prefill", flush=True)
        result["prefill"] = prefill(models, args)
    _common.save("moe", result, args)
    return result


if __name__ == "__main__":
    main()
