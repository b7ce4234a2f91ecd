"""Training schedules as pure functions of the optimizer step (from 0); they reach their end values at
`num_iterations`, the final evaluation. Argument errors name the flag that sets them.
"""


def lr_multiplier(step: int, num_iterations: int, cooldown_frac: float, final_frac: float = 0.1) -> float:
    """1.0 for the first (1 - cooldown_frac) of training, then linear down to `final_frac`: the speedrun records'
    trapezoidal schedule (record #28)."""
    if num_iterations < 1:
        raise ValueError(f"--num_iterations={num_iterations} must be at least 1")
    if not 0.0 <= cooldown_frac <= 1.0:
        raise ValueError(f"--cooldown_frac={cooldown_frac} must be in [0, 1]: the fraction of training "
                         f"spent decaying the learning rate (0 = none, 1 = all of it)")
    if not 0.0 <= final_frac <= 1.0:
        raise ValueError(f"--final_lr_frac={final_frac} must be in [0, 1]: the learning rate at the end of "
                         f"the cooldown, as a fraction of the base rate")
    assert 0 <= step <= num_iterations, f"step {step} outside [0, {num_iterations}]"
    remaining = (num_iterations - step) / num_iterations  # 1 at the start, 0 at the end
    if cooldown_frac == 0.0 or remaining >= cooldown_frac:
        return 1.0
    w = remaining / cooldown_frac  # 1 where the cooldown starts, 0 at num_iterations
    return w + (1.0 - w) * final_frac


def muon_momentum(step: int, warmup_steps: int = 300, start: float = 0.85, end: float = 0.95) -> float:
    """Muon's momentum, linear from `start` to `end` over `warmup_steps`, then constant (the records' warmup)."""
    if warmup_steps < 0:
        raise ValueError(f"--momentum_warmup_steps={warmup_steps} must be >= 0 (0 = no warmup)")
    for flag, value in (("--momentum_start", start), ("--momentum_end", end)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{flag}={value} must be in [0, 1)")
    assert step >= 0, f"step {step} is negative"
    if warmup_steps == 0 or step >= warmup_steps:
        return end
    frac = step / warmup_steps
    return (1.0 - frac) * start + frac * end


def attention_window(step: int, num_iterations: int, min_tokens: int, max_tokens: int,
                     block_size: int) -> int:
    """The attention window in tokens, growing linearly from `min_tokens` to `max_tokens` (the records' warm-up,
    cheap early steps), rounded up to whole blocks."""
    if num_iterations < 1:
        raise ValueError(f"--num_iterations={num_iterations} must be at least 1")
    assert block_size >= 1, f"attention block size {block_size} must be at least 1"
    for flag, value in (("--window_min_tokens", min_tokens), ("--window_max_tokens", max_tokens)):
        if value < block_size or value % block_size:
            raise ValueError(f"{flag}={value} must be a positive multiple of the attention block size "
                             f"{block_size}")
    if min_tokens > max_tokens:
        raise ValueError(f"--window_min_tokens={min_tokens} exceeds --window_max_tokens={max_tokens}: "
                         f"the window only grows")
    assert 0 <= step <= num_iterations, f"step {step} outside [0, {num_iterations}]"
    min_blocks, max_blocks = min_tokens // block_size, max_tokens // block_size
    grown = -(-(max_blocks - min_blocks) * step // num_iterations)  # exact integer ceil
    return (min_blocks + grown) * block_size
