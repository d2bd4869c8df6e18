"""Are the numbers right? Quantization quality, evaluation against transformers, parity checks.

    python -m experiments.quality                      # int8 / int4 / int8 KV against float32
    python -m experiments.quality --eval               # lm-evaluation-harness three ways ($JAXINFER_HF_PYTHON)
    python -m experiments.quality --parity             # logits and tokens against transformers' golden files

quantization  --windows windows of --window tokens of the held-out text through the cache, per
              mode: top-1 agreement with float32, mean KL(p_fp32 || p_mode), perplexity, bytes.
--eval        SmolLM2-135M as a Hugging Face folder (written once into --folder from the GGUF) on
              experiments/eval_tasks/, each backend in its own process: jaxinfer, lm-eval's
              local-completions against `jaxinfer serve`, `--model hf` under --hf-python; every
              item compared with hf's.
--parity      fp32 and bf16 logits, argmax and greedy tokens within the tolerances below; batched
              rows equal to each alone; the same seed twice (the device check's correctness).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from experiments import _common
from experiments._common import ROOT, TEXT

GOLDEN = ROOT / "tests" / "golden"
# name -> (weight mode, KV-cache dtype)
MODES = {"float32": (None, None), "int8": ("int8", None), "int4": ("int4", None),
         "kv-int8": (None, "int8"), "int8+kv-int8": ("int8", "int8"), "int4+kv-int8": ("int4", "int8")}
FP32_TOL = 1e-3  # max |logit diff| and |logsumexp diff| vs transformers fp32, precision "highest"
# bf16 weights and activations (8 mantissa bits). SmolLM2 on XLA CPU measured 1.08 and 95.2% (105
# positions); a real bug (a wrong rope, a missing norm) moves logits by tens and the argmax everywhere.
BF16_TOL, BF16_MIN_ARGMAX = 2.0, 0.9
REAL_GOLDEN = {"smollm2-135m": "smollm2_logits.npz", "gemma3-270m": "gemma3_logits.npz"}
TASKS = ("jaxinfer_mc", "jaxinfer_ppl", "jaxinfer_gen", "jaxinfer_gen_until5", "jaxinfer_gen_beams1")
EVAL = {"max_length": 96, "slots": 8, "max_gen_toks": 24, "prefill_chunk": 128, "served_name": "smollm2-135m-hf"}


def quantization(m, args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.model import cache as kv
    from jaxinfer.model import forward as mdl
    from jaxinfer.model import params as prm
    from jaxinfer.model import quantize as Q

    ids, W = _common.text_ids(m.tokenizer), args.window
    if len(ids) < args.windows * W:
        raise SystemExit(f"{TEXT.name} has {len(ids)} tokens, fewer than {args.windows} x {W}")
    windows = np.asarray(ids[:args.windows * W], np.int32).reshape(args.windows, W)
    targets = windows[:, 1:].reshape(-1)
    results, ref = {}, None
    modes = {k: MODES[k] for k in ("float32", "int8", "int4", "kv-int8")} if args.smoke else MODES
    for name, (wmode, kvmode) in modes.items():
        params = m.params if wmode is None else jax.jit(Q.quantize, static_argnums=(1, 2))(m.params, m.config, wmode)
        cfg = m.config.replace(kv_dtype=kvmode)
        # the whole window through the cache, so an int8 cache's rounding is in the logits
        fwd = jax.jit(lambda p, t, c, cfg=cfg: mdl.forward(p, t, mdl.default_positions(*t.shape), c, cfg).logits)
        logp = np.concatenate([np.asarray(jax.nn.log_softmax(fwd(params, jnp.asarray(w)[None], kv.init_cache(cfg, 1, W))[0, :-1], -1))
                               for w in windows])  # [P, V]: predictions of tokens 1..W-1
        ref = logp if ref is None else ref
        r = results[name] = {"positions": len(targets),
                             "perplexity": float(np.exp(-logp[np.arange(len(targets)), targets].mean())),
                             "top1_agreement": float(np.mean(logp.argmax(-1) == ref.argmax(-1))),
                             "mean_kl": float(np.mean(np.sum(np.exp(ref) * (ref - logp), -1))),
                             "weight_bytes": prm.nbytes(params), "kv_bytes_per_token": kv.bytes_per_token(cfg)}
        print(f"{name:>14}: top-1 {r['top1_agreement']:.4f}  KL {r['mean_kl']:.5f}  ppl {r['perplexity']:.3f}  "
              f"weights {r['weight_bytes'] / 1e6:.1f} MB  KV {r['kv_bytes_per_token']} B/token", flush=True)
    return {"model": args.model, "windows": args.windows, "window": W, "results": results}


# ---- parity with transformers ------------------------------------------------------------------

def _logsumexp(logits):
    """log sum exp over the last axis of [T, V] logits, in float64."""
    import numpy as np

    x = np.asarray(logits, np.float64)
    top = x.max(-1, keepdims=True)
    return np.log(np.exp(x - top).sum(-1)) + top[..., 0]


def _cases(name: str) -> list[dict]:
    """Golden cases: ids, vocab_idx (None: the full vocabulary), logits, argmax, logsumexp, greedy tokens."""
    import numpy as np

    if name.startswith("tiny_hf/"):
        r = np.load(GOLDEN / name / "reference.npz")
        return [{"ids": r["ids"].tolist(), "vocab_idx": None, "logits": r["logits"], "argmax": r["logits"].argmax(-1),
                 "lse": _logsumexp(r["logits"]), "greedy": r["greedy"].tolist()}]
    r = np.load(GOLDEN / REAL_GOLDEN[name])
    return [{"ids": r[f"ids_{i}"].tolist(), "vocab_idx": r[f"vocab_idx_{i}"].astype(np.int64),
             "logits": r[f"logits_{i}"], "argmax": r[f"argmax_{i}"], "lse": r[f"lse_{i}"],
             "greedy": r[f"greedy_{i}"].tolist()} for i in range(len([k for k in r.files if k.startswith("ids_")]))]


def _against(model, cases) -> dict:
    import numpy as np

    import jaxinfer

    worst = worst_lse = 0.0
    agree = positions = 0
    for c in cases:
        ours = np.asarray(jaxinfer.logits(model, c["ids"]), np.float64)  # [T, V]
        sel = ours if c["vocab_idx"] is None else np.take_along_axis(ours, c["vocab_idx"], axis=1)
        worst = max(worst, float(np.abs(sel - c["logits"]).max()))
        worst_lse = max(worst_lse, float(np.abs(_logsumexp(ours) - c["lse"]).max()))
        agree += int((ours.argmax(-1) == c["argmax"]).sum())
        positions += len(c["ids"])
    toks = [c.token_ids for c in jaxinfer.generate(model, [c["ids"] for c in cases], stop_at_eos=False,
                                                   max_new_tokens=len(cases[0]["greedy"])).completions]
    return {"max_logit_diff": worst, "max_lse_diff": worst_lse, "argmax_agree": agree / positions,
            "positions": positions, "greedy_identical": all(t == c["greedy"] for t, c in zip(toks, cases)),
            "greedy_tokens": toks}


def check_model(name: str) -> dict:
    """fp32 ("highest") and bf16 parity with transformers, greedy tokens, batch and seed identities."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import jaxinfer
    from jaxinfer.model.cache import write_mode

    cases, res = _cases(name), {}
    old = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")  # GPUs default to TF32-like passes
    try:
        m32 = jaxinfer.load(str(GOLDEN / name) if name.startswith("tiny_hf/") else name, dtype="float32")
        res["loaded"] = {"layout": m32.config.layout, "kv_writes": write_mode(m32.config)}  # load's defaults here
        fp32 = res["fp32"] = _against(m32, cases)
        fp32["pass"] = bool(fp32["max_logit_diff"] <= FP32_TOL and fp32["max_lse_diff"] <= FP32_TOL
                            and fp32["argmax_agree"] == 1.0 and fp32["greedy_identical"])
        ids, n_new = [c["ids"] for c in cases], len(cases[0]["greedy"])
        sampled = jaxinfer.SamplingParams(temperature=0.8, top_k=50)

        def gen(prompts, model=m32, **kw):
            return [c.token_ids for c in jaxinfer.generate(model, prompts, max_new_tokens=n_new, stop_at_eos=False,
                                                           **kw).completions]

        seeds = list(range(11, 11 + len(ids)))
        s_batch = gen(ids, seed=seeds, sampling=sampled)
        res["batch_vs_alone"] = {"greedy_identical": fp32.pop("greedy_tokens") == [gen([i])[0] for i in ids],
                                 "sampled_identical": s_batch == [gen([i], seed=s, sampling=sampled)[0]
                                                                  for i, s in zip(ids, seeds)], "rows": len(ids)}
        res["same_seed"] = {"identical": s_batch == gen(ids, seed=seeds, sampling=sampled)}
    finally:
        jax.config.update("jax_default_matmul_precision", old)
    # bf16: the fp32 weights cast on device, as load(dtype="bfloat16") would (without re-reading)
    m16 = dataclasses.replace(m32, config=m32.config.replace(dtype="bfloat16"), params=jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, m32.params))
    del m32
    bf16 = res["bf16"] = _against(m16, cases)
    bf16.pop("greedy_tokens")
    bf16["pass"] = bool(bf16["max_logit_diff"] <= BF16_TOL and bf16["argmax_agree"] >= BF16_MIN_ARGMAX)
    return res


