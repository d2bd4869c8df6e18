"""Host memory a compiled program holds on a CPU: the Engine's mixed-call programs, per weight layout.

    python experiments/program_memory.py            # SmolLM2-135M, both layouts (~5 minutes)
    python experiments/program_memory.py --smoke    # a tiny random model (the smoke test)

`jaxinfer serve` on SmolLM2-135M held 6.0 GB at idle (7.8 GB when its programs came from the
persistent compile cache) against llama-server's 0.74 GB (experiments/figures/load_vs_llamacpp*.json).
This script builds an Engine the way the server does (float16 KV, 8 slots) for each weight layout
in its own subprocess and compiles its mixed-call programs (`Runner.shapes()`) one at a time with
`jax.jit(...).lower(...).compile()`, reading the process's resident memory after each (after
glibc's `malloc_trim`, so freed heap the allocator keeps does not count). Per program it
records the growth; per layout, the resident memory after loading the weights (before and after
the trim) and with the pool.

  cpu        the CPU decode layout `load` picks on a CPU (one array per layer, an unrolled loop)
  canonical  stacked weights and one `lax.scan` over the layers

Writes <out>/program_memory.json.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `experiments` and `jaxinfer` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import common, jsonfile  # noqa: E402
from experiments.long_prompt import rss_bytes  # noqa: E402

LAYOUTS = ("per_layer", "stacked")


def rss_mb(trim: bool = True) -> float:
    """This process's resident memory in MiB (after returning free heap to the system if `trim`)."""
    if trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_bytes() / 2**20


def measure(model_name: str, layout: str, smoke: bool) -> dict:
    """In this process: load, build the Engine, compile each mixed-call shape; memory after each."""
    import jax
    import numpy as np

    from jaxinfer.decode import core
    from jaxinfer.serve import Engine
    from jaxinfer.serve.runner import MAX_TOP_LOGPROBS

    if smoke:
        from jaxinfer.model import layout as lay

        model = common.tiny_model("tiny-program-memory", kv_dtype="float16")
        if layout == "per_layer":
            model = lay.to_layout(model, "per_layer")
    else:
        import jaxinfer

        model = jaxinfer.load(model_name, kv_cache="float16", layout=layout)
    loaded_untrimmed = rss_mb(trim=False)
    loaded = rss_mb()
    engine = Engine(model, max_slots=8 if not smoke else 2, max_len=None if not smoke else 128)
    runner, out = engine.runner, []
    with_pool = before = rss_mb()
    for R, C in runner.shapes():
        args = (model.params, runner._idle_state(), runner._chunk_arrays([], (R, C)), runner.cfg, MAX_TOP_LOGPROBS,
                np.zeros((runner.max_slots,), bool))
        core.mixed_step_jit.lower(*args).compile()
        now = rss_mb()
        out.append(dict(shape=[R, C], grew_mb=now - before))
        before = now
    return dict(layout=model.config.layout, loaded_mb=loaded, loaded_untrimmed_mb=loaded_untrimmed,
                pool_mb=engine.stats().pool_bytes / 2**20, with_pool_mb=with_pool, programs=out,
                after_programs_mb=before, jax=jax.__version__)


def main(argv=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--measure", choices=LAYOUTS, help="(internal) measure one layout in this process")
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.model, args.measure, args.smoke)))
        return {}
    rows = []
    for layout in LAYOUTS:  # each in a fresh process: nothing compiled or allocated before it
        cmd = [sys.executable, os.path.abspath(__file__), "--measure", layout, "--model", args.model]
        done = subprocess.run(cmd + (["--smoke"] if args.smoke else []), capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        grew = [x["grew_mb"] for x in row["programs"]]
        print(f"{layout:9s}: resident after loading {row['loaded_untrimmed_mb']:.0f} MB ({row['loaded_mb']:.0f} after "
              f"the trim), with the pool {row['with_pool_mb']:.0f} MB, after {len(grew)} programs "
              f"{row['after_programs_mb']:.0f} MB "
              f"(first {grew[0]:.0f} MB, then {min(grew[1:], default=0):.0f}-{max(grew[1:], default=0):.0f} MB each)",
              flush=True)
        rows.append(row)
    result = dict(experiment="program_memory", model=args.model if not args.smoke else "tiny", rows=rows,
                  environment=common.environment())
    jsonfile.write_json(Path(args.out) / "program_memory.json", result)
    return result


if __name__ == "__main__":
    main()
