"""Helper process for tests/test_sharding.py: runs generate on several meshes and writes JSON.

Multi-device runs need the device count fixed before JAX starts, and other test files start JAX
in the pytest process, so the tests run this script in a subprocess:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_worker.py meshes OUT.json [tiny,real]
      1 device vs meshes (8,1), (1,8), (2,4): greedy and seeded-sampling tokens, logits, for the
      tiny preset (random weights) and the real default model (see PLAN).
  python tests/sharding_worker.py dist OUT.json PROCESS_ID NUM_PROCESSES PORT
      one process of a jax.distributed run (4 CPU devices each): the tiny preset generating
      greedily on a (2, 4) mesh that spans both processes, then a tiny mixture-of-experts model
      with its 8 experts split over a (1, 8) mesh (4 experts on each process): greedy and seeded
      tokens and the logits of one prompt.
  python tests/sharding_worker.py single OUT.json
      the single-process, single-device reference for the dist run (both models).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import numpy as np

MESHES = [(8, 1), (1, 8), (2, 4)]
NEW_TOKENS = 8
CHUNK = NEW_TOKENS - 1  # one decode chunk of exactly the remaining steps
SEEDS = [11, 12, 13, 14, 15, 16, 17, 18]
TINY_PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [3] * 7, [100, 101], [40, 41, 42], [200], [1, 2, 3, 4, 5], [77, 78]]


def _tiny():
    import jax

    from jaxinfer.model import config
    from jaxinfer.model import params as prm

    cfg = config.tiny()
    host = jax.tree.map(np.asarray, prm.init_params(cfg, jax.random.key(0)))
    return cfg, host, None, TINY_PROMPTS


def _tiny_moe():
    """A tiny random mixture-of-experts model: 8 experts, 2 per token, a gated shared expert."""
    import jax

    from jaxinfer.model import config
    from jaxinfer.model import params as prm

    cfg = config.tiny_moe(moe=config.MoEConfig(n_experts=8, top_k=2, expert_ffn_dim=32, norm_top_k=True,
                                               shared_ffn_dim=48, shared_gate=True))
    host = jax.tree.map(np.asarray, prm.init_params(cfg, jax.random.key(0)))
    return cfg, host, TINY_PROMPTS[:4]


def _moe_run(model, prompts):
    """Greedy and seeded tokens and the first prompt's logits [T, V] (gathered from every process)."""
    import jaxinfer
    from jaxinfer import sharding as shd

    return {"greedy": _greedy(model, prompts), "sampled": _sampled(model, prompts, SEEDS[: len(prompts)]),
            "logits": shd.to_host(jaxinfer.logits(model, prompts[0])).tolist()}


def _real():
    import jax

    import jaxinfer

    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "golden", "smollm2_reference.json")) as f:
        ref = json.load(f)
    m = jaxinfer.load("smollm2-135m", layout="stacked")
    host = jax.tree.map(np.asarray, m.params)
    golden = [p["ids"] for p in ref["prompts"][:3]]
    extra = [m.tokenizer.encode(t) for t in ("Once upon a time", "1, 2, 3,", "Hello", "JAX is a library for",
                                              "The sun")]
    return m.config, host, m.tokenizer, golden + extra


def _greedy(model, prompts):
    import jaxinfer

    out = jaxinfer.generate(model, prompts, max_new_tokens=NEW_TOKENS, stop_at_eos=False, chunk_size=CHUNK)
    return [c.token_ids for c in out.completions]


def _sampled(model, prompts, seeds):
    import jaxinfer
    from jaxinfer.decode.sampling import SamplingParams

    out = jaxinfer.generate(model, prompts, seed=seeds, max_new_tokens=NEW_TOKENS, stop_at_eos=False,
                            chunk_size=CHUNK, sampling=SamplingParams(temperature=0.8, top_p=0.95))
    return [c.token_ids for c in out.completions]


def _logits(model, ids):
    import jaxinfer

    return np.asarray(jaxinfer.logits(model, ids))


