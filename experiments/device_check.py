"""Is jaxinfer right and fast on this accelerator? One prepared run for a lent GPU (tools/device_check.sh).

    python -m experiments.device_check [--preset full|layouts|prefill|engine|kernels] [--sections ...]

A thin driver over the runners' own measurements (`quality.parity`, `_measure`, `_serve`,
`profile`), section by section; docs/gpu.md says what each measures. A section (or a size in it)
that fails records why and the rest still run; --time-budget is shared out between the sections
and sizes that would overrun it are skipped; speed is refused on a CPU unless --smoke or
--allow-cpu. Writes device_check.json (after each section), device_check.png and the traces to
--out; exits 1 when a section failed.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import jax
import numpy as np

from experiments import _common, _measure, _serve, quality
from experiments import profile as prof
from experiments._common import plt
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.decode.inputs import bucket
from jaxinfer.decode.request import MIN_KV_BUCKET
from jaxinfer.inspect import roofline
from jaxinfer.model import cache, params
from jaxinfer.serve import Engine
from jaxinfer.weights import hub

SPEED = ("decode", "serving", "profile")  # the sections refused on a CPU
SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


@dataclasses.dataclass(frozen=True)
class Preset:
    """What a device check runs; the defaults are Llama-3.1-8B shapes in bf16 on a GPU, running nothing."""
    model: str = "llama31_8b"  # a jaxinfer.model.config preset function
    dtype: str = "bfloat16"
    batches: tuple[int, ...] = ()  # decode batch sizes of the default layout
    quant_batches: tuple[int, ...] = ()  # int8-weight and int8-KV decode batch sizes
    ab_batches: tuple[int, ...] = ()  # where the stacked layout (and int8 in both layouts) run too
    prompt: int = 64  # prompt tokens per row for decode
    new_tokens: int = 64
    chunk: int = 32  # decode steps per jitted scan
    prefill: int = 0  # prefill length at batch 1 (0: none)
    copy_bytes: int = 4 << 30  # bandwidth probe array
    matmul_n: int = 8192  # matmul peak probe: n x n x n
    repeats: int = 3
    slots: tuple[int, ...] = ()  # serving engine slot counts
    profile_batches: tuple[int, ...] = ()  # decode batch sizes traced by the profile section
    models: tuple[str, ...] = ()  # correctness: real model names and tiny_hf/<family>
    warmup: bool = True  # serving: build every program first (the smoke run compiles only what it meets)
    int8_kernels: tuple[str, ...] = ()  # int8 weights again with ModelConfig.int8_matmul forced to each
    prefill_lengths: tuple[int, ...] = ()  # prompts (batch 1) timed with each of prefill_attentions
    prefill_attentions: tuple[str, ...] = ()  # ModelConfig.prefill_attention values
    prefill_chunk: Optional[int] = None  # those prompts' chunk (generate's prefill_chunk_size; None: its default)


PRESETS = {
    # every section, sized for ~9 minutes of one H200; tiny gemma3 first in correctness: it covers
    # sliding windows, QK-norm and GeGLU in seconds
    "full": Preset(batches=(1, 8, 64, 256), quant_batches=(1, 64), ab_batches=(1,), prefill=2048, slots=(32, 128),
                   profile_batches=(64,), models=("tiny_hf/gemma3", "smollm2-135m", "gemma3-270m", "tiny_hf/llama",
                                                  "tiny_hf/mistral", "tiny_hf/qwen2")),
    # the layout and int8 A/B alone, for a short lease (~4 minutes of device time)
    "layouts": Preset(batches=(1, 64), quant_batches=(1, 64), ab_batches=(1,), prefill=2048, slots=(32,),
                      profile_batches=(64,), models=("tiny_hf/gemma3",)),
    # prefill in both layouts and the batch sizes the full preset has no time for
    "prefill": Preset(batches=(8, 256), prefill=2048, slots=(32,), models=("tiny_hf/gemma3",)),
    # the engine: a burst at 32 slots with its trace, and a trace of a batch-1 decode step
    "engine": Preset(slots=(32,), profile_batches=(1,)),
    # issue 51's table in one call (~7 minutes of one H200): decode at 1/64/256, bf16 beside int8
    # through each int8 matmul, prefill of 2k/8k/32k tokens with the paged and the cuDNN attention
    "kernels": Preset(batches=(1, 64, 256), quant_batches=(1, 64), int8_kernels=("xla", "pallas"),
                      prefill_lengths=(2048, 8192, 32768), prefill_attentions=("paged", "cudnn"), prefill_chunk=2048),
    # anywhere in seconds (the suite): float32 (XLA's CPU bf16 is emulated); its % of roofline means
    # little, the weights (0.4 MB) sit in cache and steps are dispatch-bound
    "smoke": Preset(model="tiny", dtype="float32", batches=(1,), quant_batches=(1,), prompt=16, new_tokens=16, chunk=8,
                    prefill=16, copy_bytes=16 << 20, matmul_n=256, repeats=1, slots=(2,), models=("tiny_hf/gemma3",),
                    warmup=False, int8_kernels=("pallas",), prefill_lengths=(32,), prefill_attentions=("paged", "xla"),
                    prefill_chunk=16),
}


def _memory() -> dict | None:
    stats = jax.devices()[0].memory_stats() or {}
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats} or None


def _version(dist: str) -> Optional[str]:
    return next((d.version for d in md.distributions(name=dist)), None)  # the one imported: first on the path


def _fitting(items: dict, deadline: float, res: dict, section: str, ctx: dict):
    """Yield `items`' (name, value) pairs in order while they fit before `deadline`: one is skipped
    (its name listed in res["skipped_for_time"]) when 1.5x the last one's seconds would overrun it.
    The section's results so far are written to disk after each."""
    last_s = 0.0
    for name, value in items.items():
        if time.perf_counter() + 1.5 * last_s > deadline:
            res["skipped_for_time"].append(name)
            continue
        t0 = time.perf_counter()
        yield name, value
        last_s = time.perf_counter() - t0
        ctx["partial"](section, res)


