"""Everything a run needs around the model: its config, CLI, process setup, logging, checkpoints, user errors."""
