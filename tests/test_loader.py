"""data.loader: the token stream against a plain-Python reference, for every rank layout, shard walk and resume;
the start-up check of every shard, and the messages for folders and shards this user may not read."""
import errno
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import data.loader
import data.shard
from data.loader import DataExhausted, TrainLoader, ValLoader
from data.prepare import SAMPLE_DIR
from data.shard import BOS_ID, ShardError, check_shards, read_header, write_shard

T, B = 16, 8  # seq_len, batch_size (sequences per optimizer step)
SHARD_SIZES = (300, 40, 7, 250, 180)  # tiny middle shards: sequences span up to three shards


def make_documents(n_tokens: int, rng: np.random.Generator, max_doc: int = 3 * T) -> np.ndarray:
    """BOS-led documents of random length up to max_doc (many longer than a sequence)."""
    tokens = rng.integers(0, BOS_ID, size=n_tokens, dtype=np.int64)
    position = 0
    while position < n_tokens:
        tokens[position] = BOS_ID
        position += int(rng.integers(1, max_doc))
    return tokens


def write_shards(directory, sizes=SHARD_SIZES, seed=0, name="train"):
    """Write consecutive pieces of one document stream as shards; return the stream."""
    stream = make_documents(sum(sizes), np.random.default_rng(seed))
    offsets = np.cumsum((0, *sizes))
    for i, size in enumerate(sizes):
        write_shard(directory / f"{name}_{i + 1:06d}.bin", stream[offsets[i]:offsets[i] + size])
    return stream, str(directory / f"{name}_*.bin")


def reference_steps(stream, steps, align, batch_size=B, seq_len=T):
    """Each step's (batch_size, seq_len + 1) sequences, computed the slow obvious way."""
    out, end = [], 0
    for _ in range(steps):
        rows = []
        for _ in range(batch_size):
            start = end
            if align:
                start = next((q for q in range(end, end + seq_len) if stream[q] == BOS_ID), end)
            rows.append(stream[start:start + seq_len + 1])
            end = start + seq_len
        out.append(np.stack(rows))
    return out


def loaders_for(pattern, world_size, device_batch_size, **kwargs):
    return [TrainLoader(pattern, seq_len=kwargs.pop("seq_len", T), batch_size=kwargs.pop("batch_size", B),
                        device_batch_size=device_batch_size, rank=r, world_size=world_size, device="cpu",
                        **kwargs) for r in range(world_size)]


def take_step(loaders):
    """One optimizer step from all ranks, rows put back in global sequence order."""
    world_size, device_batch_size = len(loaders), loaders[0].device_batch_size
    rows = np.zeros((loaders[0].batch_size, loaders[0].seq_len + 1), dtype=np.int64)
    for m in range(loaders[0].grad_accum):
        for rank, loader in enumerate(loaders):
            inputs, targets = loader.next_batch()
            assert inputs.dtype == torch.int32 and targets.dtype == torch.int64
            assert inputs.shape == targets.shape == (device_batch_size, loader.seq_len)
            assert torch.equal(inputs[:, 1:].long(), targets[:, :-1])
            first = (m * world_size + rank) * device_batch_size
            rows[first:first + device_batch_size] = torch.cat([inputs, targets[:, -1:].int()], 1).numpy()
    return rows


# (world_size, device_batch_size): grad_accum = B // (world_size * device_batch_size)
LAYOUTS = [(1, 2), (2, 2), (4, 2), (1, 8), (2, 1), (8, 1)]


@pytest.mark.parametrize("align", [False, True])
def test_every_rank_layout_sees_the_reference_stream(tmp_path, align):
    stream, pattern = write_shards(tmp_path)
    steps = 4
    expected = reference_steps(stream, steps, align)
    for world_size, device_batch_size in LAYOUTS:
        loaders = loaders_for(pattern, world_size, device_batch_size, align_to_bos=align)
        for step in range(steps):
            np.testing.assert_array_equal(take_step(loaders), expected[step],
                                          err_msg=f"world {world_size}, device batch {device_batch_size}, step {step}")


