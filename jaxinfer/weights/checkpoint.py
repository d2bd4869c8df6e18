"""Checkpoints: a model's params, config and tokenizer data in one folder, saved with orbax.

Layout of a checkpoint folder (e.g. `checkpoints/gemma3-270m/`)::

  params/                  orbax PyTree checkpoint of the params (layers stacked on L)
  tokenizer.json           a GGUF's tokenizer data (`TokenizerData` as JSON), if it came from a GGUF
  hf_tokenizer/            a Hugging Face folder's tokenizer files, copied unchanged (tokenizer.json,
                           tokenizer_config.json, chat_template.jinja, generation_config.json,
                           config.json), if it came from one: the checkpoint tokenizes, renders
                           chats and stops exactly as the folder did
  jaxinfer_checkpoint.json the marker, written last: format version, config, dtype, source, the
                           shape of every tensor and the size of every file in the folder

Safety. `save` writes everything into a hidden sibling folder `.NAME.partial-<random>` and renames
it to NAME only once the marker is written, so a save killed half-way never leaves a folder named
NAME; `restore` also refuses any folder without the marker. The partial folder's name holds the
host and pid of its writer (`.NAME.partial-<host>-<pid>-<random>`): any later save into the same
parent folder removes those whose writer is gone (a live save's is never touched). On restore
every file is checked against the size the marker recorded (a truncated file is named), every tensor against the shape the config implies (a missing or
misshapen tensor is named) and the config itself is validated.

Restore builds its target from `params.abstract_params(cfg, dtype)` -- shapes and dtypes only --
so the same call can later restore straight into a sharded layout (pass `shardings`).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import params as model_params
from jaxinfer.model.config import DTYPES, ModelConfig
from jaxinfer.text.tokenizer import TokenizerData
from jaxinfer.weights import gguf as gguf_io
from jaxinfer.weights import hf as hf_io
from jaxinfer.weights import load_tokenizer
from jaxinfer.weights import source as sources
from jaxinfer.weights.hub import sha256_file
from jaxinfer.weights.source import is_checkpoint  # noqa: F401  (part of this module's interface)

FORMAT = "jaxinfer-checkpoint"
VERSION = 1
MARKER = sources.CHECKPOINT_MARKER
TOKENIZER_FILE = load_tokenizer.TOKENIZER_DATA_FILE
HF_TOKENIZER_DIR = load_tokenizer.HF_TOKENIZER_DIR
PARAMS_DIR = "params"
PARTIAL = ".partial-"  # infix of the temporary folder a save writes into


class CheckpointError(ValueError):
    """A folder is not a complete, consistent jaxinfer checkpoint."""


def _tree_paths(tree) -> dict[str, Any]:
    """{"layers/wq": leaf, ...} for a nested dict."""
    flat = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        flat["/".join(str(k.key) for k in kp)] = leaf
    return flat


def check_replaceable(dest: Path, overwrite: bool) -> None:
    """Refuse to write over `dest` unless it is absent, an empty folder, or (with `overwrite`) a
    finished jaxinfer checkpoint. Anything else -- a file, a folder of other things, an unfinished
    checkpoint -- is the user's and is never deleted: the error names what is inside."""
    if not os.path.lexists(dest):
        return
    if dest.is_dir() and not dest.is_symlink():
        entries = sorted(p.name for p in dest.iterdir())
        if not entries:
            return  # an empty folder: nothing to lose
        if is_checkpoint(dest):
            if not overwrite:
                raise FileExistsError(f"{dest} already exists; pass overwrite=True (CLI: --force) to replace it")
            return
        shown = ", ".join(entries[:8]) + (f", ... ({len(entries)} entries)" if len(entries) > 8 else "")
        raise FileExistsError(f"{dest} exists and is not a jaxinfer checkpoint (no {MARKER}); it holds: {shown}. "
                              "Refusing to replace it, even with overwrite/--force (which only replaces "
                              "checkpoints): choose another --out, or move it away yourself")
    kind = "a symlink" if dest.is_symlink() else "a file"
    raise FileExistsError(f"{dest} exists and is {kind}, not a jaxinfer checkpoint folder. Refusing to replace "
                          "it, even with overwrite/--force (which only replaces checkpoints): choose another "
                          "--out, or move it away yourself")


def _file_sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MARKER}


