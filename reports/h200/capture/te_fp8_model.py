"""FP8 attention calls for issue 17's third H200 evidence: what a capture records of TE's FP8 dot product
attention, and what replay rebuilds from it. The second run's fifth call (head_dim 64, padding_causal with full
cu_seqlens, DelayedScaling with fp8_dpa) was refused by TE ("No dot product attention backend is available");
these are the same kind of call at head_dim 128, with and without the padding mask. Each module runs a warm-up
step (delayed scaling needs amax history) and the step a replay checks; a call TE refuses is reported and the
script goes on.

    python3 reports/h200/capture/te_fp8_model.py
"""

import transformer_engine.pytorch as te  # first: TE loads its own cuDNN before torch uses one
import torch
from transformer_engine.common import recipe

HEADS, DIM, SEQ, BATCH = 8, 128, 512, 2
generator = torch.Generator(device="cuda").manual_seed(0)


def normal(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, device="cuda").to(torch.bfloat16).requires_grad_()


def main() -> None:
    full = torch.arange(BATCH + 1, dtype=torch.int32, device="cuda") * SEQ
    calls = {
        "causal": ({"attn_mask_type": "causal"}, {}),
        "padding_causal, full cu_seqlens": (
            {"attn_mask_type": "padding_causal"},
            {"cu_seqlens_q": full, "cu_seqlens_kv": full, "max_seqlen_q": SEQ, "max_seqlen_kv": SEQ}),
    }
    for name, (settings, arguments) in calls.items():
        module = te.DotProductAttention(HEADS, DIM, qkv_format="sbhd", attention_dropout=0.0, **settings)
        q, k, v = (normal(SEQ, BATCH, HEADS, DIM) for _ in range(3))
        try:
            for _ in range(2):
                with te.autocast(enabled=True, recipe=recipe.DelayedScaling(fp8_dpa=True)):
                    out = module(q, k, v, **arguments)
                out.backward(torch.randn(out.shape, generator=generator, device="cuda").to(out.dtype))
            torch.cuda.synchronize()
            print(f"FP8 {name}: forward and backward done")
        except Exception as exc:  # noqa: BLE001 - TE refusing a call is a finding, not the script's end
            print(f"FP8 {name}: TE refused it: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")


if __name__ == "__main__":
    main()