def test_alignment_starts_at_documents_and_survives_long_documents(tmp_path):
    stream = make_documents(3000, np.random.default_rng(1), max_doc=T)  # documents shorter than a sequence
    stream[400:400 + 4 * T] = 7  # except one far longer than a sequence
    write_shard(tmp_path / "train_000001.bin", stream)
    (loader,) = loaders_for(str(tmp_path / "train_*.bin"), 1, B)
    steps = [take_step([loader]) for _ in range(10)]
    for rows, expected in zip(steps, reference_steps(stream, 10, True)):
        np.testing.assert_array_equal(rows, expected)
    rows = np.concatenate(steps)
    mid_document = rows[:, 0] != BOS_ID
    # Only sequences inside the long document start mid-document, and they cover it without a gap.
    assert 3 <= mid_document.sum() <= 5
    assert (rows[mid_document][:, 1:-1] == 7).all(axis=1).sum() >= 3


def test_resume_continues_on_exactly_the_next_token(tmp_path):
    _, pattern = write_shards(tmp_path)
    for align in (False, True):
        for stop in (1, 2, 3):  # stop mid-shard 0, then in later shards after crossing boundaries
            (straight,) = loaders_for(pattern, 1, 2, align_to_bos=align)
            (first,) = loaders_for(pattern, 1, 2, align_to_bos=align)
            expected = [take_step([straight]) for _ in range(stop + 1)]
            for _ in range(stop):
                take_step([first])
            state = first.state_dict()
            assert all(type(v) is int for v in state.values())
            loaders = loaders_for(pattern, 2, 1, align_to_bos=align)  # resume on another layout, too
            for loader in loaders:
                loader.load_state_dict(state)
            np.testing.assert_array_equal(take_step(loaders), expected[stop])


def test_state_moves_across_shards(tmp_path):
    _, pattern = write_shards(tmp_path)
    (loader,) = loaders_for(pattern, 1, B, align_to_bos=False)
    take_step([loader])
    assert loader.state_dict() == {"shard": 0, "position": B * T, "epoch": 0}
    take_step([loader])  # ends at token 256 of shard 0 (300 tokens)
    take_step([loader])  # ends at 384 = 300 + 40 + 7 + 37: inside shard 3
    assert loader.state_dict() == {"shard": 3, "position": 37, "epoch": 0}


def test_data_exhausted_or_cycle(tmp_path):
    stream, pattern = write_shards(tmp_path)
    (loader,) = loaders_for(pattern, 1, B, align_to_bos=False)
    full_steps = (len(stream) - 1) // (B * T)
    for _ in range(full_steps):
        take_step([loader])
    state = loader.state_dict()
    with pytest.raises(DataExhausted, match=r"cached_fineweb10B.py N.*--num_iterations") as error:
        take_step([loader])
    assert f"{len(stream):,} tokens" in str(error.value)
    assert loader.state_dict() == state  # a failed step does not move the cursor

    (cycling,) = loaders_for(pattern, 1, B, align_to_bos=True, cycle=True)
    epochs = np.concatenate([stream] * 3)
    expected = reference_steps(epochs, 12, True)
    for step in range(12):
        np.testing.assert_array_equal(take_step([cycling]), expected[step])
    assert cycling.state_dict()["epoch"] >= 1


def stream_with_bos(n_tokens, bos_positions, seed=0):
    """Ordinary tokens with a BOS exactly at bos_positions and nowhere else: document starts placed by hand."""
    tokens = np.random.default_rng(seed).integers(0, BOS_ID, size=n_tokens, dtype=np.int64)
    tokens[list(bos_positions)] = BOS_ID
    return tokens


