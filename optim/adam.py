"""Adam's update rule as a plain tensor function (Kingma & Ba, 2015), with bias correction, no weight decay.

The step count and learning rate arrive as 0-D tensors so a compiled caller never recompiles when they
change; betas and eps are fixed for a run, so they stay Python floats.
"""
import torch


def adam_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], *, lr: torch.Tensor, step: torch.Tensor,
                beta1: float, beta2: float, eps: float) -> None:
    """One Adam step for a list of parameters sharing `lr`; updates params and both moments in place.

    `step` counts from 1 at the first update. The arithmetic follows torch.optim.AdamW with
    weight_decay=0, so the two agree to float rounding.
    """
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step).sqrt()
    step_size = lr / bias_correction1
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = v.sqrt() / bias_correction2_sqrt + eps
        p.sub_(m / denom * step_size)
