#!/usr/bin/env python3
"""Golden data for the text side of Hugging Face folders: tokenizer.json and chat templates.

Uses nothing from jaxinfer. Writes tests/golden/hf_text/:

  smollm2/        the genuine HF tokenizer files transformers writes for SmolLM2-135M-Instruct
                  (`AutoTokenizer.from_pretrained(dir, gguf_file=...)` + `save_pretrained`):
                  tokenizer.json.xz, tokenizer_config.json, chat_template.jinja.
  tinyspm/        a small Llama-2-style SentencePiece BPE vocabulary (1,000 pieces, byte fallback,
                  trained with `sentencepiece` on experiments/data/pydoc_heldout.txt; the whitespace
                  runs "▁▁", "▁▁▁▁", ... sit at low ids with score -1e9, as in Llama 2's vocabulary):
                  tokenizer.json.xz written by transformers from the .model file, and
                  tinyllama2.gguf (tokenizer only, llama.cpp's SentencePiece key layout).
  ids.json.xz     the corpus (>= 2,000 deterministic strings) and, per vocabulary type, the ids HF
                  `tokenizers` gives for every string (no BOS/EOS):
                    smollm2_bytelevel        the smollm2 tokenizer.json as written (ByteLevel regex)
                    smollm2_<variant>        the same vocabulary under other pre-tokenizers and
                                             normalizers (Digits, Split regexes, NFC), fragments stored
                    tinyspm_metaspace        tinyspm tokenizer.json as written (Metaspace, "first")
                    tinyspm_legacy           same vocab, legacy Prepend+Replace normalizer
                    tinyspm_gguf             transformers' tokenizer from tinyllama2.gguf
                    tinyspm_sentencepiece    the sentencepiece library itself on the .model
                    gemma3_gguf              transformers' tokenizer from gemma-3-270m GGUF (ids
                                             only: its tokenizer.json is 33 MB, 3.5 MB compressed)
  chat.json       templates, >= 20 conversations, and transformers' apply_chat_template(...,
                  tokenize=False) output (or its error) with add_generation_prompt on and off.

Run:  python tests/golden/make_hf_text_golden.py   (needs transformers, tokenizers, sentencepiece,
      gguf; about a minute, most of it reading Gemma's GGUF)
"""

from __future__ import annotations

import json
import lzma
import os
import random
import shutil
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "hf_text")
CACHE = os.path.expanduser("~/.cache/jaxinfer")
HELDOUT = os.path.join(HERE, "..", "..", "experiments", "data", "pydoc_heldout.txt")
SMOLLM2_GGUF, GEMMA_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"

# --- corpus ---------------------------------------------------------------------------------------

WORDS = ["hello", "world", "The", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "token",
         "naïve", "café", "résumé", "Zürich", "São", "Paulo", "Ελληνικά", "русский", "日本語", "中文",
         "한국어", "العربية", "עברית", "हिन्दी", "ภาษาไทย", "data", "model", "JAX", "numpy", "x", "I"]
CONTRACTIONS = ["don't", "I'm", "you're", "we've", "she'll", "he'd", "it's", "DON'T", "I'M", "YOU'RE",
                "y'all'd've", "rock'n'roll", "'tis", "O'Neil", "'s", "'S", "'Ll"]
CODE = ["def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
        "if __name__ == \"__main__\":\n    main()", "x = {'a': 1, \"b\": [2, 3]}  # dict",
        "SELECT * FROM t WHERE id >= 42;", "<div class=\"x\">&amp;</div>", "$ ls -la ~/.cache | grep -v '^d'",
        "λx.x  =>  (a, b) -> a + b", "fn main() { println!(\"{}\", 1_000_000u64); }", "    \n\t\n  \n"]
URLS = ["https://example.com/path?q=1&r=two#frag", "http://localhost:8080/api/v1/items/123",
        "user.name+tag@example.org", "ftp://ftp.example.net/pub/file-1.2.3.tar.gz", "www.wikipedia.org/wiki/BPE"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "🤖🧠", "✨🚀🔥", "🏳️‍🌈"]