def test_alignment_window_covers_the_largest_skip_before_every_sequence(tmp_path):
    """Every sequence skips the most alignment allows, T-1 tokens: a BOS at T-1 and then every 2T-1 tokens puts
    each next BOS T-1 tokens after the previous sequence's end. The step then reaches B * (2T-1) + 1 tokens into
    the stream, all of the window the loader reads ahead; a shorter window would end the data early."""
    period = 2 * T - 1
    stream = stream_with_bos(3 * B * period, range(T - 1, 3 * B * period, period))
    write_shard(tmp_path / "train_000001.bin", stream)
    (loader,) = loaders_for(str(tmp_path / "train_*.bin"), 1, B)
    for step, expected in enumerate(reference_steps(stream, 2, True)):
        rows = take_step([loader])
        np.testing.assert_array_equal(rows, expected)
        assert (rows[:, 0] == BOS_ID).all()
        assert loader.state_dict() == {"shard": 0, "position": (step + 1) * B * period, "epoch": 0}


def test_bos_exactly_seq_len_ahead_is_out_of_reach(tmp_path):
    """Alignment takes a BOS within the next T tokens, offsets 0..T-1 from the previous sequence's end. One exactly
    T ahead would skip a whole sequence's worth of tokens, so that sequence starts mid-document instead."""
    stream = stream_with_bos(4 * B * T, (0, 2 * T))
    write_shard(tmp_path / "train_000001.bin", stream)
    (loader,) = loaders_for(str(tmp_path / "train_*.bin"), 1, B)
    rows = take_step([loader])
    np.testing.assert_array_equal(rows, reference_steps(stream, 1, True)[0])
    np.testing.assert_array_equal(rows[1], stream[T:2 * T + 1])  # mid-document, its last target the BOS at 2T
    assert rows[1, 0] != BOS_ID and rows[2, 0] == BOS_ID
    assert loader.state_dict() == {"shard": 0, "position": B * T, "epoch": 0}  # nothing was skipped


def test_step_ending_at_a_shard_boundary_saves_a_resumable_state(tmp_path):
    """A step ending exactly at the end of a shard leaves the cursor on the next shard's first token. (shard 0,
    token 2BT) would name a token shard 0 does not hold, which load_state_dict rejects: no resume from there."""
    stream, pattern = write_shards(tmp_path, sizes=(2 * B * T, 500))
    (loader,) = loaders_for(pattern, 1, B, align_to_bos=False)
    take_step([loader])
    take_step([loader])  # its last target is shard 1's first token, its end the last token of shard 0
    state = loader.state_dict()
    assert state == {"shard": 1, "position": 0, "epoch": 0}
    resumed = loaders_for(pattern, 2, 2, align_to_bos=False)
    for r in resumed:
        r.load_state_dict(state)
    np.testing.assert_array_equal(take_step(resumed), reference_steps(stream, 3, False)[2])


def test_exactly_one_step_of_tokens_left_is_data_exhausted(tmp_path):
    """A step reads B*T + 1 tokens (the last sequence's last target too), so with exactly B*T left the data has
    ended: the user gets DataExhausted, whose message names the fix, not an internal AssertionError."""
    _, pattern = write_shards(tmp_path, sizes=(B * T + 1, B * T - 1))  # 2BT tokens, the second step across shards
    (loader,) = loaders_for(pattern, 1, B, align_to_bos=False)
    take_step([loader])
    assert loader.state_dict() == {"shard": 0, "position": B * T, "epoch": 0}  # B*T tokens left
    with pytest.raises(DataExhausted, match=r"hold 256 tokens and one optimizer step takes --batch_size=8 x "
                                            r"--seq_len=16 = 128.*--num_iterations"):
        take_step([loader])
    assert loader.state_dict() == {"shard": 0, "position": B * T, "epoch": 0}


def test_first_shard_of_exactly_one_step_is_accepted(tmp_path):
    """The constructor refuses a first shard too small for one optimizer step; B*T + 1 tokens is exactly one step,
    so it is accepted and yields that step, while one token fewer is refused."""
    stream, pattern = write_shards(tmp_path, sizes=(B * T + 1,))
    (loader,) = loaders_for(pattern, 1, B, align_to_bos=False)
    np.testing.assert_array_equal(take_step([loader]), reference_steps(stream, 1, False)[0])
    assert loader.state_dict() == {"shard": 0, "position": B * T, "epoch": 0}
    (tmp_path / "short").mkdir()
    _, short = write_shards(tmp_path / "short", sizes=(B * T,))
    with pytest.raises(ValueError, match=r"holds 128 tokens, fewer than .* \+ 1 = 129"):
        loaders_for(short, 1, B, align_to_bos=False)


