"""Text -> tokens: the pieces under cl100k_base (GPT-4's tokenizer) and under the model's own.

    python experiments/tokens.py "any text"

Prints each tokenizer's pieces (spaces shown as ·) with ids and counts, how a made-up word and the
typo "inthe" split into known pieces, and draws the text with coloured token boundaries.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `experiments` and `jaxinfer` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import common  # noqa: E402
from experiments.common import plt  # noqa: E402

DEFAULT_TEXT = "The glorptastic llama read inthe news that 2025 had 365 days."
PROBES = ("inthe", "glorptastic")  # a typo and a word that does not exist
COLORS = ["#fde2a7", "#b9e3c6", "#c8d7f5", "#f6c6d0", "#e0cdf2", "#cfeef0"]


def show(piece: bytes) -> str:
    """A token's text for display: spaces as ·, newlines as ⏎, broken UTF-8 as �."""
    return piece.decode("utf-8", errors="replace").replace(" ", "·").replace("\n", "⏎").replace("\t", "→")


def split(tokenizer, text: str) -> list[dict]:
    """[{id, piece}] for `text` under a jaxinfer Tokenizer (special-token text stays plain text)."""
    ids = tokenizer.encode(text, allowed_special=set(), disallowed_special=())
    return [{"id": int(i), "piece": show(p)} for i, p in zip(ids, tokenizer.pieces(ids))]


def draw(ax, title: str, toks: list[dict], width: int = 44) -> int:
    """Boxes of alternating colour, one per token, wrapped at `width` characters. Returns the rows used."""
    x, y = 0, 0
    for j, t in enumerate(toks):
        w = max(len(t["piece"]), 1)
        if x + w > width and x > 0:
            x, y = 0, y + 1
        ax.add_patch(plt.Rectangle((x, -y - 0.8), w, 0.7, facecolor=COLORS[j % len(COLORS)], edgecolor="#555", lw=0.6))
        ax.text(x + w / 2, -y - 0.45, t["piece"], ha="center", va="center", family="monospace", fontsize=11)
        x += w
    ax.set_xlim(-0.5, width + 0.5)
    ax.set_ylim(-y - 1.0, 0.1)
    ax.set_title(title, loc="left", fontsize=11)
    ax.axis("off")
    return y + 1


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("text", nargs="?", default=DEFAULT_TEXT, help="text to tokenize")
    args = p.parse_args(argv)
    if not args.text:
        p.error("text is empty")
    from jaxinfer.text.tokenizer import openai_tokenizer

    m = common.load_model(args, model)
    encodings = {"cl100k_base": openai_tokenizer("cl100k_base"), m.config.name: m.tokenizer}
    result = {"text": args.text, "tokenizers": {}, "probes": {}}
    for name, enc in encodings.items():
        toks = split(enc, args.text)
        result["tokenizers"][name] = {"n_tokens": len(toks), "n_chars": len(args.text), "tokens": toks}
        result["probes"][name] = {w: [t["piece"] for t in split(enc, w)] for w in PROBES}

    print(f"text: {args.text!r} ({len(args.text)} characters)")
    for name, r in result["tokenizers"].items():
        print(f"\n{name}: {r['n_tokens']} tokens")
        print("  " + " | ".join(t["piece"] for t in r["tokens"]))
        print("  ids: " + " ".join(str(t["id"]) for t in r["tokens"]))
        for w, pieces in result["probes"][name].items():
            print(f"  {w!r} -> {len(pieces)} tokens: {' + '.join(pieces)}")

    rows = {name: max(1, -(-sum(max(len(t['piece']), 1) for t in r["tokens"]) // 44)) for name, r in result["tokenizers"].items()}
    fig, axes = plt.subplots(len(encodings), 1, figsize=(8, 0.9 + 0.55 * sum(rows.values()) + 0.5 * len(rows)),
                             gridspec_kw={"height_ratios": [rows[n] + 0.6 for n in rows]})
    for ax, (name, r) in zip(axes, result["tokenizers"].items()):
        draw(ax, f"{name}: {r['n_tokens']} tokens", r["tokens"])
    fig.tight_layout()
    common.save("tokens", fig, result, args)
    return result


if __name__ == "__main__":
    main()