def parity(models, deadline: float = float("inf")) -> dict:
    """`check_model` for each model (skipping what is not staged or past `deadline`): the device
    check's correctness section."""
    from jaxinfer.weights import hub

    res, skipped = {}, []
    for name in models:
        if name not in REAL_GOLDEN and not name.startswith("tiny_hf/"):
            res[name] = {"error": f"unknown model {name!r}: use {sorted(REAL_GOLDEN)} or tiny_hf/<family>"}
        elif name in REAL_GOLDEN and not (hub.cache_dir() / hub.known_model(name).filename).exists():
            res[name] = {"status": f"not staged: {hub.known_model(name).filename} is not in {hub.cache_dir()}"}
        elif time.perf_counter() > deadline:
            skipped.append(name)
        else:
            t0 = time.perf_counter()
            try:
                r = res[name] = check_model(name)
                print(f"  {name:16s} fp32 {r['fp32']['max_logit_diff']:.1e}  bf16 {r['bf16']['max_logit_diff']:.1e} "
                      f"argmax {r['bf16']['argmax_agree']:.3f}  pass {r['fp32']['pass'] and r['bf16']['pass']}")
            except Exception as e:  # one model's failure must not hide the others'
                res[name] = _common.error_record(e)
            res[name]["seconds"] = time.perf_counter() - t0
    checked = [r for r in res.values() if "fp32" in r]
    return {"fp32_tol": FP32_TOL, "bf16_tol": BF16_TOL, "models": res, "skipped_for_time": skipped,
            "all_pass": bool(checked) and all(r["fp32"]["pass"] and r["bf16"]["pass"] and r["same_seed"]["identical"]
                                              and r["batch_vs_alone"]["greedy_identical"] for r in checked)}


