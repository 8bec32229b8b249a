"""Exact float64 attention forward and backward: the arbiter every backend is measured against.

Computed block by block over queries, one pass per block (forward, then its share of the backward),
so the seq_q x seq_kv score matrix is never materialised: only a block of rows, and for causal or
sliding-window masks only the key columns the mask leaves. GQA is handled by folding each group of
query heads into the rows of its key/value head, so k and v are never expanded.

Tensors are in "bshd" logical shape: q, dout, out, dq [batch, seq_q, heads, head_dim];
k, v, dk, dv [batch, seq_kv, kv_heads, head_dim]. Inputs may be any dtype and any strides;
they are upcast to float64 (the reference sees exactly the low-precision values a kernel saw).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_BLOCK_BYTES = {"cuda": 2 << 30, "cpu": 1 << 27}  # for the two float64 [rows, seq_kv] score buffers


@dataclass
class Reference:
    out: torch.Tensor
    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor | None
    lse: torch.Tensor  # [batch, heads, seq_q]; -inf for a row that sees no key

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"out": self.out, "dq": self.dq, "dk": self.dk, "dv": self.dv}


def key_range(q_start: int, q_stop: int, seq_kv: int, causal: bool, window: tuple[int, int] | None) -> tuple[int, int]:
    """Columns [k0, k1) that queries [q_start, q_stop) can see (top-left aligned causal, TE window convention)."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    k0 = 0 if left < 0 else max(0, q_start - left)
    k1 = seq_kv if right < 0 else min(seq_kv, q_stop + right)
    return k0, max(k0, k1)


def allowed_mask(
    rows: torch.Tensor, cols: torch.Tensor, causal: bool, window: tuple[int, int] | None
) -> torch.Tensor | None:
    """Boolean [len(rows), len(cols)] mask of visible (query, key) pairs, or None when all are visible."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    mask = None
    if right >= 0:
        mask = cols[None, :] <= rows[:, None] + right
    if left >= 0:
        lower = cols[None, :] >= rows[:, None] - left
        mask = lower if mask is None else mask & lower
    return mask


def _mask_edges(scores: torch.Tensor, q0: int, q1: int, k0: int, k1: int, group: int, causal: bool,
                window: tuple[int, int] | None) -> None:
    """Fill -inf where the mask hides keys, touching only the column ranges the mask can reach in this
    block (for causal, the diagonal strip), not the whole block."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    ranges = []
    if right >= 0 and k1 > q0 + right + 1:
        ranges.append((max(k0, q0 + right + 1), k1))  # keys past the first row's right edge
    if left >= 0 and k0 < q1 - 1 - left:
        ranges.append((k0, min(k1, q1 - 1 - left)))  # keys before the last row's left edge
    if not ranges:
        return
    rows = torch.arange(q0, q1, device=scores.device).repeat(group)
    for c0, c1 in ranges:
        visible = allowed_mask(rows, torch.arange(c0, c1, device=scores.device), causal, window)
        scores[..., c0 - k0:c1 - k0].masked_fill_(~visible, float("-inf"))


