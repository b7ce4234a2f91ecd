"""Rank-sharded loaders over .bin shard globs.

The training stream is the concatenation of the sorted glob's shards. One optimizer step takes `batch_size`
sequences of `seq_len + 1` tokens (inputs, and targets shifted by one) from it; sequence j starts where
sequence j-1 ended, or, with `align_to_bos`, at the first document start (BOS) within the next `seq_len`
tokens after that point. The step's sequences are then dealt out so that rank r, micro-step m, row i gets
sequence (m * world_size + r) * device_batch_size + i. The sequences of a step therefore depend only on
`batch_size` and `seq_len`: 1 GPU x 8 micro-steps and 8 GPUs x 1 see exactly the same tokens.
"""
import glob
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from data.prepare import SAMPLE_DIR
from data.shard import BOS_ID, check_token_ids, read_header, read_shard
from runtime.errors import UserError

DOWNLOAD_HINT = "download FineWeb shards with `python data/cached_fineweb10B.py N` or make your own with " \
                "`python -m data.prepare INPUT... --out DIR`"
SPLIT_GLOBS = {"--train_files": "*_train_*.bin", "--val_files": "*_val_*.bin"}  # names data.prepare and FineWeb use


class DataExhausted(UserError):
    """The training data ended and `cycle` is off."""


def _unreadable_folder_error(folder, pattern: str, flag: str) -> UserError:
    return UserError(f"{flag}={pattern!r}: the folder {folder} is not readable by this user, so its shard files "
                      f"cannot be listed: make it readable with `chmod a+rx {folder}`, or run as a user allowed to "
                      f"read it")


def _unreadable_folder(pattern: str) -> Path | None:
    """The first folder before `pattern`'s first wildcard that this process may not enter (or, where the glob
    lists it, read), or None."""
    fixed = []
    for part in Path(pattern).parent.parts:
        if glob.escape(part) != part:  # escape changes exactly the parts with wildcards
            break
        fixed.append(part)
    folders = [Path(*fixed[:i]) for i in range(1, len(fixed) + 1)] or [Path(".")]
    lists_last = glob.escape(pattern) != pattern  # a wildcard after the last fixed folder: the glob reads it
    for folder in folders:
        if not folder.is_dir():
            return None  # absent: the plain no-match message applies
        need = os.R_OK | os.X_OK if lists_last and folder == folders[-1] else os.X_OK
        if not os.access(folder, need):
            return folder
    return None


def _folder_error(folder: str, pattern: str, flag: str) -> UserError:
    """A folder where shard files were expected; the message names the glob of the shards inside it."""
    given = f"{flag}={pattern!r} " + ("is a folder" if folder == pattern else f"matches the folder {folder}")
    if not os.access(folder, os.R_OK | os.X_OK):
        return _unreadable_folder_error(folder, pattern, flag)
    if Path(folder).resolve() == SAMPLE_DIR:
        return UserError(f"{given}: for the sample corpus give {flag}=sample")
    for name in (SPLIT_GLOBS[flag], "*.bin"):  # "*.bin" for shards named another way
        suggestion = os.path.join(folder, name)
        if found := glob.glob(suggestion):
            return UserError(f"{given}: use {flag}={suggestion!r} instead, the glob of the {len(found)} shard "
                              f"file(s) in it")
    return UserError(f"{given} with no shard files (*.bin) in it: {DOWNLOAD_HINT}, then give {flag} their glob")


