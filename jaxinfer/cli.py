"""Command line: `jaxinfer generate "prompt"` (also `python -m jaxinfer generate ...`),
`jaxinfer convert SOURCE --out checkpoints/NAME` and `jaxinfer serve --model NAME`.

A thin layer over the library: parse flags, load, call `jaxinfer.generate` with a streaming
callback that prints text as each decode chunk arrives, then print a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def _add_generate(sub) -> None:
    from jaxinfer.weights.hub import DEFAULT_MODEL, KNOWN_MODELS

    p = sub.add_parser("generate", help="generate a continuation of a prompt")
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts are run as one batch)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"known model ({', '.join(sorted(KNOWN_MODELS))}), a .gguf file or a checkpoint / "
                   "Hugging Face folder")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed of every row (samples are reproducible)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quant", choices=["int8", "int4"], help="weight-only quantization (default: none)")
    p.add_argument("--kv-cache", choices=["int8"], help="KV-cache dtype (default: the param dtype)")
    p.add_argument("--speculative", choices=["lookup", "draft"],
                   help="speculative decoding: prompt n-gram lookup, or the target's first --draft-layers as draft")
    p.add_argument("--spec-k", type=int, default=4, help="tokens proposed per speculative round")
    p.add_argument("--draft-layers", type=int, default=4, help="layers of the truncated-target draft")
    p.add_argument("--draft", help="draft checkpoint folder (experiments/distill_draft.py) instead of the "
                                   "truncated target")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--no-stop", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--chunk-size", type=int, default=8,
                   help="decode steps per streamed chunk (the library's default, 32, favours throughput; "
                        "8 keeps streamed text flowing)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="shard over a (data, model) device mesh, e.g. data=2,model=4; D x M must equal the "
                        "device count (on CPU fake devices with "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="persistent XLA compilation cache, so a second run starts warm "
                        "(default $JAXINFER_COMPILE_CACHE or ~/.cache/jaxinfer/xla)")
    p.add_argument("--no-compile-cache", action="store_true", help="do not read or write the compile cache")
    p.add_argument("--layout", choices=["auto", "canonical", "cpu"], default="auto",
                   help="weight layout: cpu = one array per layer with fused q/k/v and gate/up projections "
                        "(jaxinfer.layout; 1.5x batch-1 decode on CPU, longer first compile); auto (default) "
                        "picks cpu on a CPU backend for float weights on one device, without --speculative, "
                        "for fewer than 8 prompts, else canonical")
    p.add_argument("--cpu-layout", "--unstack-layers", dest="layout", action="store_const", const="cpu",
                   help="same as --layout cpu")


def _generate(args) -> int:
    import jaxinfer
    from jaxinfer.decode.sampling import SamplingParams

    # Validate cheap things before the (slow) load.
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    plain = not (args.quant or args.speculative or args.mesh is not None)
    if args.layout == "cpu" and not plain:
        raise ValueError("--layout cpu works with plain float weights on one device, without --quant, "
                         "--speculative or --mesh")
    # The library's "auto" rule, plus the batch size only the CLI knows: for 8+ prompts the
    # canonical layout decodes faster on CPU (see jaxinfer/model/layout.py).
    layout = "canonical" if args.layout == "auto" and (not plain or len(args.prompt) >= 8) else args.layout
    mesh = None
    if args.mesh is not None:  # a bad spec fails here, before the load and any compile
        from jaxinfer import sharding

        mesh = sharding.make_mesh(**sharding.parse_mesh_spec(args.mesh))
    if not args.no_compile_cache:  # process-wide JAX setting: only once the input is known good
        from jaxinfer.compile_cache import enable_persistent_cache

        enable_persistent_cache(args.compile_cache)
    model = jaxinfer.load(args.model, dtype=args.dtype, quant=args.quant, kv_cache=args.kv_cache, mesh=mesh,
                          layout=layout)
    if mesh is not None:
        print(sharding.plan(model.config, mesh).describe(), file=sys.stderr)
    prompts = list(args.prompt)
    if args.chat:
        prompts = [model.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]

    streaming = not args.json and len(prompts) == 1
    stop = set() if args.no_stop else set(model.tokenizer.stop_ids)
    kept: list[int] = []  # tokens of row 0 so far, up to the first stop token
    shown = ""  # text already written

    def on_tokens(rows: list[list[int]]) -> None:
        nonlocal shown
        for t in rows[0]:
            if len(kept) >= args.max_new_tokens or (kept and kept[-1] in stop):
                break
            kept.append(t)
        text = model.tokenizer.decode([t for t in kept if t not in stop])
        # Hold back a trailing partial UTF-8 character until the next chunk completes it.
        if not text.endswith("\ufffd") and text.startswith(shown):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text

    if streaming:
        sys.stdout.write(prompts[0] if not args.chat else "")
        sys.stdout.flush()
    if args.speculative:
        from jaxinfer.decode import speculative

        draft = None
        if args.speculative == "draft":
            draft = (speculative.load_draft(args.draft) if args.draft
                     else speculative.truncated_draft(model, args.draft_layers))
        out = speculative.generate(model, prompts, method=args.speculative, draft=draft, k=args.spec_k,
                                   seed=args.seed, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                   stop_at_eos=not args.no_stop, on_tokens=on_tokens if streaming else None)
    else:
        out = jaxinfer.generate(model, prompts, seed=args.seed, max_new_tokens=args.max_new_tokens,
                                sampling=sampling, stop_at_eos=not args.no_stop, chunk_size=args.chunk_size,
                                on_tokens=on_tokens if streaming else None)
    t = out.timings
    if args.json:
        print(json.dumps({
            "model": args.model,
            "completions": [{"prompt": p, "text": c.text, "token_ids": c.token_ids,
                             "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                            for p, c in zip(prompts, out.completions)],
            "timings": t.__dict__,
        }, indent=1))
        return 0
    if streaming:
        # Flush anything held back (e.g. an incomplete multi-byte sequence at the very end).
        final = out.completions[0].text
        if final.startswith(shown):
            sys.stdout.write(final[len(shown):])
        sys.stdout.write("\n")
    else:
        for p, c in zip(prompts, out.completions):
            print(f"--- {p!r}\n{p}{c.text}")
    per_row = max(1, len(prompts))
    print(f"[{t.new_tokens} tokens, {per_row} prompt(s) | time to first token {t.ttft_s:.2f} s | "
          f"decode {t.decode_tokens_per_s:.1f} tokens/s | total {t.total_s:.2f} s | "
          f"{t.n_compilations} XLA programs compiled or loaded from the cache]", file=sys.stderr)
    stats = getattr(out, "stats", None)
    if stats is not None:
        print(f"[speculative {stats.method}, k={stats.k}: acceptance {stats.acceptance_rate:.2f}, "
              f"{stats.tokens_per_call:.2f} tokens per target call]", file=sys.stderr)
    return 0


def _add_serve(sub) -> None:
    from jaxinfer.weights.hub import DEFAULT_MODEL

    p = sub.add_parser("serve", help="serve OpenAI's HTTP API (/v1/completions, /v1/chat/completions)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="known model name, .gguf file or folder")
    p.add_argument("--served-name", help="the model id clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-slots", type=int, default=8, help="requests decoded at once")
    p.add_argument("--max-waiting", type=int, default=64, help="requests queued beyond the slots before a 429")
    p.add_argument("--kv-memory", help="KV pool size, e.g. 2GiB (default: the engine's)")
    p.add_argument("--max-len", type=int, help="longest prompt + max_tokens of one request (default: the model's "
                   "context); without --kv-memory the pool holds --max-slots requests of this length")
    p.add_argument("--quant", choices=["int8", "int4"], help="weight-only quantization")
    p.add_argument("--kv-cache", choices=["int8"], help="KV-cache dtype (default: the param dtype)")
    p.add_argument("--mesh", default=None, metavar="data=D,model=M", help="shard over a device mesh")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get a 413")


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a GGUF, known model or Hugging Face folder to a checkpoint")
    p.add_argument("source", help="a .gguf file, a known model name or a Hugging Face folder "
                   "(config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="checkpoint folder to write, e.g. checkpoints/NAME")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPE_FLAGS), help="stored dtype (default bf16)")
    p.add_argument("--force", action="store_true", help="replace an existing checkpoint at --out")


_DTYPE_FLAGS = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def _convert(args) -> int:
    import time

    from tqdm import tqdm

    from jaxinfer.weights import checkpoint

    t0 = time.perf_counter()
    with tqdm(desc="reading tensors", unit="tensor", file=sys.stderr, delay=0.5) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
            if done == total:
                bar.set_description("writing checkpoint")

        res = checkpoint.convert(args.source, args.out, dtype=_DTYPE_FLAGS[args.dtype], overwrite=args.force,
                                 progress=progress)
    print(f"{res.path}: {res.config.name} ({res.source_kind}), {res.n_params / 1e6:.1f} M params, "
          f"{res.config.dtype}, {res.bytes_on_disk / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_convert(sub)
    _add_serve(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "serve":
            try:
                from jaxinfer.serve import server
            except ImportError as e:
                raise RuntimeError(f"jaxinfer serve needs the [serve] extra ({e}): pip install 'jaxinfer[serve]'")
            return server.run(args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
