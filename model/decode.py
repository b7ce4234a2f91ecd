"""Incremental decoding of model/gpt.py's GPT with a KV cache: the same model, fed a few tokens at a time.

    cache = KVCache(model, batch=B, capacity=C, window=W)
    hidden_BTD = cache.extend(prompt_BT)      # prefill: the prompt's T tokens
    hidden_B1D = cache.extend(next_B1)        # then one token at a time
    logits_BV = model.head.logits(hidden_B1D[:, -1])

Contract: after tokens t_0 .. t_{n-1} have gone in, in any split into calls, `extend` returns for its tokens what
model.hidden_states(t_0 .. t_{n-1}, W) returns at their positions. Each attention layer caches its keys (offset
ones, with key_offset) and values and attends on SDPA under model/attention.py's rule, or, in the layers the cache is
given, in INT8/FP8 (model/fast/int8_decode.py; then the contract holds to its rounding). Only the plain modules'
functions are used, so a FastGPT decodes alike.

Shape legend: as model/gpt.py; K cached keys, C capacity.
"""
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention import attend, document_ids
from model.config import short_window, window_blocks
from model.fast.int8_decode import int8_attend
from model.gpt import GPT, MLP, Attention, norm, offset_keys, prepare_qkv, rotary_tables, x0_mix

PREFILL_CHUNK = 1024  # queries per attention call, bounding a long prompt's masks and scores


def window_mask(doc_BK: Tensor, first_key: int, start: int, blocks: int, block_size: int) -> Tensor:
    """SDPA's mask (B, 1, T, K) of the queries from `start` over the keys from `first_key`, doc_BK the documents of
    positions 0 .. start + T - 1."""
    end = doc_BK.size(1)
    q_T = torch.arange(start, end, device=doc_BK.device)
    k_K = torch.arange(first_key, end, device=doc_BK.device)
    same_doc_BTK = doc_BK[:, start:, None] == doc_BK[:, None, first_key:]
    causal_TK = q_T[:, None] >= k_K[None, :]
    near_TK = q_T[:, None] // block_size - k_K[None, :] // block_size < blocks
    return (same_doc_BTK & causal_TK & near_TK)[:, None]


