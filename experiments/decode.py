"""How fast does jaxinfer decode, against the bandwidth roofline, by batch, layout and quantization?

    python -m experiments.decode [--peers transformers,llama.cpp]   # SmolLM2-135M, every variant side by side
    python -m experiments.decode --preset llama3_8b --dtype bfloat16 --batches 1,8,64   # random 8B weights (a GPU)
    python -m experiments.decode --against HEAD~1 --rounds 4        # this tree against another commit or tree

Every --variants (`_measure.variant`) interleaved repeat by repeat, medians of --repeats after the
call that compiles: decode tokens/s of `generate` (greedy, no early stop) at --batches against the
roofline B x bandwidth / (weight bytes + B x filled KV bytes), the bandwidth measured in the run;
prefill tokens/s at --prefill lengths. --peers: transformers' fp32 `generate` in this process and
llama.cpp at batch 1 under the peer's python, on the same weights (`_peer`). --against: fresh
processes importing jaxinfer from each tree (a commit goes into a temporary git worktree),
alternating round by round, time --sections; medians, their ratio and the median of the rounds'
ratios. Writes decode.json and .png (decode_against.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import jax

from experiments import _common, _measure, _peer
from experiments._common import ROOT, plt
from jaxinfer.inspect import roofline
from jaxinfer.model import cache
from jaxinfer.weights import hub

VARIANTS = ("default", "stacked", "per_layer", "int8", "int8_stacked", "int4", "int8kv", "fused_attention")
SECTIONS = ("prefill", "decode", "long")


def transformers_decode(gguf: str, batches, prompt: list[int], n: int, repeats: int) -> tuple[dict, int, int]:
    """transformers' fp32 greedy `generate` on the same GGUF in this process (torch must be
    installed): decode tokens/s per batch (n tokens less the first), weight bytes, KV bytes per token."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                 dtype=torch.float32).eval()
    c, eos = model.config, model.config.eos_token_id

    def seconds(ids, k) -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k, do_sample=False,
                           pad_token_id=(eos[0] if isinstance(eos, (list, tuple)) else eos) or 0)
            return time.perf_counter() - t0

    tok = {b: median(b * (n - 1) / max(seconds(torch.tensor([prompt] * b), n) - seconds(torch.tensor([prompt] * b), 1),
                                       1e-9) for _ in range(repeats)) for b in batches}
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    return tok, sum(p.numel() * p.element_size() for p in model.parameters()), kv


def peers(args, base, bw: float, batches) -> tuple[dict, list[str]]:
    """Rows of the peers named in --peers on the same weights, and why any was skipped."""
    rows, notes = {}, []
    ids = _measure.prompts(base, 1, args.prompt)[0]
    for peer in filter(None, args.peers.split(",")):
        if peer == "transformers":
            try:
                gguf = args.model if os.path.exists(args.model) else str(hub.fetch(args.model))
                tok, wb, kv = transformers_decode(gguf, batches, ids, args.new_tokens, args.repeats)
            except ImportError as e:
                notes.append(f"transformers skipped: {e.name} is not installed")
                continue
        elif peer == "llama.cpp":
            p = _peer.from_args(args)
            why = p.missing("python", "gguf")
            if why:
                notes.append(f"llama.cpp skipped: {why}")
                continue
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(ids, f)
            r = _peer.run_worker(p, f.name, args.repeats + 1, args.llama_threads, decode_tokens=args.new_tokens)
            os.unlink(f.name)
            if "error" in r:
                notes.append(f"llama.cpp failed: {r['error']}")
                continue
            tok = {1: median([c["decode_tok_s"] for c in r["calls"][1:]])}  # batch 1 only
            wb, kv = r["file_bytes"], cache.bytes_per_token(base.config, "float16")  # its f16 KV cache
        else:
            raise SystemExit(f"unknown peer {peer!r}: transformers, llama.cpp")
        filled_kv = (args.prompt + args.new_tokens / 2) * kv
        roofs = {b: roofline.decode_ceiling(bw, wb, batch=b, cache_bytes_per_row=filled_kv) for b in tok}
        rows[peer] = {"decode": {b: {"batch": b, "tok_s": v, "roofline_tok_s": roofs[b], "pct_roofline": 100 * v / roofs[b]}
                                 for b, v in tok.items()}}
    return rows, notes