# ---- lm-evaluation-harness three ways ----------------------------------------------------------

def make_folder(dst: str) -> str:
    """Write SmolLM2-135M as a Hugging Face folder into dst once (a finished folder holds DONE):
    the cached GGUF dequantized to float32 under transformers' names, tests/golden's config and tokenizer."""
    import lzma
    import shutil

    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    from jaxinfer.weights import hub
    from jaxinfer.weights.gguf import dequantize, unpermute_qk

    if os.path.exists(os.path.join(dst, "DONE")):
        return dst
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    tmp = dst + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    cfg = json.loads((GOLDEN / "hf_smollm2" / "config.json").read_text())
    cfg.pop("quantization_config", None)  # the weights below are plain float32
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    tensors = {}
    for t in gguf.GGUFReader(str(hub.fetch("smollm2-135m"))).tensors:
        w, part = dequantize(t), t.name.split(".")
        if t.name.startswith("blk.") and part[2] in heads:  # llama.cpp permutes q/k rows by RoPE pair
            w = unpermute_qk(w, heads[part[2]])
        hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}.get(t.name)
        tensors[hf or f"model.layers.{part[1]}.{names[part[2]]}.weight"] = np.ascontiguousarray(w)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    _common.write_json(os.path.join(tmp, "config.json"), cfg, indent=2)
    shutil.copy(GOLDEN / "hf_smollm2" / "generation_config.json", tmp)
    text = GOLDEN / "hf_text" / "smollm2"
    with lzma.open(text / "tokenizer.json.xz", "rb") as f, open(os.path.join(tmp, "tokenizer.json"), "wb") as g:
        g.write(f.read())
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(text / name, tmp)
    open(os.path.join(tmp, "DONE"), "w").close()
    shutil.rmtree(dst, ignore_errors=True)
    os.rename(tmp, dst)
    return dst


