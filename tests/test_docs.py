"""The docs site builds warning-free, and its API pages document the public API.

The build is the one `docs/conf.py` names: Sphinx + MyST, autodoc with napoleon over the
Google-style docstrings, intersphinx from the inventories committed in docs/_inventories/ (offline).
`-W -n --keep-going`: any warning fails it, a cross-reference that resolves nowhere (`-n`,
nitpicky) included, and so does a docstring napoleon or docutils cannot parse. Everything goes to
a temporary folder (`-d` keeps the doctrees there too, `-E` reads every page afresh), so nothing
is cached between runs and nothing is written into docs/.
"""

from __future__ import annotations

import html.parser
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# What a newcomer looks for first: each must have an entry (an anchor with its full name) in the
# API reference.
PUBLIC = ["jaxinfer.load", "jaxinfer.load_tokenizer", "jaxinfer.generate", "jaxinfer.logits",
          "jaxinfer.score", "jaxinfer.attention", "jaxinfer.SamplingParams", "jaxinfer.Model",
          "jaxinfer.Output", "jaxinfer.Completion", "jaxinfer.serve.Engine",
          "jaxinfer.serve.Engine.submit", "jaxinfer.serve.Request"]
MODULES = ["jaxinfer.decode.sampling", "jaxinfer.decode.constraints", "jaxinfer.sharding",
           "jaxinfer.model.quantize", "jaxinfer.model.layout", "jaxinfer.weights.load",
           "jaxinfer.eval.scoring", "jaxinfer.decode.speculative"]


class _Page(html.parser.HTMLParser):
    """The ids and link targets of one HTML page."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])


def _parse(path: pathlib.Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("docs")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "sphinx", "-W", "-n", "--keep-going", "-E", "-q", "-j", "1",
           "-b", "html", "-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (
        f"the docs build failed (exit {proc.returncode}); run `{' '.join(cmd[1:])}` to see it.\n"
        f"warnings and errors:\n{proc.stderr}\n{proc.stdout[-4000:]}")
    return out / "html"


def test_toctree_reaches_every_page(site):
    index = _parse(site / "index.html")
    pages = sorted(p.relative_to(DOCS).with_suffix(".html").as_posix()
                   for p in DOCS.rglob("*.md") if "_build" not in p.parts)
    linked = {link.split("#")[0] for link in index.links}
    for page in pages:
        assert (site / page).is_file(), f"{page} was not built"
        if page != "index.html":
            # The sidebar holds the whole toctree, so the index links to every page in it
            # (Sphinx already warns about a page in no toctree; this checks the rendered site).
            assert page in linked, f"{page} is not linked from the site's navigation"


def test_api_pages_list_the_public_functions(site):
    ids = set()
    for page in (site / "api").glob("*.html"):
        ids |= _parse(page).ids
    missing = [name for name in PUBLIC if name not in ids]
    assert not missing, f"no API entry for {missing}"
    missing = [name for name in MODULES if f"module-{name}" not in ids]
    assert not missing, f"no API page documents the modules {missing}"
    overview = _parse(site / "api" / "index.html")
    summarized = {link.split("#")[-1] for link in overview.links}
    assert {"jaxinfer.load", "jaxinfer.generate", "jaxinfer.serve.Engine"} <= summarized