def save(path: os.PathLike, cfg: ModelConfig, params, tokenizer: Union[TokenizerData, os.PathLike, None] = None, *,
         dtype: Optional[str] = None, source: Optional[str] = None, overwrite: bool = False,
         checksums: bool = True) -> Path:
    """Write a checkpoint atomically: the folder `path` appears only when it is complete.

    Args:
      path: destination folder (must not exist unless `overwrite`).
      cfg: the model config (stored in the marker; its dtype field is set to the stored dtype).
      params: params pytree (numpy or jax arrays) matching `params.param_specs(cfg)`.
      tokenizer: what to store beside the weights: a GGUF's tokenizer data, a Hugging Face folder
        whose tokenizer files are copied (`HF_TOKENIZER_DIR`), or None.
      dtype: stored dtype ("float32", "bfloat16", "float16"); default `cfg.dtype`.
      source: where the weights came from (recorded in the marker).
      overwrite: replace an existing checkpoint at `path` (never anything else: see
        `check_replaceable`).
      checksums: also record the sha256 of every file (checked by `restore`, so by `load`).
    Returns:
      The checkpoint folder.
    """
    dtype = dtype or cfg.dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    model_params.require_layout(cfg, "stacked", "checkpoint.save")
    dest = Path(path).absolute()
    check_replaceable(dest, overwrite)
    cfg = cfg.replace(dtype=dtype)
    _check_tree(params, cfg, where="params to save")
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(dest)
    tmp = dest.parent / f".{dest.name}{PARTIAL}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_arrays(tmp, params, dtype)
        _write_tokenizer(tmp, tokenizer)
        _write_marker(tmp, cfg, params, source, checksums)
        check_replaceable(dest, overwrite)  # again: the folder may have changed during the save
        _publish(tmp, dest)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if "No space left on device" in str(e) or getattr(e, "errno", None) == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space left on the disk of {dest.parent} while writing the checkpoint "
                                        "(nothing was left behind); free some space or choose another --out") from e
        raise
    return dest


def _write_arrays(tmp: Path, params, dtype: str) -> None:
    import orbax.checkpoint as ocp

    dt = jnp.dtype(dtype)
    arrays = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), dtype=dt), params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp / PARAMS_DIR, arrays)
        ckptr.wait_until_finished()


def _write_tokenizer(tmp: Path, tokenizer: Union[TokenizerData, os.PathLike, None]) -> None:
    if isinstance(tokenizer, TokenizerData):
        (tmp / TOKENIZER_FILE).write_text(json.dumps(dataclasses.asdict(tokenizer), ensure_ascii=False))
    elif tokenizer is not None:
        load_tokenizer.copy_hf_tokenizer(str(tokenizer), str(tmp / HF_TOKENIZER_DIR))


def _write_marker(tmp: Path, cfg: ModelConfig, params, source: Optional[str], checksums: bool) -> None:
    """The marker, last: format version, config, dtype, source, every tensor's shape, every file's size."""
    sizes = _file_sizes(tmp)
    marker = {
        "format": FORMAT,
        "version": VERSION,
        "config": dataclasses.asdict(cfg),
        "dtype": cfg.dtype,
        "source": source,
        "tensors": {k: list(v.shape) for k, v in _tree_paths(params).items()},
        "files": sizes,
        "sha256": {f: sha256_file(tmp / f) for f in sizes} if checksums else None,
    }
    _write_synced(tmp / MARKER, json.dumps(marker, indent=1))


