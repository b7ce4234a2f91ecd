"""Validation loss: the mean loss per token over the validation tokens, summed over every rank's share; and the
per-layer rule that chooses INT8/FP8 attention (--attention_forward=int8) for forward-only passes."""
import torch

from data.loader import ValLoader
from model.gpt import GPT
from runtime import dist

# A layer whose INT8/FP8 attention output is off its bf16 output by more (relative L1) stays bf16; sample.py's rule too
INT8_MAX_ERROR = 0.05
CALIBRATION_TOKENS = 8192  # of a batch: where each layer's error is measured, eagerly


def validation_loss(model: GPT, val_loader: ValLoader, window: torch.Tensor, rt: dist.Runtime) -> float:
    """The loss per scored token over `val_loader`'s tokens (all ranks' together); one sync at the end."""
    total = torch.zeros((), device=rt.device, dtype=torch.float64)
    for inputs_BT, targets_BT in val_loader:
        total += model.scored_loss_sum(inputs_BT, targets_BT, window)
    return dist.all_ranks_sum(total.item(), rt) / val_loader.val_tokens


def choose_int8_layers(model, inputs_BT: torch.Tensor, window: torch.Tensor, rt: dist.Runtime) -> str:
    """Turns INT8/FP8 attention on in the layers (of a model/fast FastGPT) whose error on about CALIBRATION_TOKENS
    tokens of inputs_BT (its first rows, or the first tokens of the first), averaged over ranks so that all choose
    alike, is at most INT8_MAX_ERROR; returns the errors as a line for the log."""
    T = min(CALIBRATION_TOKENS, inputs_BT.size(1))
    rows = max(1, CALIBRATION_TOKENS // T)
    errors = [dist.all_ranks_sum(e, rt) / rt.world_size
              for e in model.int8_attention_errors(inputs_BT[:rows, :T], window)]
    on, line = int8_rule(errors)
    model.use_int8_attention(on)
    return line


def int8_rule(errors: list[float]) -> tuple[list[bool], str]:
    """Per attention layer, whether its INT8/FP8 error (relative L1) allows INT8/FP8: at most INT8_MAX_ERROR; and the
    errors as a line for the log."""
    on = [e <= INT8_MAX_ERROR for e in errors]
    return on, (f"int8 attention in {sum(on)} of {len(on)} layers; relative L1 error by layer (bf16 where over "
                f"{INT8_MAX_ERROR}): " + " ".join(f"{e:.4f}" for e in errors))
