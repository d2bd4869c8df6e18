"""The picture and the printed table of a device check report (experiments/device_check.py)."""

from __future__ import annotations

from pathlib import Path

from experiments import common  # noqa: F401  (selects matplotlib's file-only backend)
import matplotlib.pyplot as plt

COLORS = {"bf16": "tab:blue", "fp32": "tab:blue", "int8": "tab:orange", "int8kv": "tab:green",
          "stacked": "tab:gray", "int8_stacked": "tab:brown"}


def _runs(report: dict) -> list[dict]:
    return [r for r in report["sections"].get("decode", {}).get("runs", []) if "tok_s" in r]


def plot(report: dict, path: Path) -> None:
    """Three panels: decode tokens/s vs batch with the roofline; % of roofline; logit diffs."""
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    runs = _runs(report)
    for label, color in COLORS.items():
        rs = sorted((r for r in runs if r["label"] == label), key=lambda r: r["batch"])
        if rs:
            a.plot([r["batch"] for r in rs], [r["tok_s"] for r in rs], "o-", color=color, label=f"{label} measured")
            a.plot([r["batch"] for r in rs], [r["roofline_tok_s"] for r in rs], "--", color=color, alpha=0.6,
                   label=f"{label} roofline")
    a.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s (all rows)",
          title=f"decode, {report['sections'].get('decode', {}).get('model', {}).get('name', '?')}")
    if runs:
        a.legend(fontsize=7)
    names = [f"{r['label']} b{r['batch']}" for r in runs]
    b.bar(names, [r["pct_roofline"] for r in runs], color=[COLORS.get(r["label"], "gray") for r in runs])
    b.axhline(85, color="k", ls=":", lw=1, label="target 85%")
    b.set(ylabel="% of bandwidth roofline", title="decode vs measured bandwidth")
    b.tick_params(axis="x", labelrotation=60, labelsize=7)
    models = report["sections"].get("correctness", {}).get("models", {})
    rows = [(f"{m} {d}", r[d]["max_logit_diff"]) for m, r in models.items() for d in ("fp32", "bf16") if d in r]
    if rows:
        c.barh([n for n, _ in rows], [max(v, 1e-9) for _, v in rows], color="tab:purple")
        for tol, ls in ((report["sections"]["correctness"]["fp32_tol"], ":"),
                        (report["sections"]["correctness"]["bf16_tol"], "--")):
            c.axvline(tol, color="k", ls=ls, lw=1)
        c.set(xscale="log")
    c.set(xlabel="max |logit diff| vs transformers", title="correctness (lines: fp32 / bf16 tolerance)")
    c.tick_params(axis="y", labelsize=7)
    env = report["sections"].get("environment", {})
    fig.suptitle(f"jaxinfer device check: {env.get('device_kind', '?')} ({env.get('backend', '?')}), "
                 f"preset {report['preset']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def summary(report: dict) -> str:
    """The short table printed last (the device tool returns the end of the output)."""
    s = report["sections"]
    lines = [f"device check ({report['preset']}): " + ", ".join(
        f"{k} {'ok' if v['ok'] else 'FAILED'} {v['seconds']:.0f}s" for k, v in s.items())]
    d = s.get("decode", {})
    if "bandwidth" in d:
        lines.append(f"bandwidth: copy {d['bandwidth']['copy_GBps']:.0f} GB/s, read {d['bandwidth']['read_GBps']:.0f} GB/s; "
                     f"{d['matmul']['dtype']} matmul {d['matmul']['TFLOPs']:.1f} TFLOP/s")
    for r in d.get("runs", []):
        lines.append(f"  {r['label']:9s} batch {r['batch']:4d}: " + (
            f"{r['tok_s']:10.1f} tok/s  {r['pct_roofline']:5.1f}% of roofline {r['roofline_tok_s']:10.1f}"
            if "tok_s" in r else r.get("error", "?")))
    if "prefill" in d:
        p = d["prefill"]
        lines.append(f"  prefill {p['tokens']} tokens: {p['tok_s']:.0f} tok/s, {p['pct_peak']:.1f}% of matmul peak")
    if "prefill_stacked" in d:
        p = d["prefill_stacked"]
        lines.append(f"  prefill, canonical layout: {p['tok_s']:.0f} tok/s, {p['pct_peak']:.1f}% of matmul peak")
    for k, v in d.get("ratios", {}).items():
        lines.append(f"  {k}: {v:.2f}x")
    if d.get("skipped_for_time"):
        lines.append(f"  skipped for time: {', '.join(d['skipped_for_time'])}")
    for m, r in s.get("correctness", {}).get("models", {}).items():
        if "fp32" in r:
            lines.append(f"  {m:16s} fp32 {r['fp32']['max_logit_diff']:.1e} ({'pass' if r['fp32']['pass'] else 'FAIL'})"
                         f"  bf16 {r['bf16']['max_logit_diff']:.1e} argmax {r['bf16']['argmax_agree']:.3f}"
                         f"  batch=alone {r['batch_vs_alone']['greedy_identical']}/{r['batch_vs_alone']['sampled_identical']}"
                         f"  same seed {r['same_seed']['identical']}")
        else:
            lines.append(f"  {m:16s} {r.get('status') or r.get('error')}")
    srv = s.get("serving", {})
    if srv.get("runs"):
        for n, r in srv["runs"].items():
            if n.endswith("_static"):
                lines.append(f"  serving {n}: " + (f"{r['tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50']:.3f} s "
                                                   f"p99 {r['ttft_p99']:.3f} s" if "tokens_per_s" in r
                                                   else r.get("error", "?")))
                continue
            lines.append(f"  serving {n} slots: " + (
                f"{r['tokens_per_s']:.1f} tok/s ({r.get('pct_roofline', float('nan')):.1f}% of roofline), TTFT p50 "
                f"{r['ttft_p50']:.3f} s p99 {r['ttft_p99']:.3f} s, {r['iterations']} iterations "
                f"({r['tokens_per_iteration']:.1f} tokens each; {r.get('admitting_iterations', '?')} begun with requests "
                f"queued or prefilling, p50 {r.get('admitting_ms_p50', float('nan')):.1f} ms, the others p50 "
                f"{r.get('decoding_ms_p50', float('nan')):.1f} ms), call_rows {r.get('call_rows', '?')}, "
                f"{r['warmup_programs']} programs in warm-up"
                if "tokens_per_s" in r else r.get("error", "?")))
        for k, tr in srv.items():
            if k.startswith("trace_") and "devices" in tr:
                for dev, d in tr["devices"].items():
                    lines.append(f"  {k} {dev[:24]}: busy {d['busy_ms']:.0f} ms of {1e3 * tr['traced_wall_s']:.0f} ms "
                                 f"wall; programs {', '.join(f'{m} {v:.0f}' for m, v in list(d['by_program_ms'].items())[:4])}")
    else:
        lines.append(f"  serving: {srv.get('status') or srv.get('skipped') or srv.get('skipped_for_time')}")
    cm = s.get("compiles", {})
    if "n_programs" in cm:
        lines.append(f"  {cm['n_programs']} XLA programs, {cm['compile_s']:.0f} s compiling; peak/predicted "
                     f"memory {cm.get('peak_over_predicted', float('nan')):.2f}")
    return "\n".join(lines)