def environment(args, preset, ctx, deadline) -> dict:
    res = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
           "device_kind": jax.devices()[0].device_kind, "speed_allowed": ctx["speed_allowed"],
           "versions": {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": _version("jaxlib"),
                        "cuda_plugin": {d: _version(d) for d in ("jax-cuda13-plugin", "jax-cuda12-plugin") if _version(d)}},
           "memory": _memory(), "cached_models": sorted(p.name for p in hub.cache_dir().glob("*.gguf"))}
    try:
        res["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,"
                                            "clocks.mem", "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        res["nvidia_smi"] = None
    return res


def correctness(args, preset, ctx, deadline) -> dict:
    return quality.parity(preset.models, deadline)


def run_order(preset: Preset, base: str) -> list[tuple[str, int]]:
    """(label, batch) by importance, so a short budget drops the least useful: the base (the
    layout `load` picks) with, at each A/B batch, int8 in both layouts and the stacked layout;
    the other int8 batches; prefill in both layouts; the other base batches; the int8 KV cache."""
    q, first = preset.quant_batches, []
    for b in preset.ab_batches:
        first += [(base, b)] + ([("int8", b), ("int8_stacked", b)] if b in q else []) + [("stacked", b)]
    for b in q:
        first += [x for x in ((base, b), ("int8", b)) if x not in first]
    pre = [("prefill", 1), ("prefill_stacked", 1)] if preset.prefill else []
    pre += [(f"prefill_{a}", n) for n in preset.prefill_lengths for a in preset.prefill_attentions]
    order = first + pre + [(base, b) for b in preset.batches if (base, b) not in first] + [("int8kv", b) for b in q]
    return [x for label, b in order for x in [(label, b)] + ([(f"int8_{k}", b) for k in preset.int8_kernels]
                                                                if label == "int8" else [])]


def decode(args, preset, ctx, deadline) -> dict:
    res = {"runs": [], "skipped_for_time": []}
    if time.perf_counter() > deadline:
        res["skipped_for_time"] = ["everything"]
        return res
    bw = _measure.bandwidth(preset.copy_bytes, preset.repeats, preset.dtype)
    res["bandwidth"] = {"copy_GBps": bw["copy_Bps"] / 1e9, "read_GBps": bw["read_Bps"] / 1e9,
                        "roofline_GBps": bw["roofline_Bps"] / 1e9, "bytes": bw["bytes"]}
    peak = _measure.matmul_peak(preset.matmul_n, preset.repeats, preset.dtype)
    res["matmul"] = {"n": preset.matmul_n, "dtype": preset.dtype, "TFLOPs": peak / 1e12}
    stacked = _measure.random_model(preset.model, preset.dtype, "stacked")
    model = _measure.variant(stacked, "per_layer")  # what `load` gives float weights on one device
    ctx.update(model=model, bandwidth_Bps=bw["roofline_Bps"])  # serving and profile run it
    res["model"] = {"preset": preset.model, "name": model.config.name, "n_params": model.config.n_params,
                    "weight_bytes": params.nbytes(model.params), "layout": model.config.layout,
                    "writes": cache.write_mode(model.config), "memory_after_weights": _memory()}
    base = SHORT[preset.dtype]
    order = {f"{label} batch {b}": (label, b) for label, b in run_order(preset, base)}
    last_use = {label: name for name, (label, _) in order.items()}  # a quantized copy lives until then
    built, alive = {base: model, "stacked": stacked}, 2 * params.nbytes(model.params)  # both float copies live on
    n_chunks = -(-(preset.new_tokens - 1) // preset.chunk)  # S, the slots `generate` allocates per row (its formula)
    slots = bucket(max(bucket(preset.prompt), preset.prompt + n_chunks * preset.chunk + 1), MIN_KV_BUCKET)
    for name, (label, b) in _fitting(order, deadline, res, "decode", ctx):
        try:
            if label in ("prefill", "prefill_stacked"):
                res[label] = _measure.measure_prefill(built["stacked" if label == "prefill_stacked" else base],
                                                      preset.prefill, preset.repeats, peak)
            elif label.startswith("prefill_"):  # b: the prompt's tokens
                attention = label.removeprefix("prefill_")
                m = dataclasses.replace(model, config=model.config.replace(prefill_attention=attention))
                res.setdefault("prefill_attention", []).append(
                    {"attention": attention, **_measure.measure_prefill(m, b, preset.repeats, peak,
                                                                        chunk=preset.prefill_chunk)})
            else:
                kernel = label.removeprefix("int8_")
                if label not in built and kernel in preset.int8_kernels:  # the same weights, another matmul
                    q8 = built.get("int8") or _measure.variant(stacked, "int8")
                    built[label] = dataclasses.replace(q8, config=q8.config.replace(int8_matmul=kernel))
                elif label not in built:
                    built[label] = _measure.variant(model if label == "int8kv" else stacked, label)
                m = built[label]
                r = _measure.measure_decode(m, b, prompt=preset.prompt, new_tokens=preset.new_tokens,
                                            repeats=preset.repeats, bandwidth_Bps=bw["roofline_Bps"], chunk=preset.chunk)
                extra = params.nbytes(m.params) if label.startswith("int8") and label != "int8kv" else 0
                res["runs"].append({"label": label, **r, "memory_after": _memory(),
                                    "predicted_bytes": alive + extra + cache.cache_bytes(m.config, b, slots)})
        except Exception as e:  # an out-of-memory batch must not hide the others
            res["runs"].append({"label": label, "batch": b, **_common.error_record(e)})
        if last_use[label] == name and label not in (base, "stacked"):
            built.pop(label, None)
    res["ratios"] = _ratios(res, preset, base)
    return res


def _ratios(res: dict, preset: Preset, base: str) -> dict:
    """The decode section's tokens/s side by side, keyed "<numerator>_vs_<denominator>..."."""
    tok = {(r["label"], r["batch"]): r["tok_s"] for r in res["runs"] if "tok_s" in r}  # (label, batch or tokens)
    tok.update({(f"prefill_{r['attention']}", r["tokens"]): r["tok_s"]
                for r in res.get("prefill_attention", []) if "tok_s" in r})
    tok.update({(k, 1): res[k]["tok_s"] for k in ("prefill", "prefill_stacked") if k in res})
    q, b1 = preset.quant_batches, min(preset.batches, default=1)
    pairs = [(f"{a}_vs_{base}_batch{b}", (a, b), (base, b)) for a, b in tok if a != base and not a.startswith("prefill")]
    pairs += [(f"int8_vs_int8_stacked_batch{b}", ("int8", b), ("int8_stacked", b)) for b in q]
    pairs += [(f"{base}_batch{b}_vs_batch{b1}", (base, b), (base, b1)) for b in preset.batches[1:]]
    pairs += [(f"int8_pallas_vs_int8_xla_batch{b}", ("int8_pallas", b), ("int8_xla", b)) for b in q]
    pairs += [(f"prefill_{a}_vs_paged_{n}", (f"prefill_{a}", n), ("prefill_paged", n))
              for n in preset.prefill_lengths for a in preset.prefill_attentions if a != "paged"]
    pairs.append(("prefill_stacked_vs_per_layer", ("prefill_stacked", 1), ("prefill", 1)))
    return {name: tok[x] / tok[y] for name, x, y in pairs if x in tok and y in tok}


def default_model(preset: Preset, ctx: dict):
    """The decode section's weights in the layout `load` gives them (made here when it did not run)."""
    if "model" not in ctx:
        ctx["model"] = _measure.random_model(preset.model, preset.dtype, "per_layer")
    return ctx["model"]


def serving(args, preset, ctx, deadline) -> dict:
    model, folder = default_model(preset, ctx), Path(args.out)
    ids = np.random.default_rng(0).integers(3, model.config.vocab_size, 4096).tolist()
    res = {"runs": {}, "skipped_for_time": []}
    for key, n in _fitting({str(n): n for n in preset.slots}, deadline, res, "serving", ctx):
        work = _serve.workload(ids, 2 * n, prompt=(16, preset.prompt), new=(preset.new_tokens,) * 2, log_new=False)
        try:
            engine = Engine(model, max_slots=n, max_len=preset.prompt + preset.new_tokens)
            with CompileCounter() as clock:
                if preset.warmup:
                    engine.warmup()
            outs = sorted((_serve.serve_engine(engine, work) for _ in range(preset.repeats)),
                          key=lambda o: o["tokens_per_s"])
            out = {k: v for k, v in outs[len(outs) // 2].items() if k not in ("ttft", "token_ids")}  # the median run
            roof = roofline.decode_ceiling(ctx.get("bandwidth_Bps") or 1.0, params.nbytes(model.params), batch=n,
                                           cache_bytes_per_row=(preset.prompt + preset.new_tokens)
                                           * cache.bytes_per_token(model.config))
            res["runs"][key] = {"slots": n, "requests": len(work), "warmup_programs": clock.count,
                                "all_tokens_per_s": [o["tokens_per_s"] for o in outs], **out,
                                "roofline_tok_s": roof, "pct_roofline": 100 * out["tokens_per_s"] / roof}
            if n == preset.slots[0] and time.perf_counter() < deadline:  # one more burst, traced
                quiet = jax.profiler.ProfileOptions()
                quiet.python_tracer_level = 0  # traced Python calls would slow the host side being measured
                trace_dir, t1 = folder / f"engine_trace_{n}", time.perf_counter()
                with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True, profiler_options=quiet):
                    run = _serve.serve_engine(engine, work)
                res[f"trace_{n}"] = {"traced_wall_s": time.perf_counter() - t1, "iterations": run["iterations"],
                                     "devices": prof.device_time(prof.read_trace(str(trace_dir))),
                                     "trace_file": _flatten_trace(trace_dir, folder / f"engine_trace_{n}.trace.json.gz")}
                static = _serve.serve_static(model, work, n)
                res["runs"][f"{n}_static"] = {"slots": n, "requests": len(work),
                                              **{k: v for k, v in static.items() if k != "ttft"}}
                res[f"engine_vs_static_{n}"] = out["tokens_per_s"] / static["tokens_per_s"]
        except Exception as e:
            res["runs"][key] = _common.error_record(e)
        engine = None  # its pool goes before the next engine's comes
    return res


def _flatten_trace(trace_dir: Path, dest: Path) -> str:
    """The Perfetto trace moved up beside the JSON (the device tool does not carry deep folders back)."""
    shutil.move(str(max(trace_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)), dest)
    shutil.rmtree(trace_dir, ignore_errors=True)
    return dest.name


def profile(args, preset, ctx, deadline) -> dict:
    model, folder = default_model(preset, ctx), Path(args.out)
    res = {"runs": {}, "skipped_for_time": []}
    cases = {f"decode_b{b}": (b, preset.prompt, 8) for b in preset.profile_batches}
    if preset.prefill:
        cases["prefill"] = (1, preset.prefill, 2)
    for name, (batch, tokens, steps) in _fitting(cases, deadline, res, "profile", ctx):
        out = folder / f"profile_{name}"
        try:
            r = prof.main(["--prompt-tokens", str(tokens), "--decode-steps", str(steps), "--batch", str(batch),
                           "--out", str(out)], model=model)
            res["runs"][name] = {k: r[k] for k in ("layout", "stages", "devices", "batch", "prompt_tokens")}
            res["runs"][name]["trace_files"] = [_flatten_trace(out / "profile", folder / f"profile_{name}.trace.json.gz")]
        except Exception as e:
            res["runs"][name] = _common.error_record(e)
    return res


def compiles(args, preset, ctx, deadline) -> dict:
    by = ctx["compiles"]
    res = {"n_programs": sum(c["count"] for c in by.values()), "compile_s": sum(c["seconds"] for c in by.values()),
           "by_section": by, "memory": _memory()}
    runs = [r for r in ctx["report"]["sections"].get("decode", {}).get("runs", []) if "predicted_bytes" in r]
    if res["memory"] and runs:
        big = max(runs, key=lambda r: r["predicted_bytes"])
        res.update(predicted_peak_bytes=big["predicted_bytes"], predicted_for=f"{big['label']} batch {big['batch']}",
                   peak_over_predicted=res["memory"]["peak_bytes_in_use"] / big["predicted_bytes"])
    return res


# Each section's runner and its share of --time-budget (decode's many compiles take the most).
SECTIONS = {"environment": (environment, 0.02), "correctness": (correctness, 0.2), "decode": (decode, 0.5),
            "serving": (serving, 0.15), "profile": (profile, 0.13), "compiles": (compiles, 0.0)}


def plot(report: dict, path: Path) -> None:
    """Decode tokens/s against the roofline by batch; logit differences against the tolerances."""
    fig, (a, c) = plt().subplots(1, 2, figsize=(12, 4.5))
    runs = [r for r in report["sections"].get("decode", {}).get("runs", []) if "tok_s" in r]
    for label in dict.fromkeys(r["label"] for r in runs):
        rs = sorted((r for r in runs if r["label"] == label), key=lambda r: r["batch"])
        (line,) = a.plot([r["batch"] for r in rs], [r["tok_s"] for r in rs], "o-", label=label)
        a.plot([r["batch"] for r in rs], [r["roofline_tok_s"] for r in rs], "--", color=line.get_color(), alpha=0.6)
    a.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s (dashed: roofline)", title="decode")
    if runs:
        a.legend(fontsize=7)
    cor = report["sections"].get("correctness", {})
    rows = [(f"{m} {d}", r[d]["max_logit_diff"]) for m, r in cor.get("models", {}).items() for d in ("fp32", "bf16")
            if d in r]
    if rows:
        c.barh([n for n, _ in rows], [max(v, 1e-9) for _, v in rows], color="tab:purple")
        for tol, ls in ((cor["fp32_tol"], ":"), (cor["bf16_tol"], "--")):
            c.axvline(tol, color="k", ls=ls, lw=1)
        c.set(xscale="log")
    c.set(xlabel="max |logit diff| vs transformers", title="correctness (lines: fp32 / bf16 tolerance)")
    env = report["sections"].get("environment", {})
    fig.suptitle(f"jaxinfer device check: {env.get('device_kind', '?')}, preset {report['preset']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt().close(fig)


def summary(report: dict) -> str:
    """The short table printed last (the device tool returns the end of the output)."""
    s, d = report["sections"], report["sections"].get("decode", {})
    lines = [f"device check ({report['preset']}): " + ", ".join(
        f"{k} {'ok' if v['ok'] else 'FAILED'} {v['seconds']:.0f}s" for k, v in s.items())]
    if "bandwidth" in d:
        lines.append(f"bandwidth {d['bandwidth']['roofline_GBps']:.0f} GB/s, matmul {d['matmul']['TFLOPs']:.1f} TFLOP/s")
    lines += [f"  {r['label']:12s} batch {r['batch']:4d}: " + (f"{r['tok_s']:10.1f} tok/s, {r['pct_roofline']:5.1f}% of "
              f"the roofline" if "tok_s" in r else r.get("error", "?")) for r in d.get("runs", [])]
    prefills = [(k, d[k]) for k in ("prefill", "prefill_stacked") if k in d]
    prefills += [(f"prefill_{r['attention']}", r) for r in d.get("prefill_attention", []) if "tok_s" in r]
    lines += [f"  {k:15s} {r['tokens']:6d} tokens: {r['tok_s']:8.0f} tok/s, {r['pct_peak']:.1f}% of the matmul peak"
              for k, r in prefills]
    lines += [f"  {k}: {v:.2f}x" for k, v in d.get("ratios", {}).items()]
    lines += [f"  {m}: " + (f"fp32 {r['fp32']['max_logit_diff']:.1e}, bf16 {r['bf16']['max_logit_diff']:.1e}, pass "
              f"{r['fp32']['pass'] and r['bf16']['pass']}" if "fp32" in r else str(r.get("status") or r.get("error")))
              for m, r in s.get("correctness", {}).get("models", {}).items()]
    lines += [f"  serving {n}: " + (f"{r['tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50']:.3f} s" if "tokens_per_s" in r
              else r.get("error", "?")) for n, r in s.get("serving", {}).get("runs", {}).items()]
    return "\n".join(lines)

def main(argv=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="default: full (smoke with --smoke)")
    p.add_argument("--allow-cpu", action="store_true", help="report speed on a CPU backend too")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma list of %(default)s")
    p.add_argument("--time-budget", type=float, default=450.0, help="seconds for all sections")
    args = p.parse_args(argv)

    args.preset = args.preset or ("smoke" if args.smoke else "full")
    sections = [s for s in args.sections.split(",") if s]
    if set(sections) - set(SECTIONS):
        raise SystemExit(f"unknown section(s) {sorted(set(sections) - set(SECTIONS))}; allowed: {', '.join(SECTIONS)}")
    preset, out, t_start = PRESETS[args.preset], Path(args.out) / "device_check.json", time.perf_counter()
    report = {"preset": args.preset, "args": vars(args), "preset_values": dataclasses.asdict(preset), "sections": {},
              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    speed = jax.default_backend() in ("gpu", "tpu") or args.allow_cpu or args.preset == "smoke"

    def partial(name: str, res: dict) -> None:  # a section's results so far, on disk
        report["sections"][name] = {"ok": True, "partial": True, **res}
        _common.write_json(out, report)

    ctx = {"speed_allowed": speed, "compiles": {}, "report": report, "partial": partial}
    for i, name in enumerate(sections):
        run, weight = SECTIONS[name]
        left = args.time_budget - (time.perf_counter() - t_start)
        share = max(0.0, left) * weight / (sum(SECTIONS[s][1] for s in sections[i:]) or 1.0)
        t0 = time.perf_counter()
        print(f"[{name}] budget {share:.0f} s", flush=True)
        with CompileCounter() as clock:
            try:
                if name in SPEED and not speed:
                    res = {"ok": True, "skipped": "speed is reported on a GPU only (--smoke or --allow-cpu to run anyway)"}
                else:
                    res = {"ok": True, **run(args, preset, ctx, t0 + share)}
            except Exception as e:  # recorded; the other sections still run
                res = {"ok": False, **_common.error_record(e)}
        res["seconds"] = time.perf_counter() - t0
        ctx["compiles"][name] = {"count": clock.count, "seconds": clock.seconds}
        report["sections"][name] = res
        report["wall_s"] = time.perf_counter() - t_start
        _common.write_json(out, report)
        print(f"[{name}] {'ok' if res['ok'] else 'FAILED: ' + res['error']} in {res['seconds']:.1f} s", flush=True)
    try:
        plot(report, out.with_suffix(".png"))
    except Exception as e:  # the JSON matters more than the picture
        report["plot_error"] = f"{type(e).__name__}: {e}"
        _common.write_json(out, report)
    print(summary(report))
    print(f"wrote {out} and {out.with_suffix('.png')} ({report['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    sys.exit(0 if all(s["ok"] for s in main()["sections"].values()) else 1)
