#!/usr/bin/env python3
"""lm-evaluation-harness three ways on one Hugging Face folder of SmolLM2-135M, side by side.

  jaxinfer            `--model jaxinfer` in process (jaxinfer.eval.harness on the Engine)
  local-completions   lm-eval's OpenAI-completions client against `jaxinfer serve` on 127.0.0.1
  hf                  lm-eval's `--model hf` (transformers + torch, in a separate venv: --hf-python)

The tasks are the local ones in experiments/eval_tasks/ (JSONL in experiments/data/): multiple
choice, rolling perplexity, greedy generation, generation with five `until` strings, and one with
num_beams: 1 + max_new_tokens. Each backend runs in its own process: it builds its LM once
(timed as `load_s`), then runs `simple_evaluate` once per task (timed as that task's wall time).
The server is started and warmed before its client's clock starts, as a researcher's server would
be. Per-item numbers are compared with hf's: loglikelihood per choice (multiple choice) and per
document (rolling), accuracy, generated text.

The folder is written once into --folder from the cached GGUF (SmolLM2-135M-Instruct Q4_1,
dequantized to float32 with the `gguf` package, by transformers' tensor mapping, as
tests/test_hf_smollm2.py rebuilds it byte-identical to transformers' own save_pretrained), plus
the config of tests/golden/hf_smollm2 and the tokenizer files of tests/golden/hf_text/smollm2.

Run from the repository root (the tasks' data_files are relative to it), alone on the machine:
  python experiments/eval_bench.py [--hf-python /work/venv-hf/bin/python] [--limit N]
Writes experiments/figures/eval_bench.json and prints the table of README's "Evaluate with
lm-evaluation-harness" section.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_DIR = os.path.join(ROOT, "experiments", "eval_tasks")
TASKS = ["jaxinfer_mc", "jaxinfer_ppl", "jaxinfer_gen", "jaxinfer_gen_until5", "jaxinfer_gen_beams1"]
MAX_LENGTH = 96  # the context every backend gets: each rolling document takes two windows
SERVED_NAME = "smollm2-135m-hf"
MAX_SLOTS = 8
MAX_GEN_TOKS = 24  # the generation tasks' max_gen_toks
CONCURRENT = 8  # local-completions' num_concurrent: requests in flight (the server's slots)
PREFILL_CHUNK = 128  # jaxinfer's prefill buckets 16, 64, 128: a 97-token window is not padded to 256
# The server's context is what the harness needs (a 97-token window + the 1 token lm-eval asks for
# when scoring): the engine's decode step slows down with its context width (see README).
GOLDEN = os.path.join(ROOT, "tests", "golden")
NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}
SERVER_START_S = 600  # the server must answer /health within this
RUN_TIMEOUT_S = 3600  # one backend's whole run


# ---- the Hugging Face folder ------------------------------------------------------------------

def make_folder(dst: str) -> str:
    """Write the SmolLM2-135M Hugging Face folder into dst (once; a finished folder has DONE)."""
    if os.path.exists(os.path.join(dst, "DONE")):
        return dst
    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    from jaxinfer.weights import hub

    tmp = dst + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    cfg = json.load(open(os.path.join(GOLDEN, "hf_smollm2", "config.json")))
    cfg.pop("quantization_config", None)  # the weights below are plain float32
    reader = gguf.GGUFReader(str(hub.fetch("smollm2-135m")))
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}.get(t.name.split(".")[-2])
        if heads and t.name.startswith("blk."):  # undo llama.cpp's RoPE-pair permutation of q/k rows
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        tensors[_hf_name(t.name)] = np.ascontiguousarray(w)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    json.dump(cfg, open(os.path.join(tmp, "config.json"), "w"), indent=2)
    shutil.copy(os.path.join(GOLDEN, "hf_smollm2", "generation_config.json"), tmp)
    text = os.path.join(GOLDEN, "hf_text", "smollm2")
    with lzma.open(os.path.join(text, "tokenizer.json.xz"), "rb") as f:
        data = f.read()
    with open(os.path.join(tmp, "tokenizer.json"), "wb") as g:
        g.write(data)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(text, name), tmp)
    open(os.path.join(tmp, "DONE"), "w").close()
    shutil.rmtree(dst, ignore_errors=True)
    os.rename(tmp, dst)
    return dst


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, i, part, _ = gguf_name.split(".")
    return f"model.layers.{i}.{NAMES[part]}.weight"


# ---- one backend (a worker process) -----------------------------------------------------------

def _items(samples: list[dict], output_type: str) -> list:
    """Per document, in doc order: the loglikelihood per choice, the rolling loglikelihood, or the text."""
    out = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        if output_type == "multiple_choice":
            out.append([float(r[0][0]) for r in s["resps"]])
        elif output_type == "loglikelihood_rolling":
            out.append(float(s["resps"][0][0]))
        else:
            out.append(s["resps"][0][0])
    return out


def worker(kind: str, folder: str, url: str, limit, out: str, tasks_run: list[str]) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    extra = {}
    if kind == "jaxinfer":
        import jaxinfer.eval.harness as harness
        from jaxinfer.compile_cache import CompileCounter

        counter = CompileCounter().__enter__()
        lm = harness.JaxinferLM(model=folder, max_slots=MAX_SLOTS, max_length=MAX_LENGTH, prefill_chunk=PREFILL_CHUNK)
    elif kind == "hf":
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=folder, dtype="float32", max_length=MAX_LENGTH, batch_size=MAX_SLOTS, device="cpu")
    else:
        from lm_eval.models.openai_completions import LocalCompletionsAPI

        # An API model's max_length counts one token less, and its windows one less again. It cuts
        # generation contexts to max_length - max_gen_toks whatever a task's max_new_tokens says:
        # the default 256 would leave none of 97 tokens.
        lm = LocalCompletionsAPI(model=SERVED_NAME, base_url=url + "/v1/completions", tokenizer_backend="huggingface",
                                 tokenizer=folder, max_length=MAX_LENGTH + 2, max_gen_toks=MAX_GEN_TOKS,
                                 num_concurrent=CONCURRENT, tokenized_requests=True, max_retries=1, timeout=600)
    load_s = time.perf_counter() - t0
    tm = TaskManager(include_path=TASK_DIR)
    tasks = {}
    for task in tasks_run:
        t = time.perf_counter()
        res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tm, limit=limit, log_samples=True,
                                      bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                      fewshot_random_seed=0)
        wall = time.perf_counter() - t
        otype = res["configs"][task]["output_type"]
        metrics = {k: v for k, v in res["results"][task].items() if isinstance(v, (int, float)) and "stderr" not in k}
        tasks[task] = {"wall_s": wall, "output_type": otype, "metrics": metrics,
                       "items": _items(res["samples"][task], otype)}
    if kind == "jaxinfer":
        counter.__exit__(None, None, None)
        st = lm.engine.stats()
        extra = {"prefix_hit_tokens": st.prefix_hit_tokens, "programs_built": counter.count,
                 "programs_from_cache": counter.cache_hits, "compile_s": counter.seconds}
    json.dump({"kind": kind, "load_s": load_s, "tasks": tasks, **extra}, open(out, "w"))


# ---- the driver --------------------------------------------------------------------------------

def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_worker(python: str, kind: str, folder: str, url: str, limit, tmp: str, tasks: str) -> dict:
    out = os.path.join(tmp, f"{kind}.json")
    cmd = [python, os.path.abspath(__file__), "--worker", kind, "--folder", folder, "--url", url, "--out", out,
           "--tasks", tasks]
    if limit:
        cmd += ["--limit", str(limit)]
    t = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, timeout=RUN_TIMEOUT_S)
    r = json.load(open(out))
    r["process_s"] = time.perf_counter() - t
    print(f"{kind}: {r['process_s']:.1f} s in all", file=sys.stderr)
    return r


def start_server(folder: str, log_path: str):
    """`jaxinfer serve` on 127.0.0.1 (a free port); returns (process, url) once /health is 200."""
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer", "serve", "--model", folder, "--served-name", SERVED_NAME,
                             "--host", "127.0.0.1", "--port", "0", "--max-slots", str(MAX_SLOTS),
                             "--max-len", str(MAX_LENGTH + 2), "--max-waiting", "4096"],
                            cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0, url = time.perf_counter(), None
    while time.perf_counter() - t0 < SERVER_START_S:
        if proc.poll() is not None:
            raise RuntimeError(f"jaxinfer serve exited ({proc.returncode}); see {log_path}")
        if url is None:
            for line in open(log_path):
                if "/v1 (model" in line:
                    url = line.split("serve: ", 1)[1].split("/v1", 1)[0]
        if url is not None:
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    return proc, url
            except OSError:
                pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"jaxinfer serve did not become healthy within {SERVER_START_S} s; see {log_path}")


def stop_server(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def compare(ref: dict, got: dict) -> dict:
    """Per task: max |loglikelihood diff| per item, accuracy equal, generations equal."""
    out = {}
    for task, r in ref["tasks"].items():
        g = got["tasks"][task]
        cmp = {"wall_ratio": g["wall_s"] / r["wall_s"]}
        if r["output_type"] == "multiple_choice":
            d = [abs(a - b) for ra, ga in zip(r["items"], g["items"]) for a, b in zip(ra, ga)]
            cmp.update(max_ll_diff=max(d), items=len(d),
                       acc_equal=all(r["metrics"][k] == g["metrics"][k] for k in ("acc,none", "acc_norm,none")),
                       choice_equal=sum(max(range(len(a)), key=a.__getitem__) == max(range(len(b)), key=b.__getitem__)
                                        for a, b in zip(r["items"], g["items"])))
        elif r["output_type"] == "loglikelihood_rolling":
            d = [abs(a - b) for a, b in zip(r["items"], g["items"])]
            cmp.update(max_ll_diff=max(d), max_rel_diff=max(x / abs(a) for x, a in zip(d, r["items"])), items=len(d))
        else:
            same = [a == b for a, b in zip(r["items"], g["items"])]
            cmp.update(generations_equal=sum(same), items=len(same),
                       differ=[(i, a, b) for i, (a, b) in enumerate(zip(r["items"], g["items"])) if a != b][:5])
        out[task] = cmp
    return out


def table(results: dict) -> str:
    kinds = [k for k in ("hf", "local-completions", "jaxinfer") if k in results]
    head = "| task | " + " | ".join(f"{k} s" for k in kinds) + " | " + " | ".join(
        f"{k} / hf" for k in kinds if k != "hf") + " | vs hf |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for task in results["tasks"]:
        walls = [results[k]["tasks"][task]["wall_s"] for k in kinds]
        ratios = [results[k]["tasks"][task]["wall_s"] / results["hf"]["tasks"][task]["wall_s"]
                  for k in kinds if k != "hf"]
        notes = []
        for k in kinds:
            if k == "hf":
                continue
            c = results["comparison"][k][task]
            if "max_ll_diff" in c:
                notes.append(f"{k}: max diff {c['max_ll_diff']:.1e} nats"
                             + ("" if "acc_equal" not in c else f", acc {'=' if c['acc_equal'] else '!='}"))
            else:
                notes.append(f"{k}: {c['generations_equal']}/{c['items']} same")
        lines.append(f"| {task} | " + " | ".join(f"{w:.1f}" for w in walls) + " | "
                     + " | ".join(f"{x:.2f}x" for x in ratios) + " | " + "; ".join(notes) + " |")
    loads = ", ".join(f"{k} {results[k]['load_s']:.1f} s" for k in kinds)
    lines.append(f"\nLM construction (not in the task times): {loads}; the server was loaded and warmed before.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-python", default="/work/venv-hf/bin/python",
                    help="python of a venv with torch, transformers and lm-eval (never jaxinfer's own)")
    ap.add_argument("--folder", default=os.path.expanduser("~/.cache/jaxinfer/eval/smollm2-135m-hf"))
    ap.add_argument("--limit", type=int, help="documents per task (default: all)")
    ap.add_argument("--backends", default="hf,local-completions,jaxinfer")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "figures", "eval_bench.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--url", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.folder, args.url, args.limit, args.out, args.tasks.split(","))
        return
    if not os.access(args.hf_python, os.X_OK):
        sys.exit(f"--hf-python {args.hf_python} is not an executable; make the venv: python -m venv /work/venv-hf && "
                 "/work/venv-hf/bin/pip install torch==2.13.0 transformers accelerate lm-eval==0.4.13 tenacity")
    folder = make_folder(args.folder)
    tmp = os.path.join(ROOT, "experiments", "out", "eval_bench")
    os.makedirs(tmp, exist_ok=True)
    results = {"tasks": args.tasks.split(","), "max_length": MAX_LENGTH, "max_slots": MAX_SLOTS, "limit": args.limit,
               "folder": folder}
    for kind in args.backends.split(","):
        if kind == "hf":
            results[kind] = run_worker(args.hf_python, kind, folder, "", args.limit, tmp, args.tasks)
        elif kind == "jaxinfer":
            results[kind] = run_worker(sys.executable, kind, folder, "", args.limit, tmp, args.tasks)
        elif kind == "local-completions":
            proc, url = start_server(folder, os.path.join(tmp, "serve.log"))
            try:
                results[kind] = run_worker(sys.executable, kind, folder, url, args.limit, tmp, args.tasks)
                metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
                results[kind]["server_metrics"] = [l for l in metrics.splitlines()
                                                   if l.startswith(("jaxinfer_prefix", "jaxinfer_http_requests"))]
            finally:
                stop_server(proc)
        else:
            sys.exit(f"unknown backend {kind!r}")
    results["comparison"] = {k: compare(results["hf"], results[k]) for k in results
                             if k in ("jaxinfer", "local-completions") and "hf" in results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    json.dump(results, open(args.out, "w"), indent=1)
    if "hf" in results:
        print(table(results))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