def test_constructor_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"--train_files='.*nothing_\*.bin'.*cached_fineweb10B.py"):
        TrainLoader(str(tmp_path / "nothing_*.bin"), seq_len=T, batch_size=B, device_batch_size=1, rank=0,
                    world_size=1, device="cpu")
    _, pattern = write_shards(tmp_path)
    with pytest.raises(ValueError, match=r"--batch_size=8 .*--device_batch_size=3 x 1 GPUs = 3"):
        TrainLoader(pattern, seq_len=T, batch_size=B, device_batch_size=3, rank=0, world_size=1, device="cpu")
    with pytest.raises(ValueError, match=r"holds 300 tokens.*--batch_size=8 x --seq_len=64 \+ 1 = 513"):
        TrainLoader(pattern, seq_len=64, batch_size=B, device_batch_size=8, rank=0, world_size=1, device="cpu")
    (tmp_path / "run[1]").mkdir()
    write_shards(tmp_path / "run[1]")
    with pytest.raises(ValueError, match=re.escape(f"use --train_files='{tmp_path}/run[[]1]/train_*.bin'")):
        TrainLoader(str(tmp_path / "run[1]" / "train_*.bin"), seq_len=T, batch_size=B, device_batch_size=1, rank=0,
                    world_size=1, device="cpu")
    (loader,) = loaders_for(str(tmp_path / "run[[]1]" / "train_*.bin"), 1, B)  # the advice works
    (tmp_path / "empty").mkdir()
    write_shard(tmp_path / "empty" / "train_000000.bin", np.zeros(0, dtype=np.uint16))  # sorts before the others
    write_shards(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"train_000000.bin holds 0 tokens.*: remove the empty file, or make "
                                         r"--train_files skip it$"):
        TrainLoader(str(tmp_path / "empty" / "train_*.bin"), seq_len=T, batch_size=B, device_batch_size=1, rank=0,
                    world_size=1, device="cpu")
    (loader,) = loaders_for(pattern, 1, B)
    with pytest.raises(ValueError, match="--train_files the run started with"):
        loader.load_state_dict({"shard": 9, "position": 0, "epoch": 0})


def test_bad_token_id_is_reported_with_its_shard(tmp_path):
    stream, pattern = write_shards(tmp_path)
    bad = stream[300:340].copy()
    bad[5] = 60_000
    write_shard(tmp_path / "train_000002.bin", bad)
    (loader,) = loaders_for(pattern, 1, B, align_to_bos=False)
    take_step([loader])
    take_step([loader])
    with pytest.raises(ShardError, match=r"train_000002.bin.*60000"):
        take_step([loader])


@pytest.mark.parametrize("world_size,device_batch_size,context",
                         [(1, 1, 0), (2, 3, 0), (4, 2, 0), (1, 1, 5), (2, 3, 15), (4, 2, 8)])
def test_val_loader_counts_exactly_val_tokens(tmp_path, world_size, device_batch_size, context):
    """Every one of the first val_tokens predictions is scored once, in stream order, and each scored one has at
    least `context` tokens of the stream before it in its row (all of them in the first row)."""
    stream, pattern = write_shards(tmp_path, sizes=(150, 200), name="val")
    val_tokens = 301
    loaders = [ValLoader(pattern, val_tokens=val_tokens, seq_len=T, device_batch_size=device_batch_size, rank=r,
                         world_size=world_size, device="cpu", context=context) for r in range(world_size)]
    stride = T - context
    rows_needed = 1 + math.ceil((val_tokens - T) / stride)
    assert loaders[0].num_steps == math.ceil(rows_needed / (world_size * device_batch_size))
    for _ in range(2):  # every pass starts from the beginning
        inputs, targets = [], []
        for batches in zip(*loaders):  # step by step; ranks in order give consecutive rows
            for x, y in batches:
                assert x.dtype == torch.int32 and y.dtype == torch.int64 and x.shape == (device_batch_size, T)
                inputs.append(x)
                targets.append(y)
        inputs, targets = torch.cat(inputs).numpy(), torch.cat(targets).numpy()
        assert len(inputs) >= rows_needed
        for r in range(rows_needed):  # row r is the stream from r * stride on (its last read token repeated)
            positions = np.minimum(r * stride + np.arange(T + 1), val_tokens)
            np.testing.assert_array_equal(inputs[r], stream[positions[:-1]])
            scored_T = targets[r] != -100
            np.testing.assert_array_equal(targets[r][scored_T], stream[positions[1:]][scored_T])
            assert r == 0 or not scored_T[:context].any()
        scored = targets != -100
        assert scored.sum() == val_tokens
        np.testing.assert_array_equal(targets[scored], stream[1:val_tokens + 1])
        np.testing.assert_array_equal(inputs[scored], stream[:val_tokens])


