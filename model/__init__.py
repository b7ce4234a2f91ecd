"""The speedrun GPT, architecture only: config.py its options (no torch), gpt.py the model, attention.py its masks,
decode.py KV-cache decoding, fast/ the accelerated backend."""
