"""The speedrun GPT (modded-nanogpt style): the model and its parameter groups. Its config (GPTConfig), the window
rules and the FLOPs per token for MFU are in model/config.py.

Shape legend: B batch rows, T tokens, D model dim, H heads, d head dim, A = H * d attention width, V vocab,
P = d // 2 rotary pairs.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.attention import block_mask, dense_mask, document_ids
from model.config import GPTConfig, short_window
from model.head import Head
from model.layers import (SMEAR_GATE_CHANNELS, Block, FanOut, SkipAdd, TableRows, add_all, norm, rotary_tables,
                          smear, sort_ids)

REDUCTIONS = ("mean", "sum", "none")
BACKENDS = ("flex", "sdpa")
FLEX_MIN_HEAD_DIM = 16  # FlexAttention's GPU kernels: "embedding dimension ... must be at least 16"
BACKOUT_INIT = 0.2  # the backout takes out 0.2 of the mid-stream at init (nanochat's backout_lambda)
# Inductor options under which two processes compiling the same regions make the same kernels. By default three of
# its choices are made by timing candidates on the GPU at a process's first run, so they can differ between processes,
# and all change results: whether to pad a matmul's odd sizes (the attention gate's weight gradient, (6, 49152) @
# (49152, 12), was padded to (8, 49152) @ (49152, 16) in one process and not in the other); a reduction's launch
# configuration, whose block over the reduced dim orders its sum (the MLP's norm fused with x's transposed e4m3 copy
# took blocks of 512 in one process and of 32 in the other); and, for a reduction whose threads use many registers, a
# copy with half the block that dynamic_scale_rblock adds as a second candidate. On the H200, with the first two off,
# processes still fell into variants that each kept (4 processes: 2 variants); with the third off too, six processes
# (one cold, five on its cache) gave the same loss, gradients and buffers, two 12-step runs started at once the same
# losses at every step, and the step took 569.9 ms against 570.2 without it (bench/results/README.md, sections
# de9c191 and d00ab85).
REPEATABLE_COMPILE = {"shape_padding": False, "test_configs.force_filter_reduction_configs": True,
                      "dynamic_scale_rblock": False}


class GPT(nn.Module):
    """The speedrun GPT.

    Construction declares shapes only (it may run under `torch.device("meta")`, then `to_empty(device=...)`);
    `init_weights()` draws the values from the default generator, so seed before calling it.

    Set from outside: `attention_backend` ("flex": FlexAttention, forward-only on CPU; "sdpa": explicit mask,
    small T, for CPU training) and `compute_dtype` (activation dtype, bf16 by default; fp32 for exact checks).

    Compilation is regional and applied from outside (`compile_regions()` does exactly this, each compile with
    options=REPEATABLE_COMPILE too, and the masks' with persistent reductions off as well):
        model.embed_inputs = torch.compile(model.embed_inputs, dynamic=False, fullgraph=True)
        model.attention_inputs = torch.compile(model.attention_inputs, dynamic=False, fullgraph=True)
        for block in model.blocks: block.compile(dynamic=False, fullgraph=True)
        model.head.compile(dynamic=False, fullgraph=True)
        model.add_gradients = torch.compile(model.add_gradients, dynamic=False, fullgraph=True)
        model.norm_rows = torch.compile(model.norm_rows, dynamic=False, fullgraph=True)
        model.smear_rows = torch.compile(model.smear_rows, dynamic=False, fullgraph=True)  # with config.smear
    All blocks share one signature, (x, x0, v_first, ve, cos, sin, mask), so they share compiled code, one graph per
    presence pattern; every per-step value (the window) reaches them as a tensor, so schedules never recompile.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.attention_backend = "flex"
        self.compute_dtype = torch.bfloat16
        self.add_gradients = add_all  # sums x0's gradients (layers.FanOut); compile_regions compiles it
        self.norm_rows = norm  # x0 from the embedding's rows (hidden_states); compile_regions compiles it
        self.smear_rows = smear  # with config.smear, before norm_rows; compile_regions compiles it
        D, V, L = config.model_dim, config.vocab_size, config.num_layers
        attn_dim = config.num_heads * config.head_dim
        # _weight=empty: skip nn.Embedding's own random init, so construction neither costs time nor draws from
        # the generator (init_weights() alone decides the values)
        self.embed = nn.Embedding(V, D, _weight=torch.empty(V, D))
        self.value_embeds = nn.ModuleList([nn.Embedding(V, attn_dim, _weight=torch.empty(V, attn_dim))
                                           for _ in range(config.num_value_embeds)])
        self.blocks = nn.ModuleList([Block(D, config.num_heads, config.head_dim, config.mlp_ratio, config.attn_scale,
                                           attention=i not in config.no_attention_layers,
                                           mlp=i not in config.no_mlp_layers, attn_gate=config.attn_gate,
                                           shares_values=i == 0 and config.value_residual)
                                     for i in range(L)])
        # U-net skips (modded-nanogpt): block i < L//2 feeds block L-1-i through a learned weight; a one-block
        # model has none (an empty parameter would never get a gradient)
        self.skip_weights = nn.Parameter(torch.empty(L // 2)) if L >= 2 else None
        # the smear's gate over a row's first channels, and its weight: both zero at init, so a model with the smear
        # starts as one without (sigmoid(0) = 1/2 times a weight 0); the weight's gradient opens it
        self.smear_gate = nn.Parameter(torch.empty(min(SMEAR_GATE_CHANNELS, D))) if config.smear else None
        self.smear_lambda = nn.Parameter(torch.empty(1)) if config.smear else None
        # the backout (nanochat, later modded-nanogpt records): the stream entering block L // 2, times this weight,
        # joins the last block's output, so the head can take out what the first half wrote
        self.backout_weight = nn.Parameter(torch.empty(1)) if config.backout else None
        self.head = Head(D, V, config.logit_softcap)  # untied from the embedding: its own storage

    def init_weights(self) -> None:
        nn.init.normal_(self.embed.weight)  # N(0, 1), nn.Embedding's default as in modded-nanogpt
        for emb in self.value_embeds:
            nn.init.normal_(emb.weight)
        for block in self.blocks:
            block.init_weights()
        if self.skip_weights is not None:
            nn.init.ones_(self.skip_weights)
        if self.config.smear:
            nn.init.zeros_(self.smear_gate)
            nn.init.zeros_(self.smear_lambda)
        if self.config.backout:
            nn.init.constant_(self.backout_weight, -BACKOUT_INIT)
        nn.init.zeros_(self.head.weight)  # zero-init head (modded-nanogpt): the first loss is exactly ln(V)

    def compile_regions(self, **kwargs) -> None:
        """Compile the embedding lookups, the masks, x0's norm, each block and the head separately (regional
        compilation); kwargs go to torch.compile. Compiled, the four lookups and their casts are one kernel."""
        kwargs = {"dynamic": False, "fullgraph": True} | kwargs
        takes_options = kwargs.get("backend", "inductor") == "inductor" and "mode" not in kwargs  # not with a mode
        if takes_options:
            kwargs = kwargs | {"options": REPEATABLE_COMPILE | kwargs.get("options", {})}
        # All blocks share Block.forward, and dynamo's recompile limit (8) counts its graphs: one per presence
        # pattern of the optional inputs, for training and again under no_grad (an evaluation). A layer is at most
        # one pattern, so two graphs per layer always suffice, whatever inputs a block may go without.
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 2 * self.config.num_layers)
        self.embed_inputs = torch.compile(self.embed_inputs, **kwargs)
        # Eager, the masks and rotary tables are some 90 small kernels per micro-batch, each shorter than its launch,
        # and the GPU waited for them one by one; compiled, the step took 6.5 ms less on the H200 (30 steps' train
        # time, bench/results/README.md, 6639e50). With persistent reductions, which sort rows of up to 512 in one
        # Triton program, this graph took 110 s to compile cold there; without them 11 s, its sorts aten.sort calls.
        mask_kwargs = kwargs
        if takes_options:
            mask_kwargs = kwargs | {"options": kwargs["options"] | {"triton.persistent_reductions": False}}
        self.attention_inputs = torch.compile(self.attention_inputs, **mask_kwargs)
        for block in self.blocks:
            block.compile(**kwargs)
        self.head.compile(**kwargs)
        self.add_gradients = torch.compile(self.add_gradients, **kwargs)  # one kernel reads all, writes the sum once
        self.norm_rows = torch.compile(self.norm_rows, **kwargs)  # one kernel each way
        if self.config.smear:
            self.smear_rows = torch.compile(self.smear_rows, **kwargs)

    def param_groups(self) -> list[dict]:
        """Parameters tagged for the optimizer, chosen by module structure: Muon for every matrix inside the
        blocks ("hidden"), Adam for "embed", "value_embed", "head" and "scalar" (mixing weights). Empty groups
        are left out."""
        hidden = []
        extras = (self.skip_weights, self.smear_gate, self.smear_lambda, self.backout_weight)
        scalar = [p for p in extras if p is not None]
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

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hidden_states(self, inputs_BT: Tensor, window: Tensor) -> Tensor:
        """The residual stream after the last block (B, T, D), in compute_dtype."""
        cfg = self.config
        B, T = inputs_BT.shape
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}: use one of {BACKENDS}")
        window = torch.as_tensor(window, dtype=torch.int64, device=inputs_BT.device)
        if self.attention_backend == "flex":
            if T % cfg.block_size:
                raise ValueError(f"sequence length {T} is not a multiple of the attention block size "
                                 f"{cfg.block_size}: pick a seq_len that is (FlexAttention works in whole blocks)")
            if inputs_BT.device.type == "cpu" and torch.is_grad_enabled():
                raise ValueError("FlexAttention has no CPU backward: set model.attention_backend = 'sdpa' to train "
                                 "on CPU, or run under torch.no_grad()")
            if inputs_BT.is_cuda and cfg.head_dim < FLEX_MIN_HEAD_DIM:  # else a lowering error deep in inductor
                raise ValueError(f"head_dim={cfg.head_dim}: FlexAttention's GPU kernels need at least "
                                 f"{FLEX_MIN_HEAD_DIM}; use a larger head_dim")
        masks, cos_TP, sin_TP = self.attention_inputs(inputs_BT, window)
        rows_BTD, *ves_BTA = self.embed_inputs(inputs_BT)
        # the rows' gradients go straight into the tables' (TableRows); each value embedding feeds two layers
        # (GPTConfig.value_embed_index): one view of its rows for each, whose two gradients are added together
        if torch.is_grad_enabled():
            sorted_ids_N, order_N = sort_ids(inputs_BT)
            (rows_BTD,) = TableRows.apply(rows_BTD, self.embed.weight, sorted_ids_N, order_N, 1)
            ves_BTA = [list(TableRows.apply(ve_BTA, emb.weight, sorted_ids_N, order_N, 2))
                       for ve_BTA, emb in zip(ves_BTA, self.value_embeds)]
        else:  # no gradient to route
            ves_BTA = [[ve_BTA, ve_BTA] for ve_BTA in ves_BTA]
        if cfg.smear:
            rows_BTD = self.smear_rows(rows_BTD, inputs_BT, self.smear_gate, self.smear_lambda, cfg.bos_id)
        x0_BTD = self.norm_rows(rows_BTD)
        L, num_skips = cfg.num_layers, cfg.num_layers // 2
        # every block reads x0, and so does the stream's start: one view each, their gradients summed in one pass
        *x0s_BTD, x_BTD = FanOut.apply(x0_BTD, L + 1, self.add_gradients)
        # a copy: were x and x0 one tensor, the first block's inputs would alias, and dynamo compiles a graph of
        # its own for aliased inputs (two, for training and validation), which costs more cold-start seconds than
        # the copy (one read and one write of x0 per micro-step, about 0.3 ms per step by bandwidth) ever will
        x_BTD = x_BTD.clone()
        skips, v_first_BTHd = [], None
        for i, block in enumerate(self.blocks):
            if i >= L - num_skips:  # second half: add the mirrored first-half output (U-net)
                x_BTD = SkipAdd.apply(x_BTD, skips.pop(), self.skip_weights[i - (L - num_skips)])
            if cfg.backout and i == L // 2:
                mid_BTD = x_BTD  # what the middle block reads: the backout's (held only when it is on)
            ve_index = cfg.value_embed_index(i)
            ve_BTA = None if ve_index is None else ves_BTA[ve_index].pop()
            mask = masks[cfg.is_short_window(i)]
            x_BTD, v_BTHd = block(x_BTD, x0s_BTD[i], v_first_BTHd, ve_BTA, cos_TP, sin_TP, mask)
            if v_BTHd is not None:  # block 0's values, with the value residual on
                v_first_BTHd = v_BTHd
            if i < num_skips:
                skips.append(x_BTD)
        if cfg.backout:
            x_BTD = SkipAdd.apply(x_BTD, mid_BTD, self.backout_weight[0])
        return x_BTD

    def attention_inputs(self, inputs_BT: Tensor, window: Tensor) -> tuple[dict, Tensor, Tensor]:
        """The masks of one micro-batch, {is_short_window: mask} (FlexAttention BlockMasks or SDPA's dense masks),
        and the rotary tables cos, sin (T, P)."""
        cfg = self.config
        doc_BT = document_ids(inputs_BT, cfg.bos_id)
        windows = {False: window, True: short_window(window, cfg.block_size)}
        make = block_mask if self.attention_backend == "flex" else dense_mask
        masks = {short: make(doc_BT, w, cfg.block_size) for short, w in windows.items()}
        return masks, *rotary_tables(inputs_BT.size(1), cfg.head_dim, cfg.rope_base, inputs_BT.device)

    def embed_inputs(self, inputs_BT: Tensor) -> list[Tensor]:
        """[the embedding's rows (B, T, D), then each value embedding's (B, T, A)] in compute_dtype, looked up
        detached: TableRows gives them their gradient (hidden_states)."""
        return [F.embedding(inputs_BT, emb.weight.detach()).to(self.compute_dtype)
                for emb in (self.embed, *self.value_embeds)]

    def logits(self, inputs_BT: Tensor, window: Tensor) -> Tensor:
        """Capped fp32 logits (B, T, V), for sampling, evaluation and tests."""
        return self.head.logits(self.hidden_states(inputs_BT, window))

    def forward(self, inputs_BT: Tensor, targets_BT: Tensor, window: Tensor, reduction: str = "mean") -> Tensor:
        """Cross-entropy in fp32 over targets != -100: a scalar for "mean"/"sum", per-token (B, T) for "none".
        inputs (B, T) int token ids; targets (B, T) int64; window: 0-D int64 tensor, the long window in tokens."""
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction={reduction!r}: use one of {REDUCTIONS}")
        return self.head(self.hidden_states(inputs_BT, window), targets_BT, reduction)
