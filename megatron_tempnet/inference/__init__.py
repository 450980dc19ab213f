"""GPT checkpoints of any layout, read at any TP size for generation, evaluation and export."""
