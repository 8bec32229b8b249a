"""TE calls beyond a dense causal one, for issue 17's H200 evidence: what replay must rebuild from a capture.

One forward and backward of each, bf16, under `attn-doctor capture --values`:
  1. thd, padding_causal, q/k/v slices of one packed [t, 3, h, d] buffer, padding between sequences
     (cu_seqlens_*_padded);
  2. bshd, padding, lengths given as a right-padding attention_mask [b, 1, 1, s] (True = padding);
  3. sbhd, no_mask, a post_scale_bias of shape 1hss;
  4. sbhd, causal, a softmax scale of 0.1 (not 1/sqrt(d));
  5. sbhd, padding_causal with full lengths, FP8 attention (DelayedScaling, fp8_dpa), after one warm-up step.

    python3 reports/h200/capture/te_api_model.py
"""

import transformer_engine.pytorch as te  # first: TE loads its own cuDNN before torch uses one
import torch
from transformer_engine.common import recipe

HEADS, DIM = 8, 64
generator = torch.Generator(device="cuda").manual_seed(0)


def normal(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, device="cuda").to(torch.bfloat16).requires_grad_()


def step(module: te.DotProductAttention, q, k, v, **arguments) -> None:
    out = module(q, k, v, **arguments)
    out.backward(torch.randn(out.shape, generator=generator, device="cuda").to(out.dtype))


def main() -> None:
    # 1. Packed sequences of 200, 77 and 129 tokens in slots of 256, 128 and 192.
    lengths, slots = [200, 77, 129], [256, 128, 192]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    padded = torch.tensor([0, *torch.tensor(slots).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    packed = normal(sum(slots), 3, HEADS, DIM)
    thd = te.DotProductAttention(HEADS, DIM, qkv_format="thd", attn_mask_type="padding_causal", attention_dropout=0.0)
    step(thd, packed[:, 0], packed[:, 1], packed[:, 2], cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
         cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded, max_seqlen_q=256, max_seqlen_kv=256)

    # 2. Two sequences of 256 and 100 tokens, padded to 256, lengths as TE's attention_mask.
    q, k, v = (normal(2, 256, HEADS, DIM) for _ in range(3))
    padding = torch.arange(256, device="cuda")[None, None, None, :] >= torch.tensor(
        [256, 100], device="cuda")[:, None, None, None]
    bshd = te.DotProductAttention(HEADS, DIM, qkv_format="bshd", attn_mask_type="padding", attention_dropout=0.0)
    step(bshd, q, k, v, attention_mask=padding)

    # 3. A relative-position-like bias, one per head.
    q, k, v = (normal(256, 2, HEADS, DIM) for _ in range(3))
    bias = torch.randn(1, HEADS, 256, 256, generator=generator, device="cuda").to(torch.bfloat16)
    sbhd = te.DotProductAttention(HEADS, DIM, qkv_format="sbhd", attn_mask_type="no_mask", attention_dropout=0.0)
    step(sbhd, q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)

    # 4. A softmax scale of 0.1.
    scaled = te.DotProductAttention(HEADS, DIM, qkv_format="sbhd", attn_mask_type="causal", attention_dropout=0.0,
                                    softmax_scale=0.1)
    step(scaled, q, k, v)

    # 5. FP8 attention, delayed scaling: a warm-up step, then the step a replay checks.
    q, k, v = (normal(256, 2, HEADS, DIM) for _ in range(3))
    full = torch.tensor([0, 256, 512], dtype=torch.int32, device="cuda")
    fp8 = te.DotProductAttention(HEADS, DIM, qkv_format="sbhd", attn_mask_type="padding_causal",
                                 attention_dropout=0.0)
    for _ in range(2):
        with te.autocast(enabled=True, recipe=recipe.DelayedScaling(fp8_dpa=True)):
            step(fp8, q, k, v, cu_seqlens_q=full, cu_seqlens_kv=full, max_seqlen_q=256, max_seqlen_kv=256)
    torch.cuda.synchronize()
    print("5 kinds of TE call, forward and backward: done")


if __name__ == "__main__":
    main()
