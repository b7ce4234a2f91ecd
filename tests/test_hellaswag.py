"""HellaSwag scoring: mean ending losses against hand computations, accuracy of models with known answers,
two ranks against one, and the data checks (never the network)."""
import copy
import dataclasses
import io
import json
import math
import urllib.error
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from data.shard import BOS_ID
from data.tokenizer import get_encoding
from evals import hellaswag
from helpers import random_gpt, recorded_compile
from model.gpt import GPT, GPTConfig
from runtime.dist import Runtime
from runtime.errors import UserError

TINY_FILE = Path(__file__).parent / "data" / "hellaswag_tiny.jsonl"
# real GPT-2 token ids need the full (padded) vocabulary; the rest is as small as the model allows
TINY = GPTConfig(num_layers=2, model_dim=8, num_heads=2, head_dim=4, num_value_embeds=1)
CPU = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
BOOST = 10.0  # raw logit of a preferred token; the softcap c makes it c tanh(BOOST / c) (15: 8.74)


def bag_model(preferred: set[int]) -> GPT:
    """A GPT whose next-token logits ignore the input: BOOST for `preferred` tokens, 0 for the rest.

    Every token embeds to the same vector, and the zero-initialised output projections make each block the
    identity, so the head always sees norm(ones); a head row of BOOST / D then gives the logit BOOST.
    """
    torch.manual_seed(0)
    model = GPT(TINY)
    model.init_weights()
    model.compute_dtype = torch.float32
    model.attention_backend = "sdpa"
    with torch.no_grad():
        model.embed.weight.fill_(1.0)
        model.head.weight.zero_()
        model.head.weight[sorted(preferred)] = BOOST / TINY.model_dim
    return model.eval()


def random_model() -> GPT:
    """A GPT whose logits depend on every earlier token: random projections and head instead of zeros. Heads of
    16, FlexAttention's smallest on a GPU."""
    return random_gpt(dataclasses.replace(TINY, model_dim=32, head_dim=16), seed=1, std=0.3)


def tiny_examples():
    return hellaswag.load_examples(TINY_FILE)


def ending_tokens(example, index):
    return set(get_encoding().encode_ordinary(" " + example["endings"][index]))


def preferring(chosen: list[int]) -> tuple[GPT, list[bool]]:
    """The bag model preferring the tokens of ending chosen[i] of example i, and whether each example's label
    is chosen. The tiny file is written so that each ending has a token outside the preferred set unless it
    is the chosen one, so the chosen ending alone has the lowest mean loss (checked here)."""
    examples = tiny_examples()
    preferred = set().union(*(ending_tokens(ex, c) for ex, c in zip(examples, chosen)))
    for ex, c in zip(examples, chosen):
        assert all(not ending_tokens(ex, i) <= preferred for i in range(4) if i != c), ex["ind"]
    return bag_model(preferred), [ex["label"] == c for ex, c in zip(examples, chosen)]


