"""Tokenizers, JSON-lines preprocessing, indexed datasets, GPT dataset blends and the resumable
loader."""
