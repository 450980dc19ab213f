"""CLIP with TempNet: the towers, the temperature module, the five contrastive losses, the step,
the per-sample state, the task, its flags, zero-shot evaluation and its metrics, image-text data."""
