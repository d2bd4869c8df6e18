"""The correctness section of the device check: jaxinfer against transformers' golden logits.

For each model: fp32 logits at matmul precision "highest" (max |logit diff| over the golden
vocab columns, |logsumexp diff|, argmax at every position) and greedy tokens against the
committed references; the same in bf16 with its own tolerance; `generate` batched vs each prompt
alone (greedy and sampled) and one seed twice. Real models (GGUF) must be in the model cache
($JAXINFER_CACHE; experiments/device_stage.py puts them there on the device machine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer.decode.sampling import GREEDY, SamplingParams
from jaxinfer.model.cache import write_mode as kv_write_mode

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden"
FP32_TOL = 1e-3  # max |logit diff| and |logsumexp diff| vs transformers fp32, precision "highest"
# bf16 weights and activations (8 mantissa bits): max |logit diff| and the share of positions whose
# argmax agrees. SmolLM2 on XLA CPU measured 1.08 and 95.2% (105 positions); a real bug (a wrong
# rope, a missing norm) moves logits by tens and the argmax almost everywhere.
BF16_TOL = 2.0
BF16_MIN_ARGMAX = 0.9
REAL_GOLDEN = {"smollm2-135m": "smollm2_logits.npz", "gemma3-270m": "gemma3_logits.npz"}
SAMPLED = SamplingParams(temperature=0.8, top_k=50)


@contextlib.contextmanager
def highest_precision():
    """fp32 matmuls in full fp32 (GPUs default to TF32-like passes), restored afterwards."""
    old = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", old)


def _cases(name: str) -> list[dict]:
    """Golden cases of a model: ids, vocab_idx (None = full vocab), ref logits, argmax, lse, greedy."""
    if name.startswith("tiny_hf/"):
        r = np.load(GOLDEN / "tiny_hf" / name.split("/", 1)[1] / "reference.npz")
        lg = r["logits"].astype(np.float64)
        lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
        return [dict(ids=r["ids"].tolist(), vocab_idx=None, logits=r["logits"], argmax=r["logits"].argmax(-1),
                     lse=lse, greedy=r["greedy"].tolist())]
    r = np.load(GOLDEN / REAL_GOLDEN[name])
    n = len([k for k in r.files if k.startswith("ids_")])
    return [dict(ids=r[f"ids_{i}"].tolist(), vocab_idx=r[f"vocab_idx_{i}"].astype(np.int64), logits=r[f"logits_{i}"],
                 argmax=r[f"argmax_{i}"], lse=r[f"lse_{i}"], greedy=r[f"greedy_{i}"].tolist()) for i in range(n)]


def _logit_diffs(model, cases) -> dict:
    worst = worst_lse = 0.0
    argmax_ok = positions = 0
    for c in cases:
        ours = np.asarray(jaxinfer.logits(model, c["ids"]), np.float64)  # [T, V]
        sel = ours if c["vocab_idx"] is None else np.take_along_axis(ours, c["vocab_idx"], axis=1)
        lse = np.log(np.exp(ours - ours.max(1, keepdims=True)).sum(1)) + ours.max(1)
        worst = max(worst, float(np.abs(sel - c["logits"]).max()))
        worst_lse = max(worst_lse, float(np.abs(lse - c["lse"]).max()))
        argmax_ok += int((ours.argmax(-1) == c["argmax"]).sum())
        positions += len(c["ids"])
    return {"max_logit_diff": worst, "max_lse_diff": worst_lse, "argmax_agree": argmax_ok / positions,
            "positions": positions}


def _greedy(model, cases) -> tuple[list[list[int]], dict]:
    out = jaxinfer.generate(model, [c["ids"] for c in cases], max_new_tokens=len(cases[0]["greedy"]),
                            stop_at_eos=False, sampling=GREEDY)
    toks = [c.token_ids for c in out.completions]
    prefix = [next((j for j, (a, b) in enumerate(zip(t, c["greedy"])) if a != b), len(t))
              for t, c in zip(toks, cases)]
    return toks, {"greedy_identical": all(t == c["greedy"] for t, c in zip(toks, cases)),
                  "greedy_matching_prefix": prefix}


def check_model(name: str, cache_dir) -> dict:
    """fp32 ("highest") and bf16 parity with transformers, greedy tokens, batch/seed identities."""
    path = str(GOLDEN / "tiny_hf" / name.split("/", 1)[1]) if name.startswith("tiny_hf/") else name
    cases, res = _cases(name), {}
    with highest_precision():
        m32 = jaxinfer.load(path, dtype="float32", cache=cache_dir)
        res["loaded"] = {"layout": m32.config.layout, "kv_writes": kv_write_mode(m32.config)}  # load's defaults here
        fp32 = _logit_diffs(m32, cases)
        batched, g = _greedy(m32, cases)
        fp32.update(g, tol=FP32_TOL)
        fp32["pass"] = bool(fp32["max_logit_diff"] <= FP32_TOL and fp32["max_lse_diff"] <= FP32_TOL
                            and fp32["argmax_agree"] == 1.0 and g["greedy_identical"])
        res["fp32"] = fp32
        ids, n_new = [c["ids"] for c in cases], len(cases[0]["greedy"])
        alone = [jaxinfer.generate(m32, [i], max_new_tokens=len(cases[0]["greedy"]), stop_at_eos=False)
                 .completions[0].token_ids for i in ids]
        seeds = list(range(11, 11 + len(ids)))
        samp = lambda p, s: [c.token_ids for c in jaxinfer.generate(
            m32, p, seed=s, sampling=SAMPLED, max_new_tokens=n_new, stop_at_eos=False).completions]
        s_batch, s_again = samp(ids, seeds), samp(ids, seeds)
        s_alone = [samp([i], s)[0] for i, s in zip(ids, seeds)]
        res["batch_vs_alone"] = {"greedy_identical": batched == alone, "sampled_identical": s_batch == s_alone,
                                 "rows": len(ids)}
        res["same_seed"] = {"identical": s_batch == s_again}
    # bf16: the fp32 weights cast on device, as load(dtype="bfloat16") would (without re-reading)
    m16 = dataclasses.replace(m32, config=m32.config.replace(dtype="bfloat16"),
                              params=jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(
                                  x.dtype, jnp.floating) else x, m32.params))
    del m32
    bf16 = _logit_diffs(m16, cases)
    bf16.update(_greedy(m16, cases)[1], tol=BF16_TOL, min_argmax_agree=BF16_MIN_ARGMAX)
    bf16["pass"] = bool(bf16["max_logit_diff"] <= BF16_TOL and bf16["argmax_agree"] >= BF16_MIN_ARGMAX)
    res["bf16"] = bf16
    return res


def correctness(args, preset, ctx, deadline) -> dict:
    from jaxinfer.weights import hub

    models, res, skipped = (args.models.split(",") if args.models else preset.models), {}, []
    for name in models:
        if name not in REAL_GOLDEN and not name.startswith("tiny_hf/"):
            res[name] = {"error": f"unknown model {name!r}: use {sorted(REAL_GOLDEN)} or tiny_hf/<family>"}
            continue
        if name in REAL_GOLDEN and not (hub.cache_dir() / hub.known_model(name).filename).exists():
            res[name] = {"status": f"not staged: {hub.known_model(name).filename} is not in {hub.cache_dir()}"}
            continue
        if time.perf_counter() > deadline:
            skipped.append(name)
            continue
        t0 = time.perf_counter()
        try:
            res[name] = check_model(name, None)
        except Exception as e:  # one model's failure must not hide the others'
            res[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)[-2000:]}
        res[name]["seconds"] = time.perf_counter() - t0
    checked = [r for r in res.values() if "fp32" in r]
    return {"fp32_tol": FP32_TOL, "bf16_tol": BF16_TOL, "models": res, "skipped_for_time": skipped,
            "all_pass": bool(checked) and all(r["fp32"]["pass"] and r["bf16"]["pass"]
                                              and r["batch_vs_alone"]["greedy_identical"]
                                              and r["same_seed"]["identical"] for r in checked)}
