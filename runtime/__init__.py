"""Everything a run needs around the model: CLI, process setup, logging, checkpoints, user errors."""
