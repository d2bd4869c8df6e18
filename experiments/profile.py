"""Where does a step's time go? A profiler trace of one prefill and a few decode steps, per named stage.

    python -m experiments.profile [--prompt-tokens 256] [--decode-steps 8] [--batch 1]

Each stage of the data path runs under a `jax.named_scope`, so the compiled programs' HLO names
every op's stage in its `op_name`. This traces one prefill and one decode scan (<out>/profile/:
TensorBoard's profile plugin, or the .trace.json.gz in Perfetto), attributes each timed op to its
innermost stage, and writes profile.json: time per stage and its top ops.
"""

from __future__ import annotations

import collections
import gzip
import json
import math
import os
import re
import time
from pathlib import Path

import jax
import numpy as np

from experiments import _common, _measure
from jaxinfer.decode import core, request
from jaxinfer.decode import sampling as smp
from jaxinfer.model import cache as kv

# Innermost first: an op in attention/cache_write counts as cache_write.
STAGES = ("cache_write", "paged_attention", "sampling", "embed", "attention", "mlp", "logits")
CONTAINERS = ("while", "conditional", "call")  # ops whose timed span contains other timed ops


def stage_of(op_name: str) -> str:
    """The innermost named stage in an op's scope path; a layer scan's slicing of its stacked
    weights is "layer_slices"; anything else is "other"."""
    parts = op_name.split("/")
    stage = next((p for p in reversed(parts) if p in STAGES), None)
    return stage or ("layer_slices" if "jit(dynamic_index_in_dim)" in parts else "other")


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the scope path it was traced under (its op_name metadata), in a
    compiled module. A fusion without metadata (e.g. an XNNPACK matmul fusion) takes the most
    common scope inside its computation, else that of its first named user; control-flow
    containers map to "" (their body ops are timed on their own)."""
    comp, inside, instrs, users = None, collections.defaultdict(list), [], collections.defaultdict(list)
    for line in hlo_text.splitlines():
        head = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and "=" not in line.split("{")[0]:
            comp = head.group(1)
            continue
        m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = \S+ (\w[\w\-]*)\(", line)
        if not m:
            continue
        meta, calls = re.search(r'op_name="([^"]*)"', line), re.search(r"calls=%?([\w.\-]+)", line)
        instrs.append((m.group(1), m.group(2), meta.group(1) if meta else "", calls.group(1) if calls else None))
        for operand in re.findall(r"%([\w.\-]+)", line.split("=", 1)[1].split("metadata=")[0]):
            users[operand].append(m.group(1))
        if meta and comp is not None:
            inside[comp].append(meta.group(1))
    out = {}
    for name, opcode, scope, called in instrs:
        if opcode in CONTAINERS:
            scope = ""
        elif not scope and inside.get(called):
            scope = collections.Counter(inside[called]).most_common(1)[0][0]
        out[name] = scope
    for name, opcode, scope, _ in instrs:
        if not out[name] and opcode not in CONTAINERS:
            out[name] = next((out[u] for u in users[name] if out.get(u)), "")
    return out


def read_trace(folder: str) -> list[dict]:
    """Every event of the newest Perfetto trace under `folder`."""
    with gzip.open(max(Path(folder).rglob("*.trace.json.gz"), key=os.path.getmtime)) as f:
        return json.load(f)["traceEvents"]


def _device_events(events: list[dict]) -> tuple[dict, list[dict]]:
    """The trace's process names by pid, and its timed events: on an accelerator only those of its
    device processes (the host's launch events would count each op twice), on a CPU all."""
    names = {e["pid"]: str(e.get("args", {}).get("name")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in names.items() if re.match(r"/device:(GPU|TPU)", name)}
    return names, [e for e in events if e.get("ph") == "X" and "dur" in e and (not devices or e.get("pid") in devices)]


def device_time(events: list[dict], top: int = 15) -> dict:
    """Per device process of a trace (every process on a CPU): busy ms (the union of its timed
    events' intervals, so overlapping streams or threads count once), and the events' summed ms
    by XLA program (`hlo_module`) and by event name (kernel), top first."""
    names, timed = _device_events(events)
    by_pid = collections.defaultdict(list)
    for e in timed:
        by_pid[e.get("pid")].append(e)
    out = {}
    for pid, evs in by_pid.items():
        busy, end = 0.0, -math.inf
        for a, b in sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs):
            if b > end:
                busy, end = busy + b - max(a, end), b
        modules, kernels = collections.Counter(), collections.Counter()
        for e in evs:
            modules[str(e.get("args", {}).get("hlo_module", "?"))] += e["dur"] / 1e3
            kernels[str(e.get("name"))[:120]] += e["dur"] / 1e3
        out[names.get(pid, str(pid))] = {
            "busy_ms": busy / 1e3, "events": len(evs),
            "by_program_ms": {k: round(v, 3) for k, v in modules.most_common(top)},
            "by_kernel_ms": {k: round(v, 3) for k, v in kernels.most_common(top)}}
    return out


def per_stage(events: list[dict], names: dict[str, dict[str, str]]) -> dict:
    """Milliseconds per program and stage, with each stage's share and top ops, from a trace's
    events and each program's `op_names`."""
    table: dict = {}
    for e in _device_events(events)[1]:
        info = e.get("args", {})
        module, op = info.get("hlo_module", ""), info.get("hlo_op")
        prog = next((p for p in names if p in module), None)
        if prog is None or op not in names[prog] or (not names[prog][op] and op.split(".")[0] in CONTAINERS):
            continue  # not an op of these programs, or a container whose body is timed op by op
        scope = names[prog][op]
        row = table.setdefault(prog, {}).setdefault(stage_of(scope), {"us": 0.0, "ops": collections.Counter()})
        row["us"] += e["dur"]
        row["ops"][scope.split("/")[-1] or op] += e["dur"]
    out = {}
    for prog, stages in table.items():
        total = sum(s["us"] for s in stages.values())
        out[prog] = {st: {"ms": s["us"] / 1e3, "share": s["us"] / total,
                          "top_ops": [(k, round(v / 1e3, 3)) for k, v in s["ops"].most_common(4)]}
                     for st, s in sorted(stages.items(), key=lambda item: -item[1]["us"])}
    return out


def main(argv=None, model=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args(argv)
    if args.smoke:
        args.prompt_tokens, args.decode_steps = 16, 4
        model = model or _common.tiny_model()

    model = _common.load_model(args, model)
    cfg, B, T, steps = model.config, args.batch, args.prompt_tokens, args.decode_steps
    ids = np.asarray(_measure.prompts(model, B, T), np.int32)
    counts = core.host_counts(ids.tolist(), cfg.vocab_size)

    def rows():  # fresh each time: the decode scan donates its state, keys included
        return request.initial_rows(smp.row_keys(np.arange(B)), smp.GREEDY, (), steps + 1, vocab_size=cfg.vocab_size)

    def prefill_args():
        work = core.PrefillWork(tokens=ids, starts=np.zeros((B,), np.int32), n_real=np.full((B,), T, np.int32),
                                last=np.ones((B,), bool), rows=rows(), counts=counts, next_tokens=np.zeros_like(ids))
        return model.params, kv.init_cache_jit(cfg, B, T + steps + 1), work

    # each program compiled once, ahead of time: its HLO names the ops' stages, and the trace runs it
    prefill = core.prefill_jit.lower(*prefill_args(), options=core.PrefillOptions(cfg=cfg)).compile()

    def decode_state():
        cache, _, out = prefill(*prefill_args())
        r = rows()
        return core.DecodeState(cache=cache, tokens=np.asarray(out.first.tokens[:, 0]), counts=counts,
                                rows=r.replace(steps=r.steps + 1, budget=r.budget - 1))

    decode = core.decode_jit.lower(model.params, decode_state(), options=core.DecodeOptions(cfg=cfg),
                                   n_steps=steps).compile()

    def run():
        return jax.block_until_ready(decode(model.params, decode_state())[1])

    run()  # the first run's allocations stay out of the trace
    folder, t0 = os.path.join(args.out, "profile"), time.perf_counter()
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        run()
    wall, events = time.perf_counter() - t0, read_trace(folder)
    table = per_stage(events, {"prefill": op_names(prefill.as_text()), "decode": op_names(decode.as_text())})
    for prog, stages in table.items():
        what = f"{T}-token prompt x {B}" if prog == "prefill" else f"{steps} steps x {B} rows"
        print(f"\n{prog} ({what}): time per stage (XLA ops the trace timed)")
        for st, row in stages.items():
            ops = ", ".join(f"{k} {v:.2f} ms" for k, v in row["top_ops"])
            print(f"  {st:16s} {row['ms']:9.2f} ms  {100 * row['share']:5.1f}%   top: {ops}")
    result = {"model": args.model, "batch": B, "prompt_tokens": T, "decode_steps": steps, "layout": cfg.layout,
              "trace_folder": folder, "traced_wall_s": wall, "stages": table, "devices": device_time(events)}
    _common.save("profile", result, args)
    return result


if __name__ == "__main__":
    main()
