#!/usr/bin/env python3
"""Independent reference ("golden") data for jaxinfer, made with Hugging Face transformers.

This script deliberately uses nothing from the jaxinfer package: it loads the SmolLM2-135M-Instruct
Q4_1 GGUF through transformers' own GGUF loader (dequantised to fp32 on CPU) and records

  smollm2_logits.npz       per-prompt ids, a 512-wide slice of the fp32 logits, full-vocab argmax and
                           logsumexp, a 32-token greedy continuation, final-position hidden states, and
                           the reference's own float32 error per position: max |fp32 - fp64| of
                           those logits (float64_reference.py).
  smollm2_reference.json   prompts, ids, greedy ids/text, versions, GGUF sha256, and the facts about
                           the HF tokenizer/model that the JAX side has to match.
  smollm2_tokenizer.json   [{"text", "ids", "decoded", "roundtrip", "ids_smollm_pre", "smollm_pre_differs"}]

Run:  python tests/golden/make_reference.py [--gguf PATH] [--out DIR] [--float64-only]
Needs: torch (CPU is fine), transformers (GGUF support), gguf, accelerate, numpy.  About a minute.
--float64-only adds the float32-error arrays to the existing smollm2_logits.npz and changes nothing else.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from float64_reference import float64_logits, float64_model, fp32_error, update_npz  # noqa: E402

DEFAULT_GGUF = "/root/.cache/jaxinfer/SmolLM2-135M-Instruct.Q4_1.gguf"
HERE = os.path.dirname(os.path.abspath(__file__))

TOP_K = 64  # top logits always kept per position
M = 512  # columns stored per position (top-64 + random fill)
SEED = 0
N_NEW = 32  # greedy continuation length

# Digit-free on purpose: the HF GGUF tokenizer and the original SmolLM2 / llama.cpp "smollm"
# pre-tokenizer disagree only around digits, so these prompts tokenize identically under both
# (the script checks and records that).
PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef multiply(a, b):\n",
    "<|im_start|>user\nWhat is the tallest mountain in the world?<|im_end|>\n<|im_start|>assistant\n",
    (
        "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades of "
        "salt and wind. Every evening the keeper climbed the spiral staircase, trimmed the wick, and "
        "watched the beam sweep across the dark water, warning ships away from the jagged rocks that "
        "had claimed so many vessels before"
    ),
]

# Strings for the tokenizer golden file.
TOKENIZER_TEXTS = [
    # whitespace
    "",
    " ",
    "  ",
    "    ",
    "\t",
    "\n",
    "\n\n",
    "\n\n\n",
    "hello world",
    "hello  world",
    "hello   world",
    " leading space",
    "   leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "a\tb\t\tc",
    "line one\nline two\n\nline four\n",
    " \n \t \r\n x",
    "mixed \t\n  whitespace\t \n",
    # digits
    "1234567890",
    "3.14159265358979",
    "The year 2024 had 366 days.",
    "Date: 2024-11-30 12:34:56",
    "Price: $1,299.99 (was $1,500)",
    "v1.2.3 and 0.001 and -42 and 1e-5",
    " 7 77 777 7777",
    # digits after whitespace runs / non-ASCII numerics: where the HF GGUF pre-tokenizer (GPT-2 regex
    # only) and SmolLM2's own (Digits(individual) first) can disagree -- see ids_smollm_pre
    "a  1",
    "x =   42;\n  7",
    "\t\t9 and \n\n8",
    "x² + y³ = ½ and ¼",
    "Arabic-Indic ٣٤٥ and Devanagari ४२ and Roman Ⅻ",
    # contractions
    "It's John's car, isn't it? They're here; we've left; I'm sure you'll see; he'd know.",
    "IT'S JOHN'S CAR, ISN'T IT? THEY'RE HERE, WE'VE GONE, I'M SURE",
    "don't can't won't shouldn't y'all o'clock",
    # code
    'def greet(name: str) -> str:\n    """Say hello."""\n    return f"Hello, {name}!"\n',
    'for i in range(10):\n\tif i % 2 == 0:\n\t\tprint(i ** 2, end=" ")\n',
    '{"name": "SmolLM2", "params": 135000000, "tags": ["small", "llm"], "ok": true, "x": null}',
    '#include <stdio.h>\nint main(void) {\n    int a[3] = {1, 2, 3};\n    printf("%d\\n", a[0]);\n    return 0;\n}\n',
    "x = [i*i for i in range(5) if i != 3]  # comment -> ok && || != == <= >=",
    # CJK
    "你好，世界！今天天气很好。",
    "日本語のテキストとカタカナ、ひらがな。",
    "안녕하세요, 세계! 한국어 텍스트입니다.",
    # emoji
    "I love pizza 🍕😀👍",
    "Family: 👨\u200d👩\u200d👧\u200d👦 and rainbow flag 🏳\ufe0f\u200d🌈",
    "Flags: 🇫🇷🇯🇵🇺🇸 skin tone 👍🏽",
    # RTL
    "مرحبا بالعالم، كيف حالك؟",
    "שלום עולם, מה שלומך?",
    # accented Latin & other scripts
    "Café naïve résumé façade Ångström São Paulo Zürich",
    "Ελληνικά και Русский текст",
    "e\u0301 (combining acute) vs é (precomposed)",
    # punctuation
    "Wait... what?!?! --- (really) [yes] {no} <maybe>",
    "!!!???...,,,;;;:::",
    "\"quoted\" 'single' `backtick` «guillemets» “curly” ‘quotes’",
    "a_b-c.d/e\\f|g~h^i",
    # URLs / emails / paths
    "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?foo=bar&baz=1#section",
    "Contact me at jane.doe+test@example.com or visit www.example.org.",
    "/usr/local/bin/python3 C:\\Users\\me\\file.txt",
    # special tokens in text
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text before<|endoftext|>text after",
    "<repo_name>smollm<file_sep>main.py<filename>",
    "<|im_start|",
    "< |im_start| >",
    # misc
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "ALL CAPS SENTENCE WITH NUMBERS 123",
    "\u00a0non-breaking\u00a0space and zero\u200bwidth",
    "tab\tseparated\tvalues\n1\t2\t3",
]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def smollm_pre_tokenizer(hf_tok):
    """The same vocab/merges/added tokens as the HF GGUF tokenizer, but with the pre-tokenizer of the
    original SmolLM2 tokenizer.json (== llama.cpp's "smollm" pre-type: \\p{N} isolated, then GPT-2 regex)."""
    from tokenizers import Tokenizer, pre_tokenizers

    t = Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return t


def load_hf_gguf(path: str):
    """transformers' own reading of a GGUF: (tokenizer, float32 model in eval mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gdir, gname = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
    return tok, model.eval()


def select_columns(logits: torch.Tensor, fill: np.ndarray) -> np.ndarray:
    """[T, V] -> [T, M] int32 sorted indices: top-64 of each row, then `fill` in order (skipping
    duplicates) until M columns."""
    top = torch.topk(logits, TOP_K, dim=-1).indices.numpy()
    rows = []
    for t in range(logits.shape[0]):
        chosen = list(top[t])
        seen = set(chosen)
        for v in fill:
            if len(chosen) == M:
                break
            if v not in seen:
                chosen.append(int(v))
                seen.add(int(v))
        assert len(chosen) == M
        rows.append(np.sort(np.asarray(chosen, dtype=np.int64)))
    return np.stack(rows).astype(np.int32)


def float64_errors(model, arrays: dict) -> dict:
    """The reference's float32 error per prompt i: logits_fp32_error_i [T] (float32), from the stored
    ids_i, vocab_idx_i, logits_i and one float64 forward pass each. (A logsumexp moves by at most the
    largest logit error, so the logits' error bounds the lse_i too.)"""
    model64, out = float64_model(model), {}
    for i in range(len([k for k in arrays if k.startswith("ids_")])):
        l64 = float64_logits(model64, arrays[f"ids_{i}"].tolist())
        out[f"logits_fp32_error_{i}"] = fp32_error(arrays[f"logits_{i}"], l64, arrays[f"vocab_idx_{i}"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default=HERE, help="output directory (default: this script's folder)")
    ap.add_argument("--float64-only", action="store_true",
                    help="only add the float32-error arrays to the existing smollm2_logits.npz")
    args = ap.parse_args()
    if args.float64_only:
        npz_path = os.path.join(args.out, "smollm2_logits.npz")
        with np.load(npz_path) as f:
            update_npz(npz_path, float64_errors(load_hf_gguf(args.gguf)[1], {k: f[k] for k in f.files}))
        return

    t_start = time.time()
    torch.manual_seed(SEED)
    os.makedirs(args.out, exist_ok=True)
    digest = sha256(args.gguf)

    tok, model = load_hf_gguf(args.gguf)
    cfg = model.config
    V = cfg.vocab_size
    t_loaded = time.time()

    smollm_tok = smollm_pre_tokenizer(tok)

    # ---------------- tokenizer golden ----------------
    tok_rows = []
    for text in TOKENIZER_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        decoded = tok.decode(ids)
        ids_s = smollm_tok.encode(text, add_special_tokens=False).ids
        tok_rows.append(
            {
                "text": text,
                "ids": ids,
                "decoded": decoded,
                "roundtrip": decoded == text,
                "ids_smollm_pre": ids_s,
                "smollm_pre_differs": ids_s != ids,
            }
        )
    with open(os.path.join(args.out, "smollm2_tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok_rows, f, ensure_ascii=False, indent=1)
        f.write("\n")

    # ---------------- logits + greedy golden ----------------
    fill = np.random.default_rng(SEED).permutation(V)
    arrays: dict[str, np.ndarray] = {}
    prompt_meta = []
    gen_cfg = dict(
        do_sample=False,
        max_new_tokens=N_NEW,
        min_new_tokens=N_NEW,
        # No EOS: generation can neither stop early nor have EOS masked (min_new_tokens would set the
        # EOS logit to -inf, making the continuation differ from plain argmax). Pure argmax decoding.
        eos_token_id=None,
        pad_token_id=cfg.pad_token_id,
    )
    with torch.no_grad():
        for i, text in enumerate(PROMPTS):
            ids = tok.encode(text, add_special_tokens=False)
            assert smollm_tok.encode(text, add_special_tokens=False).ids == ids
            x = torch.tensor([ids], dtype=torch.long)
            out = model(input_ids=x, output_hidden_states=True)
            logits = out.logits[0].float()  # [T, V]
            assert logits.shape == (len(ids), V)
            cols = select_columns(logits, fill)
            arrays[f"ids_{i}"] = np.asarray(ids, dtype=np.int32)
            arrays[f"vocab_idx_{i}"] = cols
            arrays[f"logits_{i}"] = np.take_along_axis(logits.numpy(), cols.astype(np.int64), axis=1).astype(np.float32)
            arrays[f"argmax_{i}"] = logits.argmax(-1).numpy().astype(np.int32)
            arrays[f"lse_{i}"] = torch.logsumexp(logits.double(), -1).float().numpy()
            # hidden_states: tuple of num_layers+1 [1, T, H]; [0] = embeddings, [l] = output of layer l
            # (1-based) for l < num_layers, [-1] = output of the final RMSNorm (what lm_head sees).
            hs = torch.stack([h[0, -1] for h in out.hidden_states]).float().numpy()
            arrays[f"hidden_last_{i}"] = hs.astype(np.float32)
            final_norm_ok = torch.allclose(model.lm_head(out.hidden_states[-1][0]), out.logits[0], atol=1e-4)

            gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **gen_cfg)
            greedy = gen[0, len(ids):].tolist()
            assert len(greedy) == N_NEW, len(greedy)
            arrays[f"greedy_{i}"] = np.asarray(greedy, dtype=np.int32)

            # Cross-check generate (KV cache) against a cache-free teacher-forced forward.
            full = torch.tensor([ids + greedy[:-1]], dtype=torch.long)
            tf_argmax = model(input_ids=full).logits[0, len(ids) - 1 :].argmax(-1).tolist()
            prompt_meta.append(
                {
                    "index": i,
                    "text": text,
                    "ids": ids,
                    "num_tokens": len(ids),
                    "greedy_ids": greedy,
                    "greedy_text": tok.decode(greedy),
                    "greedy_text_skip_special": tok.decode(greedy, skip_special_tokens=True),
                    "eos_positions_in_greedy": [k for k, t in enumerate(greedy) if t == cfg.eos_token_id],
                    "greedy_matches_teacher_forced_argmax": tf_argmax == greedy,
                    "hidden_last_final_is_normed": bool(final_norm_ok),
                    "argmax_first_new_token": int(arrays[f"argmax_{i}"][-1]),
                }
            )

    arrays.update(float64_errors(model, arrays))
    npz_path = os.path.join(args.out, "smollm2_logits.npz")
    np.savez_compressed(npz_path, **arrays)

    # ---------------- facts about the HF side ----------------
    tj = json.loads(tok.backend_tokenizer.to_str())
    ref = {
        "model_file": os.path.basename(args.gguf),
        "gguf_sha256": digest,
        "versions": {
            "python": platform.python_version(),
            "transformers": version("transformers"),
            "torch": torch.__version__,
            "gguf": version("gguf"),
            "tokenizers": version("tokenizers"),
            "numpy": np.__version__,
        },
        "npz": {
            "file": "smollm2_logits.npz",
            "num_prompts": len(PROMPTS),
            "M": M,
            "top_k": TOP_K,
            "fill": f"np.random.default_rng({SEED}).permutation({V}); vocab_idx_i[t] = sorted(top-{TOP_K} of "
            f"logits[t] + first entries of that permutation not already chosen, to exactly {M})",
            "keys": {
                "ids_{i}": "int32 [T] token ids fed to the model (no BOS; exactly these)",
                "vocab_idx_{i}": f"int32 [T, {M}] sorted vocab indices per position",
                "logits_{i}": f"float32 [T, {M}] fp32 logits at vocab_idx_{{i}}",
                "argmax_{i}": "int32 [T] full-vocab argmax per position",
                "lse_{i}": "float32 [T] full-vocab logsumexp per position (computed in float64)",
                "greedy_{i}": f"int32 [{N_NEW}] greedy continuation (pure argmax, EOS neither stops nor is masked)",
                "logits_fp32_error_{i}": "float32 [T] max over the stored columns of |logits_i - the same "
                "logits from a float64 forward pass| (float64_reference.py): the reference's own float error",
                "hidden_last_{i}": f"float32 [{cfg.num_hidden_layers + 1}, {cfg.hidden_size}] hidden state at the "
                "last prompt position: [0]=token embedding, [l]=residual stream after layer l (1..L-1), "
                "[L]=after final RMSNorm",
            },
        },
        "generation_kwargs": {k: v for k, v in gen_cfg.items()},
        "prompts": prompt_meta,
        "tokenizer": {
            "class": type(tok).__name__,
            "add_bos_token": getattr(tok, "add_bos_token", None),
            "encode_hello_add_special_tokens_true": tok.encode("Hello", add_special_tokens=True),
            "encode_hello_add_special_tokens_false": tok.encode("Hello", add_special_tokens=False),
            "bos": [tok.bos_token, tok.bos_token_id],
            "eos": [tok.eos_token, tok.eos_token_id],
            "pad": [tok.pad_token, tok.pad_token_id],
            "unk": [tok.unk_token, tok.unk_token_id],
            "added_tokens": [[a["id"], a["content"], a["special"]] for a in tj["added_tokens"]],
            "normalizer": tj.get("normalizer"),
            "pre_tokenizer": tj.get("pre_tokenizer"),
            "decoder": tj.get("decoder"),
            "post_processor": tj.get("post_processor"),
            "model": {k: v for k, v in tj["model"].items() if k not in ("vocab", "merges")},
            "num_merges": len(tj["model"].get("merges", [])),
            "len": len(tok),
            "smollm_pre_tokenizer_used_for_ids_smollm_pre": json.loads(smollm_tok.to_str())["pre_tokenizer"],
            "num_tokenizer_texts_where_smollm_pre_differs": sum(r["smollm_pre_differs"] for r in tok_rows),
            "num_tokenizer_texts_roundtrip_false": sum(not r["roundtrip"] for r in tok_rows),
        },
        "model_config": {
            k: getattr(cfg, k, None)
            for k in (
                "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
                "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id",
            )
        },
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
        "torch_num_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "seconds": {"load": round(t_loaded - t_start, 1), "total": round(time.time() - t_start, 1)},
    }
    with open(os.path.join(args.out, "smollm2_reference.json"), "w", encoding="utf-8") as f:
        json.dump(ref, f, ensure_ascii=False, indent=1)
        f.write("\n")

    for p in prompt_meta:
        print(f"[{p['index']}] T={p['num_tokens']} greedy={p['greedy_text']!r} "
              f"tf_ok={p['greedy_matches_teacher_forced_argmax']} eos_at={p['eos_positions_in_greedy']}")
    print(f"npz {os.path.getsize(npz_path)} bytes; {sum(not r['roundtrip'] for r in tok_rows)} of "
          f"{len(tok_rows)} tokenizer strings fail roundtrip; smollm pre differs on "
          f"{ref['tokenizer']['num_tokenizer_texts_where_smollm_pre_differs']}; total {ref['seconds']['total']} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
