"""Attention: which earlier tokens each token looks at, in every layer and head of the real model.

    python experiments/attention.py ["The cat sat on the mat because it was soft"]

The weights come from the same blocks that generation runs (`forward_attention`,
via `jaxinfer.attention`). Prints that no token attends to a later one, and which candidate
referent "it" attends to most in the heads where it looks at the candidates most.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `experiments` and `jaxinfer` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from experiments.common import plt  # noqa: E402

DEFAULT_SENTENCE = "The cat sat on the mat because it was soft"


def find(pieces: list[str], word: str, before: int | None = None) -> int:
    """Index of the first token whose text (stripped) is `word`, optionally before index `before`."""
    for i, p in enumerate(pieces[:before]):
        if p.strip() == word:
            return i
    raise SystemExit(f"no token {word!r} in {pieces[:before]} (tokens are matched whole)")


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("sentence", nargs="?", default=DEFAULT_SENTENCE)
    p.add_argument("--word", default="it", help="the token whose attention is reported (default %(default)s)")
    p.add_argument("--candidates", default="cat,mat", help="comma-separated earlier words it may refer to")
    p.add_argument("--top", type=int, default=5, help="referent heads reported (default %(default)s)")
    args = p.parse_args(argv)
    import jaxinfer

    m = common.load_model(args, model)
    ids = m.tokenizer.encode(args.sentence)
    pieces = [b.decode("utf-8", errors="replace") for b in m.tokenizer.pieces(ids)]
    probs = jaxinfer.attention(m, ids)  # [L, N, T, T]
    L, N, T, _ = probs.shape
    future = float(np.triu(probs, k=1).max())  # weight any token gives to a later one
    row_sum_err = float(np.abs(probs.sum(-1) - 1).max())

    w = find(pieces, args.word)
    cands = [find(pieces, c, before=w) for c in args.candidates.split(",") if c]
    from_w = probs[:, :, w, :]  # [L, N, T]: attention of the word over all tokens
    mass = from_w[:, :, cands].sum(-1)  # [L, N]: on the candidate referents
    order = np.argsort(mass.ravel())[::-1][: args.top]
    heads = []
    for o in order:
        layer, head = divmod(int(o), N)
        pick = cands[int(np.argmax(from_w[layer, head, cands]))]
        heads.append({"layer": layer, "head": head, "picks": pieces[pick].strip(),
                      "weights": {pieces[c].strip(): float(from_w[layer, head, c]) for c in cands},
                      "first_token_weight": float(from_w[layer, head, 0])})
    votes = {pieces[c].strip(): sum(float(h["weights"][pieces[c].strip()]) for h in heads) for c in cands}
    winner = max(votes, key=votes.get)
    mean_over_heads = {f"{i}:{pieces[i]}": float(from_w[:, :, i].mean()) for i in range(w + 1)}

    print(f"sentence: {args.sentence!r} -> {T} tokens: {' | '.join(x.replace(' ', '·') for x in pieces)}")
    print(f"attention probabilities [layers, heads, T, T] = {list(probs.shape)} from jaxinfer.model.forward.forward_attention")
    print(f"a token only looks back: largest weight on a later token = {future:.1e} (rows sum to 1 within {row_sum_err:.1e})")
    print(f"{args.word!r} (token {w}) on average over all {L * N} heads: "
          + ", ".join(f"{k.split(':', 1)[1].strip()} {v:.2f}" for k, v in mean_over_heads.items()))
    print(f"heads where {args.word!r} looks at {', '.join(pieces[c].strip() for c in cands)} most:")
    for h in heads:
        ws = ", ".join(f"{k} {v:.2f}" for k, v in h["weights"].items())
        print(f"  layer {h['layer']:2d} head {h['head']}: {ws} -> {h['picks']}")
    print(f"summed over those {len(heads)} heads, {args.word!r} attends most to {winner!r} "
          f"({', '.join(f'{k} {v:.2f}' for k, v in votes.items())})")

    best = heads[0]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [1.1, 1]})
    im = a0.imshow(probs[best["layer"], best["head"]], cmap="Blues", vmin=0, vmax=1)
    labels = [x.replace(" ", "·") for x in pieces]
    a0.set_xticks(range(T), labels, rotation=60, ha="right", fontsize=8)
    a0.set_yticks(range(T), labels, fontsize=8)
    a0.set_xlabel("attends to (key)")
    a0.set_ylabel("token (query)")
    a0.set_title(f"layer {best['layer']}, head {best['head']}: upper triangle is 0 (no look-ahead)", fontsize=9)
    fig.colorbar(im, ax=a0, fraction=0.046)
    for c in cands:
        a1.plot(range(L), from_w[:, :, c].max(-1), marker="o", ms=3, label=f"{pieces[c].strip()!r} (max over heads)")
    a1.plot(range(L), from_w[:, :, 0].mean(-1), color="gray", ls=":", label=f"{pieces[0].strip()!r} (first token, mean)")
    a1.set_xlabel("layer")
    a1.set_ylabel(f"attention from {args.word!r}")
    a1.set_ylim(0, 1)
    a1.set_title(f"{m.config.name}: where {args.word!r} looks, per layer", fontsize=9)
    a1.legend(fontsize=8)
    fig.tight_layout()
    result = {"sentence": args.sentence, "tokens": pieces, "token_ids": ids, "shape": list(probs.shape),
              "max_weight_on_later_token": future, "max_row_sum_error": row_sum_err,
              "word": args.word, "word_index": w, "candidates": [pieces[c].strip() for c in cands],
              "referent_heads": heads, "votes": votes, "attends_most_to": winner,
              "mean_over_heads": mean_over_heads,
              "max_over_heads_per_layer": {pieces[c].strip(): from_w[:, :, c].max(-1).tolist() for c in cands}}
    common.save("attention", fig, result, args)
    return result


if __name__ == "__main__":
    main()