def test_val_loader_errors(tmp_path):
    _, pattern = write_shards(tmp_path, sizes=(150, 200), name="val")
    kwargs = dict(seq_len=T, device_batch_size=1, rank=0, world_size=1, device="cpu")
    with pytest.raises(ValueError, match="--val_tokens=0 must be positive"):
        ValLoader(pattern, val_tokens=0, **kwargs)
    with pytest.raises(ValueError, match=r"hold 350 tokens, but --val_tokens=350 needs 351"):
        ValLoader(pattern, val_tokens=350, **kwargs)
    with pytest.raises(ValueError, match=r"--val_files=.*cached_fineweb10B"):
        ValLoader(str(tmp_path / "missing_*.bin"), val_tokens=10, **kwargs)


def test_folder_instead_of_glob_names_the_glob(tmp_path):
    """A folder (one data.prepare wrote, say) where a glob belongs: the error gives the glob of its shards."""
    folder = tmp_path / "mine"
    folder.mkdir()
    write_shards(folder, name="corpus_train")
    write_shards(folder, sizes=(150, 200), name="corpus_val")
    kwargs = dict(seq_len=T, device_batch_size=1, rank=0, world_size=1, device="cpu")
    train = re.escape(f"--train_files='{folder}' is a folder: use --train_files='{folder}/*_train_*.bin' instead")
    with pytest.raises(ValueError, match=train):
        TrainLoader(str(folder), batch_size=B, **kwargs)
    val = re.escape(f"--val_files='{folder}' is a folder: use --val_files='{folder}/*_val_*.bin' instead")
    with pytest.raises(ValueError, match=val):
        ValLoader(str(folder), val_tokens=10, **kwargs)
    with pytest.raises(ValueError, match=re.escape(f"matches the folder {folder}: use --train_files='{folder}/")):
        TrainLoader(str(tmp_path / "mi*"), batch_size=B, **kwargs)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"is a folder with no shard files \(\*.bin\) in it: .*cached_fineweb10B"):
        ValLoader(str(tmp_path / "empty"), val_tokens=10, **kwargs)
    with pytest.raises(ValueError, match="for the sample corpus give --train_files=sample"):
        TrainLoader(str(SAMPLE_DIR), batch_size=B, **kwargs)


@pytest.mark.gpu
def test_cuda_batches_match_cpu(tmp_path):
    _, pattern = write_shards(tmp_path)
    (cpu,) = loaders_for(pattern, 1, 2)
    gpu = TrainLoader(pattern, seq_len=T, batch_size=B, device_batch_size=2, rank=0, world_size=1, device="cuda")
    for _ in range(2 * cpu.grad_accum):
        (x, y), (xg, yg) = cpu.next_batch(), gpu.next_batch()
        assert xg.is_cuda and xg.dtype == torch.int32 and yg.dtype == torch.int64
        assert torch.equal(x, xg.cpu()) and torch.equal(y, yg.cpu())


