"""The model's shape and options (GPTConfig) and what follows from them alone: which layers attend over which
window, how far back the model sees, its FLOPs per token. Plain Python, no torch: the run's config
(runtime/config.py) checks the flags with these before torch loads, which took 10-12 s on the H200 image where run.sh
asks it first, and the benchmark harness (bench/run.py) counts MFU with them."""

import math
from dataclasses import dataclass


def value_embed_layers(k: int, num_value_embeds: int, num_layers: int) -> set[int]:
    """The layers value embedding k feeds: layer k and layer L - n + k (record #28; GPTConfig.value_embed_index)."""
    return {k, num_layers - num_value_embeds + k}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50,257 tokens padded to a multiple of 128 for matmul efficiency
    num_layers: int = 12  # GPT-2 small depth
    model_dim: int = 768  # GPT-2 small width
    num_heads: int = 6  # 6 heads of 128 (modded-nanogpt), not GPT-2's 12 of 64
    head_dim: int = 128  # per-head width; a multiple of 4 (half-truncated RoPE splits its pairs in two)
    mlp_ratio: int = 4  # MLP width / model width, as in GPT-2
    # cap * tanh(logits / cap): Gemma 2's softcap at modded-nanogpt's value since its record of 2025-01-04 (30 -> 15
    # cut the steps by 7%); record #28 writes it as 30 * sigmoid(logits / 7.5), the same softmax
    logit_softcap: float = 15.0
    num_value_embeds: int = 3  # value embeddings shared by the first and last layers (record #28); 0 disables
    value_residual: bool = False  # mix the first layer's values into every later one's (Zhou et al. 2024); not in #28
    rope_base: float = 1024.0  # slowest rotary frequency is 1/rope_base (modded-nanogpt), not RoPE's 10,000
    attn_scale: float = 0.12  # softmax scale instead of 1/sqrt(head_dim): modded-nanogpt, tuned with QK-norm
    block_size: int = 128  # FlexAttention tile in tokens; the sequence length must be a multiple of it
    bos_id: int = 50256  # <|endoftext|>: starts every document, so attention never crosses it
    # layers using the short window (half the long one); None = record #28's long/short pattern: long on every
    # 4th layer counted from each end (12 layers: 0, 4 and 11, 7), short elsewhere
    short_window_layers: tuple[int, ...] | None = None
    # blocks without an MLP / without attention (record #28 drops layer 7's attention); empty = all complete
    no_mlp_layers: tuple[int, ...] = ()
    no_attention_layers: tuple[int, ...] = ()
    attn_gate: bool = True  # record #28's sparse per-head attention output gate (model/layers.py)
    smear: bool = False  # add a gated share of each token's previous embedding row (layers.smear); not in #28
    backout: bool = False  # add a learned multiple (init -0.2) of the mid-stream to the last block's output; not #28

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "model_dim", "num_heads", "head_dim", "mlp_ratio", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be positive")
        if self.head_dim % 4:
            raise ValueError(f"GPTConfig.head_dim={self.head_dim} must be a multiple of 4 (half-truncated RoPE "
                             f"splits the rotary pairs in two halves); use e.g. 64 or 128")
        if not 0 < self.logit_softcap < math.inf:  # also false for nan
            raise ValueError(f"GPTConfig.logit_softcap={self.logit_softcap} must be a positive finite number "
                             f"(modded-nanogpt's is 15)")
        if not 0 <= 2 * self.num_value_embeds <= self.num_layers:
            raise ValueError(f"GPTConfig.num_value_embeds={self.num_value_embeds} must be between 0 and "
                             f"num_layers // 2 = {self.num_layers // 2}: each embedding feeds one of the first and "
                             f"one of the last layers; try num_value_embeds={self.num_layers // 2}")
        if not 0 <= self.bos_id < self.vocab_size:
            raise ValueError(f"GPTConfig.bos_id={self.bos_id} must be a token id below vocab_size={self.vocab_size}")
        if self.short_window_layers is not None and not all(0 <= i < self.num_layers for i in self.short_window_layers):
            raise ValueError(f"GPTConfig.short_window_layers={self.short_window_layers} must be layer indices "
                             f"below num_layers={self.num_layers}, or None for the default pattern")
        for name in ("no_mlp_layers", "no_attention_layers"):
            if not all(0 <= i < self.num_layers for i in getattr(self, name)):
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be layer indices below "
                                 f"num_layers={self.num_layers}")
        no_attention = set(self.no_attention_layers)
        if len(no_attention) == self.num_layers:
            raise ValueError(f"no_attention_layers={list(self.no_attention_layers)} names every layer: no token would "
                             f"see an earlier one; keep attention in at least one layer")

        def unread(n: int) -> list[int]:  # value embeddings, of n, whose layers all lack attention: never read
            return [k for k in range(n) if value_embed_layers(k, n, self.num_layers) <= no_attention]

        if never_read := unread(self.num_value_embeds):  # the optimizer refuses a table that never gets a gradient
            k = never_read[0]
            layers = sorted(value_embed_layers(k, self.num_value_embeds, self.num_layers))
            fits = max(n for n in range(self.num_value_embeds) if not unread(n))
            raise ValueError(f"value embedding {k} feeds layers {layers}, which no_attention_layers="
                             f"{list(self.no_attention_layers)} leaves without attention, so it would never be "
                             f"read; keep attention in one of them, or set num_value_embeds={fits}")
        if self.value_residual and 0 in self.no_attention_layers:
            raise ValueError("layer 0 must keep its attention: the value residual feeds its values to every later "
                             "layer; remove 0 from no_attention_layers")

    def is_short_window(self, layer: int) -> bool:
        if self.short_window_layers is not None:
            return layer in self.short_window_layers
        return min(layer, self.num_layers - 1 - layer) % 4 != 0

    def value_embed_index(self, layer: int) -> int | None:
        """Which value embedding layer `layer` uses: embedding k feeds layer k and layer L - n + k (record #28)."""
        n, L = self.num_value_embeds, self.num_layers
        if layer < n:
            return layer
        if layer >= L - n:
            return layer - (L - n)
        return None


