"""GPT-2 BPE through tiktoken, built offline from OpenAI's release files in data/gpt2/: the same files
tiktoken.get_encoding("gpt2") downloads.
"""
import functools
import hashlib
import json
from pathlib import Path

import tiktoken

from data.shard import BOS_ID, VOCAB_SIZE
from runtime.errors import UserError

GPT2_DIR = Path(__file__).resolve().parent / "gpt2"
# the sha256 digests tiktoken expects for OpenAI's GPT-2 release
GPT2_FILES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
# GPT-2's split regex in tiktoken's faster equivalent form
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
    # the ranks come from encoder.json, which holds vocab.bpe's
    for name, expected in GPT2_FILES.items():
        path = GPT2_DIR / name
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != expected:
            raise UserError(f"{path} has sha256 {digest}, expected {expected}: the file is damaged; "
                             "restore it with `git checkout -- data/gpt2`")
    char_to_byte = _gpt2_char_to_byte()
    encoder = json.loads((GPT2_DIR / "encoder.json").read_text(encoding="utf-8"))
    ranks = {bytes(char_to_byte[c] for c in token): rank for token, rank in encoder.items() if token != ENDOFTEXT}
    assert len(ranks) == BOS_ID and encoder[ENDOFTEXT] == BOS_ID
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: BOS_ID}, explicit_n_vocab=VOCAB_SIZE)
