"""GPT-2 BPE through tiktoken, built from OpenAI's release files shipped in data/gpt2/ so it works offline.

`tiktoken.get_encoding("gpt2")` downloads the same two files on first use; tests/test_tokenizer.py checks,
offline, that both encodings agree token for token.
"""
import functools
import hashlib
import json
from pathlib import Path

import tiktoken

from data.shard import BOS_ID, VOCAB_SIZE

GPT2_DIR = Path(__file__).resolve().parent / "gpt2"
# The sha256 digests tiktoken itself expects for OpenAI's GPT-2 release (tiktoken_ext/openai_public.py).
GPT2_FILES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
# GPT-2's split regex in the equivalent, faster form (possessive quantifiers) that tiktoken uses for "gpt2".
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
ENDOFTEXT = "<|endoftext|>"


def _gpt2_char_to_byte() -> dict[str, int]:
    # encoder.json spells token bytes as text: a byte that prints as itself (not space) stands for itself,
    # the other bytes take chr(256), chr(257), ... in byte order (GPT-2's bytes_to_unicode).
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


@functools.cache
def get_encoding() -> tiktoken.Encoding:
    """The GPT-2 encoding ("gpt2"), identical to tiktoken's, loaded from data/gpt2/ without network."""
    # The two files are one release and pinned as a unit; vocab.bpe (the merge list) carries the same ranks
    # as encoder.json, which is the simpler one to read. The tests feed both to tiktoken's own loader.
    for name, expected in GPT2_FILES.items():
        path = GPT2_DIR / name
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != expected:
            raise ValueError(f"{path} has sha256 {digest}, expected {expected}: the file is damaged; "
                             "restore it with `git checkout -- data/gpt2`")
    char_to_byte = _gpt2_char_to_byte()
    encoder = json.loads((GPT2_DIR / "encoder.json").read_text(encoding="utf-8"))
    ranks = {bytes(char_to_byte[c] for c in token): rank for token, rank in encoder.items() if token != ENDOFTEXT}
    assert len(ranks) == BOS_ID and encoder[ENDOFTEXT] == BOS_ID
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: BOS_ID}, explicit_n_vocab=VOCAB_SIZE)
