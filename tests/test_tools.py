"""tools/: the device staging helpers (tools/device_stage.py, tools/device_check.sh), which carry
wheels and model files to a lent GPU machine without network and bring its results back."""

import importlib.util
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("device_stage", ROOT / "tools" / "device_stage.py")
ds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ds)


def test_model_files_travel_in_chunks(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(np.random.default_rng(0).bytes(10_000))
    folders = ds.write_parts(src, tmp_path / "parts", 1, part_bytes=3_000)
    assert [f.name for f in folders] == ["01", "02", "03", "04"]  # 4 chunks of 2,500 bytes
    stage, cache = tmp_path / "stage", tmp_path / "cache"
    stage.mkdir()
    for f in folders[:3]:
        for p in f.iterdir():
            (stage / p.name).write_bytes(p.read_bytes())
    assert ds.assemble(stage, cache) == {"m.gguf": "missing parts m.gguf.part03"}
    (stage / "m.gguf.part03").write_bytes((folders[3] / "m.gguf.part03").read_bytes()[:-1] + b"x")
    assert ds.assemble(stage, cache) == {"m.gguf": "sha256 mismatch"} and not list(cache.iterdir())
    (stage / "m.gguf.part03").write_bytes((folders[3] / "m.gguf.part03").read_bytes())
    assert ds.assemble(stage, cache) == {"m.gguf": "assembled"}
    assert (cache / "m.gguf").read_bytes() == src.read_bytes()
    assert ds.assemble(stage, cache) == {"m.gguf": "ready"}


def test_every_dependency_reaches_the_device():
    """Each runtime dependency is in the device image or carried as a wheel: the first H200 run
    stopped at `import llguidance` because WHEELS predated that dependency."""
    import re

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    norm = lambda name: re.split(r"[<>=!~\[ ;]", name, maxsplit=1)[0].strip().lower().replace("_", "-")
    have = {norm(n) for n in ds.DEVICE_IMAGE} | {norm(w) for w in ds.WHEELS}
    missing = sorted({norm(d) for d in deps} - have)
    assert not missing, f"dependencies neither in the device image nor in device_stage.WHEELS: {missing}"
    assert all("==" in w for w in ds.WHEELS)  # pinned: the wheels measured are the ones tested here


def test_wrapper_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "tools" / "device_check.sh")], check=True)


def test_optimized_hlo_comes_back_in_one_archive(tmp_path):
    """pack-hlo: the optimized modules, largest first, in one .tgz under the size limit; what
    would not fit is named, never half-written."""
    import tarfile

    dump = tmp_path / "dump"
    dump.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("module_1.jit_decode.after_optimizations.txt", 40_000),
                    ("module_2.jit_prefill.after_optimizations.txt", 20_000),
                    ("module_3.jit_decode.after_optimizations.txt", 5_000)):
        (dump / name).write_bytes(rng.bytes(n))  # random bytes: gzip cannot shrink them
    (dump / "module_1.jit_decode.before_optimizations.txt").write_text("HloModule jit_decode")
    out = tmp_path / "out" / "hlo.tgz"
    res = ds.pack_hlo(dump, out, limit=30_000)
    assert res["packed"] == ["module_2.jit_prefill.after_optimizations.txt",
                             "module_3.jit_decode.after_optimizations.txt"]
    assert res["left_out"] == ["module_1.jit_decode.after_optimizations.txt"]
    assert res["bytes"] == out.stat().st_size <= 30_000
    with tarfile.open(out) as tar:
        assert tar.getnames() == res["packed"]
        assert tar.extractfile(res["packed"][1]).read() == (dump / res["packed"][1]).read_bytes()
