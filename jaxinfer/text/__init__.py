"""Text <-> tokens: tiktoken encodings built from a model's own vocabulary, and its chat template.

  tokenizer.py  byte-level BPE (GGUF `gpt2` vocabularies, cl100k_base / o200k_base) as a tiktoken.Encoding
  spm.py        SentencePiece BPE vocabularies (Gemma) on tiktoken
"""