def _publish(tmp: Path, dest: Path) -> None:
    """Rename the finished folder to `dest`; an old checkpoint there is moved aside first, so `dest`
    is never half-new."""
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def remove_stale_partials(dest: Path) -> list[Path]:
    """Remove the hidden partial folders that killed saves left beside `dest`: those of `dest`
    or of any other checkpoint in the same folder, whose writer (a process on this host, named in
    the folder's name) is gone. A live save's partial folder is never touched."""
    removed = []
    host = socket.gethostname()
    for stale in dest.parent.glob(f".*{PARTIAL}*"):
        name, _, tail = stale.name[1:].partition(PARTIAL)
        parts = tail.rsplit("-", 2)
        if len(parts) == 3 and parts[1].isdigit():
            gone = parts[0] == host and not _pid_alive(int(parts[1]))
        else:  # an older name without host and pid: only a re-run to the same place removes it
            gone = name == dest.name
        if stale.is_dir() and gone:
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
    return removed


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_marker(path: os.PathLike) -> dict:
    """The marker of a finished checkpoint (raises CheckpointError if absent or unreadable)."""
    folder = Path(path)
    marker = folder / MARKER
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    if not marker.is_file():
        partial = ", ".join(p.name for p in folder.parent.glob(f".{folder.name}{PARTIAL}*"))
        hint = f" (an unfinished save left {partial}; run the conversion again)" if partial else ""
        raise CheckpointError(f"{folder} is not a finished jaxinfer checkpoint: {MARKER} is missing{hint}")
    try:
        meta = json.loads(marker.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{marker} is not valid JSON (truncated?): {e}") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{marker}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                              f"expected {FORMAT!r} version {VERSION}")
    return meta


def read_config(path: os.PathLike) -> ModelConfig:
    """The ModelConfig stored in a checkpoint, validated."""
    meta = read_marker(path)
    raw = meta.get("config")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{Path(path) / MARKER}: 'config' is missing or not an object")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise CheckpointError(f"{Path(path) / MARKER}: config has unknown fields {unknown}")
    if raw.get("layout") == "canonical":  # checkpoints written before the layouts were renamed
        raw = dict(raw, layout="stacked")
    try:
        return ModelConfig(**raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{Path(path) / MARKER}: invalid config: {e}") from e


def read_tokenizer(path: os.PathLike) -> Optional[TokenizerData]:
    """The GGUF tokenizer data stored in a checkpoint, or None if it has none (a checkpoint of a
    Hugging Face folder keeps the folder's files instead: see `jaxinfer.load_tokenizer`)."""
    try:
        return load_tokenizer.read_tokenizer_data(str(Path(path) / TOKENIZER_FILE))
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def _check_files(folder: Path, meta: dict, verify: Optional[bool]) -> None:
    recorded = meta.get("files") or {}
    for name, size in recorded.items():
        f = folder / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        actual = f.stat().st_size
        if actual != size:
            raise CheckpointError(f"checkpoint file {f} has {actual} bytes, expected {size} (truncated or replaced)")
    sums = meta.get("sha256")
    if verify and not sums:
        raise CheckpointError(f"{folder / MARKER} records no checksums; cannot verify")
    if verify is None:
        verify = bool(sums)
    if verify:
        for name, digest in sums.items():
            if sha256_file(folder / name) != digest:
                raise CheckpointError(f"checkpoint file {folder / name} does not match its recorded sha256: the "
                                      "checkpoint is corrupt (changed on disk since it was written); convert it "
                                      "again from its source")


def _check_tree(tree_shapes, cfg: ModelConfig, where: str) -> None:
    """Every tensor the config needs is present with its shape, and nothing else."""
    want = {k: tuple(s.shape) for k, s in _tree_paths(model_params.abstract_params(cfg)).items()}
    have = {k: tuple(getattr(v, "shape", v)) for k, v in _tree_paths(tree_shapes).items()}
    missing = sorted(set(want) - set(have))
    if missing:
        raise CheckpointError(f"{where}: missing tensor(s) {missing}")
    extra = sorted(set(have) - set(want))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor(s) {extra} for this config")
    for k, shape in want.items():
        if have[k] != shape:
            raise CheckpointError(f"{where}: tensor {k!r} has shape {have[k]}, expected {shape}")


def restore(path: os.PathLike, dtype: Optional[str] = None, *, shardings=None,
            verify: Optional[bool] = None):
    """Read a checkpoint into device arrays of `dtype`.

    Args:
      path: checkpoint folder written by `save`.
      dtype: parameter dtype to restore into; default the stored dtype.
      shardings: optional pytree of `jax.sharding.Sharding` (same structure as the params); default
        every array on the first device.
      verify: check every file's sha256 against the marker. None (default): whenever the marker
        records checksums (`save` does unless told not to), so bytes changed in place are caught
        by `load` and by `convert` from a checkpoint; True: require checksums; False: sizes only
        (sizes are always checked). Costs one more read of the files, a fraction of the restore's
        own time (docs/refusals.md).
    Returns:
      (config with `dtype` set, params pytree, tokenizer data or None).
    Raises:
      CheckpointError: naming the bad file or tensor.
    """
    import orbax.checkpoint as ocp

    folder = Path(path).absolute()
    meta = read_marker(folder)
    cfg = read_config(folder)
    dtype = dtype or meta.get("dtype") or cfg.dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    cfg = cfg.replace(dtype=dtype)
    _check_files(folder, meta, verify)
    tokenizer = read_tokenizer(folder)
    with ocp.StandardCheckpointer() as ckptr:
        try:
            stored = ckptr.metadata(folder / PARAMS_DIR).item_metadata.tree
        except Exception as e:  # orbax raises many types for unreadable metadata
            raise CheckpointError(f"{folder / PARAMS_DIR}: cannot read orbax metadata: {e}") from e
        _check_tree(stored, cfg, where=f"checkpoint {folder}")
        target = model_params.abstract_params(cfg, dtype)
        if shardings is None:
            one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            shardings = jax.tree.map(lambda _: one, target)
        target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), target, shardings)
        try:
            params = ckptr.restore(folder / PARAMS_DIR, target)
        except Exception as e:
            raise CheckpointError(f"cannot restore the arrays in {folder / PARAMS_DIR}: {e}") from e
    return cfg, params, tokenizer