ACCENTS = ["e\u0301", "é", "n\u0303", "ñ", "Å", "A\u030a", "ﬁ", "Ⅻ", "ｆｕｌｌ", "①②", "x²", "ǅ"]
LOOKALIKES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>", "<|im_star|>",
              "< |im_end| >", "<|IM_END|>", "<s>", "</s>", "<unk>", "<bos>", "<eos>", "<0x41>", "<|user|>",
              "<|user|", "▁", "▁▁x", "<start_of_turn>", "<end_of_turn>", "<pad>", "<|endoftext|><|endoftext|>"]
SPACES = [" ", "  ", "   ", "    ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "\n    ", "        "]
DIGITS = ["0", "7", "42", "123", "1234", "12345", "3.14159", "1,000,000", "2026-12-01", "0x1F", "1e-9",
          "٣٤٥", "१२३", "10⁶"]


def corpus(seed: int = 0, n_random: int = 1800) -> list[str]:
    """Deterministic strings: fixed cases, held-out text slices, and random mixtures."""
    fixed = ["", " ", "a", "hello world", " hello", "  hello", "hello ", "hello  ", "Hello\tworld", "\thello"]
    for group in (WORDS, CONTRACTIONS, CODE, URLS, EMOJI, ACCENTS, LOOKALIKES, SPACES, DIGITS):
        fixed += group
        fixed += [" " + s for s in group] + [s + " " for s in group]
    text = open(HELDOUT, encoding="utf-8").read()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    rng = random.Random(seed)
    held = [lines[i] for i in range(0, len(lines), max(1, len(lines) // 100))]
    for _ in range(60):
        a = rng.randrange(len(text) - 400)
        held.append(text[a:a + rng.randrange(20, 400)])
    pools = [WORDS, CONTRACTIONS, CODE, URLS, EMOJI, ACCENTS, LOOKALIKES, SPACES, DIGITS, lines]
    mixed = []
    for _ in range(n_random):
        k = rng.randrange(1, 8)
        parts = []
        for _ in range(k):
            pool = rng.choice(pools)
            s = rng.choice(pool)
            if pool is lines and len(s) > 60:
                a = rng.randrange(len(s) - 20)
                s = s[a:a + rng.randrange(5, 60)]
            parts.append(s)
            parts.append(rng.choice(["", " ", " ", "  ", "\n", "\t", "", " "]))
        mixed.append("".join(parts))
    out, seen = [], set()
    for s in fixed + held + mixed:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


# --- byte-level vocabulary (SmolLM2) ----------------------------------------------------------------

# Pre-tokenizer / normalizer variants tried on SmolLM2's vocabulary, as tokenizer.json fragments.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
_BL_NOREGEX = dict(_BL, use_regex=False)
BYTE_LEVEL_VARIANTS = {
    "digits_bytelevel": (None, {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, _BL]}),
    "split_llama3": (None, {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False}, _BL_NOREGEX]}),
    "split_qwen2_nfc": ({"type": "NFC"}, {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False}, _BL_NOREGEX]}),
    "split_tekken": (None, {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": TEKKEN_SPLIT}, "behavior": "Isolated", "invert": False}, _BL_NOREGEX]}),
    "digits_grouped_split": (None, {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": False},
        {"type": "Split", "pattern": {"Regex": r" ?[^\s\p{L}\p{N}]+|\s+"}, "behavior": "Isolated", "invert": False},
        _BL]}),
}
# llama.cpp's multi-step pre-tokenizers (src/llama-vocab.cpp, `regex_exprs`), as the Split steps
# they stand for: each regex isolates its matches in turn, then bytes are mapped (no regex).
GPT2_NO_TAIL = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMACPP_STEPS = {
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2_NO_TAIL, r"[0-9][0-9][0-9]"],
}
for _name, _steps in LLAMACPP_STEPS.items():
    BYTE_LEVEL_VARIANTS["llamacpp_" + _name] = (None, {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in _steps] + [_BL_NOREGEX]})


