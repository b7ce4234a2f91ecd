"""sample.py: greedy decoding against a step-by-step reference, seeds, top-k, and the command line."""
import dataclasses

import pytest
import torch

import sample
from data.shard import BOS_ID
from data.tokenizer import get_encoding
from helpers import random_gpt
from model.decode import KVCache
from model.gpt import GPT
from runtime.checkpoint import load_model
from runtime.errors import UserError
from runtime.config import PRESETS, TrainConfig, model_config

# the smoke model with a 128-token training sequence, so a long prompt gets cropped
CONFIG = TrainConfig(**(PRESETS["smoke"] | dict(seq_len=128, window_max_tokens=128)))
PROMPT = "The quick brown fox"


def random_model() -> GPT:
    """The smoke model with random instead of zero output projections and head, so its choices vary."""
    return random_gpt(model_config(CONFIG), seed=0, std=0.1)


@pytest.fixture(scope="module")
def model():
    return random_model()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint file in train_gpt2.py's format."""
    path = tmp_path_factory.mktemp("run") / "ckpt_000002.pt"
    state = {"model": random_model().state_dict(), "optimizer": {}, "loader": {}, "step": 2,
             "config": dataclasses.asdict(CONFIG), "model_config": dataclasses.asdict(model_config(CONFIG)),
             "rng": {"torch": torch.get_rng_state()}, "train_time_ms": 0.0}
    torch.save(state, path)
    return path


def run(model, prompt, seed=0, **kwargs):
    settings = dict(max_new_tokens=12, temperature=1.0, top_k=0, num_samples=1, window=CONFIG.window_max_tokens,
                    max_context=CONFIG.seq_len) | kwargs
    return sample.generate(model, prompt, generator=torch.Generator().manual_seed(seed), **settings)


def greedy_reference(model, prompt, steps, max_context):
    """Argmax of the unpadded context's last logits, one token at a time."""
    tokens = list(prompt)
    for _ in range(steps):
        context = torch.tensor([tokens[-max_context:]])
        with torch.no_grad():
            logits = model.logits(context, torch.tensor(CONFIG.window_max_tokens))[0, -1, :sample.TEXT_VOCAB]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("words", [4, 150])  # 150 words: past the 128-token context, so the context is cropped
def test_greedy_matches_the_unpadded_reference_and_repeats(model, words):
    prompt = [BOS_ID] + get_encoding().encode_ordinary(" ".join(["fox"] * words))
    greedy = run(model, prompt, temperature=0, num_samples=2)
    assert greedy[0] == greedy[1] == greedy_reference(model, prompt, 12, CONFIG.seq_len)
    assert run(model, prompt, seed=1, temperature=0) == greedy[:1]  # the seed plays no part
    assert len(set(greedy[0])) > 1  # the random model does not just repeat one token


def test_generate_reads_the_prompt_once_then_one_token_per_step(model, monkeypatch):
    """The cache takes the prompt, then each new token alone; once the context reaches max_context it takes the last
    max_context tokens afresh for each token (positions from 0, as in training), and the greedy tokens stay the
    unpadded reference's throughout."""
    prompt = [BOS_ID] + get_encoding().encode_ordinary(" ".join(["fox"] * 99))
    widths, extend = [], KVCache.extend
    monkeypatch.setattr(KVCache, "extend", lambda cache, tokens: widths.append(tokens.size(1)) or extend(cache, tokens))
    got = run(model, prompt, temperature=0.0, max_new_tokens=20, max_context=256)[0]
    assert len(prompt) == 100 and len(got) == 20 and widths == [100] + [1] * 19
    assert got == greedy_reference(model, prompt, 20, 256)
    widths.clear()
    assert run(model, prompt, temperature=0.0, max_new_tokens=20, max_context=110)[0] == \
        greedy_reference(model, prompt, 20, 110)
    assert widths == [100] + [1] * 10 + [110] * 9  # the context holds 110 tokens from the 10th new one on


def test_seeds_reproduce_and_differ(model):
    prompt = [BOS_ID] + get_encoding().encode_ordinary(PROMPT)
    first = run(model, prompt, seed=3, num_samples=2)
    assert run(model, prompt, seed=3, num_samples=2) == first
    assert run(model, prompt, seed=4, num_samples=2) != first
    assert first[0] != first[1]  # samples of one call are independent draws


def test_top_k_one_is_greedy(model):
    prompt = [BOS_ID] + get_encoding().encode_ordinary(PROMPT)
    assert run(model, prompt, seed=5, temperature=0.8, top_k=1) == run(model, prompt, temperature=0)


