"""A corpus's activations, streamed to shards on disk: memory-bounded and resumable after a kill.

    manifest = write_activations(model, texts, "acts/", sites=["resid_post"], layers=[6, 12])
    for shard in iter_shards("acts/"):
        shard["resid_post"]  # [N, n, D]; shard["text_index"] [N], shard["position"] [N]

The texts (an iterable: a generator over a dataset works) are tokenized one by one and run in
batches of at most `batch_tokens` padded tokens (`activations.capture_batch`: one uncached pass,
no logits), the next batch queued on the device while the host copies out the last one. Each
real token becomes a row; rows of whole texts collect until `shard_rows`, then go to disk as one
shard (safetensors, or one .npy per array) with each row's text index and position.

Resuming. A shard is written to a temporary name and renamed into place; the manifest (which
shards exist, how many texts they cover) is rewritten the same way, and only after its shard.
So a kill at any moment leaves the store as of its last manifest: rerunning with the same texts
(same order) and settings skips the texts the manifest covers, removes any shard file the
manifest does not list (a shard written after its last update), and goes on: no row is lost or
written twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from jaxinfer.decode.inputs import bucket, check_int, check_text, check_token_ids
from jaxinfer.inspect.activations import Sites, capture_batch, capture_of
from jaxinfer.model.model import Model

MANIFEST = "manifest.json"
FORMATS = ("safetensors", "npy")
DTYPES = ("float32", "float16")
STORE_VERSION = 1
MAX_TOKENS = 1024  # default cut of a text (the contexts probes and sparse autoencoders are usually trained on)


def _atomic_write(path: Path, write) -> None:
    """write(tmp_path) then rename it to `path`: readers see the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _shard_files(i: int, names: Sequence[str], fmt: str) -> list[str]:
    if fmt == "safetensors":
        return [f"shard-{i:05d}.safetensors"]
    return [f"shard-{i:05d}-{n}.npy" for n in names]


def _write_shard(folder: Path, i: int, arrays: dict[str, np.ndarray], fmt: str) -> list[str]:
    files = _shard_files(i, list(arrays), fmt)
    if fmt == "safetensors":
        from safetensors.numpy import save_file

        _atomic_write(folder / files[0], lambda p: save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()},
                                                             str(p)))
    else:
        for name, f in zip(arrays, files):
            def write(p, a=arrays[name]):
                with open(p, "wb") as fh:
                    np.save(fh, a)
            _atomic_write(folder / f, write)
    return files


def load_manifest(folder: Union[str, os.PathLike]) -> Optional[dict]:
    """The store's manifest, or None if `folder` has none."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return None
    return json.loads(path.read_text())


def iter_shards(folder: Union[str, os.PathLike]) -> Iterator[dict[str, np.ndarray]]:
    """The store's shards in order, each {site: [N, n, ...], "text_index": [N], "position": [N]}."""
    folder = Path(folder)
    manifest = load_manifest(folder)
    if manifest is None:
        raise FileNotFoundError(f"{folder} has no {MANIFEST}: not an activation store (write_activations)")
    for shard in manifest["shards"]:
        if manifest["format"] == "safetensors":
            from safetensors.numpy import load_file

            yield load_file(str(folder / shard["files"][0]))
        else:
            yield {f.rsplit("-", 1)[1][:-4]: np.load(folder / f) for f in shard["files"]}


def _settings(model: Model, capture, fmt: str, dtype: str, max_tokens: int) -> dict:
    cfg = model.config
    return {"store_version": STORE_VERSION, "model": cfg.name, "d_model": cfg.d_model, "n_layers": cfg.n_layers,
            "vocab_size": cfg.vocab_size, "sites": list(capture.sites), "layers": list(capture.layers),
            "format": fmt, "dtype": dtype, "max_tokens": max_tokens}