def _shard_paths(pattern: str, flag: str) -> list[str]:
    paths = sorted(glob.glob(pattern))
    if not paths:
        # glob passes over folders it may not read, and would leave the message below to blame the data
        if (unreadable := _unreadable_folder(pattern)) is not None:
            raise _unreadable_folder_error(unreadable, pattern, flag)
        # glob reads [ and ] as a character class; a folder named with them needs them escaped
        escaped = os.path.join(glob.escape(os.path.dirname(pattern)), os.path.basename(pattern))
        if escaped != pattern and glob.glob(escaped):
            raise UserError(f"no shard files match {flag}={pattern!r}, whose folder name holds [ or ], which a glob "
                             f"reads as a set of characters: use {flag}={escaped!r}")
        # run.sh starts in the repo folder, so a relative glob may be read from elsewhere than the user stands
        where = "" if os.path.isabs(pattern) else f" (a relative glob, read from {os.getcwd()})"
        raise UserError(f"no shard files match {flag}={pattern!r}{where}: {DOWNLOAD_HINT}, or fix {flag}")
    folder = next((p for p in paths if os.path.isdir(p)), None)
    if folder is not None:
        raise _folder_error(folder, pattern, flag)
    return paths


def _load_checked(path: str) -> np.ndarray:
    # Runs on the prefetch thread: the full scan for bad ids also pulls the file into the page cache.
    tokens = read_shard(path)
    check_token_ids(tokens, path)
    return tokens