def eval_worker(args) -> None:
    """One backend (--eval-worker) in its own process: build its LM (timed), then one
    `simple_evaluate` per task; its results go to --worker-out."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0, extra, kind = time.perf_counter(), {}, args.eval_worker
    if kind == "jaxinfer":
        from jaxinfer.compile_cache import CompileCounter
        from jaxinfer.eval import harness

        counter = CompileCounter().__enter__()
        lm = harness.JaxinferLM(model=args.folder, max_slots=EVAL["slots"], max_length=EVAL["max_length"],
                                prefill_chunk=EVAL["prefill_chunk"])
    elif kind == "hf":
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=args.folder, dtype="float32", max_length=EVAL["max_length"], batch_size=EVAL["slots"],
                  device="cpu")
    else:
        from lm_eval.models.openai_completions import LocalCompletionsAPI

        # An API model's max_length counts one token less, its windows one less again; it cuts
        # generation contexts to max_length - max_gen_toks, so max_gen_toks is set to the tasks'.
        lm = LocalCompletionsAPI(model=EVAL["served_name"], base_url=args.url + "/v1/completions",
                                 tokenizer_backend="huggingface", tokenizer=args.folder,
                                 max_length=EVAL["max_length"] + 2, max_gen_toks=EVAL["max_gen_toks"],
                                 num_concurrent=EVAL["slots"], tokenized_requests=True, max_retries=1, timeout=600)
    load_s, tm, res_tasks = time.perf_counter() - t0, TaskManager(include_path=str(ROOT / "experiments" / "eval_tasks")), {}
    for task in args.tasks.split(","):
        t = time.perf_counter()
        res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tm, limit=args.limit, log_samples=True,
                                      bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                      fewshot_random_seed=0)
        otype = res["configs"][task]["output_type"]
        samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
        items = [[float(r[0][0]) for r in s["resps"]] if otype == "multiple_choice"
                 else float(s["resps"][0][0]) if otype == "loglikelihood_rolling" else s["resps"][0][0] for s in samples]
        res_tasks[task] = {"wall_s": time.perf_counter() - t, "output_type": otype, "items": items,
                           "metrics": {k: v for k, v in res["results"][task].items()
                                       if isinstance(v, (int, float)) and "stderr" not in k}}
    if kind == "jaxinfer":
        counter.__exit__(None, None, None)
        extra = {"prefix_hit_tokens": lm.engine.stats().prefix_hit_tokens, "programs_built": counter.count,
                 "programs_from_cache": counter.cache_hits, "compile_s": counter.seconds}
    _common.write_json(args.worker_out, {"kind": kind, "load_s": load_s, "tasks": res_tasks, **extra})


def eval_compare(ref: dict, got: dict) -> dict:
    """Per task: time against hf's, max |loglikelihood diff| per item, equal accuracy, equal generations."""
    out = {}
    for task, r in ref["tasks"].items():
        g = got["tasks"][task]
        c = out[task] = {"wall_ratio": g["wall_s"] / r["wall_s"]}
        if r["output_type"] == "multiple_choice":
            c.update(max_ll_diff=max(abs(a - b) for ra, ga in zip(r["items"], g["items"]) for a, b in zip(ra, ga)),
                     acc_equal=all(r["metrics"][k] == g["metrics"][k] for k in ("acc,none", "acc_norm,none")))
        elif r["output_type"] == "loglikelihood_rolling":
            c.update(max_ll_diff=max(abs(a - b) for a, b in zip(r["items"], g["items"])))
        else:
            c.update(generations_equal=sum(a == b for a, b in zip(r["items"], g["items"])), items=len(r["items"]))
    return out