def _logits64(host, cfg, plan, ids):
    """Logits [T, V] of one uncached forward with float64 weights and matmuls (x64 on for this call).

    In float32 a sharded reduction (the FFN's down projection summed over the model axis by an
    all-reduce) adds its partial sums in another order than one device does; through 30 layers
    that rounding alone moves the real model's logits by ~1e-4. In float64 the rounding is ~1e-12,
    so what remains is any real difference between the sharded and the single-device program.
    """

    import jax
    import jax.numpy as jnp

    from jaxinfer import sharding as shd

    from jaxinfer.decode import generate as gen  # the module (jaxinfer.generate is the function)
    with jax.enable_x64(True):
        wide = jax.tree.map(lambda a: a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a, host)
        params = jax.tree.map(jnp.asarray, wide) if plan is None else shd.shard_params(wide, cfg, plan)
        assert jax.tree.leaves(params)[0].dtype == jnp.float64
        tokens = jnp.asarray(np.asarray(ids, np.int32)[None])
        return np.asarray(gen.uncached_logits_jit(params, tokens, cfg)[0], np.float64)


# Which rows each mesh runs. The tiny preset runs all 8 rows (greedy and sampled) on every mesh.
# The real model on 8 fake CPU devices is slow (2 cores emulating 8 devices and their collectives),
# so it runs only the meshes that split its weights, 2 rows each: greedy on both and seeded
# sampling on (2, 4) (splitting the batch alone, 8x1, is the tiny preset's case); every result is
# compared with a single-device run of exactly the same rows.
PLAN = {
    "tiny": {"8x1": dict(rows=8, sampled=True), "1x8": dict(rows=8, sampled=True),
             "2x4": dict(rows=8, sampled=True)},
    "real": {"1x8": dict(rows=2, sampled=False), "2x4": dict(rows=2, sampled=True)},
}


def meshes(out_path: str, which: tuple[str, ...] = ("tiny", "real")) -> None:
    import jax

    from tests.compiling import optimized

    assert len(jax.devices()) == 8, jax.devices()
    results = {}
    for name in which:
        # The real model's time goes into running it, the tiny preset's into compiling: only the
        # real model's programs get XLA's usual optimisation (tests/compiling.py).
        with (optimized() if name == "real" else contextlib.nullcontext()):
            results[name] = _mesh_results(name)
    with open(out_path, "w") as f:
        json.dump(results, f)


