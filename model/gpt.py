"""The speedrun GPT in plain PyTorch: this file is the architecture.

    tokens -> embedding -> x0 = norm(rows)
           -> U-net of blocks: block i < L/2 feeds block L-1-i through a learned skip weight
           -> norm -> untied head -> c tanh(z / c) softcap -> cross-entropy

    block: x = l0 x + l1 x0;  x += Attention(norm(x));  x += MLP(norm(x))

Attention has QK-norm, half-truncated rotary embeddings, value embeddings, document-causal sliding windows
(model/attention.py), a sigmoid gate per head and, with key_offset, offset keys in long-window layers (offset_keys);
the MLP is ReLU² (So et al. 2021); both output projections start at zero. Norms are RMSNorm without a gain; fp32
weights are cast to the activations' dtype where used.

Shape legend: B batch rows, T tokens, D model dim, H heads, d head dim, A = H d attention width, F MLP width,
V vocab, P = d / 2 rotary pairs, G gate channels, N = B T tokens.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from model.attention import attend, block_mask, dense_mask, document_ids
from model.config import GPTConfig, short_window

IGNORE_INDEX = -100  # targets equal to this carry no loss (F.cross_entropy's default)
GATE_FRACTION = 64  # the attention gate reads the first D / 64 channels (record #28)
BACKOUT_INIT = 0.2  # the backout starts by taking out 0.2 of the mid-stream (nanochat)
ATTENTION_BACKENDS = ("flex", "sdpa")
FLEX_MIN_HEAD_DIM = 16  # FlexAttention's GPU kernels need head dims of at least 16
REDUCTIONS = ("mean", "sum", "none")


def norm(x: Tensor) -> Tensor:
    """RMSNorm over the last dim, without a learned gain (modded-nanogpt)."""
    return F.rms_norm(x, (x.size(-1),))


def rotary_tables(seq_len: int, head_dim: int, base: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin (T, P) in fp32 for half-truncated RoPE: half of the pairs turn, at frequencies 1 to 1/base; the
    others stay still and carry position-free content."""
    turning = head_dim // 4
    freqs_P = torch.cat([base ** -torch.linspace(0, 1, turning, dtype=torch.float32, device=device),
                         torch.zeros(head_dim // 2 - turning, dtype=torch.float32, device=device)])
    angles_TP = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * freqs_P[None, :]
    return angles_TP.cos(), angles_TP.sin()


def apply_rotary(x_BTHd: Tensor, cos_TP: Tensor, sin_TP: Tensor) -> Tensor:
    """Rotates each pair (x[j], x[j + P]) by angle[t, j], in fp32."""
    x1, x2 = x_BTHd.float().chunk(2, dim=-1)
    cos, sin = cos_TP[None, :, None, :], sin_TP[None, :, None, :]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x_BTHd)


def prepare_qkv(qkv_BT3Hd: Tensor, cos_TP: Tensor, sin_TP: Tensor, lambdas: Tensor, v_first_BTHd: Tensor | None,
                ve_BTA: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (B, T, H, d) from the projection's output (B, T, 3H, d): q and k normed (QK-norm, Dehghani et al.
    2023) and rotated; v = own v + first v_first + embed ve, (own, first, embed) = lambdas, absent terms left out
    (v_first: layer 0's values, the value residual of Zhou et al. 2024; ve: a value embedding)."""
    q_BTHd, k_BTHd, v_BTHd = qkv_BT3Hd.chunk(3, dim=2)
    q_BTHd = apply_rotary(norm(q_BTHd), cos_TP, sin_TP)
    k_BTHd = apply_rotary(norm(k_BTHd), cos_TP, sin_TP)
    own, first, embed = lambdas.type_as(qkv_BT3Hd).unbind()
    v_BTHd = own * v_BTHd
    if v_first_BTHd is not None:
        v_BTHd = v_BTHd + first * v_first_BTHd
    if ve_BTA is not None:
        v_BTHd = v_BTHd + embed * ve_BTA.view(v_BTHd.shape)
    return q_BTHd, k_BTHd, v_BTHd


def offset_keys(k_BTHd: Tensor, before_B1Hd: Tensor | None = None) -> Tensor:
    """A new (B, T, H, d): k with each position's stationary dims (the pairs rotary_tables keeps still, d/4 .. d/2 - 1
    and 3d/4 .. d - 1) taken from the position before, position 0's from `before` (B, 1, H, d), or its own without
    it. A query can then match a key by the token before it: one-layer induction (modded-nanogpt's key offset)."""
    d = k_BTHd.size(-1)
    earlier_BTHd = torch.cat((k_BTHd[:, :1] if before_B1Hd is None else before_B1Hd, k_BTHd[:, :-1]), dim=1)
    stationary_d = torch.arange(d, device=k_BTHd.device) % (d // 2) >= d // 4
    return torch.where(stationary_d, earlier_BTHd, k_BTHd)


def uniform_(w: Tensor, std: float) -> None:
    bound = math.sqrt(3.0) * std  # a uniform on [-b, b] has std b / sqrt(3)
    nn.init.uniform_(w, -bound, bound)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int, scale: float, offsets_keys: bool = False):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.offsets_keys = num_heads, head_dim, scale, offsets_keys
        attn_dim = num_heads * head_dim
        # q, k, v as one (3, A, D) parameter; Muon orthogonalises each matrix
        self.qkv_w = nn.Parameter(torch.empty(3, attn_dim, dim))
        self.proj_w = nn.Parameter(torch.empty(dim, attn_dim))
        # weights of (own values, layer 0's values, value embedding)
        self.value_lambdas = nn.Parameter(torch.empty(3))
        # each head's output times sigmoid(w_h . x[:G]) (record #28)
        self.gate_w = nn.Parameter(torch.empty(num_heads, max(1, dim // GATE_FRACTION)))

    def init_weights(self) -> None:
        uniform_(self.qkv_w, 0.5 * self.qkv_w.size(-1) ** -0.5)  # std 0.5 / sqrt(fan_in), modded-nanogpt
        nn.init.zeros_(self.proj_w)  # each block starts as the identity
        nn.init.constant_(self.value_lambdas, 0.5)
        nn.init.zeros_(self.gate_w)  # every gate starts half open

    def attend_and_project(self, q_BTHd: Tensor, k_BTHd: Tensor, v_BTHd: Tensor, gate_in_BTG: Tensor,
                           mask: BlockMask | Tensor) -> Tensor:
        """Attention of q, k, v (B, T, H, d) under `mask`, heads gated by sigmoid(w_h . gate_in), to (B, T, D)."""
        y_BHTd = attend(q_BTHd.transpose(1, 2), k_BTHd.transpose(1, 2), v_BTHd.transpose(1, 2), mask, self.scale)
        return self.gate_and_project(y_BHTd.transpose(1, 2), gate_in_BTG)

    def gate_and_project(self, y_BTHd: Tensor, gate_in_BTG: Tensor) -> Tensor:
        """The heads' outputs (B, T, H, d), each gated by sigmoid(w_h . gate_in), projected to (B, T, D)."""
        gate_BTH = torch.sigmoid(F.linear(gate_in_BTG, self.gate_w.type_as(gate_in_BTG)))
        y_BTA = (y_BTHd * gate_BTH[..., None]).flatten(2)
        return F.linear(y_BTA, self.proj_w.type_as(y_BTA))

    def forward(self, x_BTD: Tensor, v_first_BTHd: Tensor | None, ve_BTA: Tensor | None, cos_TP: Tensor,
                sin_TP: Tensor, mask: BlockMask | Tensor) -> tuple[Tensor, Tensor]:
        """(output (B, T, D), this layer's values (B, T, H, d)) for the normed x."""
        B, T, _ = x_BTD.shape
        qkv_BT3Hd = F.linear(x_BTD, self.qkv_w.flatten(0, 1).type_as(x_BTD)).view(B, T, 3 * self.num_heads, -1)
        q, k, v = prepare_qkv(qkv_BT3Hd, cos_TP, sin_TP, self.value_lambdas, v_first_BTHd, ve_BTA)
        if self.offsets_keys:
            k = offset_keys(k)
        return self.attend_and_project(q, k, v, x_BTD[..., :self.gate_w.size(1)], mask), v


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        # both stored (D, F) as record #28's c_fc: one Muon stack, with the tall-matrix scale 1 its learning rate uses
        self.fc_w = nn.Parameter(torch.empty(dim, hidden_dim))
        self.proj_w = nn.Parameter(torch.empty(dim, hidden_dim))

    def init_weights(self) -> None:
        uniform_(self.fc_w, 0.5 * self.fc_w.size(0) ** -0.5)
        nn.init.zeros_(self.proj_w)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return F.relu(x_BTD @ self.fc_w.type_as(x_BTD)).square() @ self.proj_w.type_as(x_BTD).t()


def x0_mix(x_BTD: Tensor, x0_BTD: Tensor, lambdas: Tensor) -> Tensor:
    """lambdas[0] x + lambdas[1] x0: each block's shortcut to the normed embedding x0."""
    mix = lambdas.type_as(x_BTD)
    return mix[0] * x_BTD + mix[1] * x0_BTD


class Block(nn.Module):
    """x0 mix, attention, MLP, either of which may be absent (record #28 drops layer 7's attention). Per-layer
    inputs arrive as arguments, so blocks share one compiled graph per presence pattern."""

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        D = config.model_dim
        has_attention = layer not in config.no_attention_layers
        self.attn = self.make_attention(D, config.num_heads, config.head_dim, config.attn_scale,
                                        config.offsets_keys(layer)) if has_attention else None
        self.mlp = self.make_mlp(D, config.mlp_ratio * D) if layer not in config.no_mlp_layers else None
        # only the layer whose values later layers read returns them
        self.shares_values = has_attention and layer == 0 and config.value_residual
        self.lambdas = nn.Parameter(torch.empty(2))  # weights of (residual stream, x0): modded-nanogpt's shortcut

    make_attention, make_mlp = Attention, MLP  # model/fast's blocks build their own parts

    def init_weights(self) -> None:
        for part in (self.attn, self.mlp):
            if part is not None:
                part.init_weights()
        with torch.no_grad():
            self.lambdas.copy_(torch.tensor([1.0, 0.0]))  # start as a plain residual stream

    def forward(self, x_BTD: Tensor, x0_BTD: Tensor, v_first_BTHd: Tensor | None, ve_BTA: Tensor | None,
                cos_TP: Tensor, sin_TP: Tensor, mask: BlockMask | Tensor) -> tuple[Tensor, Tensor | None]:
        """(the residual stream after the block (B, T, D), its values if it shares them, else None)."""
        x_BTD = x0_mix(x_BTD, x0_BTD, self.lambdas)
        v_BTHd = None
        if self.attn is not None:
            y_BTD, v_BTHd = self.attn(norm(x_BTD), v_first_BTHd, ve_BTA, cos_TP, sin_TP, mask)
            x_BTD = x_BTD + y_BTD
        if self.mlp is not None:
            x_BTD = x_BTD + self.mlp(norm(x_BTD))
        return x_BTD, v_BTHd if self.shares_values else None


def capped(logits: Tensor, softcap: float) -> Tensor:
    """softcap * tanh(logits / softcap) (Gemma 2) in fp32 or wider."""
    return softcap * torch.tanh(logits.to(torch.promote_types(logits.dtype, torch.float32)) / softcap)


class Head(nn.Module):
    """Final norm, untied projection to the vocabulary, tanh softcap, cross-entropy in fp32."""

    def __init__(self, dim: int, vocab_size: int, softcap: float):
        super().__init__()
        self.softcap = softcap
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))

    def logits(self, x_BTD: Tensor) -> Tensor:
        """Capped fp32 logits (B, T, V); the product runs in x's dtype."""
        return capped(F.linear(norm(x_BTD), self.weight.type_as(x_BTD)), self.softcap)

    def forward(self, x_BTD: Tensor, targets_BT: Tensor, reduction: str) -> Tensor:
        """Cross-entropy over targets != IGNORE_INDEX: a scalar, or (B, T) for "none"."""
        loss_N = F.cross_entropy(self.logits(x_BTD).flatten(0, 1), targets_BT.flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="none")
        return reduce_loss(loss_N, targets_BT, reduction)


def reduce_loss(loss_N: Tensor, targets_BT: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return loss_N.view_as(targets_BT)
    if reduction == "sum":
        return loss_N.sum()
    return loss_N.sum() / (targets_BT != IGNORE_INDEX).sum()


class GPT(nn.Module):
    """The speedrun GPT. Construction declares shapes only (it may run on the meta device); `init_weights()` draws
    the values from the default generator. `configure(device)` picks SDPA and fp32 on the CPU (FlexAttention has no
    CPU backward), FlexAttention and bf16 activations on GPUs."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.attention_backend = "flex"
        self.compute_dtype = torch.bfloat16
        D, V, L = config.model_dim, config.vocab_size, config.num_layers
        attn_dim = config.num_heads * config.head_dim
        # _weight=empty: no random init at construction
        self.embed = nn.Embedding(V, D, _weight=torch.empty(V, D))
        self.value_embeds = nn.ModuleList([nn.Embedding(V, attn_dim, _weight=torch.empty(V, attn_dim))
                                           for _ in range(config.num_value_embeds)])
        self.blocks = nn.ModuleList([self.make_block(config, i) for i in range(L)])
        self.skip_weights = nn.Parameter(torch.empty(L // 2)) if L >= 2 else None  # U-net skips
        # the backout (nanochat): plus a learned multiple of the middle block's input
        self.backout_weight = nn.Parameter(torch.empty(1)) if config.backout else None
        self.head = self.make_head(D, V, config.logit_softcap)
        self.register_load_state_dict_pre_hook(_backend_state)

    make_block, make_head = Block, Head  # model/fast's FastGPT builds its own

    def init_weights(self) -> None:
        nn.init.normal_(self.embed.weight)  # N(0, 1), as in modded-nanogpt
        for emb in self.value_embeds:
            nn.init.normal_(emb.weight)
        for block in self.blocks:
            block.init_weights()
        if self.skip_weights is not None:
            nn.init.ones_(self.skip_weights)
        if self.backout_weight is not None:
            nn.init.constant_(self.backout_weight, -BACKOUT_INIT)
        nn.init.zeros_(self.head.weight)  # zero-init head: the first loss is exactly ln(V)

    def configure(self, device: torch.device) -> "GPT":
        """Sets the attention backend and activation dtype for `device`; returns the model."""
        if device.type == "cpu":
            self.attention_backend, self.compute_dtype = "sdpa", torch.float32
        return self

    def compile_regions(self, **kwargs) -> None:
        """torch.compile each block and the head (regional compilation)."""
        kwargs = {"dynamic": False, "fullgraph": True} | kwargs
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(self.blocks))
        for block in self.blocks:
            block.compile(**kwargs)
        self.head.compile(**kwargs)

    def param_groups(self) -> list[dict]:
        """Optimizer groups: Muon for the blocks' matrices ("hidden"), Adam for the rest; none empty."""
        hidden, scalar = [], [p for p in (self.skip_weights, self.backout_weight) if p is not None]
        for block in self.blocks:
            for p in block.parameters():
                (hidden if p.ndim >= 2 else scalar).append(p)
        groups = [
            {"kind": "muon", "name": "hidden", "params": hidden},
            {"kind": "adam", "name": "embed", "params": [self.embed.weight]},
            {"kind": "adam", "name": "value_embed", "params": [emb.weight for emb in self.value_embeds]},
            {"kind": "adam", "name": "head", "params": [self.head.weight]},
            {"kind": "adam", "name": "scalar", "params": scalar},
        ]
        groups = [g for g in groups if g["params"]]
        grouped = [id(p) for g in groups for p in g["params"]]
        assert len(grouped) == len(set(grouped)) and set(grouped) == {id(p) for p in self.parameters()}, \
            "every parameter must be in exactly one group"
        return groups

    def scale_histories(self) -> list[Tensor]:
        """Buffers the backward updates per rank that ranks must agree on (model/fast's FP8 scales)."""
        return []

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def check_inputs(self, inputs_BT: Tensor) -> None:
        """A ValueError for a sequence the attention backend cannot take."""
        T = inputs_BT.size(1)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}: use one of {ATTENTION_BACKENDS}")
        if self.attention_backend == "flex":
            if T % self.config.block_size:
                raise ValueError(f"sequence length {T} is not a multiple of the attention block size "
                                 f"{self.config.block_size}: FlexAttention works in whole blocks")
            if inputs_BT.device.type == "cpu" and torch.is_grad_enabled():
                raise ValueError("FlexAttention has no CPU backward: train on the CPU with attention_backend "
                                 "'sdpa' (configure(device) sets it), or run under torch.no_grad()")
            if inputs_BT.is_cuda and self.config.head_dim < FLEX_MIN_HEAD_DIM:
                raise ValueError(f"head_dim={self.config.head_dim}: FlexAttention's GPU kernels need at least "
                                 f"{FLEX_MIN_HEAD_DIM}; use a larger head_dim")

    def attention_inputs(self, inputs_BT: Tensor, window: Tensor) -> tuple[dict, Tensor, Tensor]:
        """({is_short_window: mask}, cos, sin (T, P)) for one batch."""
        cfg = self.config
        doc_BT = document_ids(inputs_BT, cfg.bos_id)
        masks = {short: self.make_mask(doc_BT, w)
                 for short, w in ((False, window), (True, short_window(window, cfg.block_size)))}
        return masks, *rotary_tables(inputs_BT.size(1), cfg.head_dim, cfg.rope_base, inputs_BT.device)

    def make_mask(self, doc_BT: Tensor, window: Tensor) -> BlockMask | Tensor:
        """The mask of one window for documents doc_BT, in the attention backend's form."""
        make = block_mask if self.attention_backend == "flex" else dense_mask
        return make(doc_BT, window, self.config.block_size)

    def embed_stream(self, inputs_BT: Tensor) -> tuple[Tensor, list[Tensor], list[list[Tensor]]]:
        """(the stream's start (B, T, D), x0 for each block, each value embedding's rows (B, T, A) once for each of
        its two layers), in compute_dtype: x0 = norm(the token embedding's rows) is also the stream's start."""
        x0_BTD = norm(self.embed(inputs_BT).to(self.compute_dtype))
        ves_BTA = [emb(inputs_BT).to(self.compute_dtype) for emb in self.value_embeds]
        return x0_BTD, [x0_BTD] * self.config.num_layers, [[ve_BTA, ve_BTA] for ve_BTA in ves_BTA]

    @staticmethod
    def skip_add(x_BTD: Tensor, s_BTD: Tensor, w: Tensor) -> Tensor:
        """x + w s: a U-net skip (w a 0-D weight), and the backout."""
        return x_BTD + w.type_as(x_BTD) * s_BTD

    def hidden_states(self, inputs_BT: Tensor, window: Tensor) -> Tensor:
        """The residual stream after the last block (B, T, D) in compute_dtype, from token ids (B, T); window is the
        long attention window in tokens, a 0-D int64 tensor so that growing it never recompiles."""
        cfg = self.config
        self.check_inputs(inputs_BT)
        window = torch.as_tensor(window, dtype=torch.int64, device=inputs_BT.device)
        masks, cos_TP, sin_TP = self.attention_inputs(inputs_BT, window)
        x_BTD, x0s_BTD, ves_BTA = self.embed_stream(inputs_BT)
        v_first_BTHd, skips = None, []
        L, num_skips = cfg.num_layers, cfg.num_layers // 2
        for i, block in enumerate(self.blocks):
            if i >= L - num_skips:  # second half: add the mirrored first-half output (U-net)
                x_BTD = self.skip_add(x_BTD, skips.pop(), self.skip_weights[i - (L - num_skips)])
            if i == L // 2:
                mid_BTD = x_BTD  # what the middle block reads: the backout's
            ve_index = cfg.value_embed_index(i)
            ve_BTA = None if ve_index is None else ves_BTA[ve_index].pop()
            x_BTD, v_BTHd = block(x_BTD, x0s_BTD[i], v_first_BTHd, ve_BTA, cos_TP, sin_TP,
                                  masks[cfg.is_short_window(i)])
            if v_BTHd is not None:
                v_first_BTHd = v_BTHd
            if i < num_skips:
                skips.append(x_BTD)
        if self.backout_weight is not None:
            x_BTD = self.skip_add(x_BTD, mid_BTD, self.backout_weight[0])
        return x_BTD

    def logits(self, inputs_BT: Tensor, window: Tensor) -> Tensor:
        """Capped fp32 logits (B, T, V)."""
        return self.head.logits(self.hidden_states(inputs_BT, window))

    def forward(self, inputs_BT: Tensor, targets_BT: Tensor, window: Tensor, reduction: str = "mean") -> Tensor:
        """Cross-entropy in fp32 over targets (B, T) != IGNORE_INDEX, reduced as Head's."""
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction={reduction!r}: use one of {REDUCTIONS}")
        return self.head(self.hidden_states(inputs_BT, window), targets_BT, reduction)

    @torch.no_grad()
    def scored_loss_sum(self, inputs_BT: Tensor, targets_BT: Tensor, window: Tensor) -> Tensor:
        """The summed loss of one evaluation batch; the head, most of a small model's work, sees only scored rows."""
        hidden_BTD = self.hidden_states(inputs_BT, window)
        scored_BT = targets_BT != IGNORE_INDEX
        return self.head(hidden_BTD[scored_BT][None], targets_BT[scored_BT][None], "sum")


def _backend_state(module: GPT, state: dict, prefix: str, *args) -> None:
    """Drops the checkpoint's `*.grad_amax` buffers (model/fast) that the model lacks; zeros those the checkpoint
    lacks."""
    own = {prefix + name for name, _ in module.named_buffers() if name.endswith("grad_amax")}
    for key in [k for k in state if k.endswith("grad_amax") and k not in own]:
        del state[key]
    for key in own:
        state.setdefault(key, torch.zeros(()))
