"""Decode and prefill speed of jaxinfer vs transformers and llama.cpp, against the memory roofline.

One command, one model, one prompt, the same settings for every engine:

    python experiments/bench.py                 # SmolLM2-135M fp32, all engines found
    python experiments/bench.py --quick         # fewer repeats and tokens (a smoke run)

Measured in the same run (medians of --repeats, engines interleaved repeat by repeat, so a
noisy neighbour slows all of them alike and the ratios stay meaningful):
  - memory bandwidth: a jitted read of a 1 GiB array (bigger than the last-level cache);
  - prefill tokens/s at prompt 128 and 512 (batch 1);
  - decode tokens/s at batch 1, 8, 32 (128 new tokens; greedy; no early stop);
  - % of roofline = tokens/s x bytes read per step / tokens per step / bandwidth, where the bytes
    per step are the engine's weights plus the filled KV cache of every row;
  - jaxinfer time to first token: cold (new process, compile included), warm in-process, and warm
    from the persistent compilation cache (a second new process); XLA compilations; peak memory.
Peers: `transformers` (torch, fp32, `generate`) and `llama-cpp-python` on the same GGUF (its own
quantized weights; batch 1 only) are skipped with a message when not installed.
Writes experiments/out/bench-<time>.json and a PNG (tokens/s vs batch, with the roofline).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

import jaxinfer  # noqa: E402
from jaxinfer.model import cache as kv  # noqa: E402
from jaxinfer.weights import hub  # noqa: E402
from jaxinfer.model import layout  # noqa: E402
from jaxinfer.compile_cache import CompileCounter  # noqa: E402
from jaxinfer.model import params as P  # noqa: E402
from jaxinfer.model import quantize as Q  # noqa: E402
from experiments import common  # noqa: E402

PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith from "
          "Mainz combined movable metal type, oil-based ink and a wooden screw press. Within fifty "
          "years, printing had spread to hundreds of cities across Europe, and")


def rss_mb() -> float:
    """Peak resident memory of this process so far (MB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(PROMPT)
    return (ids * (n // len(ids) + 1))[:n]


# Engines -------------------------------------------------------------------------------------
# Each engine: prefill(ids) -> seconds; decode(batch of ids, n_new) -> decode tokens/s.

class JaxinferEngine:
    def __init__(self, model, name):
        self.model, self.name = model, name

    def prefill(self, ids):
        out = jaxinfer.generate(self.model, [ids], max_new_tokens=1, stop_at_eos=False)
        return out.timings.prefill_s

    def decode(self, batch, n_new):
        out = jaxinfer.generate(self.model, batch, max_new_tokens=n_new, stop_at_eos=False, chunk_size=32)
        return out.timings.decode_tokens_per_s

    def bytes_per_step(self, batch, filled):
        cfg = self.model.config
        return P.nbytes(self.model.params) + batch * filled * kv.bytes_per_token(cfg)


class TransformersEngine:
    name = "transformers"

    def __init__(self, gguf_path, threads):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        d, f = os.path.split(gguf_path)
        self.model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
        eos = self.model.config.eos_token_id
        self.pad = (eos[0] if isinstance(eos, (list, tuple)) else eos) or 0

    def _gen(self, batch, n_new):
        ids = self.torch.tensor(batch)
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=n_new,
                                min_new_tokens=n_new, do_sample=False, pad_token_id=self.pad)
            return time.perf_counter() - t0

    def prefill(self, ids):
        return self._gen([ids], 1)

    def decode(self, batch, n_new):
        t1 = self._gen(batch, 1)
        tn = self._gen(batch, n_new)
        return len(batch) * (n_new - 1) / max(tn - t1, 1e-9)

    def bytes_per_step(self, batch, filled):
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        cfg = self.model.config
        kv_tok = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
        return weights + batch * filled * kv_tok


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, gguf_path, threads, n_ctx, cfg):
        from llama_cpp import Llama

        self.kv_tok = kv.bytes_per_token(cfg, "float16")  # llama.cpp's default f16 KV cache

        self.llm = Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False)
        self.file_bytes = os.path.getsize(gguf_path)

    def prefill(self, ids):
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0

    def decode(self, batch, n_new):
        if len(batch) != 1:
            return None  # the high-level API decodes one sequence at a time
        self.llm.reset()
        self.llm.eval(batch[0])
        tok = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
        t0 = time.perf_counter()
        for _ in range(n_new - 1):
            self.llm.eval([tok])
            tok = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
        return (n_new - 1) / (time.perf_counter() - t0)

    def bytes_per_step(self, batch, filled):
        # Quantized weights as stored in the file (tokenizer metadata is negligible) + f16 KV cache.
        return self.file_bytes + batch * filled * self.kv_tok