def _to_device(rows: np.ndarray, targets: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs int32, targets int64) on `device`; on CUDA through pinned memory with asynchronous copies."""
    if device.type != "cuda":
        return torch.from_numpy(rows.astype(np.int32)), torch.from_numpy(targets.astype(np.int64))
    # fresh pinned tensors: the caching host allocator reuses a block only after its copy has finished
    inputs_cpu = torch.empty(rows.shape, dtype=torch.int32, pin_memory=True)
    targets_cpu = torch.empty(targets.shape, dtype=torch.int64, pin_memory=True)
    inputs_cpu.numpy()[:] = rows
    targets_cpu.numpy()[:] = targets
    return inputs_cpu.to(device, non_blocking=True), targets_cpu.to(device, non_blocking=True)


class TrainLoader:
    """Micro-batches of the training stream for one rank; a step is `grad_accum` calls of next_batch()."""

    def __init__(self, pattern: str, *, seq_len: int, batch_size: int, device_batch_size: int, rank: int,
                 world_size: int, device, align_to_bos: bool = True, cycle: bool = False):
        for name, value in (("--seq_len", seq_len), ("--batch_size", batch_size),
                            ("--device_batch_size", device_batch_size)):
            if value <= 0:
                raise UserError(f"{name}={value} must be positive")
        assert 0 <= rank < world_size, f"rank {rank} outside world of size {world_size}"
        per_micro_step = device_batch_size * world_size
        if batch_size % per_micro_step:
            raise UserError(f"--batch_size={batch_size} sequences is not a multiple of --device_batch_size="
                             f"{device_batch_size} x {world_size} GPUs = {per_micro_step}: change --batch_size "
                             f"or --device_batch_size so that it divides")
        self.pattern, self.seq_len, self.batch_size = pattern, seq_len, batch_size
        self.device_batch_size, self.rank, self.world_size = device_batch_size, rank, world_size
        self.device = torch.device(device)
        self.align_to_bos, self.cycle = align_to_bos, cycle
        self.grad_accum = batch_size // per_micro_step
        self.paths = _shard_paths(pattern, "--train_files")
        self.counts = [read_header(p) for p in self.paths]  # every header checked now, not hours into a run
        step_tokens = batch_size * seq_len + 1
        if self.counts[0] < step_tokens:
            fix = ("remove the empty file, or make --train_files skip it" if self.counts[0] == 0 else
                   "lower --batch_size or --seq_len, or use larger shards")
            raise UserError(f"the first training shard {self.paths[0]} holds {self.counts[0]:,} tokens, fewer than "
                             f"one optimizer step needs (--batch_size={batch_size} x --seq_len={seq_len} + 1 = "
                             f"{step_tokens:,}): {fix}")
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch")
        self._loads: dict[int, Future] = {}
        self._shard, self._position, self._epoch = 0, 0, 0
        self._micro = 0  # micro-step within the current optimizer step
        self._window, self._starts = None, None
        self._tokens(0)

    def paths_for(self, num_steps: int) -> list[str]:
        """The shards that the first `num_steps` optimizer steps can read: all with `cycle`, else those holding the
        most tokens the steps can take (alignment skips up to seq_len - 1 before each sequence)."""
        if self.cycle:
            return list(self.paths)
        per_sequence = 2 * self.seq_len - 1 if self.align_to_bos else self.seq_len
        reach = num_steps * self.batch_size * per_sequence + 1
        return self.paths[:int(np.searchsorted(np.cumsum(self.counts), reach)) + 1]

    # ---- shards: loaded on a background thread, one ahead of the one in use
    def _tokens(self, i: int) -> np.ndarray:
        if i not in self._loads:
            self._loads[i] = self._prefetcher.submit(_load_checked, self.paths[i])
        return self._loads[i].result()

    def _next_shard(self, shard: int, epoch: int) -> tuple[int, int] | None:
        if shard + 1 < len(self.paths):
            return shard + 1, epoch
        return (0, epoch + 1) if self.cycle else None

    def _prefetch_after(self, shard: int) -> None:
        following = self._next_shard(shard, 0)
        keep = {shard} | ({following[0]} if following else set())
        self._loads = {i: f for i, f in self._loads.items() if i in keep}
        if following and following[0] not in self._loads:
            self._loads[following[0]] = self._prefetcher.submit(_load_checked, self.paths[following[0]])

    # ---- one optimizer step
    def _plan_step(self) -> tuple[np.ndarray, np.ndarray, tuple[int, int, int]]:
        """The tokens ahead of the cursor, the step's sequence starts in them, and the cursor after the step."""
        B, T = self.batch_size, self.seq_len
        # alignment skips up to T - 1 tokens before each sequence
        need = B * (2 * T - 1) + 1 if self.align_to_bos else B * T + 1
        pieces, segments = [], []  # segments: (shard, position, epoch, length) of each piece
        place = (self._shard, self._position, self._epoch)
        have = 0
        while have < need and place is not None:
            shard, position, epoch = place
            piece = self._tokens(shard)[position:position + need - have]
            if len(piece):
                pieces.append(piece)
                segments.append((shard, position, epoch, len(piece)))
                have += len(piece)
            if have < need:
                following = self._next_shard(shard, epoch)
                place = (following[0], 0, following[1]) if following else None
        window = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

        if self.align_to_bos:
            bos = np.flatnonzero(window == BOS_ID)
            starts = np.empty(B, dtype=np.int64)
            end = 0
            for j in range(B):
                k = np.searchsorted(bos, end)
                # A document longer than a sequence has no BOS in reach: start mid-document, skip nothing.
                starts[j] = bos[k] if k < len(bos) and bos[k] < end + T else end
                end = starts[j] + T
        else:
            starts = np.arange(B, dtype=np.int64) * T
            end = B * T
        if end + 1 > len(window):
            raise DataExhausted(
                f"training data ended at shard {self.paths[-1]}: the {len(self.paths)} shard(s) matching "
                f"{self.pattern!r} hold {sum(self.counts):,} tokens and one optimizer step takes --batch_size="
                f"{B} x --seq_len={T} = {B * T:,}, so about {sum(self.counts) // (B * T):,} steps (fewer with "
                f"document alignment): add shards (`python data/cached_fineweb10B.py N` with a larger N) or "
                f"lower --num_iterations")

        offset = 0
        for shard, position, epoch, length in segments:
            if end < offset + length:
                return window, starts, (shard, position + int(end) - offset, epoch)
            offset += length
        raise AssertionError("the step's end lies inside the window")

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch: inputs int32 and targets int64, both (device_batch_size, seq_len)."""
        if self._micro == 0:
            self._window, self._starts, (self._shard, self._position, self._epoch) = self._plan_step()
            self._prefetch_after(self._shard)
        first = (self._micro * self.world_size + self.rank) * self.device_batch_size
        starts = self._starts[first:first + self.device_batch_size]
        rows = self._window[starts[:, None] + np.arange(self.seq_len + 1)]
        self._micro = (self._micro + 1) % self.grad_accum
        return _to_device(rows[:, :-1], rows[:, 1:], self.device)

    # ---- resume
    def state_dict(self) -> dict:
        assert self._micro == 0, "TrainLoader.state_dict() is only valid between optimizer steps"
        return {"shard": self._shard, "position": self._position, "epoch": self._epoch}

    def load_state_dict(self, state: dict) -> None:
        shard, position, epoch = int(state["shard"]), int(state["position"]), int(state["epoch"])
        if not (0 <= shard < len(self.paths) and 0 <= position < self.counts[shard]):
            raise UserError(f"the checkpoint's data position (shard {shard}, token {position}) does not exist in "
                             f"the {len(self.paths)} shard(s) matching {self.pattern!r}: resume with the "
                             f"--train_files the run started with")
        self._shard, self._position, self._epoch, self._micro = shard, position, epoch, 0
        self._prefetch_after(shard)


class ValLoader:
    """The first `val_tokens` predictions of the validation stream, in micro-batches of the training shape.

    Row r (of all ranks' rows) holds stream tokens [r * S, r * S + seq_len), S = seq_len - context: its first
    `context` predictions repeat row r - 1's end unscored (-100), as context only. With context >= the longest
    window - 1 every scored token sees the keys it would see in one endless sequence, so the loss does not depend on
    seq_len. Exactly `val_tokens` targets are scored; each iteration starts from the beginning.
    """

    def __init__(self, pattern: str, *, val_tokens: int, seq_len: int, device_batch_size: int, rank: int,
                 world_size: int, device, context: int = 0):
        if val_tokens <= 0:
            raise UserError(f"--val_tokens={val_tokens} must be positive: it is how many tokens each validation "
                             f"scores (the speedrun's --val_tokens=10485760)")
        assert 0 <= context < seq_len, f"context {context} outside 0..{seq_len - 1} (runtime.config.derive checks it)"
        assert 0 <= rank < world_size, f"rank {rank} outside world of size {world_size}"
        self.val_tokens, self.seq_len, self.device_batch_size = val_tokens, seq_len, device_batch_size
        self.context, self.stride = context, seq_len - context
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        paths = _shard_paths(pattern, "--val_files")
        available = sum(read_header(p) for p in paths)
        if available < val_tokens + 1:
            raise UserError(f"the {len(paths)} validation shard(s) matching {pattern!r} hold {available:,} tokens, "
                             f"but --val_tokens={val_tokens:,} needs {val_tokens + 1:,} (one more input than "
                             f"predictions): lower --val_tokens or point --val_files at more data")
        # row 0 scores seq_len predictions, every later row `stride` more
        rows = 1 + max(0, math.ceil((val_tokens - seq_len) / self.stride))
        self.num_steps = math.ceil(rows / (world_size * device_batch_size))
        pieces, have = [], 0
        for path in paths:
            piece = np.array(read_shard(path)[:val_tokens + 1 - have])
            check_token_ids(piece, path)
            pieces.append(piece)
            have += len(piece)
            if have == val_tokens + 1:
                break
        self._stream = np.concatenate(pieces)
        self.paths = paths[:len(pieces)]  # the shards validation reads

    def __len__(self) -> int:
        return self.num_steps

    def __iter__(self):
        T, Bd = self.seq_len, self.device_batch_size
        for step in range(self.num_steps):
            row_B = (step * self.world_size + self.rank) * Bd + np.arange(Bd)
            positions = (row_B * self.stride)[:, None] + np.arange(T + 1)
            # Positions past the stream repeat its last token; every target there is ignored anyway.
            rows = self._stream[np.minimum(positions, len(self._stream) - 1)]
            # the first scored target's stream position: row 0 from its start, later rows after their context
            first_scored_B = np.where(row_B > 0, positions[:, 0] + self.context, 0) + 1
            scored = (positions[:, 1:] >= first_scored_B[:, None]) & (positions[:, 1:] <= self.val_tokens)
            targets = np.where(scored, rows[:, 1:].astype(np.int64), -100)
            yield _to_device(rows[:, :-1], targets, self.device)
