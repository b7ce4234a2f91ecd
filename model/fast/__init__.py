"""The accelerated backend: model/gpt.py's GPT computed with fused Triton and Gluon kernels and FP8 on CUDA.

gpt.py       FastGPT: regional compilation, the FP8 switch
blocks.py    the block's fused paths
mlp.py       the ReLU² MLP and its residual add as one Function
head.py      the LM head's loss without fp32 logits
routing.py   gradient routing: the U-net skip, x0's readers, embedding rows
fp8.py       e4m3 copies and their scales
*_kernels.py the kernels; the torch ops beside each Function are their references
int8_decode.py INT8/FP8 attention of the KV cache (model/decode.py) in torch ops

The others import triton, so they are loaded only where the kernels are asked for (runtime/backend.py);
int8_decode.py does not, so the KV cache uses it wherever torch runs.
"""