def evaluation(args) -> dict:
    from experiments import _serve

    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    backends = args.backends.split(",")
    if "hf" in backends and not (args.hf_python and os.access(args.hf_python, os.X_OK)):
        raise SystemExit("--eval's hf backend needs --hf-python or $JAXINFER_HF_PYTHON: a python with torch, "
                         "transformers, accelerate and lm-eval==0.4.13 (never jaxinfer's own)")
    folder = make_folder(os.path.expanduser(args.folder))
    tmp = os.path.join(args.out, "quality_eval")
    os.makedirs(tmp, exist_ok=True)
    results = {"tasks": args.tasks.split(","), **EVAL, "limit": args.limit, "folder": folder}

    def run(kind: str, url: str = "") -> dict:
        out = os.path.join(tmp, f"{kind}.json")
        cmd = [args.hf_python if kind == "hf" else sys.executable, "-m", "experiments.quality", "--eval-worker", kind,
               "--folder", folder, "--url", url, "--worker-out", out, "--tasks", args.tasks]
        t = time.perf_counter()
        subprocess.run(cmd + (["--limit", str(args.limit)] if args.limit else []), cwd=ROOT, env=env, check=True,
                       timeout=3600)
        return {**json.loads(open(out).read()), "process_s": time.perf_counter() - t}

    for kind in backends:
        if kind == "local-completions":
            server = _serve.jaxinfer_server(folder, ["--served-name", EVAL["served_name"], "--max-slots",
                                                     str(EVAL["slots"]), "--max-len", str(EVAL["max_length"] + 2),
                                                     "--max-waiting", "4096"], os.path.join(tmp, "serve.log"), env)
            try:
                server.start(600)
                results[kind] = run(kind, server.url)
            finally:
                server.stop()
        else:
            results[kind] = run(kind)
        print(f"{kind}: " + ", ".join(f"{t} {v['wall_s']:.1f} s" for t, v in results[kind]["tasks"].items()))
    if "hf" in results:
        results["comparison"] = {k: eval_compare(results["hf"], results[k]) for k in ("jaxinfer", "local-completions")
                                 if k in results}
        print(json.dumps(results["comparison"], indent=1))
    return results


def main(argv=None, model=None) -> dict:
    p = _common.parser(__doc__)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--eval", action="store_true", help="lm-evaluation-harness: jaxinfer, its server, hf")
    what.add_argument("--parity", action="store_true", help="logits and tokens against transformers' golden files")
    what.add_argument("--eval-worker", help=argparse.SUPPRESS)
    p.add_argument("--windows", type=int, default=4, help="quantization: windows of held-out text")
    p.add_argument("--window", type=int, default=512, help="quantization: tokens per window")
    p.add_argument("--models", default="tiny_hf/gemma3,smollm2-135m,gemma3-270m,tiny_hf/llama,tiny_hf/mistral,tiny_hf/qwen2",
                   help="parity: real model names (in the model cache) and tiny_hf/<family>")
    p.add_argument("--hf-python", default=os.environ.get("JAXINFER_HF_PYTHON"),
                   help="eval: python of a venv with torch, transformers and lm-eval ($JAXINFER_HF_PYTHON)")
    p.add_argument("--folder", default="~/.cache/jaxinfer/eval/smollm2-135m-hf", help="eval: the Hugging Face folder")
    p.add_argument("--backends", default="hf,local-completions,jaxinfer", help="eval: which backends")
    p.add_argument("--tasks", default=",".join(TASKS), help="eval: tasks of experiments/eval_tasks/")
    p.add_argument("--limit", type=int, help="eval: documents per task (default all)")
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.eval_worker:
        eval_worker(args)
        return {}
    if args.eval:
        name, result = "quality_eval", evaluation(args)
    elif args.parity:
        name, result = "quality_parity", parity(["tiny_hf/gemma3"] if args.smoke else args.models.split(","))
    else:
        if args.smoke:
            args.windows, args.window = 2, 32
        name, result = "quality", quantization(_common.load_model(args, model, layout="stacked"), args)
    _common.save(name, result, args)
    return result


if __name__ == "__main__":
    main()