def test_val_context_scores_as_one_unbroken_stream(tmp_path):
    """With the model's receptive field as context, the summed validation loss over the loader's rows equals the
    loss of the whole stream as one sequence. With less, tokens after a cut lose part of their document's beginning
    and the sum differs. A small random-weight model (fp32, SDPA), so that attention carries information."""
    from model.config import receptive_field
    from model.gpt import GPT, GPTConfig

    _, pattern = write_shards(tmp_path, sizes=(150, 200), name="val")
    seq_len, window, val_tokens = 96, 32, 255
    config = GPTConfig(num_layers=2, model_dim=32, num_heads=2, head_dim=16, num_value_embeds=1, block_size=16)
    # both layers of a 2-layer model have the long window, 2 blocks; the context rounded up to whole blocks (as
    # runtime.config.derive does) keeps every row's blocks on the stream's
    assert receptive_field(config, window) == 2 * (window - 16) + 15
    context = -(-receptive_field(config, window) // 16) * 16  # 47 -> 48
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    model.attention_backend, model.compute_dtype = "sdpa", torch.float32
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3 if p.ndim >= 2 else 1.0)

    def summed_loss(seq_len, context):
        loader = ValLoader(pattern, val_tokens=val_tokens, seq_len=seq_len, device_batch_size=2, rank=0,
                           world_size=1, device="cpu", context=context)
        with torch.no_grad():
            return sum(model(x, y, torch.tensor(window), reduction="sum").item() for x, y in loader)

    whole = summed_loss(256, 0)  # one row: the whole stream
    assert summed_loss(seq_len, context) == pytest.approx(whole, rel=1e-6)  # fp32 rounding: measured 4e-8 of it
    assert summed_loss(seq_len, context + 16) == pytest.approx(whole, rel=1e-6)  # more than needed: the same
    # one layer's window is not enough (the layers chain); nor is enough context off the stream's blocks
    for short in (0, window - 1, context + 8):
        assert abs(summed_loss(seq_len, short) - whole) > 5e-6 * whole, short  # measured 5.7e-4 to 7.5e-4 of it


# --- the start-up check, and folders and shards this user may not read ------------------------------------------

def test_the_start_up_check_finds_a_bad_id_in_the_last_shard_before_any_step(tmp_path):
    """The loaders read a shard's ids only when they reach it: on their own they start, and the bad id in the last
    shard would stop the run hours in. check_shards, called once with the loaders' paths, stops it first."""
    stream, pattern = write_shards(tmp_path)
    last = tmp_path / f"train_{len(SHARD_SIZES):06d}.bin"
    bad = stream[-SHARD_SIZES[-1]:].copy()
    bad[-1] = 60_000
    write_shard(last, bad)
    _, val_pattern = write_shards(tmp_path, sizes=(150,), name="val")
    (train,) = loaders_for(pattern, 1, B)  # constructed without complaint: shard 0 is fine
    val = ValLoader(val_pattern, val_tokens=100, seq_len=T, device_batch_size=1, rank=0, world_size=1, device="cpu")
    with pytest.raises(ShardError, match=rf"^shard {last}: holds token id 60000, but the GPT-2 vocabulary has 50257"):
        check_shards(train.paths + val.paths, vocab_size=50304)
    assert train.state_dict() == {"shard": 0, "position": 0, "epoch": 0}  # no step was drawn


running_as_root = pytest.mark.skipif(os.geteuid() == 0, reason="root reads folders whatever their mode")


def deny(monkeypatch, folder) -> None:
    """Make data.loader's access checks refuse `folder` as chmod 000 would for a user that is not root."""
    access = os.access
    monkeypatch.setattr(data.loader.os, "access",
                        lambda path, mode: False if Path(path) == Path(folder) else access(path, mode))


def unreadable_folder_message(flag, pattern, folder):
    return (f"{flag}={pattern!r}: the folder {folder} is not readable by this user, so its shard files cannot be "
            f"listed: make it readable with `chmod a+rx {folder}`, or run as a user allowed to read it")