def _open_store(folder: Path, settings: dict) -> dict:
    """The manifest to continue from, with stray shard files removed; for a new store, a fresh one.

    Files are only ever removed from a store that has a manifest (the resume case: shards written
    after its last update). A folder without one must be new or empty, so no file this writer did
    not write is deleted; the fresh manifest is written at once, so a kill from here on resumes.
    """
    manifest = load_manifest(folder)
    if manifest is None:
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{folder} is a file, not a folder; pass an empty or new folder")
        present = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
        if present and present != [MANIFEST + ".tmp"]:  # only the cut first write of a manifest is ours
            raise ValueError(f"{folder} has no {MANIFEST} but holds {', '.join(map(repr, present[:5]))}"
                             + (f" and {len(present) - 5} more" if len(present) > 5 else "")
                             + "; pass an empty or new folder (or a store written by write_activations)")
        folder.mkdir(parents=True, exist_ok=True)
        manifest = {**settings, "shards": [], "texts_done": 0, "rows": 0}
        _atomic_write(folder / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1) + "\n"))
        return manifest
    differ = {k: (manifest.get(k), v) for k, v in settings.items() if manifest.get(k) != v}
    if differ:
        raise ValueError(f"{folder} holds activations written with other settings: "
                         + ", ".join(f"{k} {a!r} there, {b!r} now" for k, (a, b) in differ.items())
                         + "; use another folder or the same settings")
    listed = {f for s in manifest["shards"] for f in s["files"]}
    strays = []
    for p in folder.iterdir():
        if p.name in listed or p.name == MANIFEST:
            continue
        if p.name.startswith("shard-") or p.name.endswith(".tmp"):
            strays.append(p)  # written after the manifest's last update (or half written): redone below
        else:
            raise ValueError(f"{folder} holds {p.name!r}, which is not part of an activation store; "
                             "pass an empty or new folder")
    for p in strays:
        p.unlink()
    return manifest


