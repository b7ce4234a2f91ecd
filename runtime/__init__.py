"""Around the model: config, CLI, process setup, logging, checkpoints, user errors."""
