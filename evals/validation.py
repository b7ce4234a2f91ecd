"""Validation loss: the mean loss per token over the validation tokens, summed over every rank's share."""
import torch

from data.loader import ValLoader
from model.gpt import GPT
from runtime import dist


def validation_loss(model: GPT, val_loader: ValLoader, window: torch.Tensor, rt: dist.Runtime) -> float:
    """The loss per scored token over `val_loader`'s tokens (all ranks' together); one sync at the end."""
    total = torch.zeros((), device=rt.device, dtype=torch.float64)
    for inputs_BT, targets_BT in val_loader:
        total += model.scored_loss_sum(inputs_BT, targets_BT, window)
    return dist.all_ranks_sum(total.item(), rt) / val_loader.val_tokens
