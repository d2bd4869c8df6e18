"""Helper process for tests/test_moe.py: a tiny mixture-of-experts model on one device and with its
experts split over 8 CPU devices, greedy and seeded tokens and logits, written as JSON.

The device count must be fixed before JAX starts (other test files start it in the pytest
process), so the test runs this script in a subprocess:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/moe_sharding_worker.py OUT.json

Then the tiny DeepSeek-V3 (latent attention, grouped routing, a dense first layer) and gpt-oss
(attention sinks, sliding window, biased experts) folders of tests/golden/tiny_moe, loaded straight
onto a (2, 4) mesh (`jaxinfer.load(..., mesh=)`): two of their golden prompts' greedy tokens and
logits, for the test to compare with transformers' (tests/golden/make_tiny_moe.py), and seeded
tokens here and on one device.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

MESHES = [(2, 4), (1, 8)]  # (data, model): 2 and 1 experts per device
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [3] * 7, [100, 101]]
SEEDS = [11, 12, 13, 14]
NEW_TOKENS = 8
FAMILIES = ("deepseek_v3", "gpt_oss")


def main(out_path: str) -> None:
    import jax
    import jax.numpy as jnp

    import jaxinfer
    from jaxinfer import sharding as shd
    from jaxinfer.decode.sampling import SamplingParams
    from jaxinfer.model import config as C
    from jaxinfer.model.model import Model
    from jaxinfer.model.params import init_params

    assert len(jax.devices()) == 8, jax.devices()
    cfg = C.tiny_moe(moe=C.MoEConfig(n_experts=8, top_k=2, expert_ffn_dim=32, norm_top_k=True, shared_ffn_dim=48,
                                     shared_gate=True))
    host = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0)))

    def run(model):
        greedy = jaxinfer.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        sampled = jaxinfer.generate(model, PROMPTS, seed=SEEDS, max_new_tokens=NEW_TOKENS, stop_at_eos=False,
                                    sampling=SamplingParams(temperature=1.0, top_k=50))
        return {"greedy": [c.token_ids for c in greedy.completions],
                "sampled": [c.token_ids for c in sampled.completions],
                "logits": np.asarray(jaxinfer.logits(model, PROMPTS[0])).tolist()}

    out = {"single": run(Model(cfg, jax.tree.map(jnp.asarray, host))), "meshes": {}, "families": {}}
    for data, model in MESHES:
        plan = shd.plan(cfg, shd.make_mesh(data, model))
        sharded = Model(shd.config_for(cfg, plan), shd.shard_params(host, cfg, plan))
        got = run(sharded)
        got.update(kernel=sharded.config.moe.kernel, rules=dict(plan.rules),
                   expert_shard=list(sharded.params["layers"]["we_gate_up"].addressable_shards[0].data.shape))
        out["meshes"][f"{data}x{model}"] = got
    golden = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "tiny_moe")
    for family in FAMILIES:
        ref = np.load(os.path.join(golden, family, "reference.npz"))
        prompts = [row[:n].tolist() for row, n in zip(ref["batch_ids"][:2], ref["batch_lengths"][:2])]

        def tokens(model, **kw):
            res = jaxinfer.generate(model, prompts, max_new_tokens=NEW_TOKENS, stop_at_eos=False, **kw)
            return [c.token_ids for c in res.completions]

        sampling = dict(seed=SEEDS[:2], sampling=SamplingParams(temperature=1.0, top_k=50))
        one = jaxinfer.load(os.path.join(golden, family), layout="stacked")
        sharded = jaxinfer.load(os.path.join(golden, family), mesh=shd.make_mesh(2, 4))
        out["families"][family] = {
            "greedy": tokens(sharded), "sampled": tokens(sharded, **sampling),
            "single_sampled": tokens(one, **sampling),
            "logits": shd.to_host(jaxinfer.logits(sharded, ref["ids"].tolist())).tolist(),
            "kernel": sharded.config.moe.kernel,
            "expert_shard": list(sharded.params["layers"]["we_gate_up"].addressable_shards[0].data.shape)}
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
