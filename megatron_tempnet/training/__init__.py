"""Training: configuration, the objective, engine set-up, the loop, checkpoints, logging."""