def write_activations(model: Model, texts: Iterable[Union[str, Sequence[int]]], folder: Union[str, os.PathLike], *,
                      sites: Sites = ("resid_post",), layers=None, batch_tokens: int = 8192,
                      max_tokens: Optional[int] = None, shard_rows: int = 65536, format: str = "safetensors",
                      dtype: str = "float32", progress: Optional[Callable[[int, Optional[int]], None]] = None,
                      total: Optional[int] = None,
                      allow_special: bool = False) -> dict:
    """Capture sites over a corpus and write them to `folder` in shards (module docstring).

    Args:
      model: a loaded Model.
      texts: an iterable of strings (encoded as `generate` encodes a prompt) or token-id lists,
        none empty (refused as `activations` refuses an empty prompt, when the writer reaches it);
        resuming needs the same texts in the same order.
      folder: the store: created if missing, continued if it holds a manifest of the same settings;
        a folder without a manifest must be empty (nothing in it is ever deleted).
      sites, layers: what to capture (site names; layer indices or None for every layer).
      batch_tokens: the most padded tokens (rows x padded length) of one pass: bounds device memory.
      max_tokens: texts are cut to this many tokens (default min(MAX_TOKENS, the context length);
        at most the context length). One pass attends densely, [N, T, T] scores per row, so long
        texts cost memory quadratically: batch_tokens bounds the rows, not that.
      shard_rows: a shard is written once it holds this many rows (whole texts, so a little more).
      format: "safetensors" (one file per shard) or "npy" (one file per array per shard).
      dtype: "float32" or "float16" (rows as stored).
      progress: optional callback(done, total): texts done so far (those a resumed store already
        covers included), called once at the start and as texts are read; total as below.
      total: the number of texts, passed to `progress` (default len(texts) where it has one, else None).
      allow_special: as in `generate`.
    Returns:
      The manifest (also in folder/manifest.json): settings, shards (files, rows, first_text,
      end_text), texts_done, rows.
    """
    cfg = model.config
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    check_int("shard_rows", shard_rows, 1)
    max_tokens = (min(MAX_TOKENS, cfg.max_seq_len) if max_tokens is None
                  else check_int("max_tokens", max_tokens, 1, cfg.max_seq_len))
    check_int("batch_tokens", batch_tokens, 1)
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be None or a callable(done, total), got {progress!r}")
    capture = capture_of(sites, layers, cfg)
    if "attn_pattern" in capture.sites:  # its width S is each text's own length
        raise ValueError("write_activations stores rows of one width per site; attn_pattern is [N, S] per token, S "
                         "the text's length: read it with jaxinfer.activations")
    folder = Path(folder)
    manifest = _open_store(folder, _settings(model, capture, format, dtype, max_tokens))
    start = manifest["texts_done"]
    if total is None and hasattr(texts, "__len__"):
        total = len(texts)

    report = progress or (lambda done, total: None)
    buffer: list[tuple[int, dict]] = []  # (text index, {site: [T, n, ...]}) of processed texts
    # rows in the buffer; texts processed (the shard's end_text); texts read or skipped, for `progress`
    state = {"buffered_rows": 0, "covered": start, "done": start}

    def flush(end_text: int) -> None:
        buffer_rows = sum(len(r["text_index"]) for _, r in buffer)
        if buffer_rows:
            arrays = {k: np.concatenate([r[k] for _, r in buffer]) for k in buffer[0][1]}
            i = len(manifest["shards"])
            files = _write_shard(folder, i, arrays, format)
            manifest["shards"].append({"files": files, "rows": buffer_rows, "first_text": buffer[0][0],
                                       "end_text": end_text})
        manifest["texts_done"] = end_text
        manifest["rows"] += buffer_rows
        _atomic_write(folder / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1) + "\n"))
        buffer.clear()
        state["buffered_rows"] = 0

    def advance(n: int) -> None:
        state["done"] += n
        report(state["done"], total)

    def collect(batch: list[tuple[int, list[int]]], cap) -> None:
        host = {k: np.asarray(v) for k, v in cap.items()}  # waits for this batch only
        for j, (t, ids) in enumerate(batch):
            n = len(ids)
            row = {k: v[j, :n].astype(dtype) for k, v in host.items()}
            row["text_index"] = np.full((n,), t, np.int64)
            row["position"] = np.arange(n, dtype=np.int32)
            buffer.append((t, row))
            state["buffered_rows"] += n
        state["covered"] = batch[-1][0] + 1
        advance(len(batch))
        if state["buffered_rows"] >= shard_rows:
            flush(state["covered"])

    pending: list[tuple[int, list[int]]] = []
    in_flight = None  # (batch, device arrays) dispatched, not yet read
    seen = start

    def dispatch() -> None:
        nonlocal in_flight, pending
        cap = capture_batch(model, [ids for _, ids in pending], capture)
        if in_flight is not None:
            collect(*in_flight)
        in_flight, pending = (pending, cap), []

    report(start, total)
    for t, text in enumerate(texts):
        seen = t + 1
        if t < start:
            continue
        ids = _ids(model, text, t, allow_special)[:max_tokens]
        longest = max([len(ids)] + [len(p) for _, p in pending])
        if pending and bucket(len(pending) + 1, 1) * bucket(longest) > batch_tokens:
            dispatch()
        pending.append((t, ids))
    if pending:
        dispatch()
    if in_flight is not None:
        collect(*in_flight)
        in_flight = None
    flush(max(seen, state["covered"]))
    return manifest


def _ids(model: Model, text, t: int, allow_special: bool) -> list[int]:
    """Text t's token ids, refused as `activations` refuses a prompt: empty (no rows to write, and
    a silent gap in the store), invalid Unicode, bytes, ids outside the vocabulary."""
    if isinstance(text, str):
        if model.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token-id lists")
        return model.tokenizer.encode_prompt(check_text(text, f"text {t}"), allow_special=allow_special)
    if isinstance(text, (bytes, bytearray)):
        raise TypeError(f"text {t} is bytes; decode it first")
    return check_token_ids(text, model.config.vocab_size, f"text {t}")
