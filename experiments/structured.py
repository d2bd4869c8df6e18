"""Structured output: how often is constrained JSON valid and finished, and what does the constraint cost?

    python -m experiments.structured [--seeds 10] [--max-new-tokens 160]   # SmolLM2-135M, ~13 minutes

Validity: each schema of experiments/data/schemas/ x --seeds seeds at temperature 0.8 (one batched
`generate`), a short chat turn asking for one object: every finished output must validate
(`jsonschema`), and the share finished within --max-new-tokens is the target (>= 80%); again with
unbounded JSON whitespace (`constraints.JSON_WHITESPACE`'s effect). Cost: --rows rows constrained
against unconstrained (ignore_eos) in the multi-step scan and at one step per call, decode time per
step; through the Engine, one request per schema. llguidance alone: per schema the grammar build,
its compile, the mask per token along a valid instance; `apply_token_bitmask` on [8, V] under jit.
Writes structured.json.
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import jsonschema
import llguidance
import numpy as np

import jaxinfer
from experiments import _common, _measure
from experiments._common import DATA
from jaxinfer.decode import bitmask as bm
from jaxinfer.decode import constraints
from jaxinfer.decode.inputs import chat_ids
from jaxinfer.serve.engine import Engine

SCHEMAS = DATA / "schemas"
TEMPERATURE = 0.8
# One valid instance per schema, written as a model writes JSON (", " and ": " separators when dumped).
INSTANCES = json.loads((DATA / "schema_instances.json").read_text(encoding="utf-8"))


def _ms(xs) -> dict:
    return {"median_ms": statistics.median(xs) * 1e3, "p90_ms": float(np.percentile(xs, 90)) * 1e3,
            "max_ms": max(xs) * 1e3}


def prompt_ids(tok, schema: dict) -> list[int]:
    """A short chat turn asking for the schema's kind of object (the constraint supplies the shape)."""
    ask = f"Reply with a JSON object describing one {schema.get('title', 'record').lower()}."
    return chat_ids(tok, [{"role": "user", "content": ask}])


def verdict(text: str, finish: str, schema: dict) -> str:
    """'valid', 'invalid' (finished but wrong: must never happen) or 'unfinished'."""
    if finish != "stop":
        return "unfinished"
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


def validity(model, schemas: dict, seeds: int, max_new: int, whitespace) -> dict:
    out = {}
    for name, schema in schemas.items():
        sp = jaxinfer.SamplingParams(temperature=TEMPERATURE, constraint=constraints.json_schema(schema, whitespace=whitespace))
        res = jaxinfer.generate(model, [prompt_ids(model.tokenizer, schema)] * seeds, seed=list(range(seeds)),
                                max_new_tokens=max_new, sampling=sp)
        v = [verdict(x.text, x.finish_reason, schema) for x in res.completions]
        out[name] = {"rows": seeds, "finished": v.count("valid") + v.count("invalid"), "valid": v.count("valid"),
                     "invalid": v.count("invalid"), "tokens": [len(x.token_ids) for x in res.completions],
                     "whitespace_share_of_chars": statistics.mean(sum(ch in " \t\n\r" for ch in x.text) / max(1, len(x.text))
                                                                  for x in res.completions),
                     "example": res.completions[0].text[:300]}
        print(f"  {name:18} finished {out[name]['finished']:2d}/{seeds}  valid {out[name]['valid']:2d}  "
              f"invalid {out[name]['invalid']}  median tokens {statistics.median(out[name]['tokens']):5.0f}")
    total = sum(v["rows"] for v in out.values())
    return {"schemas": out, "rows": total, "finished_share": sum(v["finished"] for v in out.values()) / total,
            "invalid_total": sum(v["invalid"] for v in out.values())}