@dataclasses.dataclass(frozen=True)
class Converted:
    """What `convert` did."""

    path: Path
    config: ModelConfig
    source_kind: str  # "gguf", "known", "huggingface" or "checkpoint"
    n_params: int
    bytes_on_disk: int


@dataclasses.dataclass(frozen=True)
class SourceModel:
    """A model source read into host memory (`read_source`)."""

    config: ModelConfig
    params: dict  # float32 numpy, stacked layout
    tokenizer: Union[TokenizerData, str, None]  # a GGUF's tokenizer data, or a folder of HF tokenizer files
    kind: str  # "gguf", "known", "huggingface" or "checkpoint"


def require_model(src: sources.Source, given: str) -> sources.Source:
    """`src` when it holds weights, else CheckpointError saying what it is."""
    if src.has_weights:
        return src
    if src.kind == "tokenizer_folder":
        raise CheckpointError(f"{given} is neither a finished jaxinfer checkpoint (it has no {MARKER}) nor a "
                              "Hugging Face model folder (config.json + model.safetensors or "
                              "model.safetensors.index.json)")
    raise CheckpointError(f"{given} is a tokenizer alone ({src.kind}), not a model with weights; "
                          "jaxinfer.load_tokenizer reads it")


def read_source(source: str, *, cache: Optional[str] = None, progress=None) -> SourceModel:
    """Read any model source into numpy params.

    Args:
      source: a .gguf file, a known model name, a Hugging Face folder or hub id, or a jaxinfer checkpoint.
      cache: model cache folder for known names.
      progress: optional callback(done, total) per tensor read.
    Returns:
      A `SourceModel`.
    """
    src = require_model(sources.classify(source, cache=cache), source)
    if src.kind == "checkpoint":
        cfg, params, tok = restore(src.path, "float32")
        hf_dir = Path(src.path) / HF_TOKENIZER_DIR
        return SourceModel(cfg, jax.tree.map(np.asarray, params), str(hf_dir) if hf_dir.is_dir() else tok,
                           "checkpoint")
    if src.kind == "huggingface":
        load_tokenizer.tokenizer_of(src)  # a tokenizer jaxinfer refuses fails here, before the slow read
        cfg = hf_io.read_config(src.path)
        return SourceModel(cfg, hf_io.read_params(src.path, cfg, progress), src.path, "huggingface")
    g = gguf_io.read_gguf(src.path, name=src.name, progress=progress)
    return SourceModel(g.config, g.params, g.tokenizer, "known" if src.known else "gguf")


def convert(source: str, out: os.PathLike, *, dtype: str = "bfloat16", overwrite: bool = False,
            cache: Optional[str] = None, progress=None) -> Converted:
    """Convert a GGUF file, known model name, Hugging Face folder or checkpoint into a checkpoint.

    The source's tokenizer goes with it: a GGUF's tokenizer data, or a Hugging Face folder's
    tokenizer files (tokenizer, chat template, stop ids), so the checkpoint loads as the same model.

    Args:
      source: see `read_source`.
      out: destination folder (written atomically, see `save`).
      dtype: stored dtype, "bfloat16", "float32" or "float16".
      overwrite: replace an existing checkpoint at `out`.
      cache: model cache folder for known names.
      progress: optional callback(done, total) per tensor read.
    Returns:
      A `Converted` record.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out = Path(out)
    check_replaceable(out.absolute(), overwrite)  # before the (slow) read
    m = read_source(source, cache=cache, progress=progress)
    cfg = m.config.replace(name=out.name)
    path = save(out, cfg, m.params, m.tokenizer, dtype=dtype, source=str(source), overwrite=overwrite)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return Converted(path=path, config=cfg.replace(dtype=dtype), source_kind=m.kind,
                     n_params=model_params.count(m.params), bytes_on_disk=size)
