"""The speedrun GPT: architecture only (no distributed code, no device or environment choices, no file I/O).

config.py holds the model's config and the rules that follow from it without torch (the run's flag checks read
them before torch loads); gpt.py the model itself."""
