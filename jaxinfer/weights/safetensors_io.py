"""Reading safetensors files lazily: headers first, then one tensor at a time.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the raw
tensor bytes (offsets relative to the end of the header). A sharded model lists its files in
`model.safetensors.index.json` ({"weight_map": {name: file}}).

`index(folder)` reads every header (a few KB each) and checks, before any tensor data is read or
any memory allocated, that every file named by the index exists and is as long as its header says.
`read(info)` then reads one tensor's bytes into a numpy array of the stored dtype (bf16 stays bf16,
as ml_dtypes.bfloat16), so host memory holds one tensor at a time.
`write(path, tensors)` writes one file (PEFT adapters that jaxinfer saves).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Optional

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
NP_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
             "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64),
             "U8": np.dtype(np.uint8)}  # U8: packed quantized blocks (gpt-oss's MXFP4 experts)
JAX_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # model dtypes jaxinfer runs in
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


class SafetensorsError(ValueError):
    """A safetensors file or index is missing, truncated or malformed (names the file)."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: file, stored dtype ("BF16" ...), shape, absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, checked against the file's length (reads no data)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise SafetensorsError(f"{path}: header length {n} exceeds the file ({size} bytes): "
                                       "truncated or not a safetensors file")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise SafetensorsError(f"{path}: file is missing") from None
    except (ValueError, UnicodeDecodeError) as e:
        if isinstance(e, SafetensorsError):
            raise
        raise SafetensorsError(f"{path}: header is not valid JSON: {e}") from e
    base = 8 + n
    out, end_max = {}, base
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(o) for o in t["data_offsets"])
            info = TensorInfo(path, str(t["dtype"]), tuple(int(d) for d in t["shape"]), base + begin, base + end)
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsError(f"{path}: bad header entry for {name!r}: {e}") from e
        if info.dtype in NP_DTYPES and info.nbytes != NP_DTYPES[info.dtype].itemsize * int(np.prod(info.shape)):
            raise SafetensorsError(f"{path}: tensor {name!r} has {info.nbytes} bytes for shape {info.shape} "
                                   f"{info.dtype}")
        out[name] = info
        end_max = max(end_max, info.end)
    if end_max > size:
        raise SafetensorsError(f"{path}: truncated: its header describes {end_max} bytes, the file has {size}")
    return out


def index(folder: os.PathLike) -> dict[str, TensorInfo]:
    """name -> TensorInfo for a folder's `model.safetensors` or the shards its index names.

    Every shard's header is read and checked first, so a missing or truncated shard is reported
    before any tensor is read.
    """
    folder = Path(folder)
    idx = folder / INDEX_FILE
    if idx.is_file():
        try:
            weight_map = dict(json.loads(idx.read_text(encoding="utf-8"))["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise SafetensorsError(f"{idx} is not a valid safetensors index: {e}") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise SafetensorsError(f"{idx} names shard(s) that are missing from {folder}: {', '.join(missing)}")
        headers = {f: read_header(folder / f) for f in files}
        out = {}
        for name, f in weight_map.items():
            if name not in headers[f]:
                raise SafetensorsError(f"{idx} places {name!r} in {f}, whose header does not have it")
            out[name] = headers[f][name]
        return out
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise SafetensorsError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    return read_header(single)


def read(info: TensorInfo) -> np.ndarray:
    """One tensor's bytes as a numpy array of its stored dtype (BF16 as ml_dtypes.bfloat16)."""
    if info.dtype not in NP_DTYPES:
        raise SafetensorsError(f"{info.file}: dtype {info.dtype} is not supported ({', '.join(NP_DTYPES)})")
    dt = NP_DTYPES[info.dtype]
    count = int(np.prod(info.shape))
    with open(info.file, "rb") as f:
        f.seek(info.start)
        arr = np.fromfile(f, dtype=dt, count=count)
    if arr.size != count:  # the file shrank since its header was read
        raise SafetensorsError(f"{info.file}: truncated while reading ({arr.size} of {count} values)")
    return arr.reshape(info.shape)


_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
              np.dtype(np.float64): "F64"}


def write(path: os.PathLike, tensors: dict[str, np.ndarray], metadata: Optional[dict[str, str]] = None) -> None:
    """Write `tensors` as one safetensors file (names sorted; little-endian; float dtypes of NP_DTYPES).

    Written to a temporary name and renamed, so a reader never sees half a file."""
    path = Path(path)
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset, blobs = 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _ST_DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has dtype {a.dtype}; writable: "
                                   f"{', '.join(str(d) for d in _ST_DTYPES)}")
        blob = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _ST_DTYPES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)