def hf_ids(tokenizer_json: str, texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    return [tok.encode(t, add_special_tokens=False).ids for t in texts]


def save_xz(path: str, data: bytes) -> None:
    with lzma.open(path, "wb", preset=9) as f:
        f.write(data)


def make_smollm2(tmp: str, texts: list[str], ids: dict):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(CACHE, gguf_file=SMOLLM2_GGUF)
    tok.save_pretrained(os.path.join(tmp, "smollm2"))
    out = os.path.join(OUT, "smollm2")
    os.makedirs(out, exist_ok=True)
    raw = open(os.path.join(tmp, "smollm2", "tokenizer.json"), encoding="utf-8").read()
    save_xz(os.path.join(out, "tokenizer.json.xz"), raw.encode("utf-8"))
    for f in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(tmp, "smollm2", f), os.path.join(out, f))
    ids["smollm2_bytelevel"] = {"ids": hf_ids(raw, texts)}
    base = json.loads(raw)
    for name, (norm, pre) in BYTE_LEVEL_VARIANTS.items():
        j = dict(base, normalizer=norm, pre_tokenizer=pre)
        ids[f"smollm2_{name}"] = {"normalizer": norm, "pre_tokenizer": pre, "ids": hf_ids(json.dumps(j), texts)}
    return tok


# --- SentencePiece-style vocabulary (tiny Llama 2) --------------------------------------------------

WHITESPACE_PIECES = ["\u2581\u2581", "\u2581\u2581\u2581\u2581", "\u2581" * 8, "\u2581\u2581\u2581"]


