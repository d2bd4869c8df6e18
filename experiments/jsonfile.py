"""One way every experiment writes its JSON: whole or not at all (standard library only, so the
llama.cpp peer's python can import it too)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def jsonable(x):
    """JSON for what json cannot write: numpy scalars and arrays as numbers and lists, bytes as text,
    anything else as its str()."""
    if hasattr(x, "tolist"):  # numpy arrays and scalars
        return x.tolist()
    if isinstance(x, bytes):
        return x.decode("utf-8", errors="replace")
    return str(x)


def write_json(path, data, indent: int = 1) -> Path:
    """Write `data` to `path` (folders made as needed) through a temporary file renamed into
    place, so an interrupted run never leaves half a file where a finished one was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=indent, default=jsonable) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
