"""Tokenizers, JSON-lines preprocessing, indexed datasets and GPT data loading."""