def train_tinyspm(tmp: str) -> str:
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    text = open(HELDOUT, encoding="utf-8").read()
    prefix = os.path.join(tmp, "tinyspm")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_prefix=prefix, vocab_size=1000, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, split_digits=True, remove_extra_whitespaces=False,
        add_dummy_prefix=True, normalization_rule_name="identity", user_defined_symbols=["<|user|>"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
    m = pb.ModelProto()
    m.ParseFromString(open(prefix + ".model", "rb").read())
    # Llama 2's layout: whitespace runs right after the byte pieces, with score -1e9.
    pieces = [p for p in m.pieces if p.piece not in WHITESPACE_PIECES]
    first_normal = next(i for i, p in enumerate(pieces) if p.type == 1)
    new = []
    for w in WHITESPACE_PIECES:
        p = pb.ModelProto.SentencePiece()
        p.piece, p.score, p.type = w, -1e9, 1
        new.append(p)
    del m.pieces[:]
    m.pieces.extend(pieces[:first_normal] + new + pieces[first_normal:])
    with open(prefix + ".model", "wb") as f:
        f.write(m.SerializeToString())
    return prefix + ".model"


def write_tiny_gguf(model_path: str, path: str) -> None:
    """llama.cpp's SentencePiece keys for a 'llama' vocabulary (no tensors: tokenizer only)."""
    import gguf
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString(open(model_path, "rb").read())
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tinyllama2-tokenizer")
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list([p.piece for p in m.pieces])
    w.add_token_scores([p.score for p in m.pieces])
    w.add_token_types([p.type for p in m.pieces])  # sentencepiece's types = llama.cpp's token types
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_space_prefix(True)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_tinyspm(tmp: str, texts: list[str], ids: dict) -> None:
    import sentencepiece as spm
    from transformers import AutoTokenizer, LlamaTokenizer

    model_path = train_tinyspm(tmp)
    d = os.path.join(tmp, "tinyspm_src")
    os.makedirs(d)
    shutil.copy(model_path, os.path.join(d, "tokenizer.model"))
    tok = LlamaTokenizer.from_pretrained(d)  # transformers' own SentencePiece -> tokenizer.json conversion
    tok.save_pretrained(os.path.join(tmp, "tinyspm_hf"))
    raw = open(os.path.join(tmp, "tinyspm_hf", "tokenizer.json"), encoding="utf-8").read()
    j = json.loads(raw)
    n_pieces = spm.SentencePieceProcessor(model_file=model_path).get_piece_size()
    assert j["model"]["byte_fallback"] and len(j["model"]["vocab"]) == n_pieces, "conversion lost the vocabulary"
    out = os.path.join(OUT, "tinyspm")
    os.makedirs(out, exist_ok=True)
    save_xz(os.path.join(out, "tokenizer.json.xz"), raw.encode("utf-8"))
    shutil.copy(os.path.join(tmp, "tinyspm_hf", "tokenizer_config.json"), os.path.join(out, "tokenizer_config.json"))
    ids["tinyspm_metaspace"] = {"ids": hf_ids(raw, texts)}
    legacy_norm = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                       {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    ids["tinyspm_legacy"] = {"normalizer": legacy_norm, "pre_tokenizer": None,
                             "ids": hf_ids(json.dumps(dict(j, normalizer=legacy_norm, pre_tokenizer=None)), texts)}
    gguf_path = os.path.join(out, "tinyllama2.gguf")
    write_tiny_gguf(model_path, gguf_path)
    gt = AutoTokenizer.from_pretrained(out, gguf_file="tinyllama2.gguf")
    gt.save_pretrained(os.path.join(tmp, "tinyspm_gguf"))
    ids["tinyspm_gguf"] = {"ids": hf_ids(open(os.path.join(tmp, "tinyspm_gguf", "tokenizer.json")).read(), texts)}
    sp = spm.SentencePieceProcessor(model_file=model_path)
    ids["tinyspm_sentencepiece"] = {"ids": [sp.encode(t) for t in texts]}


def make_gemma(tmp: str, texts: list[str], ids: dict) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(CACHE, gguf_file=GEMMA_GGUF)
    tok.save_pretrained(os.path.join(tmp, "gemma3"))
    raw = open(os.path.join(tmp, "gemma3", "tokenizer.json"), encoding="utf-8").read()
    ids["gemma3_gguf"] = {"ids": hf_ids(raw, texts)}


# --- chat templates ------------------------------------------------------------------------------

# Templates written for this test to exercise what real ones use: whitespace control with and
# without "-", trim_blocks/lstrip_blocks, namespace, loop variables, slicing, string methods,
# tojson (non-ASCII kept, no HTML escaping), raise_exception, strftime_now behind a default,
# bos_token / eos_token, tools.
TEMPLATES = {
    "chatml_tools": (
        "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n"
        "        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n    {{- '# Tools\\n<tools>' }}\n"
        "    {%- for tool in tools %}\n        {{- '\\n' }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
        "    {{- '\\n</tools><|im_end|>\\n' }}\n{%- elif messages[0].role == 'system' %}\n"
        "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n{%- endif %}\n"
        "{%- set ns = namespace(last_user=-1) %}\n{%- for m in messages[::-1] %}\n"
        "    {%- if ns.last_user < 0 and m.role == 'user' %}{%- set ns.last_user = (messages|length - 1) - loop.index0 %}{%- endif %}\n"
        "{%- endfor %}\n{%- for m in messages %}\n    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}\n"
        "        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}\n"
        "    {%- elif m.role == 'assistant' %}\n        {%- set content = m.content %}\n"
        "        {%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}\n"
        "        {{- '<|im_start|>assistant\\n' + content.strip() }}\n"
        "        {%- if loop.index0 > ns.last_user %}{{- ' [after last user]' }}{%- endif %}\n"
        "        {{- '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endfor %}\n"
        "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"),
    "llama3_style": (
        "{{- bos_token }}\n{%- if not date_string is defined %}\n    {%- if strftime_now is defined %}\n"
        "        {%- set date_string = strftime_now('%d %b %Y') %}\n    {%- else %}\n"
        "        {%- set date_string = '26 Jul 2024' %}\n    {%- endif %}\n{%- endif %}\n"
        "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content']|trim %}\n"
        "    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = '' %}\n{%- endif %}\n"
        "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n{{- 'Today Date: ' + date_string + '\\n\\n' }}\n"
        "{{- system_message }}\n{{- '<|eot_id|>' }}\n{%- for message in messages %}\n"
        "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
        "{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n"),
    "mistral_style": (
        "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content'] %}\n"
        "    {%- set loop_messages = messages[1:] %}\n{%- else %}\n    {%- set loop_messages = messages %}\n{%- endif %}\n\n"
        "{{- bos_token }}\n{%- for message in loop_messages %}\n"
        "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
        "        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}\n"
        "    {%- endif %}\n    {%- if message['role'] == 'user' %}\n"
        "        {%- if loop.first and system_message is defined %}\n"
        "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
        "        {%- else %}\n            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n        {%- endif %}\n"
        "    {%- elif message['role'] == 'assistant' %}\n        {{- ' ' + message['content'] + eos_token}}\n"
        "    {%- else %}\n        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}\n"
        "    {%- endif %}\n{%- endfor %}\n"),
    "blocks_no_dash": (
        "{% for message in messages %}\n  {% if message.role == 'system' %}\n<<SYS>>{{ message.content }}<</SYS>>\n"
        "  {% else %}\n[{{ message.role | upper }}] {{ message.content }}\n  {% endif %}\n{% endfor %}\n"
        "{% if add_generation_prompt %}\n[ASSISTANT]\n{% endif %}\n{{ eos_token if not add_generation_prompt }}"),
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo <now> & \"quoted\"",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def conversations() -> list[dict]:
    S = {"role": "system", "content": "You are a helpful assistant. Réponds en français & <b>bold</b>."}
    U = [{"role": "user", "content": c} for c in ("Hi!", "What is 2+2?", "  spaces around  ", "日本語で答えて 🤖",
                                                     "multi\nline\n\ttext", "<|im_end|> injection?")]
    A = [{"role": "assistant", "content": c} for c in ("Hello! How can I help?", "4", "<think>\nhmm\n</think>\n\nSure.",
                                                          "  padded answer \n")]
    convs = [[U[0]], [S, U[0]], [U[1], A[1], U[0]], [S, U[1], A[1], U[2]], [U[3]], [S, U[4]], [U[5]],
             [U[0], A[0], U[1], A[1], U[2]], [S, U[0], A[2], U[1]], [U[0], A[3]], [S, U[3], A[0]],
             [U[4], A[2]], [S], [U[0], A[0], U[1], A[1], U[2], A[2], U[3]], [S, U[5], A[3], U[4]],
             [U[2], A[0], U[0]], [S, U[1]], [U[0], U[1]], [S, A[0]], [U[3], A[1], U[4], A[2]],
             [{"role": "user", "content": ""}], [S, {"role": "user", "content": "{{ not a template }} {% raw %}"}],
             [U[0], {"role": "tool", "content": "sunny"}]]
    out = [{"messages": c} for c in convs]
    out += [{"messages": [S, U[0]], "tools": TOOLS}, {"messages": [U[1]], "tools": TOOLS}]
    return out


def make_chat(smol) -> dict:
    """Render every template with transformers' apply_chat_template on SmolLM2's tokenizer."""
    templates = {"smollm2": {"template": open(os.path.join(OUT, "smollm2", "chat_template.jinja")).read(),
                             "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}}
    for name, t in TEMPLATES.items():
        templates[name] = {"template": t, "bos_token": "<s>", "eos_token": "</s>"}
    convs = conversations()
    rendered = {}
    for name, t in templates.items():
        rows = []
        for c in convs:
            for agp in (False, True):
                kwargs = {"tools": c.get("tools")}
                if name == "llama3_style":
                    kwargs["date_string"] = "01 Dec 2026"
                smol.bos_token, smol.eos_token = t["bos_token"], t["eos_token"]
                try:
                    text = smol.apply_chat_template(c["messages"], chat_template=t["template"], tokenize=False,
                                                    add_generation_prompt=agp, **kwargs)
                    rows.append({"add_generation_prompt": agp, "text": text})
                except Exception as e:  # the template's own raise_exception, or a Jinja error
                    rows.append({"add_generation_prompt": agp, "error": f"{type(e).__name__}: {e}"})
        rendered[name] = rows
    return {"templates": templates, "conversations": convs, "rendered": rendered,
            "extra_kwargs": {"llama3_style": {"date_string": "01 Dec 2026"}}}


def main() -> None:
    import tokenizers
    import transformers

    os.makedirs(OUT, exist_ok=True)
    texts = corpus()
    ids: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        smol = make_smollm2(tmp, texts, ids)
        make_tinyspm(tmp, texts, ids)
        make_gemma(tmp, texts, ids)
    meta = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    save_xz(os.path.join(OUT, "ids.json.xz"),
            json.dumps({"meta": meta, "corpus": texts, "vocabs": ids}, ensure_ascii=False).encode("utf-8"))
    chat = make_chat(smol)
    chat["meta"] = meta
    with open(os.path.join(OUT, "chat.json"), "w", encoding="utf-8") as f:
        json.dump(chat, f, ensure_ascii=False, indent=0)
    n_chat = sum(len(v) for v in chat["rendered"].values())
    print(f"{len(texts)} strings x {len(ids)} vocabularies; {len(chat['conversations'])} conversations x "
          f"{len(chat['templates'])} templates x 2 = {n_chat} renders -> {OUT}")


if __name__ == "__main__":
    main()