def test_tiny_file_has_the_real_format():
    lines = [json.loads(line) for line in TINY_FILE.read_text().splitlines()]
    keys = {"ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "label", "split", "split_type", "source_id"}
    assert all(set(ex) == keys for ex in lines)
    assert hellaswag.load_examples(TINY_FILE) == lines
    assert [ex["label"] for ex in lines] == [0, 2, 1, 3, 1]


def test_ending_losses_match_the_closed_form_of_the_bag_model():
    enc = get_encoding()
    preferred = set(enc.encode_ordinary(" the cat sat"))
    model = bag_model(preferred)
    rows = [([BOS_ID] + enc.encode_ordinary("Once upon a time"), enc.encode_ordinary(text))
            for text in (" the cat sat", " the dog sat", " a dog ran away")]
    # softmax over V logits: len(preferred) of them z, the others 0
    z = TINY.logit_softcap * math.tanh(BOOST / TINY.logit_softcap)
    log_norm = math.log(len(preferred) * math.exp(z) + TINY.vocab_size - len(preferred))
    expected = [sum(log_norm - (z if t in preferred else 0.0) for t in ending) / len(ending) for _, ending in rows]
    losses = hellaswag.ending_losses(model, rows, num_rows=5, device="cpu")
    # 1e-4: the model's softmax sums 50,304 terms in fp32; endings differ by ~9.6 per unpreferred token
    assert losses.tolist() == pytest.approx(expected, rel=1e-4)
    assert expected[0] < expected[1] < expected[2]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ending_losses_match_unpadded_logits(device):
    """Padding to the block, unused rows and the window must not change the losses of the real tokens. On CUDA
    the scored model runs as an evaluation does there (FlexAttention, bf16 activations) against the fp32 CPU
    reference: bf16 moved these losses by 0.08% at most when measured on the CPU, so 1% is the bound there."""
    enc = get_encoding()
    model = random_model()
    scored = model
    if device == "cuda":
        scored = copy.deepcopy(model).to(device)
        scored.attention_backend, scored.compute_dtype = "flex", torch.bfloat16
    long_context = [BOS_ID] + enc.encode_ordinary("The quick brown fox jumps over the lazy dog. " * 14)
    assert 128 < len(long_context) < 256  # the batch pads to two blocks
    rows = [([BOS_ID] + enc.encode_ordinary("A man is sitting on a roof. he"), enc.encode_ordinary(" starts pulling")),
            (long_context, enc.encode_ordinary(" and then runs home to sleep."))]
    losses = hellaswag.ending_losses(scored, rows, num_rows=4, device=device)
    for (context, ending), loss in zip(rows, losses):
        tokens = torch.tensor([context + ending])
        n = tokens.size(1)
        with torch.no_grad():
            logprobs = F.log_softmax(model.logits(tokens, torch.tensor(2 * n)), dim=-1)[0]
        picked = logprobs[len(context) - 1:n - 1].gather(1, torch.tensor(ending)[:, None])
        assert loss.item() == pytest.approx(-picked.mean().item(), rel=1e-5 if device == "cpu" else 1e-2)


# the last: its first two examples right, the others wrong, so --limit=2 shows which examples it keeps
@pytest.mark.parametrize("chosen, accuracy", [([0, 2, 1, 3, 1], 1.0), ([1, 3, 2, 0, 2], 0.0),
                                              ([0, 1, 1, 0, 1], 0.6), ([0, 2, 0, 0, 0], 0.4)])
def test_accuracy_of_models_with_known_answers(chosen, accuracy):
    model, right = preferring(chosen)
    assert sum(right) / len(right) == accuracy
    assert hellaswag.evaluate_hellaswag(model, CPU, path=str(TINY_FILE)) == accuracy
    # --limit keeps the first examples
    assert hellaswag.evaluate_hellaswag(model, CPU, path=str(TINY_FILE), limit=2) == sum(right[:2]) / 2


def test_a_compiled_model_scores_without_compiling_new_shapes():
    """train_gpt2 --hellaswag=1 scores the compiled training model. Its blocks' graphs (three patterns here, as in
    record #28, for training and validation) leave dynamo 2 of its 8; the rows' new shapes would pass the limit,
    a fullgraph error at the end of a run. They run eagerly, with the same accuracy as the uncompiled model."""
    # layers 0 and 3 take the value embedding, layer 2 has no attention: three block patterns
    config = dataclasses.replace(TINY, num_layers=4, model_dim=32, head_dim=16, no_attention_layers=(2,))
    model = random_gpt(config, seed=1, std=0.3)
    expected = hellaswag.evaluate_hellaswag(model, CPU, path=str(TINY_FILE))
    inputs = torch.randint(0, 50257, (1, 128))
    with recorded_compile(model) as graphs:
        model(inputs, inputs, torch.tensor(128)).backward()  # training's graphs
        with torch.no_grad():
            model(inputs, inputs, torch.tensor(128))  # validation's
        trained = len(graphs)
        assert hellaswag.evaluate_hellaswag(model, CPU, path=str(TINY_FILE)) == expected
    # the blocks' patterns (the first block's, whose x is x0 itself, one of its own) and the head, in both modes
    assert trained == 4 * 2 + 2
    assert len(graphs) == trained


def _rank_main(rank, store, out_dir):
    torch.set_num_threads(1)  # two ranks share CI's two cores
    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model, _ = preferring([0, 2, 0, 0, 1])
        rt = dataclasses.replace(CPU, rank=rank, world_size=2)
        scored, score = [], hellaswag.ending_losses

        def counting(model, rows, num_rows, device):  # how many examples this rank scores itself
            scored.append(len(rows) // hellaswag.NUM_ENDINGS)
            return score(model, rows, num_rows, device)

        hellaswag.ending_losses = counting  # in this child process only
        counts = hellaswag.count_correct(model, rt, tiny_examples())
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"counts": counts, "scored": sum(scored)}))
    finally:
        torch_dist.destroy_process_group()