# Time to first token, cold and warm (new processes) -------------------------------------------

_TTFT_CHILD = r"""
import sys, time, json
t0 = time.perf_counter()
sys.path.insert(0, {root!r})
import jaxinfer
from jaxinfer import compile_cache
from jaxinfer.model import layout
if {cache_dir!r}:
    compile_cache.enable_persistent_cache({cache_dir!r})
m = jaxinfer.load({model!r}, dtype={dtype!r}, layout="stacked")
if {fast!r}:
    m = layout.to_layout(m, "per_layer")
t_load = time.perf_counter() - t0
out = jaxinfer.generate(m, [{ids!r}], max_new_tokens=1, stop_at_eos=False)
print(json.dumps({{"load_s": t_load, "ttft_s": out.timings.ttft_s, "compilations": out.timings.n_compilations}}))
"""


def ttft_subprocess(model, dtype, fast, ids, cache_dir):
    code = _TTFT_CHILD.format(root=ROOT, cache_dir=cache_dir, model=model, dtype=dtype, fast=fast, ids=ids)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if r.returncode:
        return {"error": r.stderr[-400:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


# Main ------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=hub.DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-lens", default="128,512")
    ap.add_argument("--decode-prompt", type=int, default=32, help="prompt tokens per row for decode runs")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peers", default="transformers,llama.cpp", help="comma list; empty for none")
    ap.add_argument("--no-cpu-layout", action="store_true",
                    help="skip jaxinfer in the per_layer layout (jaxinfer.layout.to_layout)")
    ap.add_argument("--quant-modes", default="int8,int4",
                    help="comma list of jaxinfer weight quantizations to add as rows; empty for none")
    ap.add_argument("--no-ttft", action="store_true", help="skip the cold/warm start subprocesses")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 repeats, 32 new tokens, batch 1,8")
    ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "out"))
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.new_tokens, args.batches = 2, 32, "1,8"
    batches = [int(b) for b in args.batches.split(",")]
    prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    threads = os.cpu_count() or 1
    notes = []

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {threads} CPU cores; "
          f"load average {os.getloadavg()[0]:.1f} at start", flush=True)
    bw = common.measure_bandwidth(2**30, args.repeats)
    bw["read_GBps"] = bw["bandwidth_Bps"] / 1e9  # the roofline's bandwidth: decode reads its weights
    print(f"memory bandwidth (jitted 1 GiB read): {bw['read_GBps']:.1f} GB/s; copies: jax "
          f"{bw['jax_copy_Bps'] / 1e9:.1f}, numpy {bw['numpy_copy_Bps'] / 1e9:.1f} GB/s", flush=True)

    base = jaxinfer.load(args.model, dtype=args.dtype, layout="stacked")
    engines = [JaxinferEngine(base, "jaxinfer")]
    if not args.no_cpu_layout:  # per-layer arrays, fused projections: faster batch-1 decode
        engines.append(JaxinferEngine(layout.to_layout(base, "per_layer"), "jaxinfer-cpu-layout"))
    for mode in filter(None, args.quant_modes.split(",")):  # weight-only quantization, canonical layout
        engines.append(JaxinferEngine(dataclasses.replace(base, params=Q.quantize(base.params, base.config, mode)),
                                      f"jaxinfer-{mode}"))
    gguf = str(hub.fetch(args.model)) if not os.path.exists(args.model) else args.model
    mem = {"jaxinfer": rss_mb()}
    for peer in filter(None, args.peers.split(",")):
        try:
            if peer == "transformers":
                engines.append(TransformersEngine(gguf, threads))
            elif peer == "llama.cpp":
                engines.append(LlamaCppEngine(gguf, threads, n_ctx=1024, cfg=base.config))
            else:
                raise ValueError(f"unknown peer {peer!r}; known: transformers, llama.cpp")
            mem[peer] = rss_mb()
        except ImportError as e:
            msg = f"{peer}: skipped, not installed ({e.name}). README.md (section 'Speed') says how to install it."
            print(msg, flush=True)
            notes.append(msg)

    tok = base.tokenizer
    with CompileCounter() as compiles:
        # Warm-up: compile every shape once (not timed).
        for e in engines:
            for n in prompt_lens:
                e.prefill(prompt_ids(tok, n))
            for b in batches:
                e.decode([prompt_ids(tok, args.decode_prompt)] * b, min(args.new_tokens, 8) if "jax" not in e.name else args.new_tokens)
    n_compiles = compiles.count

    prefill = {e.name: {n: [] for n in prompt_lens} for e in engines}
    decode = {e.name: {b: [] for b in batches} for e in engines}
    for r in range(args.repeats):
        for e in engines:
            for n in prompt_lens:
                prefill[e.name][n].append(n / e.prefill(prompt_ids(tok, n)))
            for b in batches:
                decode[e.name][b].append(e.decode([prompt_ids(tok, args.decode_prompt)] * b, args.new_tokens))
        print(f"repeat {r + 1}/{args.repeats} done (load average {os.getloadavg()[0]:.1f})", flush=True)

    med = lambda xs: float(np.median([x for x in xs if x is not None])) if any(x is not None for x in xs) else None
    filled = args.decode_prompt + args.new_tokens / 2  # mean filled KV slots per row during decode
    results = {}
    for e in engines:
        row = {"prefill_tok_s": {n: med(prefill[e.name][n]) for n in prompt_lens},
               "decode_tok_s": {b: med(decode[e.name][b]) for b in batches},
               "decode_all": {b: decode[e.name][b] for b in batches}}
        row["bytes_per_step"] = {b: e.bytes_per_step(b, filled) for b in batches}
        row["roofline_tok_s"] = {b: b * bw["read_GBps"] * 1e9 / row["bytes_per_step"][b] for b in batches}
        row["pct_roofline"] = {b: (100 * row["decode_tok_s"][b] / row["roofline_tok_s"][b]
                                   if row["decode_tok_s"][b] else None) for b in batches}
        results[e.name] = row

    ttft = {}
    if not args.no_ttft:
        ids = prompt_ids(tok, args.decode_prompt)
        ttft["in_process_warm_s"] = med([jaxinfer.generate(engines[0].model, [ids], max_new_tokens=1,
                                                            stop_at_eos=False).timings.ttft_s
                                         for _ in range(args.repeats)])
        ttft["cold"] = ttft_subprocess(args.model, args.dtype, False, ids, "")
        if not args.no_cpu_layout:  # its unrolled layer loop compiles longer
            ttft["cold_cpu_layout"] = ttft_subprocess(args.model, args.dtype, True, ids, "")
        with tempfile.TemporaryDirectory() as d:
            ttft["persistent_cache_first"] = ttft_subprocess(args.model, args.dtype, False, ids, d)
            ttft["persistent_cache_second"] = ttft_subprocess(args.model, args.dtype, False, ids, d)

    report = {"model": args.model, "dtype": args.dtype, "bandwidth": bw, "threads": threads,
              "new_tokens": args.new_tokens, "decode_prompt": args.decode_prompt, "repeats": args.repeats,
              "results": results, "jaxinfer_compilations": n_compiles, "ttft": ttft,
              "peak_rss_mb_after_load": mem, "peak_rss_mb": rss_mb(), "notes": notes,
              "load_average_end": os.getloadavg(), "platform": platform.platform(),
              "jax": jax.__version__}
    print_table(report, batches, prompt_lens)
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(args.out, f"bench-{stamp}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    png = plot(report, batches, os.path.join(args.out, f"bench-{stamp}.png"))
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return report


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def print_table(rep, batches, prompt_lens):
    res = rep["results"]
    names = list(res)
    cols = [f"prefill@{n}" for n in prompt_lens] + [f"decode B={b}" for b in batches] + \
           [f"%roof B={b}" for b in batches]
    print(f"\n{rep['model']} {rep['dtype']} | bandwidth {rep['bandwidth']['read_GBps']:.1f} GB/s | "
          f"median of {rep['repeats']} | tokens/s")
    print(f"{'engine':20s}" + "".join(f"{c:>14s}" for c in cols))
    for n in names:
        r = res[n]
        vals = [r["prefill_tok_s"][p] for p in prompt_lens] + [r["decode_tok_s"][b] for b in batches]
        pcts = [r["pct_roofline"][b] for b in batches]
        print(f"{n:20s}" + "".join(f"{_fmt(v):>14s}" for v in vals) + "".join(f"{_fmt(v):>13s}%" for v in pcts))
    ours_names = [n for n in ("jaxinfer", "jaxinfer-cpu-layout") if n in res]
    for mine in ours_names:
        print(f"ratios {mine} / other (same run):")
        ours = res[mine]
        for n in names:
            if n == mine or n.startswith("jaxinfer-"):  # peers, and the canonical layout for the CPU layout
                continue
            r = res[n]
            pairs = [(ours["prefill_tok_s"][p], r["prefill_tok_s"][p]) for p in prompt_lens] + \
                    [(ours["decode_tok_s"][b], r["decode_tok_s"][b]) for b in batches]
            print(f"  vs {n:16s}" + "".join(f"{_fmt(a / b if a and b else None, '.2f') + 'x':>14s}" for a, b in pairs))
    for mine in [n for n in names if n.startswith("jaxinfer-int")]:
        ref = res.get("jaxinfer")
        if ref and ref["decode_tok_s"].get(1) and res[mine]["decode_tok_s"].get(1):
            print(f"{mine} / jaxinfer float decode at batch 1: "
                  f"{res[mine]['decode_tok_s'][1] / ref['decode_tok_s'][1]:.2f}x")
    for mine in ours_names:
        b1 = res[mine]["decode_tok_s"].get(1)
        for b in batches[1:]:
            if b1 and res[mine]["decode_tok_s"][b]:
                print(f"{mine} batch {b} aggregate / batch 1: {res[mine]['decode_tok_s'][b] / b1:.2f}x")
    if len(ours_names) == 2 and 1 in batches:  # one library, both layouts: the best per batch size
        best = {b: max(res[n]["decode_tok_s"][b] or 0 for n in ours_names) for b in batches}
        for b in batches[1:]:
            print(f"jaxinfer (faster layout per batch) batch {b} / batch 1: {best[b] / best[1]:.2f}x")
    t = rep["ttft"]
    if t:
        get = lambda k: t.get(k, {}).get("ttft_s")
        print(f"time to first token: cold {_fmt(get('cold'), '.2f')} s (new process, compile included; load "
              f"{_fmt(t.get('cold', {}).get('load_s'), '.1f')} s not counted) | warm in-process "
              f"{_fmt(t.get('in_process_warm_s'), '.3f')} s | persistent cache, second process "
              f"{_fmt(get('persistent_cache_second'), '.2f')} s"
              + (f" | cold in the CPU layout {_fmt(get('cold_cpu_layout'), '.2f')} s" if "cold_cpu_layout" in t else ""))
    print(f"jaxinfer XLA compilations (all shapes above): {rep['jaxinfer_compilations']}; "
          f"peak RSS {rep['peak_rss_mb']:.0f} MB (after loads: {rep['peak_rss_mb_after_load']})")
    for n in rep["notes"]:
        print("note:", n)


def plot(rep, batches, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in rep["results"].items():
        xs = [b for b in batches if r["decode_tok_s"][b]]
        line, = ax.plot(xs, [r["decode_tok_s"][b] for b in xs], "o-", label=name)
        ax.plot(batches, [r["roofline_tok_s"][b] for b in batches], "--", color=line.get_color(), alpha=0.6,
                label=f"{name} roofline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s (aggregate)")
    ax.set_title(f"{rep['model']} {rep['dtype']}, {rep['bandwidth']['read_GBps']:.1f} GB/s measured")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":
    main()