def _block_rows(batch: int, heads: int, seq_kv: int, seq_q: int, device: torch.device, block_bytes: int | None) -> int:
    budget = block_bytes if block_bytes is not None else DEFAULT_BLOCK_BYTES.get(device.type, 1 << 27)
    per_query_row = batch * heads * max(seq_kv, 1) * 8 * 2  # two float64 [rows, seq_kv] buffers live at once
    rows = max(16, budget // per_query_row)
    return int(min(seq_q, rows))


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None,
    *,
    causal: bool,
    softmax_scale: float,
    window: tuple[int, int] | None = None,
    block_bytes: int | None = None,
) -> Reference:
    """Float64 out, dq, dk, dv and log-sum-exp of softmax(q k^T * scale + mask) v, blockwise.

    With `dout` None only the forward is computed (dq, dk, dv are returned as None).
    """
    batch, seq_q, heads, head_dim = q.shape
    _, seq_kv, kv_heads, head_dim_v = v.shape
    group = heads // kv_heads
    device = q.device
    f64 = torch.float64

    # [b, hkv, g, s, d]: query head h = kv_head * group + member, as repeat_interleave orders them.
    backward = dout is not None

    def rows_of(t: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
        """Queries [q0, q1) of a bshd tensor as float64 [b, hkv, group * n, d]: q and dout are upcast one
        block at a time (each row is read once), k and v once in full (every block reads them)."""
        block = t[:, q0:q1].to(f64).permute(0, 2, 1, 3)
        return block.reshape(batch, kv_heads, group * (q1 - q0), t.shape[-1])
    k64 = k.to(f64).permute(0, 2, 1, 3)  # [b, hkv, s_kv, d]
    v64 = v.to(f64).permute(0, 2, 1, 3)

    out = torch.zeros(batch, kv_heads, group, seq_q, head_dim_v, dtype=f64, device=device)
    lse = torch.full((batch, kv_heads, group, seq_q), float("-inf"), dtype=f64, device=device)
    if backward:
        dq = torch.zeros(batch, kv_heads, group, seq_q, head_dim, dtype=f64, device=device)
        dk = torch.zeros(batch, kv_heads, seq_kv, head_dim, dtype=f64, device=device)
        dv = torch.zeros(batch, kv_heads, seq_kv, head_dim_v, dtype=f64, device=device)

    rows_per_block = _block_rows(batch, heads, seq_kv, seq_q, device, block_bytes)
    for q0 in range(0, seq_q, rows_per_block):
        q1 = min(seq_q, q0 + rows_per_block)
        k0, k1 = key_range(q0, q1, seq_kv, causal, window)
        if k1 <= k0:
            continue  # every row of this block sees no key: out, dq stay 0, lse stays -inf
        n = q1 - q0
        # Scaling q (a block of rows) instead of the scores saves a full pass over the score block.
        qb = rows_of(q, q0, q1) * softmax_scale  # not in place: for float64 inputs rows_of may be a view of q
        kb, vb = k64[:, :, k0:k1], v64[:, :, k0:k1]

        scores = torch.matmul(qb, kb.transpose(-1, -2))
        _mask_edges(scores, q0, q1, k0, k1, group, causal, window)
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        probs = scores.sub_(row_max).exp_()  # in place: the scores buffer becomes the probabilities
        row_sum = probs.sum(dim=-1, keepdim=True)
        seen = row_sum > 0
        probs.div_(torch.where(seen, row_sum, torch.ones_like(row_sum)))
        ob = torch.matmul(probs, vb)
        block_lse = torch.where(seen, row_max + torch.log(row_sum), torch.full_like(row_sum, float("-inf")))

        out[:, :, :, q0:q1] = ob.view(batch, kv_heads, group, n, head_dim_v)
        lse[:, :, :, q0:q1] = block_lse.view(batch, kv_heads, group, n)
        if backward:
            # Backward of the same block: dS = P * (dO V^T - rowsum(dO * O)).
            dob = rows_of(dout, q0, q1)
            delta = (dob * ob).sum(dim=-1, keepdim=True)
            dscores = torch.matmul(dob, vb.transpose(-1, -2)).sub_(delta).mul_(probs)
            dqb = torch.matmul(dscores, kb).mul_(softmax_scale)
            dk[:, :, k0:k1] += torch.matmul(dscores.transpose(-1, -2), qb)  # qb is already scaled
            dv[:, :, k0:k1] += torch.matmul(probs.transpose(-1, -2), dob)
            dq[:, :, :, q0:q1] = dqb.view(batch, kv_heads, group, n, head_dim)
            del dscores
        del scores, probs

    def to_bshd(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, heads, seq_q, t.shape[-1]).permute(0, 2, 1, 3)

    return Reference(
        out=to_bshd(out),
        dq=to_bshd(dq) if backward else None,
        dk=dk.permute(0, 2, 1, 3) if backward else None,
        dv=dv.permute(0, 2, 1, 3) if backward else None,
        lse=lse.reshape(batch, heads, seq_q),
    )


class Float64Attention(torch.autograd.Function):
    """The blockwise float64 attention as an autograd op (bshd), for float64 model replicas.

    Backward recomputes the forward block by block instead of saving probabilities: memory stays O(seq).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, softmax_scale: float, window):
        ctx.save_for_backward(q, k, v)
        ctx.options = (causal, softmax_scale, window)
        return attention_reference(q, k, v, None, causal=causal, softmax_scale=softmax_scale, window=window).out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        causal, softmax_scale, window = ctx.options
        ref = attention_reference(q, k, v, dout, causal=causal, softmax_scale=softmax_scale, window=window)
        return ref.dq, ref.dk, ref.dv, None, None, None


def naive_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    window: tuple[int, int] | None = None,
) -> Reference:
    """The plain float64 formula through autograd, materialising all scores (tests and benchmarks only)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    qh = q64.transpose(1, 2)
    kh = k64.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    vh = v64.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * softmax_scale
    seq_q, seq_kv = scores.shape[-2:]
    mask = allowed_mask(
        torch.arange(seq_q, device=q.device), torch.arange(seq_kv, device=q.device), causal, window
    )
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0)
    out = torch.matmul(probs, vh).transpose(1, 2)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.to(torch.float64))
    return Reference(out.detach(), dq, dk, dv, lse.detach())