def test_two_ranks_split_the_examples_and_sum_the_counts(tmp_path):
    mp.start_processes(_rank_main, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")  # a fork after an earlier test's backward fails
    model, right = preferring([0, 2, 0, 0, 1])
    assert hellaswag.count_correct(model, CPU, tiny_examples()) == (3, 5)
    # rank 0 scores examples 0, 2, 4 (2 right), rank 1 examples 1, 3 (1 right): both report the sum
    assert right == [True, True, False, False, True]
    for rank, scored in enumerate((3, 2)):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"counts": [3, 5], "scored": scored}


def test_cli_scores_a_checkpoint(tmp_path, capsys):
    model, _ = preferring([0, 2, 1, 3, 1])
    state = {"model": model.state_dict(), "optimizer": {}, "loader": {}, "step": 0, "config": {},
             "model_config": dataclasses.asdict(TINY), "rng": {}, "train_time_ms": 0.0}
    torch.save(state, tmp_path / "ckpt_000000.pt")
    assert hellaswag.main(["--checkpoint", str(tmp_path), "--hellaswag_file", str(TINY_FILE), "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip() == "hellaswag accuracy: 1.0000 (5/5)"


def test_bad_line_names_the_file_and_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = TINY_FILE.read_text().splitlines()[0]
    bad.write_text(good + "\n" + json.dumps({"ctx": "x", "endings": ["a", "b"], "label": 0}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 is not a HellaSwag example"):
        hellaswag.load_examples(bad)
    with pytest.raises(ValueError, match="no such file"):
        hellaswag.load_examples(tmp_path / "absent.jsonl")
    binary = tmp_path / "ckpt_000002.pt"  # a checkpoint passed by mistake: a zip, not UTF-8 text
    binary.write_bytes(b"PK\x03\x04\x80\xff" + bytes(range(256)))
    with pytest.raises(ValueError, match=r"ckpt_000002\.pt:1 is not a HellaSwag example"):
        hellaswag.load_examples(binary)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder; any real download attempt fails the test."""
    path = tmp_path / "hellaswag" / "hellaswag_val.jsonl"
    monkeypatch.setattr(hellaswag, "CACHE", path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def no_network(*args, **kwargs):
        raise AssertionError("tests must not touch the network")

    monkeypatch.setattr(hellaswag.urllib.request, "urlopen", no_network)
    return path


def test_offline_names_the_file_the_url_and_the_flag(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as e:
        hellaswag.evaluate_hellaswag(bag_model({1}), CPU)
    for part in (str(cache), hellaswag.URL, "--hellaswag_file", "HF_HUB_OFFLINE=1"):
        assert part in str(e.value)


def test_failed_download_names_the_fix(cache, monkeypatch):
    def unreachable(url, timeout):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(hellaswag.urllib.request, "urlopen", unreachable)
    with pytest.raises(ValueError, match="downloading it failed.*--hellaswag_file"):
        hellaswag.select_examples(None, None)
    assert list(cache.parent.iterdir()) == []  # nothing half-written is left


def test_the_url_names_the_pinned_commit():
    assert hellaswag.URL == ("https://raw.githubusercontent.com/rowanz/hellaswag/"
                             "a29ff8e9a04bba4bd6588223785ce105328adc57/data/hellaswag_val.jsonl")


@pytest.mark.parametrize("content, blob", [(b"", "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"),
                                           (b"hello\n", "ce013625030ba8dba906f756967f9e9ca394464a")])
def test_git_blob_id_is_gits(tmp_path, content, blob):
    """Ids git itself gives these contents (`git hash-object`), so VAL_BLOB_ID can be compared with the file's."""
    (tmp_path / "f").write_bytes(content)
    assert hellaswag.git_blob_id(tmp_path / "f") == blob


def test_download_is_checked_before_it_is_kept(cache, monkeypatch):
    payload = TINY_FILE.read_bytes()
    tiny_blob = hellaswag.git_blob_id(TINY_FILE)
    urls = []

    def serve(url, timeout):
        urls.append(url)
        return io.BytesIO(payload)

    monkeypatch.setattr(hellaswag.urllib.request, "urlopen", serve)
    with pytest.raises(ValueError) as error:
        hellaswag.select_examples(None, None)
    assert str(error.value).startswith(f"the download from {hellaswag.URL} has git blob id {tiny_blob}, not the "
                                       f"{hellaswag.VAL_BLOB_ID} its commit records: deleted it")
    assert list(cache.parent.iterdir()) == [] and urls == [hellaswag.URL]
    monkeypatch.setattr(hellaswag, "VAL_BLOB_ID", tiny_blob)  # the pinned file's id: kept and used
    assert hellaswag.select_examples(None, 3) == tiny_examples()[:3]
    assert cache.read_bytes() == payload


def test_a_cached_file_that_differs_is_refused_at_start_up(cache, monkeypatch):
    """A cached file other than the pinned one (damaged, or copied there by hand) stops a training run at start-up;
    it is the user's to delete, so it stays."""
    cache.parent.mkdir()
    cache.write_bytes(TINY_FILE.read_bytes())
    words = (f"{cache} differs from the HellaSwag validation file of the pinned commit (git blob "
             f"{hellaswag.git_blob_id(cache)}, expected {hellaswag.VAL_BLOB_ID}): it is damaged or another file; "
             f"delete it to download the pinned one again, or pass it with --hellaswag_file to score it anyway")
    for call in (lambda: hellaswag.check_available(None), lambda: hellaswag.select_examples(None, None)):
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == words
    assert cache.read_bytes() == TINY_FILE.read_bytes()


def test_a_hellaswag_file_that_differs_is_scored_with_a_warning(monkeypatch, capsys):
    """--hellaswag_file is the user's explicit choice (an offline copy, or a file in the same format on purpose):
    it is scored, with a warning on the first process when it is not the pinned file."""
    assert hellaswag.select_examples(str(TINY_FILE), None) == tiny_examples()
    err = capsys.readouterr().err
    assert err.startswith(f"warning: --hellaswag_file {TINY_FILE} differs from the HellaSwag validation file of the "
                          f"pinned commit (git blob {hellaswag.git_blob_id(TINY_FILE)}, expected "
                          f"{hellaswag.VAL_BLOB_ID}, {hellaswag.URL}): scoring it anyway")
    monkeypatch.setenv("RANK", "1")
    hellaswag.select_examples(str(TINY_FILE), None)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(hellaswag, "VAL_BLOB_ID", hellaswag.git_blob_id(TINY_FILE))  # the pinned file: no warning
    hellaswag.select_examples(str(TINY_FILE), None)
    assert capsys.readouterr().err == ""


def test_check_available_finds_what_the_evaluation_would_miss(cache, monkeypatch, tmp_path):
    """The start-up check raises the evaluation's own messages, and nothing when the evaluation could get its file;
    it never downloads (the fixture fails any attempt)."""
    hellaswag.check_available(str(TINY_FILE))
    hellaswag.check_available(None)  # no cache, but a download is allowed
    with pytest.raises(ValueError, match=f"--hellaswag_file {tmp_path}: a folder; pass a copy of"):
        hellaswag.check_available(str(tmp_path))  # a folder is not the file
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="is missing and HF_HUB_OFFLINE=1 forbids downloading it"):
        hellaswag.check_available(None)
    cache.parent.mkdir()
    cache.write_bytes(TINY_FILE.read_bytes())
    monkeypatch.setattr(hellaswag, "VAL_BLOB_ID", hellaswag.git_blob_id(cache))
    hellaswag.check_available(None)  # offline, but cached


@pytest.mark.parametrize("case", ["missing --hellaswag_file", "offline without the cached file"])
def test_training_refuses_a_missing_hellaswag_file_before_it_trains(cache, monkeypatch, tmp_path, capsys, case):
    """train_gpt2 --hellaswag=1 scores after training: a missing file must stop the run at start-up, not after the
    training (which, without --checkpoint_every, would be lost)."""
    import train_gpt2  # here: the other tests need no training script

    flags = ["--preset=smoke", "--device=cpu", "--num_iterations=2", "--hellaswag=1", f"--log_dir={tmp_path / 'logs'}"]
    if case == "missing --hellaswag_file":
        flags.append(f"--hellaswag_file={tmp_path / 'absent.jsonl'}")
        words = f"--hellaswag_file {tmp_path / 'absent.jsonl'}: no such file"
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        words = f"the HellaSwag validation file {cache} is missing and HF_HUB_OFFLINE=1 forbids downloading it"
    with pytest.raises(ValueError) as e:
        train_gpt2.main(flags)
    assert words in str(e.value)
    assert "step:" not in capsys.readouterr().out and not (tmp_path / "logs").exists()  # nothing ran, nothing written


@pytest.mark.parametrize("case", ["missing", "empty folder"])
def test_cli_checks_the_checkpoint_before_the_data(cache, monkeypatch, tmp_path, case):
    """Offline and without the data file, a wrong --checkpoint is still the error reported: the user typed it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tmp_path / "run"
    if case == "empty folder":
        path.mkdir()
    with pytest.raises(UserError) as e:
        hellaswag.main(["--checkpoint", str(path), "--device", "cpu"])
    assert str(e.value).startswith(f"--checkpoint {path}: ") and "--resume" not in str(e.value)
