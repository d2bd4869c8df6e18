"""What constrained decoding costs on the host: schema compile time and mask time per token.

    python experiments/constraint_cost.py [--reps 20] [--no-outlines] [--tokenizer smollm2-135m]

For the 8 schemas in experiments/data/schemas/ (the validity benchmark's), on SmolLM2's vocabulary
(V = 49152), with llguidance (jaxinfer.constraints):
  * build: `constraints.json_schema(schema)` (grammar + validation, no tokenizer);
  * compile: the first matcher for this vocabulary (what `Compiler` caches), and a copy of it;
  * mask per token: `fill_bitmask` + `consume` along a valid instance of the schema (the
    instance below, tokenized as the model would write it), `reps` times: median, p90, max;
  * batch: the 8 schemas as 8 rows, `Compiler.fill_bitmasks` (threads, GIL dropped) per step;
  * GIL: a pure-Python loop's speed alone and while another thread computes masks;
  * apply: `bitmask.apply_token_bitmask` on [8, V] under jit (the device side, here the CPU).
With --outlines (default when outlines-core is installed) the same schemas through outlines-core:
regex from the schema, Index build (its compile), and mask + advance per token.
Writes experiments/out/constraint_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import jaxinfer  # noqa: E402
from jaxinfer.decode import constraints as C  # noqa: E402
from experiments import jsonfile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "experiments" / "data" / "schemas"

# One valid instance per schema, written as a model writes JSON (", " and ": " separators).
INSTANCES = {
    "nested_objects": {"name": "Ada Lovelace", "age": 36, "address": {"street": "12 St James's Square",
                       "city": "London", "geo": {"lat": 51.5074, "lon": -0.1347}},
                       "employer": {"company": "Analytical Engines Ltd", "since": 1952}},
    "enums": {"status": "shipped", "priority": "high", "currency": "EUR", "channel": "web", "gift_wrap": False},
    "arrays_bounded": {"title": "Pancakes", "ingredients": ["flour", "milk", "eggs", "butter"],
                       "steps": ["Whisk everything together", "Fry in a hot pan"], "ratings": [5, 4]},
    "numbers": {"temperature_c": 21.5, "humidity_pct": 48, "pressure_hpa": 1013.25, "wind_kmh": 12.8,
                "readings": 240},
    "nullable_fields": {"name": "Grace Hopper", "email": None, "phone": "+1 555 0100", "age": None,
                        "notes": "Prefers e-mail in the morning"},
    "string_patterns": {"tracking_code": "RA123456785DE", "postcode": "10115", "phone": "+4930123456",
                        "ship_date": "2024-05-17", "sku": "ABC-1234"},
    "closed_object": {"theme": "dark", "font_size": 14, "language": "en-GB",
                      "notifications": {"email": True, "push": False}, "beta": False},
    "anyof_union": {"label": "triangle", "shape": {"kind": "polygon", "points": [[0, 0], [4, 0], [2, 3.5]]}},
}


def _ms(xs):
    return {"median_ms": statistics.median(xs) * 1e3, "p90_ms": float(np.percentile(xs, 90)) * 1e3,
            "max_ms": max(xs) * 1e3}


def llguidance_costs(tok, reps: int) -> dict:
    t = time.perf_counter()
    comp = C.Compiler(tok)
    out = {"compiler_build_s": time.perf_counter() - t, "vocab": comp.vocab_size, "schemas": {}}
    mask = comp.allocate_bitmask(1)
    for path in sorted(SCHEMAS.glob("*.json")):
        name = path.stem
        schema = json.loads(path.read_text())
        t = time.perf_counter()
        c = C.json_schema(schema)
        build = time.perf_counter() - t
        t = time.perf_counter()
        comp.compile(c)
        compile_s = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(100):
            comp.matcher(c)
        copy_s = (time.perf_counter() - t) / 100
        ids = tok.encode(json.dumps(INSTANCES[name], ensure_ascii=False))
        per_token, cold, consume = [], [], []
        for rep in range(reps + 1):  # rep 0 is cold: llguidance builds lexer states lazily, then reuses them
            m = comp.matcher(c)
            for k, tid in enumerate(ids):
                t = time.perf_counter()
                m.fill_bitmask(mask[0])
                (per_token if rep else cold).append(time.perf_counter() - t)
                assert np.unpackbits(mask[0].view(np.uint8), bitorder="little")[tid], (name, k)
                t = time.perf_counter()
                assert m.consume(tid), (name, k, m.error)
                consume.append(time.perf_counter() - t)
            assert m.is_accepting, name
        allowed = []
        m = comp.matcher(c)
        for tid in ids:
            m.fill_bitmask(mask[0])
            allowed.append(int(np.unpackbits(mask[0].view(np.uint8), bitorder="little").sum()))
            m.consume(tid)
        out["schemas"][name] = {"tokens": len(ids), "build_ms": build * 1e3, "compile_ms": compile_s * 1e3,
                                "matcher_copy_us": copy_s * 1e6, "mask": _ms(per_token),
                                "mask_first_pass": _ms(cold), "consume": _ms(consume),
                                "forced_steps": sum(a == 1 for a in allowed),
                                "median_allowed_tokens": statistics.median(allowed)}
    # 8 rows at once, one per schema, stepping along their instances
    cs = [C.json_schema(json.loads(p.read_text())) for p in sorted(SCHEMAS.glob("*.json"))]
    paths = [tok.encode(json.dumps(INSTANCES[p.stem], ensure_ascii=False)) for p in sorted(SCHEMAS.glob("*.json"))]
    batch = comp.allocate_bitmask(len(cs))
    par, seq = [], []
    for _ in range(reps):
        ms = [comp.matcher(c) for c in cs]
        for step in range(min(len(p) for p in paths)):
            t = time.perf_counter()
            comp.fill_bitmasks(ms, batch)
            par.append(time.perf_counter() - t)
            t = time.perf_counter()
            for i, m in enumerate(ms):
                m.fill_bitmask(batch[i])
            seq.append(time.perf_counter() - t)
            for m, p in zip(ms, paths):
                m.consume(p[step])
    out["batch8"] = {"parallel": _ms(par), "sequential": _ms(seq)}
    out["gil"] = gil_check(comp, cs[0], paths[0])
    out["overlap"] = overlap_check(comp, cs, paths)
    return out


def overlap_check(comp, cs, paths, repeats: int = 5) -> dict:
    """Masks for 8 rows on a host thread while the main thread waits for a device step (a jitted
    [8, 576] x [576, V] product, SmolLM2's head, standing in for the forward pass)."""
    import jax
    import jax.numpy as jnp

    steps = min(len(p) for p in paths)
    w = jax.random.normal(jax.random.key(0), (576, comp.vocab_size), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (8, 576), jnp.float32)
    device = jax.jit(lambda x, w: jnp.max(x @ w, axis=-1))
    device(x, w).block_until_ready()
    batch = comp.allocate_bitmask(len(cs))

    def host_steps():
        ms = [comp.matcher(c) for c in cs]

        def one(step):
            for i, m in enumerate(ms):
                m.fill_bitmask(batch[i])
                m.consume(paths[i][step])
        return one

    def run(kind):
        one = host_steps()
        t = time.perf_counter()
        for step in range(steps):
            if kind == "device":
                device(x, w).block_until_ready()
            elif kind == "host":
                one(step)
            else:
                th = threading.Thread(target=one, args=(step,))
                th.start()
                device(x, w).block_until_ready()  # waiting on the device drops the GIL
                th.join()
        return (time.perf_counter() - t) / steps

    res = {k: statistics.median(run(k) for _ in range(repeats)) * 1e3 for k in ("device", "host", "both")}
    return {"steps": steps, "device_step_ms": res["device"], "host_masks_8_rows_ms": res["host"],
            "overlapped_step_ms": res["both"], "sum_ms": res["device"] + res["host"]}


def gil_check(comp, c, ids, seconds: float = 1.0) -> dict:
    """Python loop iterations per second alone, and while a thread computes masks non-stop."""

    def spin(duration):
        n, end = 0, time.perf_counter() + duration
        while time.perf_counter() < end:
            n += 1
        return n / duration

    alone = spin(seconds)
    stop = threading.Event()
    done = [0]
    in_mask = [0.0]

    def python_spin():  # a thread that holds the GIL: the reference for "not released"
        while not stop.is_set():
            pass

    th = threading.Thread(target=python_spin)
    th.start()
    with_python = spin(seconds)
    stop.set()
    th.join()
    stop.clear()

    def masks():
        buf = np.zeros(comp.mask_words, np.int32)
        while not stop.is_set():
            m = comp.matcher(c)
            for tid in ids:
                t = time.perf_counter()
                m.fill_bitmask(buf)
                in_mask[0] += time.perf_counter() - t
                m.consume(tid)
                done[0] += 1

    th = threading.Thread(target=masks)
    th.start()
    with_masks = spin(seconds)
    stop.set()
    th.join()
    return {"python_loop_per_s_alone": alone, "ratio_with_python_thread": with_python / alone,
            "ratio_with_mask_thread": with_masks / alone, "masks_in_thread_per_s": done[0] / seconds,
            "mask_thread_time_in_masks": in_mask[0] / seconds}


def outlines_costs(tok, reps: int) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    t = time.perf_counter()
    special = set(C.special_token_ids(tok))
    by_bytes: dict[bytes, list[int]] = {}
    for i, p in enumerate(tok.pieces(range(tok.vocab_size))):
        if i not in special and p:
            by_bytes.setdefault(p, []).append(i)
    vocab = outlines_core.Vocabulary(tok.stop_ids[-1], by_bytes)
    out = {"vocabulary_build_s": time.perf_counter() - t, "version": outlines_core.__dict__.get("__version__"),
           "schemas": {}}
    words = -(-tok.vocab_size // 32)
    buf = np.zeros(words, np.int32)
    for path in sorted(SCHEMAS.glob("*.json")):
        name = path.stem
        try:
            t = time.perf_counter()
            rx = build_regex_from_schema(path.read_text(), C.JSON_WHITESPACE + "?")
            index = outlines_core.Index(rx, vocab)
            compile_s = time.perf_counter() - t
        except Exception as e:  # a schema outlines-core cannot turn into a regex / index
            out["schemas"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        ids = tok.encode(json.dumps(INSTANCES[name], ensure_ascii=False))
        per_token = []
        ok = True
        for _ in range(reps):
            g = outlines_core.Guide(index)
            for tid in ids:
                t = time.perf_counter()
                g.write_mask_into(buf.ctypes.data, words, 4)
                per_token.append(time.perf_counter() - t)
                try:
                    g.advance(tid, return_tokens=False)
                except Exception:
                    ok = False
                    break
            if not ok:
                break
        out["schemas"][name] = {"compile_ms": compile_s * 1e3, "mask": _ms(per_token), "instance_accepted": ok}
    return out


def apply_cost(vocab: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxinfer.decode import bitmask as bm

    f = jax.jit(bm.apply_token_bitmask)
    logits = jnp.zeros((8, vocab), jnp.float32)
    mask = jnp.full((8, bm.mask_words(vocab)), -1, jnp.int32)
    f(logits, mask).block_until_ready()
    ts = []
    for _ in range(reps * 5):
        t = time.perf_counter()
        f(logits, mask).block_until_ready()
        ts.append(time.perf_counter() - t)
    return {"rows": 8, "vocab": vocab, **_ms(ts)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default="smollm2-135m")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-outlines", action="store_true")
    p.add_argument("--out", default=str(ROOT / "experiments" / "out"))
    args = p.parse_args(argv)
    import jsonschema
    import llguidance

    for path in sorted(SCHEMAS.glob("*.json")):
        jsonschema.validate(INSTANCES[path.stem], json.loads(path.read_text()))
    tok = jaxinfer.load_tokenizer(args.tokenizer)
    result = {"experiment": "constraint_cost", "tokenizer": args.tokenizer, "llguidance": llguidance.__version__,
              "llguidance_costs": llguidance_costs(tok, args.reps), "apply_token_bitmask": apply_cost(tok.vocab_size, args.reps)}
    if not args.no_outlines:
        try:
            result["outlines_core"] = outlines_costs(tok, args.reps)
        except ImportError:
            result["outlines_core"] = "not installed"
    jsonfile.write_json(Path(args.out) / "constraint_cost.json", result)
    lg = result["llguidance_costs"]
    print(f"llguidance {result['llguidance']}: compiler build {lg['compiler_build_s']:.2f} s, V = {lg['vocab']}")
    print(f"{'schema':18} {'tok':>4} {'build ms':>9} {'compile ms':>10} {'mask med ms':>11} {'p90':>7} {'max':>7}"
          f" {'cold max':>8}"
          + ("   outlines: compile ms  mask med ms" if isinstance(result.get("outlines_core"), dict) else ""))
    for name, s in lg["schemas"].items():
        line = (f"{name:18} {s['tokens']:4d} {s['build_ms']:9.2f} {s['compile_ms']:10.2f} "
                f"{s['mask']['median_ms']:11.3f} {s['mask']['p90_ms']:7.3f} {s['mask']['max_ms']:7.3f}"
                f" {s['mask_first_pass']['max_ms']:8.3f}")
        oc = result.get("outlines_core")
        if isinstance(oc, dict):
            o = oc["schemas"].get(name, {})
            line += (f"   {o['compile_ms']:18.1f} {o['mask']['median_ms']:12.3f}" if "mask" in o
                     else f"   {o.get('error', '')[:60]}")
        print(line)
    b = lg["batch8"]
    print(f"8 rows per step: parallel {b['parallel']['median_ms']:.3f} ms, sequential {b['sequential']['median_ms']:.3f} ms")
    g = lg["gil"]
    print(f"GIL: a Python loop runs at {g['ratio_with_mask_thread']:.2f}x its solo speed while a thread computes "
          f"{g['masks_in_thread_per_s']:.0f} masks/s ({g['mask_thread_time_in_masks']:.0%} of its time in masks), "
          f"{g['ratio_with_python_thread']:.2f}x beside a pure-Python thread")
    o = lg["overlap"]
    print(f"overlap: device step {o['device_step_ms']:.2f} ms, 8 masks {o['host_masks_8_rows_ms']:.2f} ms, "
          f"both (masks on a thread) {o['overlapped_step_ms']:.2f} ms (sum {o['sum_ms']:.2f} ms)")
    a = result["apply_token_bitmask"]
    print(f"apply_token_bitmask [8, {a['vocab']}] jit on CPU: {a['median_ms']:.3f} ms")
    return result


if __name__ == "__main__":
    main()