def test_top_k_draws_only_among_the_k_likeliest():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]]).expand(4000, 5)
    drawn = sample.pick(logits, 1.0, 2, torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {1, 3}
    # softmax over the two kept logits: p(1) = 1 / (1 + e^-1) = 0.731, binomial std 0.007 in 4,000 draws; a uniform
    # draw among the kept two (0.5) lies far outside
    assert (drawn == 1).float().mean().item() == pytest.approx(0.731, abs=0.03)


def test_cli_prints_the_prompt_and_its_continuation(checkpoint, capsys):
    args = ["--checkpoint", str(checkpoint.parent), "--prompt", PROMPT, "--max_new_tokens", "6", "--device", "cpu"]
    assert sample.main(args + ["--temperature", "0"]) == 0
    text = capsys.readouterr().out
    prompt = [BOS_ID] + get_encoding().encode_ordinary(PROMPT)
    continuation = get_encoding().decode(greedy_reference(random_model(), prompt, 6, CONFIG.seq_len))
    assert text == PROMPT + continuation + "\n"
    assert sample.main(args + ["--num_samples", "2", "--seed", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "--- sample 1/2" and lines[1].startswith(PROMPT)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_cache_matches_the_full_model_as_sample_loads_it(checkpoint, device, capsys):
    """On each device, as sample.py loads the model there (a FastGPT on CUDA): the cache's next-token logits after the
    prompt and after each of 6 more tokens equal the full model's under the dense-mask path; and the command runs
    there. CPU math is fp32; on CUDA it is bf16, where the two differ by rounding only (logits up to 15, differences
    of 0.03 typically and 0.18 at most), so 0.3 still catches any wrong key, document or window."""
    model, config = load_model(str(checkpoint), torch.device(device))
    model.attention_backend = "sdpa"
    tokens = torch.tensor([[BOS_ID] + get_encoding().encode_ordinary(" ".join(["fox"] * 40) + PROMPT)], device=device)
    n, window = tokens.size(1), config["window_max_tokens"]
    cache = KVCache(model, 1, n, window)
    with torch.no_grad():
        hidden = [cache.extend(tokens[:, :n - 6])] + [cache.extend(tokens[:, t:t + 1]) for t in range(n - 6, n)]
        cached = model.head.logits(torch.cat(hidden, dim=1))
        full = model.logits(tokens, torch.tensor(window, device=device))
    assert full.abs().max() > 5  # the random head's logits are far from 0
    assert (cached - full).abs().max() < (1e-4 if device == "cpu" else 0.3)

    assert sample.main(["--checkpoint", str(checkpoint), "--prompt", PROMPT, "--max_new_tokens", "6", "--device",
                        device, "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(PROMPT) and len(text) > len(PROMPT) + 1


def test_bad_flag_values_name_the_flag(checkpoint):
    for value in ("-1", "nan"):
        with pytest.raises(ValueError, match=f"--temperature={float(value)} must be at least 0"):
            sample.main(["--checkpoint", str(checkpoint), "--temperature", value])
    with pytest.raises(ValueError, match=r"--temperature=inf would draw every token alike: give a finite temperature"):
        sample.main(["--checkpoint", str(checkpoint), "--temperature", "inf"])


def test_a_tiny_temperature_draws_the_likeliest_token():
    """Tempered after the shift to a maximum of 0: 1e-40 makes the other logits -inf, not nan (inf - inf)."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]]).expand(50, 5)
    drawn = sample.pick(logits, 1e-40, 0, torch.Generator().manual_seed(0))
    assert drawn.tolist() == [1] * 50


def test_a_prompt_beyond_the_context_says_what_the_model_reads(checkpoint, capsys):
    long_prompt = " fox" * (CONFIG.seq_len + 10)
    assert sample.main(["--checkpoint", str(checkpoint), "--prompt", long_prompt, "--max_new_tokens", "1",
                        "--device", "cpu", "--temperature", "0"]) == 0
    assert capsys.readouterr().err == (f"note: the prompt is {CONFIG.seq_len + 11:,} tokens with its <|endoftext|> "
                                       f"start; the model reads only the last {CONFIG.seq_len:,} (its training "
                                       f"--seq_len)\n")


@pytest.mark.parametrize("change", ["reshaped weight", "unknown config field"])
def test_checkpoint_of_another_model_version_is_a_user_error(checkpoint, tmp_path, change):
    """A checkpoint written before a model change (here: fc_w stored the other way round, or a config field this
    version lacks) is refused with the way out, not a state_dict traceback."""
    state = torch.load(checkpoint, weights_only=False)
    if change == "reshaped weight":
        state["model"]["blocks.0.mlp.fc_w"] = state["model"]["blocks.0.mlp.fc_w"].t().contiguous()
    else:
        state["model_config"]["rotary_kind"] = "yarn"
    path = tmp_path / "ckpt_000002.pt"
    torch.save(state, path)
    with pytest.raises(UserError, match="^--checkpoint .*: the checkpoint's model does not fit this version of the "
                       "code .* check out the git_commit"):
        load_model(str(path), torch.device("cpu"))


@pytest.mark.parametrize("case, words", [
    ("missing", "no such file; pass a ckpt_<step>.pt file or the run folder under --log_dir"),
    ("empty folder", "the folder holds no checkpoint (ckpt_<step>.pt); runs write them when started with "
                     "--checkpoint_every N"),
    ("corrupt", "the checkpoint is truncated or corrupt (BadZipFile); pass an earlier ckpt_<step>.pt in"),
])
def test_a_bad_checkpoint_names_the_checkpoint_flag(tmp_path, case, words):
    """The messages come from runtime/checkpoint.py, shared with train_gpt2's --resume: here they name the flag
    that sample.py's user typed."""
    path = tmp_path / "run"
    if case != "missing":
        path.mkdir()
    if case == "corrupt":
        path = path / "ckpt_000002.pt"
        path.write_bytes(b"not a zip archive")
    with pytest.raises(UserError) as e:
        sample.main(["--checkpoint", str(path), "--device", "cpu"])
    assert str(e.value).startswith(f"--checkpoint {path}: {words}") and "--resume" not in str(e.value)
