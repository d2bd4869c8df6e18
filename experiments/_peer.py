"""llama.cpp as a peer of the side-by-side runners: where it lives, the F32 GGUF it reads, its worker.

    python -m experiments._peer check            # which parts the runners will find
    python -m experiments._peer verify-gguf      # the F32 GGUF against jaxinfer's dequantization

llama.cpp is never a dependency and never runs in the suite; its parts come from flags or the
environment, never default paths (docs/notes/llamacpp.md: how to build them, and why the F32 GGUF
holds exactly the weights jaxinfer dequantizes). Only the standard library is imported at module
level: the worker runs under the peer's python, which has no jaxinfer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

from experiments._common import PeakRSS, rss_bytes, run_json

PARTS = {"python": "JAXINFER_LLAMA_PYTHON", "server": "JAXINFER_LLAMA_SERVER", "gguf": "JAXINFER_LLAMA_GGUF"}
N_BATCH = 512


@dataclass(frozen=True)
class Peer:
    """Where the llama.cpp side lives; any part may be missing (see `missing`)."""

    python: Optional[str]  # interpreter with llama_cpp importable
    server: Optional[str]  # llama-server binary
    gguf: Optional[str]  # F32 GGUF of the benchmarked model

    def missing(self, *parts: str) -> Optional[str]:
        """Why the named parts ("python", "server", "gguf") cannot be used, or None when all can."""
        why = []
        for part in parts:
            path = getattr(self, part)
            if not path:
                why.append(f"no {part} given (--llama-{part} or ${PARTS[part]})")
            elif not os.path.isfile(path):
                why.append(f"{part} {path} not found (--llama-{part} or ${PARTS[part]})")
            elif part != "gguf" and not os.access(path, os.X_OK):
                why.append(f"{part} {path} is not executable")
        if "python" in parts and not why and self.version() is None:
            why.append(f"{self.python} cannot import llama_cpp")
        return "; ".join(why) or None

    def version(self) -> Optional[str]:
        """llama-cpp-python's version under the peer's python (None when it is not there)."""
        if not self.python or not os.path.isfile(self.python):
            return None
        r = subprocess.run([self.python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True, timeout=120)
        return r.stdout.strip() if r.returncode == 0 else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--llama-python, --llama-server, --llama-gguf (defaults from the environment) and --llama-threads."""
    for part, env in PARTS.items():
        p.add_argument(f"--llama-{part}", default=os.environ.get(env), help=f"llama.cpp's {part} (${env})")
    p.add_argument("--llama-threads", type=int, default=2, help="llama.cpp threads (default %(default)s)")


def from_args(args) -> Peer:
    return Peer(python=args.llama_python, server=args.llama_server, gguf=args.llama_gguf)


def run_worker(peer: Peer, ids_file: str, calls: int, threads: int, decode_tokens: int = 0,
               timeout: float = 3600.0) -> dict:
    """`worker` under the peer's python in a fresh process: its JSON, or {"error": why}."""
    code = "import json, sys; from experiments._peer import worker; print(json.dumps(worker(*json.loads(sys.argv[1]))))"
    cmd = [peer.python, "-c", code, json.dumps([peer.gguf, ids_file, calls, threads, decode_tokens])]
    try:
        return run_json(cmd, timeout=timeout)
    except RuntimeError as e:
        return {"error": str(e)}


def worker(gguf: str, ids_file: str, calls: int, threads: int, decode_tokens: int) -> dict:
    """In the peer's python: load the GGUF, then `calls` times evaluate the ids in `ids_file` (KV
    cleared before): wall seconds, the greedy first token and the peak RSS above the loaded model;
    with `decode_tokens`, greedy decode tokens/s at batch 1 after the prompt."""
    import llama_cpp
    import numpy as np

    with open(ids_file) as f:
        ids = json.load(f)
    n_ctx = max(1024, -(-(len(ids) + decode_tokens + 1) // 256) * 256)
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_batch=N_BATCH, n_threads=threads,
                          n_threads_batch=threads, logits_all=False, verbose=False)
    load_s, loaded = time.perf_counter() - t0, rss_bytes()
    n_vocab = llm.n_vocab()

    def argmax() -> int:  # Llama.eval keeps no logits unless logits_all; the context holds the last
        last = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(last, shape=(n_vocab,))))

    rows = []
    for _ in range(calls):
        llm.reset()  # n_tokens = 0: eval() clears the KV cache from there
        with PeakRSS() as peak:
            t0 = time.perf_counter()
            llm.eval(ids)
            tok = argmax()
            row = {"ttft_s": time.perf_counter() - t0, "first_token": tok}
        row["peak_rss_above_load_mb"] = (peak.peak - loaded) / 2**20
        if decode_tokens > 1:
            t0 = time.perf_counter()
            for _ in range(decode_tokens - 1):
                llm.eval([tok])
                tok = argmax()
            row["decode_tok_s"] = (decode_tokens - 1) / (time.perf_counter() - t0)
        rows.append(row)
    return {"load_s": load_s, "rss_loaded_mb": loaded / 2**20, "calls": rows, "file_bytes": os.path.getsize(gguf)}


def compare_weights(src: str, f32: str) -> dict:
    """Tensors of `f32` against `src` dequantized to float32 as jaxinfer reads it (the `gguf`
    package): {"tensors", "bit_identical", "max_abs_diff", "src_types"}."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    theirs = {t.name: t for t in GGUFReader(f32).tensors}
    ours = GGUFReader(src).tensors
    same, worst, types = 0, 0.0, {}
    for t in ours:
        u = theirs.get(t.name)
        if u is None or u.tensor_type.name != "F32":
            raise ValueError(f"{f32}: tensor {t.name} is {'missing' if u is None else u.tensor_type.name}, not F32")
        x = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        y = np.asarray(u.data, np.float32).reshape(-1)
        if x.shape != y.shape:
            raise ValueError(f"{f32}: tensor {t.name} has {y.size} values, {src} {x.size}")
        same += bool(np.array_equal(x, y))
        worst = max(worst, float(np.max(np.abs(x - y))))
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"tensors": len(ours), "bit_identical": same, "max_abs_diff": worst, "src_types": types}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["check", "verify-gguf"])
    p.add_argument("--src", help="source GGUF (default: the file jaxinfer loads for smollm2-135m)")
    add_arguments(p)
    args = p.parse_args(argv)
    peer = from_args(args)
    if args.command == "check":
        print(f"llama-cpp-python: {peer.version() or 'not available'} ({peer.python})")
        for part in PARTS:
            print(f"{part:7s} {getattr(peer, part)}: {peer.missing(part) or 'ok'}")
        return 0
    if not peer.gguf:
        raise SystemExit(f"give the F32 GGUF's path: --llama-gguf or ${PARTS['gguf']}")
    if args.src is None:
        from jaxinfer.weights import hub

        args.src = str(hub.fetch(hub.DEFAULT_MODEL))
    r = compare_weights(args.src, peer.gguf)
    print(f"{r['bit_identical']} of {r['tensors']} tensors bit-identical to jaxinfer's dequantization of "
          f"{r['src_types']} (max abs difference {r['max_abs_diff']:g})")
    return 0 if r["bit_identical"] == r["tensors"] else 1


if __name__ == "__main__":
    sys.exit(main())