def plot(result: dict):
    fig, ax = plt().subplots(figsize=(6.5, 4.2))
    for name, r in result["variants"].items():
        rows = sorted(r["decode"].values(), key=lambda x: x["batch"])
        (line,) = ax.plot([x["batch"] for x in rows], [x["tok_s"] for x in rows], "o-", label=name)
        ax.plot([x["batch"] for x in rows], [x["roofline_tok_s"] for x in rows], "--", color=line.get_color(), alpha=0.5)
    ax.set(yscale="log", xlabel="batch size", ylabel="decode tokens/s (all rows)",
           title=f"{result['model']}: measured (solid) and roofline (dashed), "
                 f"{result['bandwidth']['roofline_Bps'] / 1e9:.1f} GB/s")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def summary(name: str, r: dict) -> str:
    """One printed line: decode tokens/s (% of the roofline) per batch, then prefill tokens/s per length."""
    return "  ".join([f"{name:14s}"] + [f"B={b} {x['tok_s']:8.1f} ({x['pct_roofline']:4.0f}%)" for b, x in r["decode"].items()]
                     + [f"prefill@{n} {x['tok_s']:7.0f}" for n, x in r.get("prefill", {}).items()])


def measure(args, base) -> dict:
    """Every variant's decode and prefill, interleaved, and the peers."""
    batches = [int(b) for b in args.batches.split(",") if b]
    prefill_lens = [int(n) for n in args.prefill.split(",") if n]
    dtype = base.config.dtype if jax.default_backend() != "cpu" else "float32"  # XLA CPU bf16 is emulated
    bw = _measure.bandwidth(args.copy_mib << 20, args.repeats, dtype)
    peak = _measure.matmul_peak(args.matmul_n, args.repeats, dtype)
    print(f"bandwidth {bw['roofline_Bps'] / 1e9:.1f} GB/s (read {bw['read_Bps'] / 1e9:.1f}, copy "
          f"{bw['copy_Bps'] / 1e9:.1f}); matmul {peak / 1e12:.2f} TFLOP/s", flush=True)
    models = {v: _measure.variant(base, v) for v in args.variants.split(",")}
    calls = {}
    for v, m in models.items():
        for b in batches:
            calls[(v, "decode", b)] = _measure.decode_call(m, _measure.prompts(m, b, args.prompt), args.new_tokens,
                                                            args.chunk)
        for n in prefill_lens:
            calls[(v, "prefill", n)] = _measure.prefill_call(m, _measure.prompts(m, 1, n)[0])
    runs = _measure.interleaved(calls, args.repeats)
    variants, filled = {}, args.prompt + args.new_tokens / 2
    for v, m in models.items():
        prefill_s = {n: median(runs[(v, "prefill", n)]) for n in prefill_lens}
        variants[v] = {"layout": m.config.layout, "kv_dtype": m.config.kv_dtype,
                       "decode": {b: _measure.roofline_row(m, b, runs[(v, "decode", b)], filled, bw["roofline_Bps"])
                                  for b in batches},
                       "prefill": {n: {"tok_s": n / s, "pct_peak": 100 * _measure.prefill_flops(m, n) / s / peak}
                                   for n, s in prefill_s.items()}}
        print(summary(v, variants[v]), flush=True)
    result = {"model": base.config.name, "dtype": base.config.dtype, "bandwidth": bw, "matmul_flops_per_s": peak,
              "batches": batches, "prompt": args.prompt, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "variants": variants}
    if args.peers:
        result["peers"], result["notes"] = peers(args, base, bw["roofline_Bps"], batches)
        for n in result["notes"]:
            print("note:", n)
        for name, r in result["peers"].items():
            print(summary(name, r))
    return result


# ---- two trees side by side ---------------------------------------------------------------------

# Self-contained: it runs under the other tree, whose experiments/ may differ from this one's.
WORKER = r"""
import json, os, sys, time
import numpy as np
import jaxinfer
name, text, new, sections, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(","), int(sys.argv[5])
batches, lengths = ((1,), (128,)) if name == "tiny" else ((1, 8), (128, 512, 2048))
if name == "tiny":  # a random tiny model (the smoke run): random prompts
    import jax
    from jaxinfer.model import config, params
    from jaxinfer.model.model import Model
    cfg = config.tiny(max_seq_len=4096)
    model = Model(cfg, params.init_params(cfg, jax.random.key(0)))
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, 3000).tolist()
else:
    model = jaxinfer.load(name)
    ids = model.tokenizer.encode(open(text).read())
out = {}

def timed(prompts, n):  # (Timings, CPU seconds over wall seconds) of the median run by wall time, after one that compiles
    jaxinfer.generate(model, prompts, max_new_tokens=n, stop_at_eos=False)
    runs = []
    for _ in range(repeats):
        c0, t0 = os.times(), time.perf_counter()
        t = jaxinfer.generate(model, prompts, max_new_tokens=n, stop_at_eos=False).timings
        c1, t1 = os.times(), time.perf_counter()
        runs.append((t, (c1.user - c0.user + c1.system - c0.system) / (t1 - t0)))
    return sorted(runs, key=lambda r: r[0].total_s)[len(runs) // 2]

for n in lengths if "prefill" in sections else ():
    out[f"prefill_{n}_tokens_per_s"] = n / timed([ids[:n]], 1)[0].ttft_s
for b in batches if "decode" in sections else ():
    t, busy = timed([ids[i * 40:(i + 1) * 40] for i in range(b)], new)
    out[f"decode_b{b}_tokens_per_s"] = t.decode_tokens_per_s
    out[f"decode_b{b}_cores_busy"] = busy  # below the core count, XLA idles a core
for name, lengths in (("ctx_30_730", range(30, 731, 100)), ("ctx_1200", [1200] * 8)) if "long" in sections else ():
    out[f"decode_b8_{name}_tokens_per_s"] = timed([ids[:n] for n in lengths], new)[0].decode_tokens_per_s
print(json.dumps(out))
"""