@pytest.mark.parametrize("how", ["monkeypatched", pytest.param("chmod", marks=running_as_root)])
def test_an_unreadable_folder_is_named_not_blamed_on_missing_data(tmp_path, monkeypatch, how):
    folder = tmp_path / "data" / "shards"
    folder.mkdir(parents=True)
    if how == "chmod":  # shards inside, which glob cannot list
        write_shards(folder)
        folder.chmod(0)
    else:  # root lists any folder; an empty one gives the same no-match, with the access check refused
        deny(monkeypatch, folder)
    pattern = str(folder / "train_*.bin")
    try:
        with pytest.raises(ValueError) as error:
            TrainLoader(pattern, seq_len=T, batch_size=B, device_batch_size=1, rank=0, world_size=1, device="cpu")
        assert str(error.value) == unreadable_folder_message("--train_files", pattern, folder)
        with pytest.raises(ValueError) as error:  # the folder itself given, as --val_files
            ValLoader(str(folder), val_tokens=10, seq_len=T, device_batch_size=1, rank=0, world_size=1, device="cpu")
        assert str(error.value) == unreadable_folder_message("--val_files", str(folder), folder)
    finally:
        folder.chmod(0o755)


def test_a_folder_that_cannot_be_entered_on_the_way_is_named(tmp_path, monkeypatch):
    deny(monkeypatch, tmp_path / "data")
    (tmp_path / "data" / "shards").mkdir(parents=True)
    pattern = str(tmp_path / "data" / "shards" / "train_*.bin")
    with pytest.raises(ValueError) as error:
        TrainLoader(pattern, seq_len=T, batch_size=B, device_batch_size=1, rank=0, world_size=1, device="cpu")
    assert str(error.value) == unreadable_folder_message("--train_files", pattern, tmp_path / "data")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"no shard files match --train_files=.*cached_fineweb10B"):  # readable: as ever
        TrainLoader(pattern, seq_len=T, batch_size=B, device_batch_size=1, rank=0, world_size=1, device="cpu")


@pytest.mark.parametrize("how", ["monkeypatched", pytest.param("chmod", marks=running_as_root)])
def test_an_unreadable_shard_stops_the_loader_with_the_fix(tmp_path, monkeypatch, how):
    _, pattern = write_shards(tmp_path)
    secret = tmp_path / "train_000003.bin"
    if how == "chmod":
        secret.chmod(0)
    else:
        def refusing(file, *args, **kwargs):
            if Path(file) == secret:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
            return open(file, *args, **kwargs)

        monkeypatch.setattr(data.shard, "open", refusing, raising=False)
    with pytest.raises(ShardError) as error:
        loaders_for(pattern, 1, B)
    assert str(error.value) == (f"shard {secret}: cannot be read (Permission denied): make it readable with "
                                f"`chmod a+r {secret}`, or run as a user allowed to read it")


@pytest.mark.parametrize("align", [False, True])
def test_paths_for_holds_every_shard_the_steps_read(tmp_path, monkeypatch, align):
    """paths_for(n) is what the start-up check needs: every shard n steps read (a bad id in the next one does not
    stop them), and, with shards far longer than a step as FineWeb's are, not the shards after."""
    _, pattern = write_shards(tmp_path)
    read, tokens = set(), TrainLoader._tokens

    def recording(self, i):
        read.add(self.paths[i])
        return tokens(self, i)

    monkeypatch.setattr(TrainLoader, "_tokens", recording)
    for steps in range(1, 5):  # the 777 tokens hold 4 steps of 128 with alignment's skips, not always 5
        (loader,) = loaders_for(pattern, 1, 2, align_to_bos=align)
        within = loader.paths_for(steps)
        if len(within) < len(loader.paths):  # a bad id just past them is never met
            following = Path(loader.paths[len(within)])
            write_shard(following, np.full(read_header(following), 60_000, dtype=np.uint16))
        read.clear()
        for _ in range(steps):
            take_step([loader])
        assert read <= set(within), (steps, sorted(read), within)
        write_shards(tmp_path)  # the good shards back
    (cycling,) = loaders_for(pattern, 1, 2, cycle=True)
    assert cycling.paths_for(1) == cycling.paths
    (fineweb_like,) = loaders_for(pattern, 1, 1, seq_len=2, batch_size=2, align_to_bos=align)
    assert fineweb_like.paths_for(3) == fineweb_like.paths[:1]  # 3 steps of 2 x 2 tokens stay in the first shard