class KVCache:
    """Cached keys, values and document ids of `batch` rows of up to `capacity` tokens, for a long `window`. The
    attention layers in `int8_layers` attend in INT8/FP8. With `measure_int8`, every attention layer's output is
    SDPA's, and its INT8/FP8 output's distance from it is summed for int8_errors."""

    def __init__(self, model: GPT, batch: int, capacity: int, window: int, int8_layers: Collection[int] = (),
                 measure_int8: bool = False):
        cfg, device, dtype = model.config, model.embed.weight.device, model.compute_dtype
        self.model, self.capacity, self.length = model, capacity, 0
        shape = (batch, capacity, cfg.num_heads, cfg.head_dim)
        self.keys = {i: torch.empty(shape, dtype=dtype, device=device)
                     for i, block in enumerate(model.blocks) if block.attn is not None}
        self.values = {i: torch.empty_like(k) for i, k in self.keys.items()}
        self.int8_layers = set(int8_layers)
        # with measure_int8, per attention layer: (sum |INT8/FP8 output - SDPA output|, sum |SDPA output|) so far
        self.int8_l1 = {i: torch.zeros(2, device=device) for i in self.keys} if measure_int8 else None
        # per offsetting layer, the last position's key before its offset (B, 1, H, d): the next token's offset reads it
        self.last_keys = {}
        self.doc_BC = torch.zeros(batch, capacity, dtype=torch.int32, device=device)
        self.cos_CP, self.sin_CP = rotary_tables(capacity, cfg.head_dim, cfg.rope_base, device)
        # how many whole blocks back each kind of layer sees, by is_short_window
        self.blocks = {short: window_blocks(w, cfg.block_size)
                       for short, w in ((False, window), (True, short_window(window, cfg.block_size)))}

    @torch.no_grad()
    def extend(self, tokens_BT: Tensor) -> Tensor:
        """The residual stream after the last block (B, T, D) at the new tokens' positions."""
        if self.length + tokens_BT.size(1) > self.capacity:
            raise ValueError(f"{self.length} cached tokens + {tokens_BT.size(1)} new exceed the cache's capacity "
                             f"{self.capacity}: start a new cache with the context's last tokens")
        return torch.cat([self._extend(chunk) for chunk in tokens_BT.split(PREFILL_CHUNK, dim=1)], dim=1)

    def _extend(self, tokens_BT: Tensor) -> Tensor:
        model, cfg = self.model, self.model.config
        start, end = self.length, self.length + tokens_BT.size(1)
        before_B1 = self.doc_BC[:, start - 1:start] if start else 0  # the document the row is in so far
        self.doc_BC[:, start:end] = before_B1 + document_ids(tokens_BT, cfg.bos_id)
        S = cfg.block_size
        # each layer kind reads the keys from its first query's window on
        first_keys = {short: max(0, (start // S - blocks + 1) * S) for short, blocks in self.blocks.items()}
        masks = {short: window_mask(self.doc_BC[:, :end], first_keys[short], start, blocks, S)
                 for short, blocks in self.blocks.items()}
        cos_TP, sin_TP = self.cos_CP[start:end], self.sin_CP[start:end]

        x0_BTD = norm(model.embed(tokens_BT).to(model.compute_dtype))
        ves_BTA = [emb(tokens_BT).to(model.compute_dtype) for emb in model.value_embeds]
        x_BTD, v_first_BTHd, skips = x0_BTD, None, []
        L, num_skips = cfg.num_layers, cfg.num_layers // 2
        for i, block in enumerate(model.blocks):
            if i >= L - num_skips:  # U-net: the mirrored first-half output
                x_BTD = x_BTD + model.skip_weights[i - (L - num_skips)].type_as(x_BTD) * skips.pop()
            if i == L // 2:
                mid_BTD = x_BTD  # the backout's
            x_BTD = x0_mix(x_BTD, x0_BTD, block.lambdas)
            if block.attn is not None:
                ve_index = cfg.value_embed_index(i)
                short = cfg.is_short_window(i)
                y_BTD, v_BTHd = self.attention(i, block.attn, norm(x_BTD), v_first_BTHd,
                                               None if ve_index is None else ves_BTA[ve_index], cos_TP, sin_TP,
                                               first_keys[short], masks[short])
                x_BTD = x_BTD + y_BTD
                if block.shares_values:
                    v_first_BTHd = v_BTHd
            if block.mlp is not None:
                # MLP's own forward: a FastMLP's takes the residual as well
                x_BTD = x_BTD + MLP.forward(block.mlp, norm(x_BTD))
            if i < num_skips:
                skips.append(x_BTD)
        if model.backout_weight is not None:
            x_BTD = x_BTD + model.backout_weight[0].type_as(x_BTD) * mid_BTD
        self.length = end
        return x_BTD

    def attention(self, layer: int, attn: Attention, x_BTD: Tensor, v_first_BTHd: Tensor | None,
                  ve_BTA: Tensor | None, cos_TP: Tensor, sin_TP: Tensor, first_key: int,
                  mask_B1TK: Tensor) -> tuple[Tensor, Tensor]:
        """Attention.forward for the new tokens' normed x over the cached keys from first_key on, theirs first
        stored; in INT8/FP8 in int8_layers."""
        B, T, _ = x_BTD.shape
        qkv_BT3Hd = F.linear(x_BTD, attn.qkv_w.flatten(0, 1).type_as(x_BTD)).view(B, T, 3 * attn.num_heads, -1)
        q_BTHd, k_BTHd, v_BTHd = prepare_qkv(qkv_BT3Hd, cos_TP, sin_TP, attn.value_lambdas, v_first_BTHd, ve_BTA)
        if attn.offsets_keys:
            before_B1Hd = self.last_keys.get(layer)
            self.last_keys[layer] = k_BTHd[:, -1:]
            k_BTHd = offset_keys(k_BTHd, before_B1Hd)
        end = self.length + T
        self.keys[layer][:, self.length:end] = k_BTHd
        self.values[layer][:, self.length:end] = v_BTHd
        k_BKHd, v_BKHd = self.keys[layer][:, first_key:end], self.values[layer][:, first_key:end]
        gate_in_BTG = x_BTD[..., :attn.gate_w.size(1)]
        if layer not in self.int8_layers and self.int8_l1 is None:
            return attn.attend_and_project(q_BTHd, k_BKHd, v_BKHd, gate_in_BTG, mask_B1TK), v_BTHd
        y_BTHd = int8_attend(q_BTHd, k_BKHd, v_BKHd, mask_B1TK, attn.scale, self.model.config.block_size)
        if self.int8_l1 is not None:  # measuring: SDPA's output goes on, as without INT8/FP8
            ref_BTHd = attend(q_BTHd.transpose(1, 2), k_BKHd.transpose(1, 2), v_BKHd.transpose(1, 2), mask_B1TK,
                              attn.scale).transpose(1, 2)
            self.int8_l1[layer] += torch.stack([(y_BTHd.float() - ref_BTHd.float()).abs().sum(),
                                                ref_BTHd.float().abs().sum()])
            y_BTHd = ref_BTHd
        return attn.gate_and_project(y_BTHd, gate_in_BTG), v_BTHd

    def int8_errors(self) -> dict[int, float]:
        """With measure_int8: each attention layer's INT8/FP8 output's relative L1 error against its SDPA output,
        over the tokens extended so far."""
        return {layer: float(diff / ref) for layer, (diff, ref) in self.int8_l1.items()}
