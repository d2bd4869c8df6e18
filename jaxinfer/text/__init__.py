"""Text <-> tokens: tiktoken encodings built from a model's own vocabulary, and its chat template.

  tokenizer.py  byte-level BPE (GGUF `gpt2` vocabularies, cl100k_base / o200k_base) as a tiktoken.Encoding
  spm.py        SentencePiece BPE vocabularies (Llama 2, Mistral, Gemma) on tiktoken
  hf_tokenizer.py  a Hugging Face tokenizer.json (byte-level or SentencePiece-style BPE), exact or refused
  chat.py       the model's own Jinja chat template, rendered as transformers renders it
"""