def cost_generate(model, schemas: dict, rows: int, max_new: int) -> dict:
    def step_ms(ids, new, sampling, chunk) -> tuple[float, int]:  # ms per decode step without compiles, steps
        res = jaxinfer.generate(model, [ids] * rows, seed=list(range(rows)), max_new_tokens=new, sampling=sampling,
                                chunk_size=chunk)
        steps = max(len(c.token_ids) for c in res.completions) - 1
        return 1e3 * res.timings.decode_tokens / res.timings.decode_tokens_per_s / steps, steps

    out = {}
    for name, schema in schemas.items():
        ids = prompt_ids(model.tokenizer, schema)
        con = jaxinfer.SamplingParams(temperature=TEMPERATURE, constraint=constraints.json_schema(schema))
        free = jaxinfer.SamplingParams(temperature=TEMPERATURE, ignore_eos=True)
        con_ms, steps = step_ms(ids, max_new, con, 32)
        r = out[name] = {"steps": steps, "constrained_step_ms": con_ms,
                         "unconstrained_scan_step_ms": step_ms(ids, steps + 1, free, 32)[0],
                         "unconstrained_one_step_per_call_ms": step_ms(ids, steps + 1, free, 1)[0]}
        r["overhead"] = r["constrained_step_ms"] / r["unconstrained_scan_step_ms"] - 1
        print(f"  {name:18} steps {steps:3d}  constrained {r['constrained_step_ms']:6.1f} ms/step, unconstrained "
              f"{r['unconstrained_scan_step_ms']:6.1f}, one step per call {r['unconstrained_one_step_per_call_ms']:6.1f}")
    keys = ("constrained_step_ms", "unconstrained_scan_step_ms", "unconstrained_one_step_per_call_ms")
    mean = {k: statistics.mean(v[k] for v in out.values()) for k in keys}
    mean["overhead"] = mean["constrained_step_ms"] / mean["unconstrained_scan_step_ms"] - 1
    mean["round_trip_ms"] = mean["unconstrained_one_step_per_call_ms"] - mean["unconstrained_scan_step_ms"]
    mean["host_mask_work_ms"] = mean["constrained_step_ms"] - mean["unconstrained_one_step_per_call_ms"]
    return {"rows": rows, "schemas": out, "mean": mean}


def cost_engine(model, schemas: dict, max_new: int) -> dict:
    """One request per schema at once through the Engine, constrained vs unconstrained, same lengths."""
    # no prefix cache: a repeated prompt would be prefilled in other chunk shapes (new programs)
    engine = Engine(model, max_slots=len(schemas), prefill_chunk=512, prefix_cache=False)
    prompts = {n: prompt_ids(model.tokenizer, s) for n, s in schemas.items()}

    def run(samplings, lengths):
        reqs = [engine.submit(prompts[n], max_new_tokens=lengths[n], sampling=samplings[n], seed=i)
                for i, n in enumerate(schemas)]
        t = time.perf_counter()
        engine.run_until_idle()
        return time.perf_counter() - t, [r.result() for r in reqs]

    con = {n: jaxinfer.SamplingParams(temperature=TEMPERATURE, constraint=constraints.json_schema(s)) for n, s in schemas.items()}
    run(con, dict.fromkeys(schemas, max_new))  # compiles and warms llguidance's caches
    con_s, comps = run(con, dict.fromkeys(schemas, max_new))
    lengths = {n: len(c.token_ids) for n, c in zip(schemas, comps)}
    free = dict.fromkeys(schemas, jaxinfer.SamplingParams(temperature=TEMPERATURE, ignore_eos=True))
    run(free, lengths)
    free_s, _ = run(free, lengths)
    tokens = sum(lengths.values())
    print(f"  engine: {tokens} tokens, constrained {tokens / con_s:.1f} tok/s, unconstrained {tokens / free_s:.1f}")
    return {"requests": len(schemas), "tokens": tokens, "constrained_tokens_per_s": tokens / con_s,
            "unconstrained_tokens_per_s": tokens / free_s, "overhead": con_s / free_s - 1}


