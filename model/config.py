"""The model's shape and options (GPTConfig) and what follows from them alone: windows per layer, receptive field,
FLOPs per token. No torch, so that the run's flag checks can use them before torch loads."""

import math
from dataclasses import dataclass


def value_embed_layers(k: int, num_value_embeds: int, num_layers: int) -> set[int]:
    """The layers value embedding k feeds: k and L - n + k (record #28)."""
    return {k, num_layers - num_value_embeds + k}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50,257 padded to a multiple of 128
    num_layers: int = 12  # GPT-2 small depth
    model_dim: int = 768  # GPT-2 small width
    num_heads: int = 6  # modded-nanogpt's 6 heads of 128
    head_dim: int = 128  # a multiple of 4 (half-truncated RoPE)
    mlp_ratio: int = 4  # MLP width / model width
    # cap * tanh(logits / cap) (Gemma 2) at modded-nanogpt's value
    logit_softcap: float = 15.0
    num_value_embeds: int = 3  # value embeddings of the first and last layers (record #28)
    value_residual: bool = False  # layer 0's values in every later layer's (Zhou et al. 2024)
    rope_base: float = 1024.0  # slowest rotary frequency 1/rope_base (modded-nanogpt)
    attn_scale: float = 0.12  # softmax scale (modded-nanogpt, tuned with QK-norm)
    block_size: int = 128  # FlexAttention tile; sequence lengths are multiples of it
    bos_id: int = 50256  # <|endoftext|>, opening every document
    # layers with the short (half) window; None: record #28's, long on every 4th layer from each end
    short_window_layers: tuple[int, ...] | None = None
    # blocks without an MLP / without attention (record #28 drops layer 7's attention)
    no_mlp_layers: tuple[int, ...] = ()
    no_attention_layers: tuple[int, ...] = ()
    backout: bool = False  # add a learned multiple of the mid-stream to the output (nanochat)
    # long-window layers' keys take the previous position's stationary dims: one-layer induction (modded-nanogpt)
    key_offset: bool = False

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

    def offsets_keys(self, layer: int) -> bool:
        """Whether `layer`'s attention offsets its keys (model.gpt.offset_keys): with key_offset, the long ones."""
        return self.key_offset and layer not in self.no_attention_layers and not self.is_short_window(layer)

    def value_embed_index(self, layer: int) -> int | None:
        """The value embedding `layer` uses, or None (value_embed_layers)."""
        n, L = self.num_value_embeds, self.num_layers
        if layer < n:
            return layer
        if layer >= L - n:
            return layer - (L - n)
        return None


def short_window(window, block_size: int):
    """Half the long window (int or tensor), rounded down to whole blocks, at least one."""
    blocks = window // 2 // block_size
    return (blocks.clamp_min(1) if hasattr(blocks, "clamp_min") else max(blocks, 1)) * block_size


def window_blocks(window, block_size: int):
    """ceil(window / block_size): the blocks a window spans, the query's own included."""
    return (window + block_size - 1) // block_size


def attention_windows(config: GPTConfig, window: int) -> dict[int, int]:
    """{layer: its window in tokens, whole blocks} for the layers with attention."""
    long = window_blocks(window, config.block_size) * config.block_size
    short = short_window(window, config.block_size)
    return {i: short if config.is_short_window(i) else long
            for i in range(config.num_layers) if i not in config.no_attention_layers}


def receptive_field(config: GPTConfig, window: int) -> int:
    """How many tokens before a position can change its output: from the last position of a block, down the layers,
    each reaches the first key of its window's first block, and an offsetting layer's key the position before it
    too. Without offsets sum(W - S) + S - 1 over the layers' windows."""
    S = config.block_size
    p = -1  # the query, the last position of a block
    for layer, w in sorted(attention_windows(config, window).items(), reverse=True):
        p = (p // S - w // S + 1) * S - config.offsets_keys(layer)
    return -1 - p


def mean_context(seq_len: int, window: int, block_size: int) -> float:
    """Mean number of keys a query attends under the window (documents ignored), counted per block."""
    earlier_blocks = window_blocks(window, block_size) - 1  # the window's blocks before the query's own
    keys = seq_len * (seq_len + 1) // 2
    for block in range(-(-seq_len // block_size)):
        queries = min(block_size, seq_len - block * block_size)  # the last block may be short
        keys -= queries * max(block - earlier_blocks, 0) * block_size
    return keys / seq_len


def flops_per_token(config: GPTConfig, seq_len: int, window: int) -> float:
    """Training FLOPs per token in the PaLM convention (Chowdhery et al. 2022, app. B): 6 N_matmul + sum over layers
    of 12 A C, C the mean attended keys (`mean_context`)."""
    D, A = config.model_dim, config.num_heads * config.head_dim
    windows = attention_windows(config, window)
    mlp_layers = config.num_layers - len(config.no_mlp_layers)
    n_matmul = (len(windows) * (3 * A * D + D * A) + mlp_layers * 2 * config.mlp_ratio * D * D
                + config.vocab_size * D)
    return 6 * n_matmul + sum(12 * A * mean_context(seq_len, w, config.block_size) for w in windows.values())
