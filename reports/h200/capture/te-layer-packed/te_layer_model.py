"""A two-layer te.TransformerLayer stack, one training step (forward and backward), bf16 on the GPU. TE >= 2.20's
MultiheadAttention hands its fused projection's output to DotProductAttention as `qkv_layer` (q, k, v None):
issue 17's H200 evidence that the capture records such a call as the views TE selects, and that replay runs it.
    attn-doctor capture --values --out CAP -- python3 reports/h200/capture/te-layer-packed/te_layer_model.py
"""

import transformer_engine.pytorch as te  # first: TE loads its own cuDNN before torch uses one
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(*[
    te.TransformerLayer(256, 1024, 4, self_attn_mask_type="causal", attention_dropout=0.0, hidden_dropout=0.0,
                        attn_input_format="bshd", params_dtype=torch.bfloat16) for _ in range(2)]).cuda()
x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
model(x).float().square().mean().backward()
torch.cuda.synchronize()
print(f"one training step of {len(model)} te.TransformerLayer, TE {te.__version__ if hasattr(te, '__version__') else ''}")