def _mesh_results(name: str) -> dict:
    """1 device vs the meshes of PLAN[name]: tokens, logits, shard shapes (see `meshes`)."""
    import jax
    import jax.numpy as jnp

    import jaxinfer
    from jaxinfer import sharding as shd
    from jaxinfer.model.model import Model

    cfg, host, tokenizer, prompts = (_tiny if name == "tiny" else _real)()
    t0 = time.perf_counter()
    base = Model(cfg, jax.tree.map(jnp.asarray, host), tokenizer)
    single: dict = {"logits": _logits(base, prompts[0]), "logits64": _logits64(host, cfg, None, prompts[0])}
    res = {"prompts": prompts, "single": {}, "meshes": {}}
    for key, todo in PLAN[name].items():
        rows = prompts[: todo["rows"]]
        ref = res["single"].setdefault(str(len(rows)), {})
        if "greedy" not in ref:
            ref["greedy"] = _greedy(base, rows)
        if todo["sampled"] and "sampled" not in ref:
            ref["sampled"] = _sampled(base, rows, SEEDS[: len(rows)])
    res["single_s"] = time.perf_counter() - t0
    for key, todo in PLAN[name].items():
        t0 = time.perf_counter()
        data, model = map(int, key.split("x"))
        mesh = shd.make_mesh(data, model)
        plan = shd.plan(cfg, mesh)
        sharded = Model(cfg, shd.shard_params(host, cfg, plan), tokenizer)
        rows = prompts[: todo["rows"]]
        got = {"rows": len(rows), "greedy": _greedy(sharded, rows)}
        if todo["sampled"]:
            got["sampled"] = _sampled(sharded, rows, SEEDS[: len(rows)])
        if name == "tiny":  # the same call again must build no executable
            again = jaxinfer.generate(sharded, rows, max_new_tokens=NEW_TOKENS, stop_at_eos=False,
                                      chunk_size=CHUNK)
            got["repeat_compilations"] = again.timings.n_compilations
        wq, w_up = sharded.params["layers"]["wq"], sharded.params["layers"]["w_up"]
        diff64 = np.abs(_logits64(host, cfg, plan, prompts[0]) - single["logits64"]).max()
        got.update(logits_max_diff=float(np.abs(_logits(sharded, prompts[0]) - single["logits"]).max()),
                   logits64_max_diff=float(diff64),
                   logits_max_abs=float(np.abs(single["logits"]).max()),
                   # the single-device run's own float32 error: the scale of the tolerance
                   single_fp32_error=float(np.abs(single["logits"] - single["logits64"]).max()),
                   reasons=dict(plan.reasons), seconds=time.perf_counter() - t0,
                   wq_shard_shape=list(wq.addressable_shards[0].data.shape),
                   w_up_shard_shape=list(w_up.addressable_shards[0].data.shape))
        res["meshes"][key] = got
    if name == "tiny":  # the GPU's cache writes (one scatter per layer) on a sharded pool
        scfg = cfg.replace(kv_writes="scatter")
        sharded = Model(scfg, shd.shard_params(host, scfg, shd.plan(scfg, shd.make_mesh(2, 4))), tokenizer)
        res["scatter_2x4"] = {"greedy": _greedy(sharded, prompts), "sampled": _sampled(sharded, prompts, SEEDS)}
    return res


def single(out_path: str) -> None:
    import jax
    import jax.numpy as jnp

    from jaxinfer.model.model import Model

    cfg, host, _, prompts = _tiny()
    model = Model(cfg, jax.tree.map(jnp.asarray, host))
    got = {"greedy": _greedy(model, prompts)}
    cfg, host, prompts = _tiny_moe()
    got["moe"] = _moe_run(Model(cfg, jax.tree.map(jnp.asarray, host)), prompts)
    with open(out_path, "w") as f:
        json.dump(got, f)


def dist(out_path: str, process_id: int, num_processes: int, port: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # collectives across processes
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=120)
    from jaxinfer import sharding as shd
    from jaxinfer.model.model import Model

    assert jax.process_count() == num_processes and len(jax.devices()) == 4 * num_processes
    cfg, host, _, prompts = _tiny()  # same key on every process: identical host weights
    mesh = shd.make_mesh(2, 4)
    model = Model(cfg, shd.shard_params(host, cfg, mesh))
    spans = not model.params["layers"]["w_up"].is_fully_addressable
    got = {"greedy": _greedy(model, prompts)}
    got.update(process_index=jax.process_index(), devices=len(jax.devices()),
               local_devices=len(jax.local_devices()), params_span_processes=spans)
    # The MoE model on (1, 8): the model axis, and so the experts, span both processes, so the
    # routed experts' all-reduce runs over gloo between the processes.
    cfg, host, prompts = _tiny_moe()
    plan = shd.plan(cfg, shd.make_mesh(1, 8))
    moe_model = Model(shd.config_for(cfg, plan), shd.shard_params(host, cfg, plan))
    experts = moe_model.params["layers"]["we_gate_up"]  # [L, X, 2Fe, D]
    local = sorted({s.index[1].start for s in experts.addressable_shards})
    got["moe"] = _moe_run(moe_model, prompts)
    got["moe"].update(rules=dict(plan.rules), kernel=moe_model.config.moe.kernel, local_experts=local,
                      expert_shard=list(experts.addressable_shards[0].data.shape))
    with open(out_path, "w") as f:
        json.dump(got, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "meshes":
        meshes(out, tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else ("tiny", "real"))
    elif mode == "single":
        single(out)
    elif mode == "dist":
        dist(out, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