def commit_of(tree) -> str | None:
    """The commit checked out in `tree`, "-dirty" when tracked files differ (None outside git)."""
    r = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty", "--abbrev=40"], capture_output=True,
                       text=True)
    return r.stdout.strip() or None


def against(args) -> dict:
    """WORKER under --against and --new, alternating for --rounds: medians, ratios and every run."""
    sections = [s for s in args.sections.split(",") if s]
    if not sections or set(sections) - set(SECTIONS):
        raise SystemExit(f"--sections takes a comma-separated subset of {','.join(SECTIONS)}, got {args.sections!r}")
    cmd = [sys.executable, "-c", WORKER, "tiny" if args.smoke else args.model, str(_common.TEXT), str(args.new_tokens),
           ",".join(sections), str(args.repeats)]
    with _common.source_tree(args.against) as old:
        trees = {"old": old, "new": Path(args.new).resolve()}
        runs = {"old": [], "new": []}
        for r in range(args.rounds):
            for side in ("old", "new"):  # alternating: drift on the machine hits both alike
                runs[side].append(_common.run_json(cmd, tree=trees[side]))
                print(f"round {r + 1} {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[side][-1].items()), flush=True)
        commits = {side: commit_of(t) for side, t in trees.items()}
    table = {}
    for k in runs["new"][0]:
        old, new = median([x[k] for x in runs["old"]]), median([x[k] for x in runs["new"]])
        # each round's new/old, the two runs minutes apart: steadier than the ratio of medians on a drifting machine
        rr = median([n[k] / o[k] for n, o in zip(runs["new"], runs["old"])])
        table[k] = {"old": old, "new": new, "ratio": new / old, "round_ratio_median": rr}
        print(f"{k:32s} old {old:8.2f}  new {new:8.2f}  new/old {new / old:.2f}x (median of round ratios {rr:.2f}x)")
    return {"old_tree": str(trees["old"]), "new_tree": str(trees["new"]), "old_commit": commits["old"],
            "new_commit": commits["new"], "rounds": args.rounds, "sections": sections, "table": table, "runs": runs}


def main(argv=None, model=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--preset", help="random weights of this jaxinfer.model.config preset function (e.g. llama3_8b, "
                                    "tiny) instead of --model")
    p.add_argument("--dtype", default="bfloat16", help="--preset's dtype (default %(default)s)")
    p.add_argument("--variants", default="default,stacked,int8,int4", help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row for decode")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--chunk", type=int, default=None, help="decode steps per scan (default: generate's)")
    p.add_argument("--prefill", default="128,512", help="prefill prompt lengths (batch 1); empty for none")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--copy-mib", type=int, default=1024, help="bandwidth probe size")
    p.add_argument("--matmul-n", type=int, default=2048, help="matmul peak probe: n x n x n")
    p.add_argument("--peers", default="", help="comma list: transformers, llama.cpp")
    p.add_argument("--against", help="another source tree or git commit, side by side with --new")
    p.add_argument("--new", default=str(ROOT), help="--against: the new tree (default: this one)")
    p.add_argument("--rounds", type=int, default=3, help="--against: rounds, trees alternating")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="--against: comma list of prefill (128, 512, 2,048 tokens), decode (batch 1 and 8), long "
                        "(batch 8 over contexts of 30-730 and of 1,200 tokens)")
    _peer.add_arguments(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.preset = args.preset or "tiny"
        # the device check's smoke shapes: in one test session the two share their compiled programs
        args.batches, args.prompt, args.new_tokens, args.chunk, args.prefill, args.repeats = "1", 16, 16, 8, "16", 1
        args.copy_mib, args.matmul_n, args.rounds, args.sections = 16, 128, 1, "prefill"
        args.dtype, args.variants = "float32", "default,int8"
    if args.against:
        result = against(args)
        _common.save("decode_against", result, args)
        return result
    if model is None and args.preset:
        model = _measure.random_model(args.preset, args.dtype)
    result = measure(args, _common.load_model(args, model))
    _common.save("decode", result, args, plot(result))
    return result


if __name__ == "__main__":
    main()
