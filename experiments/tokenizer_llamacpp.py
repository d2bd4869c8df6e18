#!/usr/bin/env python3
"""Byte-level GGUF vocabularies vs llama.cpp's tokenizer test vectors (Hugging Face's own ids).

llama.cpp ships, beside each `models/ggml-vocab-NAME.gguf` (a real model's tokenizer, no weights),
`NAME.gguf.inp` (test strings, separated by "\\n__ggml_vocab_test__\\n") and `NAME.gguf.out` (the ids
the model's Hugging Face tokenizer gives, one line per string). For every vocabulary in a folder,
this loads the GGUF with `jaxinfer.load_tokenizer` and counts the strings whose ids are identical,
both as a prompt is encoded (special-token text as plain text) and with special tokens allowed;
a vocabulary jaxinfer refuses is listed with the reason it gives. Writes
experiments/out/tokenizer_llamacpp.json.

Run:  python experiments/tokenizer_llamacpp.py LLAMA_CPP/models
"""

import argparse
import glob
import json
import os

import jaxinfer
from jaxinfer.text.tokenizer import TokenizerError

HERE = os.path.dirname(os.path.abspath(__file__))
SEPARATOR = "\n__ggml_vocab_test__\n"


def check(gguf: str) -> dict:
    """Agreement of one vocabulary with its test vectors (or the refusal)."""
    texts = open(gguf + ".inp", encoding="utf-8").read().split(SEPARATOR)
    want = [[int(x) for x in line.split()] for line in open(gguf + ".out", encoding="utf-8").read().split("\n")]
    try:
        tok = jaxinfer.load_tokenizer(gguf)
    except TokenizerError as e:
        return {"refused": str(e)}
    plain = [tok.encode(t, allowed_special=set(), disallowed_special=()) for t in texts]
    special = [tok.encode(t) for t in texts]
    bad = [{"text": t, "want": [p.decode("utf-8", "replace") for p in tok.pieces(w)],
            "got": [p.decode("utf-8", "replace") for p in tok.pieces(g)]}
           for t, w, g in zip(texts, want, plain) if w != g]
    return {"strings": len(texts), "identical_as_prompt": sum(w == g for w, g in zip(want, plain)),
            "identical_special_allowed": sum(w == g for w, g in zip(want, special)), "first_mismatches": bad[:3]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", help="llama.cpp's models/ folder (ggml-vocab-*.gguf with .inp / .out)")
    args = p.parse_args(argv)
    results = {}
    for gguf in sorted(glob.glob(os.path.join(args.models, "ggml-vocab-*.gguf"))):
        if not os.path.exists(gguf + ".out"):
            continue
        name = os.path.basename(gguf)[len("ggml-vocab-"):-len(".gguf")]
        r = results[name] = check(gguf)
        if "refused" in r:
            print(f"{name:16s} refused: {r['refused'][:110]}")
        else:
            print(f"{name:16s} {r['identical_as_prompt']}/{r['strings']} identical as a prompt, "
                  f"{r['identical_special_allowed']}/{r['strings']} with special tokens allowed")
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "tokenizer_llamacpp.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, ensure_ascii=False)
    return results


if __name__ == "__main__":
    main()
