"""Image-text pairs for CLIP: manifests and tar shards, transforms, captions, shuffled epochs, and
scikit-learn's handwritten digits as a demo dataset."""
