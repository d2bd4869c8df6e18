"""Structured output on SmolLM2-135M: how often constrained JSON is valid and finishes, and what it costs.

    python experiments/structured_bench.py [--seeds 10] [--max-new-tokens 160] [--smoke]

Validity: each of the 8 schemas in experiments/data/schemas/ (nested objects, enums, bounded
arrays, numbers, nullable fields, string patterns, additionalProperties: false, anyOf) x `seeds`
seeds at temperature 0.8, one batched `generate` call per schema (row i samples with seed i), the
prompt a short chat turn asking for one object of the schema's title. Every output that finishes ("stop")
must parse and validate (`jsonschema`); the share that finishes within max-new-tokens is the
target (>= 80%). The same batches are run again with unbounded JSON whitespace (`whitespace=None`)
to show what the bound (`constraints.JSON_WHITESPACE`) does about runaway whitespace.

Cost: per schema, 8 rows (seeds 0..7) constrained, then the same 8 prompts unconstrained for the
same number of decode steps (ignore_eos, so no row stops early) twice: with the multi-step scan
(chunk_size 32, generate's default) and one step per call (chunk_size 1, what a constrained batch
does). Rates are rows x steps / decode time (compiles excluded), so rows that finish early do not
count against the constraint. The difference between the two unconstrained runs is the price of
one host round trip per token; the rest of the constrained run's extra time is the host's mask
work (llguidance's masks, consuming tokens, uploading and applying the mask). Then the Engine:
8 requests, one schema each, constrained vs unconstrained with the same lengths.
Grammar compile and mask times come from experiments/constraint_cost.py (llguidance alone, and
outlines-core beside it when installed).

Writes experiments/figures/structured_bench.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema  # noqa: E402

from experiments import common, constraint_cost, jsonfile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "experiments" / "data" / "schemas"
TEMPERATURE = 0.8


def prompt_ids(tok, schema: dict) -> list[int]:
    """A short chat turn asking for the schema's kind of object (the constraint supplies the shape;
    a prompt that spelled out the schema would only make prefill the cost being measured)."""
    from jaxinfer.decode.inputs import chat_ids

    ask = f"Reply with a JSON object describing one {schema.get('title', 'record').lower()}."
    return chat_ids(tok, [{"role": "user", "content": ask}])


def check(text: str, finish: str, schema: dict) -> str:
    """'valid', 'invalid' (finished but wrong: must never happen) or 'unfinished'."""
    if finish != "stop":
        return "unfinished"
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


def validity(model, schemas: dict, seeds: int, max_new: int, whitespace) -> dict:
    import jaxinfer
    from jaxinfer.decode import constraints as C

    out = {}
    for name, schema in schemas.items():
        c = C.json_schema(schema, whitespace=whitespace)
        ids = prompt_ids(model.tokenizer, schema)
        t = time.perf_counter()
        res = jaxinfer.generate(model, [ids] * seeds, seed=list(range(seeds)), max_new_tokens=max_new,
                                sampling=jaxinfer.SamplingParams(temperature=TEMPERATURE, constraint=c))
        wall = time.perf_counter() - t
        verdicts = [check(x.text, x.finish_reason, schema) for x in res.completions]
        ws = [sum(ch in " \t\n\r" for ch in x.text) / max(1, len(x.text)) for x in res.completions]
        out[name] = {"rows": seeds, "finished": verdicts.count("valid") + verdicts.count("invalid"),
                     "valid": verdicts.count("valid"), "invalid": verdicts.count("invalid"),
                     "tokens": [len(x.token_ids) for x in res.completions],
                     "whitespace_share_of_chars": statistics.mean(ws), "wall_s": wall,
                     "example": res.completions[0].text[:300]}
        print(f"  {name:18} finished {out[name]['finished']:2d}/{seeds}  valid {out[name]['valid']:2d}  "
              f"invalid {out[name]['invalid']}  median tokens {statistics.median(out[name]['tokens']):5.0f}  "
              f"whitespace {out[name]['whitespace_share_of_chars']:.0%} of chars")
    total = sum(v["rows"] for v in out.values())
    return {"schemas": out, "rows": total, "finished_share": sum(v["finished"] for v in out.values()) / total,
            "invalid_total": sum(v["invalid"] for v in out.values())}


def timed_generate(model, ids, rows: int, max_new: int, sampling, chunk_size: int = 32):
    """One generate call: its result, decode steps and decode seconds with compiles left out."""
    import jaxinfer

    res = jaxinfer.generate(model, [ids] * rows, seed=list(range(rows)), max_new_tokens=max_new, sampling=sampling,
                            chunk_size=chunk_size)
    t = res.timings
    steps = max(len(c.token_ids) for c in res.completions) - 1  # the first token comes from the prefill
    return res, steps, t.decode_tokens / t.decode_tokens_per_s  # = decode time minus its compiles


def cost_generate(model, schemas: dict, rows: int, max_new: int) -> dict:
    import jaxinfer
    from jaxinfer.decode import constraints as C

    out = {}
    for name, schema in schemas.items():
        ids = prompt_ids(model.tokenizer, schema)
        con, steps, con_s = timed_generate(model, ids, rows, max_new, jaxinfer.SamplingParams(
            temperature=TEMPERATURE, constraint=C.json_schema(schema)), chunk_size=32)
        free = jaxinfer.SamplingParams(temperature=TEMPERATURE, ignore_eos=True)
        _, steps_scan, scan_s = timed_generate(model, ids, rows, steps + 1, free, chunk_size=32)
        _, steps_one, one_s = timed_generate(model, ids, rows, steps + 1, free, chunk_size=1)
        live = sum(len(c.token_ids) - 1 for c in con.completions)
        r = {"rows": rows, "steps": steps, "live_row_steps": live,
             "constrained_step_ms": 1e3 * con_s / steps, "unconstrained_scan_step_ms": 1e3 * scan_s / steps_scan,
             "unconstrained_one_step_per_call_ms": 1e3 * one_s / steps_one}
        r["constrained_tokens_per_s"] = rows * steps / con_s
        r["unconstrained_tokens_per_s"] = rows * steps_scan / scan_s
        r["overhead"] = r["constrained_step_ms"] / r["unconstrained_scan_step_ms"] - 1
        r["round_trip_share_of_overhead"] = ((r["unconstrained_one_step_per_call_ms"] - r["unconstrained_scan_step_ms"])
                                             / max(1e-9, r["constrained_step_ms"] - r["unconstrained_scan_step_ms"]))
        out[name] = r
        print(f"  {name:18} steps {steps:3d}  constrained {r['constrained_step_ms']:6.1f} ms/step  unconstrained "
              f"scan {r['unconstrained_scan_step_ms']:6.1f}  one step per call {r['unconstrained_one_step_per_call_ms']:6.1f}"
              f"  overhead {r['overhead']:+.0%}")
    keys = ("constrained_step_ms", "unconstrained_scan_step_ms", "unconstrained_one_step_per_call_ms")
    mean = {k: statistics.mean(v[k] for v in out.values()) for k in keys}
    mean["overhead"] = mean["constrained_step_ms"] / mean["unconstrained_scan_step_ms"] - 1
    mean["round_trip_ms"] = mean["unconstrained_one_step_per_call_ms"] - mean["unconstrained_scan_step_ms"]
    mean["host_mask_work_ms"] = mean["constrained_step_ms"] - mean["unconstrained_one_step_per_call_ms"]
    return {"schemas": out, "mean": mean}


def cost_engine(model, schemas: dict, max_new: int) -> dict:
    """8 requests at once through the Engine, one schema each, constrained vs unconstrained."""
    import jaxinfer
    from jaxinfer.decode import constraints as C
    from jaxinfer.serve.engine import Engine

    # The first run of each kind compiles. No prefix cache: a repeated prompt would be prefilled in other
    # chunk shapes (new programs) in the timed run.
    engine = Engine(model, max_slots=len(schemas), prefill_chunk=512, prefix_cache=False)
    prompts = {name: prompt_ids(model.tokenizer, s) for name, s in schemas.items()}

    def run(samplings: dict, lengths: dict) -> tuple[float, list]:
        reqs = [engine.submit(prompts[n], max_new_tokens=lengths[n], sampling=samplings[n], seed=i)
                for i, n in enumerate(schemas)]
        t = time.perf_counter()
        engine.run_until_idle()
        return time.perf_counter() - t, [r.result() for r in reqs]

    con = {n: jaxinfer.SamplingParams(temperature=TEMPERATURE, constraint=C.json_schema(s)) for n, s in schemas.items()}
    run(con, {n: max_new for n in schemas})  # compiles and warms llguidance's caches
    con_s, comps = run(con, {n: max_new for n in schemas})
    lengths = {n: len(c.token_ids) for n, c in zip(schemas, comps)}
    free = {n: jaxinfer.SamplingParams(temperature=TEMPERATURE, ignore_eos=True) for n in schemas}
    run(free, lengths)
    free_s, free_comps = run(free, lengths)
    tokens = sum(lengths.values())
    assert tokens == sum(len(c.token_ids) for c in free_comps)
    r = {"requests": len(schemas), "tokens": tokens, "constrained_s": con_s, "unconstrained_s": free_s,
         "constrained_tokens_per_s": tokens / con_s, "unconstrained_tokens_per_s": tokens / free_s,
         "overhead": con_s / free_s - 1, "decode_steps_per_scan": engine.decode_steps}
    print(f"  engine: {tokens} tokens, constrained {r['constrained_tokens_per_s']:.1f} tok/s, unconstrained "
          f"{r['unconstrained_tokens_per_s']:.1f} tok/s, overhead {r['overhead']:+.0%} (wall time incl. prefill)")
    return r


def main(argv=None, model=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=common.DEFAULT_MODEL)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--rows", type=int, default=8, help="rows of the cost batches (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--reps", type=int, default=6, help="constraint_cost repetitions (default %(default)s)")
    p.add_argument("--no-unbounded", action="store_true", help="skip the unbounded-whitespace comparison")
    p.add_argument("--smoke", action="store_true", help="2 schemas, 2 seeds, 24 tokens")
    p.add_argument("--out", default=str(ROOT / "experiments" / "figures"))
    args = p.parse_args(argv)
    import jaxinfer
    import llguidance

    schemas = {path.stem: json.loads(path.read_text()) for path in sorted(SCHEMAS.glob("*.json"))}
    if args.smoke:
        schemas = dict(list(schemas.items())[:2])
        args.seeds, args.rows, args.max_new_tokens, args.reps, args.no_unbounded = 2, 2, 24, 1, True
    if model is None:
        t = time.perf_counter()
        model = jaxinfer.load(args.model)
        print(f"loaded {args.model} in {time.perf_counter() - t:.1f} s")
    result = {"experiment": "structured_bench", "model": args.model, "llguidance": llguidance.__version__,
              "temperature": TEMPERATURE, "max_new_tokens": args.max_new_tokens, "seeds": args.seeds}
    print(f"validity: {len(schemas)} schemas x {args.seeds} seeds, T={TEMPERATURE}, <= {args.max_new_tokens} tokens, "
          "bounded whitespace")
    from jaxinfer.decode import constraints as C

    result["validity"] = validity(model, schemas, args.seeds, args.max_new_tokens, C.JSON_WHITESPACE)
    if not args.no_unbounded:
        print("validity with unbounded whitespace (whitespace=None)")
        result["validity_unbounded_whitespace"] = validity(model, schemas, args.seeds, args.max_new_tokens, None)
    print(f"cost through generate: {args.rows} rows")
    result["cost_generate"] = cost_generate(model, schemas, args.rows, args.max_new_tokens)
    print(f"cost through the Engine: {len(schemas)} requests")
    result["cost_engine"] = cost_engine(model, schemas, args.max_new_tokens)
    print("llguidance alone (experiments/constraint_cost.py)")
    lg = constraint_cost.llguidance_costs(model.tokenizer, args.reps)
    result["llguidance_costs"] = lg
    try:
        result["outlines_core"] = constraint_cost.outlines_costs(model.tokenizer, max(1, args.reps // 2))
    except ImportError:
        result["outlines_core"] = "not installed"
    result["apply_token_bitmask"] = constraint_cost.apply_cost(model.config.vocab_size, args.reps)
    result["environment"] = common.environment()
    v, m = result["validity"], result["cost_generate"]["mean"]
    print(f"finished within {args.max_new_tokens} tokens: {v['finished_share']:.0%}; invalid among finished: "
          f"{v['invalid_total']}; generate overhead {m['overhead']:+.0%} ({m['constrained_step_ms']:.1f} vs "
          f"{m['unconstrained_scan_step_ms']:.1f} ms/step; round trip {m['round_trip_ms']:.1f} ms, host mask work "
          f"{m['host_mask_work_ms']:.1f} ms)")
    out = Path(args.out)
    jsonfile.write_json(out / "structured_bench.json", result)
    print(f"wrote {out / 'structured_bench.json'}")
    return result


if __name__ == "__main__":
    main()
