"""A model with hand-written attention (as research code and Hugging Face's eager attention have): its
`CoreAttention` computes softmax(q k^T / sqrt(d) + causal mask) v itself, on bshd tensors, with no attention
function attn-doctor wraps, so only `capture --module tests.models.hand_attention.CoreAttention:...` sees it.

What the attention does is `train`'s `kind`:
- `unfused`: scores and softmax in fp32, probabilities rounded to the inputs' dtype, autograd's backward (as
  Megatron's local attention computes);
- `wrong`: the same, dropping the last key (a faulty hand-written kernel);
- `flash`: a flash-style kernel in the inputs' dtype (FlashAttention 2's algorithm: the backward recomputes the
  probabilities and takes D = rowsum(dO * O) from the rounded output it returned): correct, but less accurate
  than `unfused` on dQ where the keys share a large direction (`key_shift`);
- `flash-wrong`: the same with dQ 5% too large.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

HEADS, DIM, SEQ, BATCH, VOCAB = 2, 8, 12, 2, 32
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _probabilities(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Causal softmax of the scaled scores, in fp32, [b, h, s, t]."""
    scores = torch.einsum("bshd,bthd->bhst", query.float(), key.float()) / math.sqrt(query.shape[-1])
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


class CoreAttention(torch.nn.Module):
    def forward(self, query, key, value, dropout_p=0.0):
        return self.attend(query, key, value)

    def attend(self, query, key, value):
        probs = self.keep(_probabilities(query, key)).to(value.dtype)
        return torch.einsum("bhst,bthd->bshd", probs, value)

    def keep(self, probs):
        return probs


class WrongAttention(CoreAttention):
    def keep(self, probs):
        return probs * torch.cat([torch.ones_like(probs[..., :-1]), torch.zeros_like(probs[..., -1:])], -1)


class _FlashStyle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, dq_factor):
        out = torch.einsum("bhst,bthd->bshd", _probabilities(query, key).to(value.dtype).float(),
                           value.float()).to(value.dtype)
        ctx.save_for_backward(query, key, value, out)
        ctx.dq_factor = dq_factor
        return out

    @staticmethod
    def backward(ctx, dout):
        query, key, value, out = ctx.saved_tensors
        dtype, scale = value.dtype, 1 / math.sqrt(query.shape[-1])
        probs = _probabilities(query, key)  # recomputed
        dv = torch.einsum("bhst,bshd->bthd", probs.to(dtype).float(), dout.float()).to(dtype)
        dp = torch.einsum("bshd,bthd->bhst", dout.float(), value.float())
        rows = (dout.float() * out.float()).sum(-1).transpose(1, 2)[..., None]  # D from the rounded output
        ds = (probs * (dp - rows)).to(dtype).float()
        dq = (torch.einsum("bhst,bthd->bshd", ds, key.float()) * scale * ctx.dq_factor).to(dtype)
        dk = (torch.einsum("bhst,bshd->bthd", ds, query.float()) * scale).to(dtype)
        return dq, dk, dv, None


class FlashStyleAttention(CoreAttention):
    dq_factor = 1.0

    def attend(self, query, key, value):
        return _FlashStyle.apply(query, key, value, self.dq_factor)


class WrongFlashStyleAttention(FlashStyleAttention):
    dq_factor = 1.05


KINDS = {"unfused": CoreAttention, "wrong": WrongAttention, "flash": FlashStyleAttention,
         "flash-wrong": WrongFlashStyleAttention}


class Block(torch.nn.Module):
    def __init__(self, kind: str, key_shift: float):
        super().__init__()
        self.qkv = torch.nn.Linear(HEADS * DIM, 3 * HEADS * DIM)
        self.attention = KINDS[kind]()
        # A direction every key shares (deep layers' keys do): the exact dQ does not see it, a flash-style one does
        shared = torch.randn(HEADS, DIM, generator=torch.Generator().manual_seed(2))
        self.register_buffer("shared_key", key_shift * shared / shared.norm(dim=-1, keepdim=True))

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, DIM)).unbind(2)
        return x + self.attention(q, k + self.shared_key.to(k.dtype), v).flatten(-2)


def train(layers: int = 2, faulty: bool = False, kind: str | None = None, dtype: str = "fp32",
          key_shift: float = 0.0) -> float:
    """One forward and backward of a small model; `faulty` is `kind="wrong"`."""
    torch.manual_seed(0)
    kind = kind or ("wrong" if faulty else "unfused")
    embed = torch.nn.Embedding(VOCAB, HEADS * DIM)
    model = torch.nn.Sequential(embed, *(Block(kind, key_shift) for _ in range(layers)),
                                torch.nn.Linear(HEADS * DIM, VOCAB)).to(DTYPES[dtype])
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item()
