"""data.tokenizer: token for token equal to tiktoken's own "gpt2", which the test loads offline from our files."""
import hashlib
import shutil

import numpy as np
import pytest
import tiktoken
import tiktoken.load
import tiktoken.registry

from data.tokenizer import GPT2_DIR, get_encoding

# The URLs tiktoken_ext/openai_public.py fetches for "gpt2"; tiktoken caches each download under sha1(url).
GPT2_URLS = {
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
}

TRICKY = [
    "Hello, world! It's a test: we'll see, they've gone, I'm here, you're there, he'd go, she's.",
    "Unicode: naïve café, Straße, Ελληνικά, русский, עברית, العربية",
    "中文字符, 日本語のテキスト, 한국어",
    "Emoji: 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ and a lone surrogate-free 🙂.",
    "Whitespace   runs\t\ttabs\n\n\nnewlines  \n  trailing   ",
    "   leading spaces and \r\n windows newlines\r\n",
    "Numbers 1234567890 3.14159 1e-10 0x1F and mixed a1b2c3",
    "Code: def f(x):\n    return x**2  # comment\n\tif (a&&b) { c->d; }",
    "Punctuation!!! ??? ... --- ''' \"\"\" `backticks` «quotes» „quotes“",
    "CAPS'LL 'S 'T 'RE 'VE 'M 'LL 'D and ’curly’ apostrophes",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """tiktoken.get_encoding("gpt2") built from a cache pre-filled with the shipped files; no network allowed."""
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    for name, url in GPT2_URLS.items():
        shutil.copy(GPT2_DIR / name, cache / hashlib.sha1(url.encode()).hexdigest())

    def no_network(blobpath):
        raise AssertionError(f"tiktoken tried to fetch {blobpath}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        patch.setattr(tiktoken.load, "read_file", no_network)
        patch.setattr(tiktoken.registry, "ENCODINGS", {})  # build it now, from the cache above
        yield tiktoken.get_encoding("gpt2")


def test_same_vocabulary(reference):
    ours = get_encoding()
    assert ours.name == reference.name == "gpt2"
    assert ours.n_vocab == reference.n_vocab == 50257 and ours.eot_token == reference.eot_token == 50256
    assert ours._mergeable_ranks == reference._mergeable_ranks
    assert ours._pat_str == reference._pat_str and ours._special_tokens == reference._special_tokens


def test_tricky_text_token_for_token(reference):
    ours = get_encoding()
    assert ours.encode_ordinary("Hello world") == [15496, 995]  # GPT-2's published ids
    for text in TRICKY:
        tokens = ours.encode_ordinary(text)
        assert tokens == reference.encode_ordinary(text), text
        assert ours.decode(tokens) == text
    rng = np.random.default_rng(0)
    alphabet = list("ab AB'\n\t 1.,!é中😀") + [" ", "  ", "'s", "'ll"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(1, 40))))
        assert ours.encode_ordinary(text) == reference.encode_ordinary(text), repr(text)


def test_endoftext_is_special_only_when_allowed(reference):
    ours = get_encoding()
    text = "a<|endoftext|>b"
    with pytest.raises(ValueError, match="disallowed special token"):
        ours.encode(text)
    assert ours.encode(text, allowed_special={"<|endoftext|>"}) == reference.encode(text, allowed_special="all")
    assert ours.encode(text, allowed_special="all")[1] == 50256
    as_text = ours.encode_ordinary(text)
    assert 50256 not in as_text and as_text == reference.encode(text, disallowed_special=())


def test_damaged_vocabulary_file_is_refused(tmp_path, monkeypatch):
    for name in ("vocab.bpe", "encoder.json"):
        shutil.copy(GPT2_DIR / name, tmp_path / name)
    with open(tmp_path / "vocab.bpe", "ab") as f:
        f.write(b"x")
    monkeypatch.setattr("data.tokenizer.GPT2_DIR", tmp_path)
    get_encoding.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"vocab.bpe has sha256 .* expected 1ce16647.*git checkout -- data/gpt2"):
            get_encoding()
    finally:
        get_encoding.cache_clear()
