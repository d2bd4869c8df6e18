"""Helper process for tests/test_moe.py: a tiny mixture-of-experts model on one device and with its
experts split over 8 CPU devices, greedy and seeded tokens and logits, written as JSON.

The device count must be fixed before JAX starts (other test files start it in the pytest
process), so the test runs this script in a subprocess:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/moe_sharding_worker.py OUT.json
"""

from __future__ import annotations

import json
import sys

import numpy as np

MESHES = [(2, 4), (1, 8)]  # (data, model): 2 and 1 experts per device
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [3] * 7, [100, 101]]
SEEDS = [11, 12, 13, 14]
NEW_TOKENS = 8


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

    out = {"single": run(Model(cfg, jax.tree.map(jnp.asarray, host))), "meshes": {}}
    for data, model in MESHES:
        plan = shd.plan(cfg, shd.make_mesh(data, model))
        sharded = Model(shd.config_for(cfg, plan), shd.shard_params(host, cfg, plan))
        got = run(sharded)
        got.update(kernel=sharded.config.moe.kernel, rules=dict(plan.rules),
                   expert_shard=list(sharded.params["layers"]["we_gate_up"].addressable_shards[0].data.shape))
        out["meshes"][f"{data}x{model}"] = got
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
