"""`generate` speed before and after a change: two source trees side by side in one run.

    git worktree add /tmp/old <commit>               # the tree to compare against
    python experiments/bench_regression.py --old /tmp/old
    python experiments/bench_regression.py --old /tmp/old --sections decode --rounds 5   # batch 1 and 8 only
    python experiments/bench_regression.py --old /tmp/old --smoke

Each measurement runs in a fresh subprocess that imports jaxinfer from one tree, loads the
default model (`jaxinfer.load`, on a CPU the CPU decode layout), warms up, and times: prefill
tokens/s for a 128-, a 512- and a 2,048-token prompt (batch 1, time to first token), and decode
tokens/s at batch 1 and batch 8 (128 new tokens, greedy, no early stop;
`Timings.decode_tokens_per_s`, compile time excluded), and at batch 8 over long contexts: rows of
30, 130, ... 730 prompt tokens (the serving load's spread) and eight rows of 1,200. Each figure is
the median of `--repeats` runs after the one that compiles. Trees alternate round by round (old,
new, old, new ...), so a noisy neighbour slows both alike; the table reports medians, new/old
ratios of the medians, and the median of each round's new/old ratio. Writes
<out>/bench_regression.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORKER = r"""
import json, os, sys, time
import jaxinfer
model = jaxinfer.load(sys.argv[1])
text = open(sys.argv[2]).read()
ids = model.tokenizer.encode(text)
new = int(sys.argv[3])
sections = sys.argv[4].split(",")
repeats = int(sys.argv[5])
out = {}


def timed(prompts, n):  # Timings of the median run (by wall time) of `repeats`, after one that compiles
    jaxinfer.generate(model, prompts, max_new_tokens=n, stop_at_eos=False)
    ts = sorted((jaxinfer.generate(model, prompts, max_new_tokens=n, stop_at_eos=False).timings
                 for _ in range(repeats)), key=lambda t: t.total_s)
    return ts[len(ts) // 2]



for n in (128, 512, 2048) if "prefill" in sections else ():
    out[f"prefill_{n}_tokens_per_s"] = n / timed([ids[:n]], 1).ttft_s
for b in (1, 8) if "decode" in sections else ():
    out[f"decode_b{b}_tokens_per_s"] = timed([ids[i * 40:(i + 1) * 40] for i in range(b)], new).decode_tokens_per_s
for name, lengths in (("ctx_30_730", range(30, 731, 100)), ("ctx_1200", [1200] * 8)) if "long" in sections else ():
    out[f"decode_b8_{name}_tokens_per_s"] = timed([ids[:n] for n in lengths], new).decode_tokens_per_s
print("RESULT " + json.dumps(out))
"""


SECTIONS = ("prefill", "decode", "long")


def measure(tree: str, model: str, new_tokens: int, sections=SECTIONS, repeats: int = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    text = os.path.join(ROOT, "experiments", "data", "pydoc_heldout.txt")
    res = subprocess.run([sys.executable, "-c", WORKER, model, text, str(new_tokens), ",".join(sections),
                          str(repeats)], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=3600)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"worker in {tree} failed:\n{res.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def commit_of(tree: str):
    """The git commit checked out in `tree`, with "-dirty" when tracked files differ from it (None
    outside a git checkout)."""
    res = subprocess.run(["git", "-C", tree, "describe", "--always", "--dirty", "--abbrev=40"],
                         capture_output=True, text=True)
    return res.stdout.strip() or None


def main(argv=None) -> dict:
    from experiments import common, jsonfile

    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="source tree of the version to compare against")
    p.add_argument("--new", default=ROOT, help="source tree of the new version (default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per measurement in each worker (after one that compiles); the median run counts")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="what to time, comma-separated: prefill (128/512/2,048 tokens), decode (batch 1 and 8 "
                        "over 40-token prompts), long (batch 8 over long contexts); default all")
    args = p.parse_args(argv)
    sections = tuple(x for x in args.sections.split(",") if x)
    if not sections or set(sections) - set(SECTIONS):
        raise SystemExit(f"--sections takes a comma-separated subset of {','.join(SECTIONS)}, got {args.sections!r}")
    if args.smoke:
        args.rounds, args.new_tokens, args.repeats = 1, 8, 1
    runs = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in ("old", "new"):
            runs[name].append(measure(getattr(args, name), args.model, args.new_tokens, sections, args.repeats))
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[name][-1].items()))
    keys = list(runs["new"][0])
    table = {k: dict(old=float(np.median([x[k] for x in runs["old"]])),
                     new=float(np.median([x[k] for x in runs["new"]]))) for k in keys}
    for k, v in table.items():
        v["ratio"] = v["new"] / v["old"]
        # each round's new/old, the two runs minutes apart: steadier than the ratio of medians when the machine drifts
        v["round_ratio_median"] = float(np.median([n[k] / o[k] for n, o in zip(runs["new"], runs["old"])]))
        print(f"{k:28s} old {v['old']:8.1f}  new {v['new']:8.1f}  new/old {v['ratio']:.2f}x "
              f"(median of round ratios {v['round_ratio_median']:.2f}x)")
    result = dict(old_tree=os.path.abspath(args.old), new_tree=os.path.abspath(args.new),
                  old_commit=commit_of(args.old), new_commit=commit_of(args.new), rounds=args.rounds,
                  repeats=args.repeats, sections=sections,
                  table=table, runs=runs)
    jsonfile.write_json(os.path.join(args.out, "bench_regression.json"), result)
    return result


if __name__ == "__main__":
    main()
