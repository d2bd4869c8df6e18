"""Finding a model in the local Hugging Face hub cache by its id ("ORG/NAME"), offline.

The hub (huggingface_hub, `huggingface-cli download`, `from_pretrained`) keeps one folder per repo:

  <cache>/models--ORG--NAME/refs/main              the commit hash `main` pointed to when fetched
  <cache>/models--ORG--NAME/snapshots/<hash>/...   the files of that commit (symlinks into blobs/)
  <cache>/models--ORG--NAME/blobs/<sha256>         the file contents

and <cache> is $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub. Nothing here needs
huggingface_hub or the network: a snapshot is a plain folder that `jaxinfer.load` reads like any
other Hugging Face folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping, Optional

# Hub repo ids: "ORG/NAME", each part letters, digits, '-', '_', '.', not starting with '.' or '-'
_REPO_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*/[A-Za-z0-9_][A-Za-z0-9._-]*$")


class HFCacheError(FileNotFoundError):
    """A hub id is not in the local Hugging Face cache (says where it looked and how to fetch it)."""


def is_repo_id(name: str) -> bool:
    """Whether `name` has the form of a hub model id, "ORG/NAME" (not whether it is cached)."""
    return bool(_REPO_ID.match(name)) and not name.endswith(".gguf") and ".." not in name


def cache_dir(env: Optional[Mapping[str, str]] = None) -> Path:
    """The hub cache folder: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def repo_folder(repo_id: str, cache: Path) -> Path:
    """<cache>/models--ORG--NAME."""
    return cache / ("models--" + repo_id.replace("/", "--"))


def resolve(repo_id: str, *, revision: str = "main", cache: Optional[os.PathLike] = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` in the local hub cache.

    Args:
      repo_id: "ORG/NAME", e.g. "Qwen/Qwen2.5-0.5B-Instruct".
      revision: a ref name (the commit `refs/<revision>` names) or a commit hash.
      cache: the hub cache folder (default: `cache_dir()`).
    Returns:
      <cache>/models--ORG--NAME/snapshots/<commit>, which holds config.json.
    Raises:
      HFCacheError: nothing usable is cached; the message lists the paths tried and the command
        that fetches the model on a machine with network.
    """
    if not is_repo_id(repo_id):
        raise ValueError(f"{repo_id!r} is not a hub model id of the form 'ORG/NAME'")
    cache = cache_dir() if cache is None else Path(cache)
    repo = repo_folder(repo_id, cache)
    ref = repo / "refs" / revision
    looked = [str(ref)]
    commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    looked.append(str(snapshot))
    if (snapshot / "config.json").is_file():
        return snapshot
    found = sorted(p.name for p in (repo / "snapshots").glob("*") if p.is_dir()) if repo.is_dir() else []
    where = (f"looked for {repo_id!r} (revision {revision!r}) in the Hugging Face cache {cache} "
             "($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub):\n  "
             + "\n  ".join(looked))
    if snapshot.is_dir():
        raise HFCacheError(f"{where}\nthe snapshot has no config.json (an incomplete download?); "
                           f"fetch it again with `huggingface-cli download {repo_id}` on a machine with network")
    other = f"\nsnapshots present: {', '.join(found)} (pass one as revision)" if found else ""
    raise HFCacheError(f"{where}\nnot found.{other}\nTo get it, on a machine with network run "
                       f"`huggingface-cli download {repo_id}` (or `hf download {repo_id}`) and copy "
                       f"{repo.name} into {cache}, or pass the path of a folder holding config.json and "
                       "*.safetensors")


def snapshot_repo_id(folder: os.PathLike) -> Optional[str]:
    """"ORG/NAME" when `folder` is a hub snapshot (.../models--ORG--NAME/snapshots/<commit>), else None."""
    p = Path(folder)
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name[len("models--"):].replace("--", "/", 1)
    return None
