"""The logit lens: what each layer would predict, read through the final norm and the unembedding.

    python -m experiments.logit_lens ["The capital of France is"] [--top-k 5]

Draws a layers x positions grid of `jaxinfer.logit_lens`'s top token and its probability, and says
from which layer on the model's final answer at the last position is the top token.
"""

from __future__ import annotations

import numpy as np

from experiments import _common as common


def settled_from(top_ids: np.ndarray) -> int:
    """The first layer from which the top token equals the last layer's, to the end. top_ids: [L]."""
    layer = len(top_ids) - 1
    while layer > 0 and top_ids[layer - 1] == top_ids[-1]:
        layer -= 1
    return layer


def label(piece: str) -> str:
    """A token's text as a cell label: spaces as '·', escapes for newlines, at most 10 characters."""
    return repr(piece)[1:-1].replace(" ", "·")[:10]


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("prompt", nargs="?", default="The capital of France is")
    p.add_argument("--top-k", type=int, default=5, help="tokens kept per layer and position (default %(default)s)")
    args = p.parse_args(argv)
    import jaxinfer

    m = common.load_model(args, model)
    lens = jaxinfer.logit_lens(m, args.prompt, top_k=args.top_k)
    n, T, _ = lens.top_ids.shape
    pieces = [m.tokenizer.decode([t]) for t in lens.token_ids]
    top = [[lens.top_tokens[i][t][0] for t in range(T)] for i in range(n)]  # [n][T] the top token's text
    final_token = top[-1][-1]
    layer = lens.layers[settled_from(lens.top_ids[:, -1, 0])]
    first_seen = next((lens.layers[i] for i in range(n) if final_token in lens.top_tokens[i][-1]), None)

    print(f"prompt {args.prompt!r} -> {T} tokens: {' | '.join(x.replace(' ', '·') for x in pieces)}")
    print("last position, top token by layer (probability):")
    for i in range(n):
        print(f"  layer {lens.layers[i]:2d}: {top[i][-1]!r:14} {lens.top_probs[i, -1, 0]:.3f}")
    print(f"{final_token!r} is the top token from layer {layer} on (of {n}); in the top {args.top_k} from "
          f"layer {first_seen}; final probability {lens.top_probs[-1, -1, 0]:.3f}")

    fig, ax = common.plt().subplots(figsize=(1.5 + 1.3 * T, 0.9 + 0.28 * n))
    im = ax.imshow(lens.top_probs[:, :, 0], aspect="auto", cmap="viridis", vmin=0, vmax=1, origin="lower")
    for i in range(n):
        for t in range(T):
            ax.text(t, i, label(top[i][t]), ha="center", va="center", fontsize=6.5,
                    color="white" if lens.top_probs[i, t, 0] < 0.6 else "black")
    ax.set_xticks(range(T), [label(x) for x in pieces], fontsize=8)
    ax.set_yticks(range(n), [str(x) for x in lens.layers], fontsize=7)
    ax.set(xlabel="position (the token read there)",
           ylabel="layer (resid_post through the final norm and the unembedding)")
    ax.set_title(f"logit lens: top next token and its probability\n{args.model}: {args.prompt!r}", fontsize=9)
    fig.colorbar(im, ax=ax, label="probability of the top token")
    result = {"prompt": args.prompt, "tokens": pieces, "token_ids": lens.token_ids, "layers": list(lens.layers),
              "final_token": final_token, "top_from_layer": layer, "in_top_k_from_layer": first_seen,
              "top_tokens": lens.top_tokens, "top_ids": lens.top_ids, "top_probs": lens.top_probs.round(5)}
    common.save("logit_lens", result, args, fig=fig)
    return result


if __name__ == "__main__":
    main()
