#!/usr/bin/env python3
"""Gemma 3 tokenizer: jaxinfer's tiktoken encoding vs the Hugging Face tokenizer, on a big corpus.

Corpus: chunks of Python's own standard-library sources and docs (code, English, whitespace),
the golden tokenizer strings, and seeded random strings mixing scripts, emoji, digits, spaces
and rare code points (byte fallback). Counts strings whose ids differ, and the tokens involved.
Needs transformers (the HF tokenizer is built from the same GGUF). Writes
experiments/out/tokenizer_gemma.json.

Run:  python experiments/tokenizer_gemma.py [--chunks 3000]
"""

import argparse
import json
import os
import random
import sysconfig
import time

from jaxinfer.weights import gguf as gguf_io
from jaxinfer.weights import hub
from jaxinfer.text import spm

HERE = os.path.dirname(os.path.abspath(__file__))


def corpus(n_chunks: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    files = []
    for root, _, names in os.walk(sysconfig.get_paths()["stdlib"]):
        if "site-packages" in root:
            continue
        files += [os.path.join(root, n) for n in names if n.endswith((".py", ".txt", ".rst"))]
    files.sort()
    rng.shuffle(files)
    out = []
    for f in files:
        try:
            text = open(f, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        for i in range(0, min(len(text), 6000), 1500):
            out.append(text[i:i + 1500])
        if len(out) >= n_chunks:
            break
    golden = os.path.join(HERE, "..", "tests", "golden", "gemma3_tokenizer.json")
    out += [r["text"] for r in json.load(open(golden, encoding="utf-8"))]
    pools = ["abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", "  \t\n", ".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
             "éèêëàâäôöûüçñßøåæœ", "你好世界中文字符测试", "日本語カタカナひらがな", "한국어텍스트", "مرحبابالعالم", "שלוםעולם",
             "русскийтекст", "ελληνικά", "😀👍🍕🏳️‍🌈👨‍👩‍👧", "\u2581", "\u0301\u200b\u00a0", "\U0010ffff\ue000\U0001d518"]
    for _ in range(n_chunks // 2):
        k = rng.randint(1, 60)
        out.append("".join(rng.choice(rng.choice(pools)) for _ in range(k)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=3000)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    path = hub.fetch("gemma3-270m")
    t = time.time()
    ours = spm.from_gguf(gguf_io.read_tokenizer(gguf_io.open_gguf(str(path))))
    t_ours = time.time() - t
    t = time.time()
    hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    t_hf = time.time() - t
    texts = corpus(args.chunks)
    bad, n_tok, examples = 0, 0, []
    for text in texts:
        a, b = ours.encode(text), hf.encode(text, add_special_tokens=False)
        n_tok += len(b)
        if a != b:
            bad += 1
            if len(examples) < 10:
                examples.append({"text": text[:200], "hf": b[:40], "ours": a[:40]})
    rt = sum(ours.decode(ours.encode(x)) == x for x in texts if "\u2581" not in x)
    res = {"strings": len(texts), "hf_tokens": n_tok, "strings_differing": bad,
           "mismatch_rate": bad / len(texts), "roundtrip_ok": rt,
           "roundtrip_total": sum("\u2581" not in x for x in texts),
           "build_s": {"jaxinfer": round(t_ours, 2), "transformers": round(t_hf, 2)}, "examples": examples}
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "tokenizer_gemma.json"), "w", encoding="utf-8") as f:
        json.dump(res, f, ensure_ascii=False, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "examples"}, indent=1))
    for e in examples[:3]:
        print(e)


if __name__ == "__main__":
    main()