def short_window(window, block_size: int):
    """The short-window layers' window: half the long one, rounded down to whole blocks, at least one block. `window`
    is an int, or a tensor (the model's, so that a growing window never recompiles a graph)."""
    blocks = window // 2 // block_size
    return (blocks.clamp_min(1) if hasattr(blocks, "clamp_min") else max(blocks, 1)) * block_size


def window_blocks(window, block_size: int):
    """How many blocks a window (tensor or int) spans: ceil(window / block_size), the query's own block included."""
    return (window + block_size - 1) // block_size


def attention_windows(config: GPTConfig, window: int) -> dict[int, int]:
    """{layer: its window in tokens, whole blocks} for the layers with attention, when the long window is `window`."""
    long = window_blocks(window, config.block_size) * config.block_size
    short = short_window(window, config.block_size)
    return {i: short if config.is_short_window(i) else long
            for i in range(config.num_layers) if i not in config.no_attention_layers}


def receptive_field(config: GPTConfig, window: int) -> int:
    """How many tokens before a position can change the model's output there (document starts aside). A window of
    W tokens (whole blocks of S) reaches from the last token of a block to the first of the block W / S - 1 blocks
    back; so the farthest path starts at the end of a block, each layer but one moves it W - S back, block end to
    block end, and one layer W - 1, to a block's first token: sum(W - S) + S - 1. The smear reaches one token
    further."""
    S = config.block_size
    windows = attention_windows(config, window).values()
    return (sum(w - S for w in windows) + S - 1 if windows else 0) + int(config.smear)


def mean_context(seq_len: int, window: int, block_size: int) -> float:
    """Mean number of keys a query attends under the causal window of whole blocks (documents ignored): the query at
    position p sees its p + 1 causal keys, less the whole blocks before its window. Counted per block, not per query
    (a loop over 384 blocks instead of 49,152 queries), in integers: the division is the one rounding."""
    earlier_blocks = window_blocks(window, block_size) - 1  # the window's blocks before the query's own
    keys = seq_len * (seq_len + 1) // 2
    for block in range(-(-seq_len // block_size)):
        queries = min(block_size, seq_len - block * block_size)  # the last block may be short
        keys -= queries * max(block - earlier_blocks, 0) * block_size
    return keys / seq_len


def flops_per_token(config: GPTConfig, seq_len: int, window: int) -> float:
    """Training FLOPs per token (forward + backward) for MFU, in the PaLM convention (Chowdhery et al. 2022, app. B):

        6 * N_matmul  +  sum over layers of 12 * A * C_layer

    N_matmul counts the weights used in matmuls (block matrices and the head; embedding lookups are free): 2 FLOPs
    per weight per token forward, 4 backward. Attention's QK^T and AV each cost 2 * A * C forward per token, times
    3 for training, where C is the mean number of attended keys under the layer's causal window (`mean_context`;
    document boundaries are data-dependent and ignored, so this is an upper bound on useful work).
    """
    D, A = config.model_dim, config.num_heads * config.head_dim
    windows = attention_windows(config, window)
    mlp_layers = config.num_layers - len(config.no_mlp_layers)
    n_matmul = (len(windows) * (3 * A * D + D * A) + mlp_layers * 2 * config.mlp_ratio * D * D
                + config.vocab_size * D)
    return 6 * n_matmul + sum(12 * A * mean_context(seq_len, w, config.block_size) for w in windows.values())
