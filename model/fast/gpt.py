"""FastGPT: model/gpt.py's GPT (same parameters and math) on model/fast's fused paths, compiled region by region:
FastBlocks and FastHead, embedding gradients straight into their tables (TableRows), x0's readers' gradients summed
in one pass (FanOut), U-net skips as one kernel each way (SkipAdd), with `fp8` FP8 products, and in forward-only
passes INT8/FP8 attention in the layers `use_int8_attention` names.

Shape legend: as model/gpt.py.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from model.fast.attention_kernels import Int8Mask
from model.fast.blocks import FastAttention, FastBlock, fp8_parts
from model.fast.head import FastHead
from model.fast.routing import FanOut, SkipAdd, TableRows, add_all, sort_ids
from model.gpt import GPT, norm

# Inductor options under which two processes make the same kernels: by default it picks matmul padding and
# reduction configurations by timing them, and each choice changes the roundings.
REPEATABLE_COMPILE = {"shape_padding": False, "test_configs.force_filter_reduction_configs": True,
                      "dynamic_scale_rblock": False}


class FastGPT(GPT):
    """GPT on the fused paths; `compile_regions()` compiles each region separately with REPEATABLE_COMPILE."""

    make_block, make_head = FastBlock, FastHead

    def __init__(self, config):
        super().__init__(config)
        self.add_gradients = add_all  # sums x0's gradients (FanOut); compile_regions compiles it
        self.norm_rows = norm  # x0 from the embedding's rows; compile_regions compiles it
        self.compiled = False

    def configure(self, device: torch.device, fp8: bool = False) -> "FastGPT":
        """GPT.configure; with fp8, the blocks' FP8 products on Hopper (16-byte aligned rows) and the head's on 8.9+."""
        super().configure(device)
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
        c = self.config
        aligned = c.model_dim % 16 == 0 and (c.num_heads * c.head_dim) % 16 == 0
        self.head.fp8 = fp8 and capability >= (8, 9)
        for part in fp8_parts(self.blocks):
            part.fp8 = fp8 and aligned and capability[0] == 9
        return self

    def fp8_in_use(self) -> dict[str, bool]:
        """Which parts run FP8 products, for the run's log."""
        parts = fp8_parts(self.blocks)
        return {"head": self.head.fp8, "blocks": bool(parts) and all(part.fp8 for part in parts)}

    def scale_histories(self) -> list[Tensor]:
        return [part.grad_amax for part in fp8_parts(self.blocks) if part.fp8]

    def compile_regions(self, **kwargs) -> None:
        kwargs = {"dynamic": False, "fullgraph": True} | kwargs
        takes_options = kwargs.get("backend", "inductor") == "inductor" and "mode" not in kwargs
        if takes_options:
            kwargs = kwargs | {"options": REPEATABLE_COMPILE | kwargs.get("options", {})}
        # Block.forward has a graph per presence pattern of its optional inputs (two per layer), and forward-only
        # passes with INT8/FP8 attention one per choice of the layer's attention (two more)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 4 * self.config.num_layers)
        self.embed_inputs = torch.compile(self.embed_inputs, **kwargs)
        # a persistent reduction over the masks' rows compiles for minutes
        mask_kwargs = kwargs
        if takes_options:
            mask_kwargs = kwargs | {"options": kwargs["options"] | {"triton.persistent_reductions": False}}
        self.attention_inputs = torch.compile(self.attention_inputs, **mask_kwargs)
        for block in self.blocks:
            block.compile(**kwargs)
        self.head.compile(**kwargs)
        self.add_gradients = torch.compile(self.add_gradients, **kwargs)
        self.norm_rows = torch.compile(self.norm_rows, **kwargs)
        self.compiled = True

    def embed_inputs(self, inputs_BT: Tensor) -> list[Tensor]:
        """[the embedding's rows (B, T, D), then each value embedding's (B, T, A)], detached (TableRows)."""
        return [F.embedding(inputs_BT, emb.weight.detach()).to(self.compute_dtype)
                for emb in (self.embed, *self.value_embeds)]

    def embed_stream(self, inputs_BT: Tensor) -> tuple[Tensor, list[Tensor], list[list[Tensor]]]:
        rows_BTD, *ves_BTA = self.embed_inputs(inputs_BT)
        # the rows' gradients go straight into their tables; each value embedding feeds two layers, a view each
        if torch.is_grad_enabled():
            sorted_ids_N, order_N = sort_ids(inputs_BT)
            (rows_BTD,) = TableRows.apply(rows_BTD, self.embed.weight, sorted_ids_N, order_N, 1)
            ves_BTA = [list(TableRows.apply(ve_BTA, emb.weight, sorted_ids_N, order_N, 2))
                       for ve_BTA, emb in zip(ves_BTA, self.value_embeds)]
        else:
            ves_BTA = [[ve_BTA, ve_BTA] for ve_BTA in ves_BTA]
        x0_BTD = self.norm_rows(rows_BTD)
        # one view of x0 per reader, their gradients summed in one pass
        *x0s_BTD, x_BTD = FanOut.apply(x0_BTD, self.config.num_layers + 1, self.add_gradients)
        # a copy: aliased inputs would make dynamo compile the first block's graph again
        return x_BTD.clone(), x0s_BTD, ves_BTA

    skip_add = staticmethod(SkipAdd.apply)

    def attentions(self) -> list[FastAttention]:
        return [block.attn for block in self.blocks if block.attn is not None]

    def make_mask(self, doc_BT: Tensor, window: Tensor):
        mask = super().make_mask(doc_BT, window)
        if torch.is_grad_enabled() or all(attn.int8 == "off" for attn in self.attentions()):
            return mask
        return Int8Mask.of(mask, doc_BT, window, self.config.block_size)

    @torch.no_grad()
    def int8_attention_errors(self, inputs_BT: Tensor, window: Tensor) -> list[float]:
        """Each attention layer's INT8/FP8 output against its FlexAttention one on this batch, as the relative L1 error,
        every layer given the FlexAttention stream. Runs eagerly, and eager FlexAttention holds the whole score
        matrix: a few thousand tokens make a batch."""
        attentions = self.attentions()
        for attn in attentions:
            attn.int8 = "measure"
        try:
            with torch.compiler.set_stance("force_eager"):
                self.hidden_states(inputs_BT, window)
        finally:
            for attn in attentions:
                attn.int8 = "off"
        return [attn.int8_error for attn in attentions]

    def use_int8_attention(self, layers: list[bool]) -> None:
        """INT8/FP8 attention in forward-only passes for the attention layers marked True, in order."""
        for attn, on in zip(self.attentions(), layers, strict=True):
            attn.int8 = "on" if on else "off"

    def scored_loss_sum(self, inputs_BT: Tensor, targets_BT: Tensor, window: Tensor) -> Tensor:
        """GPT.scored_loss_sum; compiled, the blocks run with autograd on, reusing their training graphs, unless
        INT8/FP8 attention is on."""
        if not self.compiled:
            return super().scored_loss_sum(inputs_BT, targets_BT, window)
        # INT8/FP8 attention is for forward-only passes: graphs of their own
        with torch.set_grad_enabled(all(attn.int8 == "off" for attn in self.attentions())):
            hidden_BTD = self.hidden_states(inputs_BT, window)
        with torch.no_grad():
            return self.head(hidden_BTD, targets_BT, "sum")