def llguidance_costs(tok, schemas: dict, reps: int) -> dict:
    t = time.perf_counter()
    comp = constraints.Compiler(tok)
    out = {"compiler_build_s": time.perf_counter() - t, "vocab": comp.vocab_size, "schemas": {}}
    mask = comp.allocate_bitmask(1)
    paths = {n: tok.encode(json.dumps(INSTANCES[n], ensure_ascii=False)) for n in schemas}
    for name, schema in schemas.items():
        t = time.perf_counter()
        c = constraints.json_schema(schema)
        build = time.perf_counter() - t
        t = time.perf_counter()
        comp.compile(c)
        compile_s = time.perf_counter() - t
        warm, cold = [], []
        for rep in range(reps + 1):  # rep 0 is cold: llguidance builds lexer states lazily, then reuses them
            m = comp.matcher(c)
            for k, tid in enumerate(paths[name]):
                t = time.perf_counter()
                m.fill_bitmask(mask[0])
                (warm if rep else cold).append(time.perf_counter() - t)
                assert np.unpackbits(mask[0].view(np.uint8), bitorder="little")[tid], (name, k)
                assert m.consume(tid), (name, k, m.error)
            assert m.is_accepting, name
        out["schemas"][name] = {"tokens": len(paths[name]), "build_ms": build * 1e3, "compile_ms": compile_s * 1e3,
                                "mask": _ms(warm), "mask_first_pass": _ms(cold)}
    return out


def apply_cost(vocab: int, reps: int) -> dict:
    """`apply_token_bitmask` on [8, V] under jit, after the call that compiles."""
    f = jax.jit(bm.apply_token_bitmask)
    logits, mask = jnp.zeros((8, vocab), jnp.float32), jnp.full((8, bm.mask_words(vocab)), -1, jnp.int32)
    call = _measure.timed(lambda: f(logits, mask))
    call()
    return {"rows": 8, "vocab": vocab, **_ms([call() for _ in range(reps * 5)])}


def main(argv=None, model=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--rows", type=int, default=8, help="rows of the cost batches")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--reps", type=int, default=6, help="repetitions of llguidance's timings")
    p.add_argument("--no-unbounded", action="store_true", help="skip the unbounded-whitespace comparison")
    args = p.parse_args(argv)

    schemas = {path.stem: json.loads(path.read_text()) for path in sorted(SCHEMAS.glob("*.json"))}
    for name, schema in schemas.items():
        jsonschema.validate(INSTANCES[name], schema)
    if args.smoke:
        schemas = dict(list(schemas.items())[:1])
        args.seeds, args.rows, args.max_new_tokens, args.reps, args.no_unbounded = 2, 2, 24, 1, True
    model = _common.load_model(args, model)
    result = {"model": args.model, "llguidance": llguidance.__version__, "temperature": TEMPERATURE,
              "max_new_tokens": args.max_new_tokens, "seeds": args.seeds}
    print(f"validity: {len(schemas)} schemas x {args.seeds} seeds, <= {args.max_new_tokens} tokens")
    result["validity"] = validity(model, schemas, args.seeds, args.max_new_tokens, constraints.JSON_WHITESPACE)
    if not args.no_unbounded:
        print("validity with unbounded whitespace (whitespace=None)")
        result["validity_unbounded_whitespace"] = validity(model, schemas, args.seeds, args.max_new_tokens, None)
    print(f"cost through generate: {args.rows} rows")
    result["cost_generate"] = cost_generate(model, schemas, args.rows, args.max_new_tokens)
    result["cost_engine"] = cost_engine(model, schemas, args.max_new_tokens)
    result["llguidance_costs"] = llguidance_costs(model.tokenizer, schemas, args.reps)
    result["apply_token_bitmask"] = apply_cost(model.config.vocab_size, args.reps)
    v, m = result["validity"], result["cost_generate"]["mean"]
    print(f"finished within {args.max_new_tokens} tokens: {v['finished_share']:.0%}; invalid among finished: "
          f"{v['invalid_total']}; generate overhead {m['overhead']:+.0%}")
    _common.save("structured", result, args)
    return result


if __name__ == "__main__":
    main()
