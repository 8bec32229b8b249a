"""Exact float64 attention forward and backward: the arbiter every backend is measured against.

Computed as FlashAttention computes it, in tiles of (query rows x key columns), so the seq_q x seq_kv score
matrix is never materialised. Each block of query rows takes two passes over its key tiles: the forward
(output, row sums, log-sum-exp), then the backward, with the block's probabilities kept from its forward
where the byte budget allows (heads are then taken a few at a time), else recomputed tile by tile. Key
tiles a causal or sliding-window mask hides entirely are skipped, and the mask is applied only to tiles it
cuts. GQA is handled by folding each group of query heads into the rows of its key/value head, so k and v
are never expanded.

The plain formula, all scores materialised, is a second implementation on purpose:
`attn_doctor.numerics.standalone.dense_reference` (`naive_reference` here). The standalone repro scripts
compute it, as their minimal cases are small and a reader checks it at a glance; attn-doctor needs this
tiled one, as seq_q x seq_kv float64 scores do not fit at the lengths it checks. tests/test_te_api.py and
tests/test_standalone.py hold the two equal (every mask type, length, window, bias and sink).

Most of the time goes into the matmuls. To keep the element-wise passes over the tiles few (they are
bound by memory bandwidth), the row sums and the backward's delta ride inside the matmuls on an extra
column (see `_extended`), and ordinary scores need no softmax shift: exp is the only element-wise pass of
the forward, one product the only one of the backward.

Tensors are in "bshd" logical shape: q, dout, out, dq [batch, seq_q, heads, head_dim];
k, v, dk, dv [batch, seq_kv, kv_heads, head_dim]. Inputs may be any dtype and any strides;
they are upcast to float64 (the reference sees exactly the low-precision values a kernel saw).

Term magnitudes: the scale of a correct kernel's rounding noise.

Each entry of out, dQ, dK, dV is a sum of terms (see ../shared/reference/verdict-numerics.md):

    out_i = sum_j P_ij v_j                 dV_j = sum_i P_ij dO_i
    dQ_i  = c sum_j dS_ij k_j              dK_j = c sum_i dS_ij q_i
    dS_ij = P_ij (dP_ij - D_i),  dP_ij = dO_i . v_j,  D_i = dO_i . out_i

A correct kernel in precision u rounds every operand and intermediate (P, dS, out...) to relative
precision ~u, independently, so its error in a row is ~u times the root-sum-square of the sizes of the
terms, not u times the (possibly cancelled) sum. For each row this module returns that root-sum-square,
squared and summed over the head dim, with dS_ij's size taken as the size of the two quantities whose
difference it is, each a root-sum-square over the head dim too (the size of a sum of rounded terms, which
cannot vanish by cancellation as dP_ij itself can): M_ij = P_ij (A_ij + B_i), A_ij = |dO_i * v_j|,
B_i = |dO_i * out_i| (elementwise products, L2 norms over the head dim):

    out_i: sum_j P_ij^2 |v_j|^2            dV_j: sum_i P_ij^2 |dO_i|^2
    dQ_i:  c^2 sum_j M_ij^2 |k_j|^2        dK_j: c^2 sum_i M_ij^2 |q_i|^2

Kernels compute scores and the log-sum-exp in fp32 whatever the input dtype, and a flash-style backward
recomputes P = exp(s - lse) from them, so P's relative error also has a part u_fp32 * (|s| + |lse|):
negligible in bf16/fp16 (2^-16 and 2^-13 of their own roundoff per unit of |lse|), dominant in fp32 with
large logits. Each row's terms are also returned scaled by g_i = 1 + 2 |lse_i| u_scores / u_inputs: that is
the scale of the noise, while the terms as they are say whether the exact result cancels.

For random inputs this is close to the exact row's own squared norm (the signed sum of random terms has
the size of their root-sum-square); where the exact result cancels (one key, a saturated softmax, equal
keys or values) the exact row is ~0 while this stays the size of the noise every correct kernel makes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attn_doctor.numerics import standalone
from attn_doctor.numerics.masks import Semantics, Visibility

# Bytes for float64 score tiles. On CUDA: at seq 131072, 1024 rows of 4 heads' probabilities kept (4 GiB),
# 18.6 GiB in all with 16 heads.
DEFAULT_BLOCK_BYTES = {"cuda": 9 << 29, "cpu": 1 << 27}
MAX_TILE_ROWS, MAX_TILE_COLS = 1024, 8192  # 8192 columns: 1.3% faster than 4096 at seq 131072 on the H200
MIN_TILE = 16
# Fewest query rows per block worth keeping the probabilities for: the backward's dK and dV matmuls take
# the block's rows as their inner dimension, and below this they run too far from the matmul rate.
MIN_KEPT_ROWS = 256
# Below this bound on every |score| exp needs no shift: exp(+-300) ~ 1e+-130 leaves room for the sums.
SHIFT_FREE_BOUND = 300.0
# A row whose exponentials sum below this lost range to the shift (none, or a loose bound on its maximum
# score, see `_score_bound`); its block is redone with the exact maximum. Not lower: the backward divides dO
# by the sum and squares it for the term magnitudes, and 1e-100 keeps (dO / sum)^2 finite up to |dO| ~ 1e50
# (1e-200 overflowed them on the "outliers" inputs: NaN terms, an error of infinite size).
UNDERFLOW_SUM = 1e-100


@dataclass
class Reference:
    out: torch.Tensor
    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor | None
    lse: torch.Tensor  # [batch, heads, seq_q]; -inf for a row that sees no key
    # The magnitude of the terms each row of out, dq, dk, dv is summed from ([batch, seq, heads, 2], float64;
    # None without a backward): [..., 0] as they are, [..., 1] with fp32 scores' rounding (see "Term
    # magnitudes" above).
    out_terms: torch.Tensor | None = None
    dq_terms: torch.Tensor | None = None
    dk_terms: torch.Tensor | None = None
    dv_terms: torch.Tensor | None = None
    # A learnable softmax sink's gradient, per head, as [1, 1, heads, 1] (terms [1, 1, heads, 2]); else None.
    dsink: torch.Tensor | None = None
    dsink_terms: torch.Tensor | None = None
    # TE's return_max_logit: each head's largest visible score, as [1, 1, heads, 1] (terms [1, 1, heads, 2]: the
    # size of the products its score sums, see `max_logit_reference`); else None.
    max_logit: torch.Tensor | None = None
    max_logit_terms: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        found = {"out": self.out, "dq": self.dq, "dk": self.dk, "dv": self.dv}
        for name in ("dsink", "max_logit"):
            if getattr(self, name) is not None:
                found[name] = getattr(self, name)
        return found

    def terms(self, name: str) -> torch.Tensor | None:
        return getattr(self, f"{name}_terms")

    def shared(self) -> tuple[torch.Tensor | None, ...]:
        """Every tensor, in field order (`Reference(*shared)` rebuilds it): what workers map."""
        return (self.out, self.dq, self.dk, self.dv, self.lse,
                self.out_terms, self.dq_terms, self.dk_terms, self.dv_terms, self.dsink, self.dsink_terms,
                self.max_logit, self.max_logit_terms)



def key_range(q_start: int, q_stop: int, seq_kv: int, vis: Visibility) -> tuple[int, int]:
    """Columns [k0, k1) that queries [q_start, q_stop) can see."""
    k0 = 0 if vis.left < 0 else max(0, q_start + vis.diag - vis.left)
    k1 = seq_kv if vis.right < 0 else max(0, min(seq_kv, q_stop + vis.diag + vis.right))
    return k0, max(k0, k1)


def allowed_mask(
    rows: torch.Tensor, cols: torch.Tensor, causal: bool, window: tuple[int, int] | None
) -> torch.Tensor | None:
    """Boolean [len(rows), len(cols)] mask of visible (query, key) pairs under top-left causal / window
    semantics, or None when all are visible (the TP, depth and distributed probes' dense cases)."""
    return Visibility.top_left(causal, window).pairs(rows, cols)


def _mask_tile(scores: torch.Tensor, q0: int, q1: int, c0: int, c1: int, group: int, vis: Visibility) -> None:
    """Fill -inf where the mask hides keys [c0, c1) from queries [q0, q1), touching only the column ranges
    the mask can reach in this tile (for causal, the diagonal strip), not the whole tile."""
    ranges = []
    first, last = q0 + vis.diag, q1 - 1 + vis.diag  # the block's rows, shifted to their diagonal
    if vis.right >= 0 and c1 > first + vis.right + 1:
        ranges.append((max(c0, first + vis.right + 1), c1))  # keys past the first row's right edge
    if vis.left >= 0 and c0 < last - vis.left:
        ranges.append((c0, min(c1, last - vis.left)))  # keys before the last row's left edge
    if not ranges:
        return
    rows = torch.arange(q0, q1, device=scores.device).repeat(group)
    for r0, r1 in ranges:
        visible = vis.pairs(rows, torch.arange(r0, r1, device=scores.device))
        scores[..., r0 - c0:r1 - c0].masked_fill_(~visible, float("-inf"))


@dataclass(frozen=True)
class TilePlan:
    pairs: int  # (batch, kv head) pairs per chunk: the matmuls' batch dimension
    rows: int  # query positions per block
    cols: int  # key columns per tile
    keep: bool  # keep each block's probabilities from its forward for its backward, instead of recomputing them


def plan_tiles(pairs: int, group: int, seq_q: int, seq_kv: int, device: torch.device,
               block_bytes: int | None) -> TilePlan:
    """Tiles as large as the byte budget allows.

    Keeping a block's probabilities (rows x every key) saves a matmul and an exp per (query, key) pair, so
    it is chosen whenever blocks of enough rows fit; heads are then taken a few at a time (a chunk of
    pairs) so that long sequences still get tall blocks. Otherwise the probabilities are recomputed in the
    backward, tile by tile, all pairs at once.
    """
    budget = block_bytes if block_bytes is not None else DEFAULT_BLOCK_BYTES.get(device.type, 1 << 27)
    cols = min(seq_kv, MAX_TILE_COLS)
    bytes_per_row = group * 8 * (seq_kv + cols)  # per pair: the kept probabilities and one gradient tile
    tallest = min(seq_q, MAX_TILE_ROWS)
    chunk = max(1, min(pairs, budget // (bytes_per_row * tallest)))
    kept_rows = budget // (chunk * bytes_per_row)
    if kept_rows >= min(seq_q, MIN_KEPT_ROWS):
        rows = min(tallest, kept_rows)
        if 64 < rows < seq_q:
            rows -= rows % 64  # whole matmul tiles
        return TilePlan(chunk, rows, cols, keep=True)
    rows = tallest
    while pairs * group * rows * cols * 8 * 2 > budget and (rows > MIN_TILE or cols > MIN_TILE):
        if cols > rows and cols > MIN_TILE:
            cols = max(MIN_TILE, cols // 2)
        else:
            rows = max(MIN_TILE, rows // 2)
    return TilePlan(pairs, max(1, rows), max(1, cols), keep=False)


def _extended(t: torch.Tensor, extra: torch.Tensor | float) -> torch.Tensor:
    """Float64 [..., n, round_up(d + 1, 8)] holding t in the first d columns and `extra` in column d.

    With K = [k, 1] and Q = [q * scale, -c] one matmul gives q k^T * scale - c, with V = [v, 1] the row sums
    come out of P V as the last column, and with dO = [do, -delta] dO V^T is dP - delta: no separate pass.
    The zero padding keeps the rows 64-byte aligned for the matmul.
    """
    d = t.shape[-1]
    out = torch.zeros(*t.shape[:-1], -(-(d + 1) // 8) * 8, dtype=torch.float64, device=t.device)
    out[..., :d] = t
    out[..., d] = extra
    return out


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None,
    *,
    softmax_scale: float,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    semantics: Semantics | None = None,
    block_bytes: int | None = None,
    with_terms: bool = True,
    value_gradient_only: bool = False,
) -> Reference:
    """Float64 out, dq, dk, dv and log-sum-exp of softmax(q k^T * scale + bias + mask, sink) v, tile by tile,
    and (with `with_terms`) the term magnitudes of each row of out, dq, dk, dv (and of dsink). With
    `value_gradient_only` (and no terms) the backward computes dv alone, half of its matmuls; dq and dk are None.

    The attention is the case's (`semantics`: TE's mask types, lengths, bias and sink; see
    `attn_doctor.numerics.masks`) or, without semantics, a dense one with a top-left causal mask and window.
    Padded positions (beyond a sequence's length) get 0 and lse -inf. With `dout` None only the forward is
    computed (dq, dk, dv and the term magnitudes are returned as None).
    """
    if semantics is None or not semantics.per_sequence:
        vis = Visibility.top_left(causal, window) if semantics is None else semantics.visibility(0)
        bias = sink = None
        if semantics is not None:
            bias = None if semantics.bias is None else semantics.bias[0].to(torch.float64)
            sink = semantics.sink
        result = _attention(q, k, v, dout, vis, softmax_scale, bias=bias, sink=sink, block_bytes=block_bytes,
                            with_terms=with_terms, sink_gradient=semantics is not None and semantics.learnable_sink,
                            value_gradient_only=value_gradient_only)
    else:
        result = _per_sequence(q, k, v, dout, semantics, softmax_scale, block_bytes, with_terms, value_gradient_only)
    if semantics is not None and semantics.case.return_max_logit:
        result.max_logit, result.max_logit_terms = max_logit_reference(q, k, semantics, softmax_scale)
    return result


def max_logit_reference(q: torch.Tensor, k: torch.Tensor, semantics: Semantics, softmax_scale: float,
                        block_bytes: int = 1 << 27) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's largest score over every visible (query, key) pair of every sequence, in float64 (TE's
    return_max_logit: max of mask(q k^T * scale + bias)), as [1, 1, heads, 1]; -inf for a head that sees nothing.

    Its terms ([1, 1, heads, 2], squared, both columns alike): the winning score's terms, the products
    scale * q_id * k_jd and the bias, as a root-sum-square: a correct kernel rounds the score it reports to ~u of
    that (fp32 scores from low-precision inputs, or the inputs' own precision where it computes scores in them),
    which does not vanish where the score itself is ~0. Query rows a block at a time: no full score matrix."""
    batch, heads, kv_heads = q.shape[0], q.shape[2], k.shape[2]
    case, f64, device = semantics.case, torch.float64, q.device
    best = torch.full((heads,), float("-inf"), dtype=f64, device=device)
    best_terms = torch.zeros(heads, dtype=f64, device=device)
    for b in range(batch):
        len_q, len_kv = case.lengths_q()[b], case.lengths_kv()[b]
        if len_q == 0 or len_kv == 0:
            continue
        keys = k[b, :len_kv].to(f64).repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [h, kv, d]
        bias = semantics.bias_of(b, len_q, len_kv, device)
        rows_per_block = max(1, block_bytes // (8 * heads * len_kv * 2))
        for r0 in range(0, len_q, rows_per_block):
            r1 = min(len_q, r0 + rows_per_block)
            queries = q[b, r0:r1].to(f64).transpose(0, 1) * softmax_scale  # [h, rows, d]
            scores = queries @ keys.transpose(1, 2)
            block_bias = None if bias is None else bias if bias.shape[-2] == 1 else bias[..., r0:r1, :]
            if block_bias is not None:
                scores = scores + block_bias
            visible = semantics.visibility(b).pairs(torch.arange(r0, r1, device=device),
                                                    torch.arange(len_kv, device=device))
            if semantics.allowed is not None:
                allowed = semantics.allowed[b, 0, r0:r1, :len_kv]
                visible = allowed if visible is None else visible & allowed
            if visible is not None:
                scores = scores.masked_fill(~visible, float("-inf"))
            top, where = scores.flatten(1).max(dim=1)
            better = top > best
            if not bool(better.any()):
                continue
            row, col = where // len_kv, where % len_kv
            heads_index = torch.arange(heads, device=device)
            products = queries[heads_index, row] * keys[heads_index, col]  # [h, d]
            size = products.square().sum(-1)
            if block_bias is not None:
                size = size + block_bias.expand(heads, r1 - r0, len_kv).reshape(heads, -1)[heads_index, where].square()
            best = torch.where(better, top, best)
            best_terms = torch.where(better, size, best_terms)
    terms = best_terms.view(1, 1, heads, 1).expand(1, 1, heads, 2).clone()
    return best.view(1, 1, heads, 1), terms


def _per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor | None,
                  semantics: Semantics, softmax_scale: float, block_bytes: int | None,
                  with_terms: bool, value_gradient_only: bool = False) -> Reference:
    """One sequence at a time, each at its own lengths, its mask and bias; gathered into padded tensors."""
    batch, seq_q, heads, _ = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    f64, device = torch.float64, q.device
    case = semantics.case
    result = Reference(
        out=torch.zeros(batch, seq_q, heads, v.shape[-1], dtype=f64, device=device), dq=None, dk=None, dv=None,
        lse=torch.full((batch, heads, seq_q), float("-inf"), dtype=f64, device=device))
    if dout is not None:
        if not value_gradient_only:
            result.dq = torch.zeros(q.shape, dtype=f64, device=device)
            result.dk = torch.zeros(k.shape, dtype=f64, device=device)
        result.dv = torch.zeros(v.shape, dtype=f64, device=device)
        if with_terms:
            result.out_terms = torch.zeros(batch, seq_q, heads, 2, dtype=f64, device=device)
            result.dq_terms = torch.zeros_like(result.out_terms)
            result.dk_terms = torch.zeros(batch, seq_kv, kv_heads, 2, dtype=f64, device=device)
            result.dv_terms = torch.zeros_like(result.dk_terms)
        if semantics.learnable_sink:  # summed over the sequences (an empty one adds nothing: its out is 0)
            result.dsink = torch.zeros(1, 1, heads, 1, dtype=f64, device=device)
            result.dsink_terms = torch.zeros(1, 1, heads, 2, dtype=f64, device=device) if with_terms else None
    for b in range(batch):
        len_q, len_kv = case.lengths_q()[b], case.lengths_kv()[b]
        if len_q == 0 or len_kv == 0:
            continue  # no query or no key: out 0, no gradient (with a sink too: out 0 makes d sink 0)
        allowed = None if semantics.allowed is None else semantics.allowed[b, 0, :len_q, :len_kv]
        one = _attention(
            q[b:b + 1, :len_q], k[b:b + 1, :len_kv], v[b:b + 1, :len_kv],
            None if dout is None else dout[b:b + 1, :len_q], semantics.visibility(b), softmax_scale,
            bias=semantics.bias_of(b, len_q, len_kv, device), allowed=allowed, sink=semantics.sink,
            block_bytes=block_bytes, with_terms=with_terms, sink_gradient=semantics.learnable_sink,
            value_gradient_only=value_gradient_only)
        result.out[b, :len_q] = one.out[0]
        result.lse[b, :, :len_q] = one.lse[0]
        for name in ("dq", "dk", "dv", "out_terms", "dq_terms", "dk_terms", "dv_terms"):
            got = getattr(one, name)
            if got is not None:
                getattr(result, name)[b, :got.shape[1]] = got[0]
        for name in ("dsink", "dsink_terms"):
            if getattr(one, name) is not None:
                getattr(result, name).add_(getattr(one, name))
    return result


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor | None, vis: Visibility,
               softmax_scale: float, *, bias: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
               sink: torch.Tensor | None = None, block_bytes: int | None = None,
               with_terms: bool = True, sink_gradient: bool = False, value_gradient_only: bool = False) -> Reference:
    """The tiled computation for sequences that share one visibility: `bias` float64 broadcastable to
    [heads, seq_q, seq_kv], `allowed` bool [seq_q, seq_kv] (True = visible, one sequence), `sink` [heads]
    (its gradient computed with `sink_gradient`: a learnable sink's)."""
    batch, seq_q, heads, head_dim = q.shape
    _, seq_kv, kv_heads, head_dim_v = v.shape
    group = heads // kv_heads
    device = q.device
    f64 = torch.float64
    pairs = batch * kv_heads  # independent problems; each one's query rows are (group member, position)

    def per_kv_head(t: torch.Tensor) -> torch.Tensor:
        return t.to(f64).permute(0, 2, 1, 3).reshape(pairs, seq_kv, t.shape[-1])

    # Before the big allocations: the float64 norms are transient. A bias widens the scores' range, a sink
    # logit must fit in exp's range too.
    bias_top = 0.0 if bias is None or not bias.numel() else float(bias.abs().amax())
    sink64 = None if sink is None else sink.to(device=device, dtype=f64)
    sink_top = 0.0 if sink64 is None else float(sink64.abs().amax())
    shift_free = max(_score_bound_of_all(q, k, softmax_scale) + bias_top, sink_top) <= SHIFT_FREE_BOUND
    k_ext = _extended(per_kv_head(k), 1.0)  # [pairs, s_kv, d + pad]
    v_ext = _extended(per_kv_head(v), 1.0)
    v_squared = v_ext[..., :head_dim_v].square() if dout is not None and with_terms else None
    score_precision = standalone.score_precision(q.dtype)
    out = torch.zeros(pairs, group, seq_q, head_dim_v, dtype=f64, device=device)
    lse = torch.full((pairs, group, seq_q), float("-inf"), dtype=f64, device=device)
    grads = terms = dsink = None
    if value_gradient_only and with_terms:
        raise ValueError("the term magnitudes need every gradient")
    if dout is not None:
        grads = (None if value_gradient_only else torch.zeros(pairs, group, seq_q, head_dim, dtype=f64, device=device),
                 None if value_gradient_only else torch.zeros(pairs, seq_kv, head_dim, dtype=f64, device=device),
                 torch.zeros(pairs, seq_kv, head_dim_v, dtype=f64, device=device))
        if sink64 is not None and sink_gradient:  # per (pair, group member): the sink's gradient and its terms
            dsink = torch.zeros(pairs, group, 3, dtype=f64, device=device)
    if dout is not None and with_terms:
        # Per row: out and dq like the queries, dk and dv like the keys (see "Term magnitudes" above).
        terms = (torch.zeros(pairs, group, seq_q, 2, dtype=f64, device=device),
                 torch.zeros(pairs, group, seq_q, 2, dtype=f64, device=device),
                 torch.zeros(pairs, seq_kv, 2, dtype=f64, device=device),
                 torch.zeros(pairs, seq_kv, 2, dtype=f64, device=device))

    def rows_of(t: torch.Tensor, p0: int, p1: int, q0: int, q1: int) -> torch.Tensor:
        """Positions [q0, q1) of pairs [p0, p1) of a bshd tensor as float64 [p1 - p0, group * n, d]."""
        block = t[:, q0:q1].view(batch, q1 - q0, kv_heads, group, t.shape[-1]).permute(0, 2, 3, 1, 4)
        return block.reshape(pairs, group * (q1 - q0), t.shape[-1])[p0:p1].to(f64)

    plan = plan_tiles(pairs, group, seq_q, seq_kv, device, block_bytes)
    for p0 in range(0, pairs, plan.pairs):
        p1 = min(pairs, p0 + plan.pairs)
        kv_head = torch.arange(p0, p1, device=device) % kv_heads  # each pair's kv head
        chunk = _Chunk(k_ext[p0:p1], v_ext[p0:p1], out[p0:p1], lse[p0:p1], score_precision,
                       None if grads is None else tuple(None if g is None else g[p0:p1] for g in grads),
                       k_norms=None if shift_free else k_ext[p0:p1, :, :head_dim].norm(dim=-1),
                       terms=None if terms is None else tuple(t[p0:p1] for t in terms),
                       v_squared=None if terms is None else v_squared[p0:p1],
                       sink=None if sink64 is None else sink64.view(kv_heads, group)[kv_head],
                       dsink=None if dsink is None else dsink[p0:p1], bias_top=bias_top)
        for q0 in range(0, seq_q, plan.rows):
            q1 = min(seq_q, q0 + plan.rows)
            k0, k1 = key_range(q0, q1, seq_kv, vis)
            if k1 <= k0:
                continue  # every row of this block sees no key: out, dq stay 0, lse stays -inf
            tiles = [(c0, min(k1, c0 + plan.cols)) for c0 in range(k0, k1, plan.cols)]
            block = _Block(q0, q1, tiles, group, vis, _tile_bias(bias, kv_head, group, heads, q0, q1),
                           None if allowed is None else allowed[q0:q1])
            _attend_block(
                chunk, block, rows_of(q, p0, p1, q0, q1) * softmax_scale,
                None if dout is None else rows_of(dout, p0, p1, q0, q1), softmax_scale,
                shift_free=shift_free, keep=plan.keep or len(tiles) == 1,  # one tile's are at hand anyway
            )

    def to_bshd(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, heads, seq_q, t.shape[-1]).permute(0, 2, 1, 3)

    def kv_to_bshd(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, kv_heads, seq_kv, t.shape[-1]).permute(0, 2, 1, 3)

    def rows_to_bsh(t: torch.Tensor, q_side: bool) -> torch.Tensor:
        if q_side:
            return t.reshape(batch, heads, seq_q, 2).permute(0, 2, 1, 3)
        return t.view(batch, kv_heads, seq_kv, 2).permute(0, 2, 1, 3)

    sink_grad = {}
    if dsink is not None:  # summed over the batch, per head, as a [1, 1, heads, 1] "tensor" (terms: [.., 2])
        per_head = dsink.view(batch, kv_heads, group, 3).sum(0).reshape(1, 1, heads, 3)
        sink_grad = {"dsink": per_head[..., :1].clone(), "dsink_terms": per_head[..., 1:].clone() if with_terms else None}
    return Reference(
        out=to_bshd(out),
        dq=None if grads is None or grads[0] is None else to_bshd(grads[0]),
        dk=None if grads is None or grads[1] is None else kv_to_bshd(grads[1]),
        dv=None if grads is None else kv_to_bshd(grads[2]),
        lse=lse.reshape(batch, heads, seq_q),
        **({} if terms is None else {f"{name}_terms": rows_to_bsh(t, name in ("out", "dq"))
                                     for name, t in zip(("out", "dq", "dk", "dv"), terms)}),
        **sink_grad,
    )


def _tile_bias(bias: torch.Tensor | None, kv_head: torch.Tensor, group: int, heads: int, q0: int,
               q1: int) -> Callable[[int, int], torch.Tensor] | None:
    """The bias of a chunk's rows for key columns [c0, c1), as [pairs, group * (q1 - q0), c1 - c0]: rows in
    the chunk's (group member, position) order, each pair's heads picked by its kv head."""
    if bias is None:
        return None
    n = q1 - q0
    rows = bias[:, q0:q1] if bias.shape[1] > 1 else bias  # [heads or 1, n or 1, seq_kv]

    def tile(c0: int, c1: int) -> torch.Tensor:
        part = rows[..., c0:c1]
        if part.shape[0] == heads:
            part = part.view(heads // group, group, *part.shape[1:])[kv_head]  # [pairs, group, n|1, c]
        else:
            part = part[None].expand(len(kv_head), group, *part.shape[1:])
        return part.expand(len(kv_head), group, n, c1 - c0).reshape(len(kv_head), group * n, c1 - c0)
    return tile


@dataclass
class _Chunk:
    """Views of one chunk of (batch, kv head) pairs: extended k and v in, results out."""

    k_ext: torch.Tensor  # [pairs, s_kv, d + pad]: [k, 1, 0...]
    v_ext: torch.Tensor  # [pairs, s_kv, d_v + pad]: [v, 1, 0...]
    out: torch.Tensor  # [pairs, group, s_q, d_v]
    lse: torch.Tensor  # [pairs, group, s_q]
    score_precision: float  # the scores' unit roundoff over the inputs' (see "Term magnitudes")
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # dq like out; dk, dv like k and v
    k_norms: torch.Tensor | None  # [pairs, s_kv]: |k|, for the score bound (None: scores need no shift)
    terms: tuple[torch.Tensor, ...] | None = None  # out, dq [pairs, group, s_q, 2]; dk, dv [pairs, s_kv, 2]
    v_squared: torch.Tensor | None = None  # [pairs, s_kv, d_v]: v * v, for the term magnitudes
    sink: torch.Tensor | None = None  # [pairs, group]: each row's sink logit
    dsink: torch.Tensor | None = None  # [pairs, group, 3]: the sink's gradient, its terms as they are and amplified
    bias_top: float = 0.0  # max |bias|: added to the score bound


@dataclass(frozen=True)
class _Block:
    """Query positions [q0, q1) and the key tiles they see."""

    q0: int
    q1: int
    tiles: list[tuple[int, int]]
    group: int
    vis: Visibility
    bias: Callable[[int, int], torch.Tensor] | None = None  # the block's bias for columns [c0, c1)
    allowed: torch.Tensor | None = None  # [q1 - q0, seq_kv] explicit mask of the block's rows

    def mask(self, scores: torch.Tensor, c0: int, c1: int) -> None:
        """Add the bias, then hide what the mask hides (-inf)."""
        if self.bias is not None:
            scores += self.bias(c0, c1)
        if self.allowed is not None:
            scores.masked_fill_(~self.allowed[:, c0:c1].repeat(self.group, 1), float("-inf"))
        _mask_tile(scores, self.q0, self.q1, c0, c1, self.group, self.vis)


def _attend_block(chunk: _Chunk, block: _Block, q_scaled: torch.Tensor, dob: torch.Tensor | None,
                  softmax_scale: float, shift_free: bool, keep: bool) -> None:
    """Forward (and, with `dob`, backward) of one block of query rows against its key tiles."""
    q0, q1, tiles = block.q0, block.q1, block.tiles
    head_dim, head_dim_v = q_scaled.shape[-1], chunk.out.shape[-1]
    keys = chunk.k_ext[..., :head_dim]  # k alone, as a strided view
    n = q1 - q0
    pairs, group = chunk.out.shape[0], block.group
    sink_rows = None if chunk.sink is None else chunk.sink[:, :, None].expand(pairs, group, n).reshape(pairs, -1)

    def probabilities(q_side: torch.Tensor, k_side: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
        """exp(q k^T * scale + bias - shift) for keys [c0, c1), masked, not normalised. The shift, if any,
        rides on the operands' extra column (see `_extended`)."""
        scores = torch.bmm(q_side, k_side[:, c0:c1].transpose(1, 2))
        block.mask(scores, c0, c1)
        return scores.exp_()

    seq_kv = chunk.k_ext.shape[1]
    seen = block.vis.sees_a_key(torch.arange(q0, q1, device=q_scaled.device), seq_kv).repeat(group)
    if block.allowed is not None:
        seen = seen & block.allowed.any(dim=-1).repeat(group)
    # Scores bounded by SHIFT_FREE_BOUND can neither overflow exp nor underflow the sums: no shift, and the
    # score matmuls keep K = head_dim. Otherwise each row is shifted by its score bound.
    shift = None
    if not shift_free:
        shift = _score_bound(q_scaled, chunk.k_norms[:, tiles[0][0]:tiles[-1][1]]) + chunk.bias_top
        if sink_rows is not None:
            shift = torch.maximum(shift, sink_rows)
    for retry in (False, True):
        q_side, k_side = ((q_scaled, keys) if shift is None else (_extended(q_scaled, -shift), chunk.k_ext))
        sums, kept = None, []
        for c0, c1 in tiles:
            probs = probabilities(q_side, k_side, c0, c1)
            if sums is None:
                sums = torch.bmm(probs, chunk.v_ext[:, c0:c1])  # [P v | row sum of P]
            else:
                sums.baddbmm_(probs, chunk.v_ext[:, c0:c1])
            if keep:
                kept.append(probs)
            del probs
        row_sum = sums[..., head_dim_v]
        if sink_rows is not None:
            sink_weight = torch.exp(sink_rows if shift is None else sink_rows - shift)  # exp(o - shift)
            row_sum = row_sum + sink_weight
        if shift is None or retry or not bool(((row_sum < UNDERFLOW_SUM) & seen).any()):
            break
        shift = _exact_row_max(q_scaled, keys, tiles, block.mask, seen)
        if sink_rows is not None:
            shift = torch.maximum(shift, sink_rows)

    ob = torch.where(seen[:, None], sums[..., :head_dim_v] / row_sum[..., None], 0.0)
    block_lse = torch.log(row_sum) if shift is None else shift + torch.log(row_sum)
    chunk.out[:, :, q0:q1] = ob.view(pairs, group, n, head_dim_v)
    chunk.lse[:, :, q0:q1] = torch.where(seen, block_lse, float("-inf")).view(pairs, group, n)
    if dob is None:
        return

    # Backward: dS = P * (dO v^T - rowsum(dO * O)) with P = P~ / l, the forward's unnormalised
    # probabilities over their row sums. Dividing dO and the delta by l instead of P~ saves a pass over
    # each tile. P~ is the forward's, kept, or recomputed tile by tile.
    dq, dk, dv = chunk.grads
    inverse_sum = torch.where(seen, 1 / row_sum, 0.0)
    delta = (dob * ob).sum(dim=-1) * inverse_sum
    dob = dob * inverse_sum[..., None]
    do_ext = _extended(dob, -delta)
    terms = chunk.terms
    amplified = (1 + 2 * chunk.score_precision * torch.where(seen, block_lse, 0.0).abs()).square()[..., None]
    if chunk.dsink is not None:
        # d o = -sum_i P_sink,i D_i with P_sink,i = exp(o - shift) / l_i and D_i = dO_i . out_i = delta_i l_i;
        # its terms: (P_sink,i |dO_i * out_i|)^2, as they are and amplified.
        weight = torch.where(seen, sink_weight, 0.0)
        sink_terms = (weight.square() * (dob.square() * ob.square()).sum(-1))[..., None]
        chunk.dsink[..., 0] -= (weight * delta).view(pairs, group, n).sum(-1)
        chunk.dsink[..., 1:] += torch.cat([sink_terms, sink_terms * amplified], -1).view(pairs, group, n, 2).sum(2)
    if terms is not None:
        # Squared row norms for the term magnitudes: P~ and dob carry 1/l, q_scaled carries the scale, so
        # P~ (A' + B') = P (A + B) with A' and B' computed from dob.
        k_sq, v_sq = keys.square().sum(-1, keepdim=True), chunk.v_squared.sum(-1, keepdim=True)
        dob_squared = dob.square()
        q_sq, do_sq = q_scaled.square().sum(-1, keepdim=True), dob_squared.sum(-1, keepdim=True)
        b_term = (dob_squared * ob.square()).sum(-1, keepdim=True).sqrt_()
        # g^2 per row: a second column of dk's and dv's row weights; out's and dq's rows take it at the end
        q_sq, do_sq = torch.cat([q_sq, q_sq * amplified], -1), torch.cat([do_sq, do_sq * amplified], -1)
    dqb = None
    row_out_terms = row_dq_terms = 0.0
    for index, (c0, c1) in enumerate(tiles):
        if keep:
            probs, kept[index] = kept[index], None  # freed as soon as the tile is done
        else:
            probs = probabilities(q_side, k_side, c0, c1)
        dv[:, c0:c1].baddbmm_(probs.transpose(1, 2), dob)
        if dq is None:  # the value gradient alone
            del probs
            continue
        dscores = torch.bmm(do_ext, chunk.v_ext[:, c0:c1].transpose(1, 2)).mul_(probs)
        if dqb is None:
            dqb = torch.bmm(dscores, keys[:, c0:c1])
        else:
            dqb.baddbmm_(dscores, keys[:, c0:c1])
        dk[:, c0:c1].baddbmm_(dscores.transpose(1, 2), q_scaled)  # q is already scaled
        del dscores
        if terms is not None:
            sizes = torch.bmm(dob_squared, chunk.v_squared[:, c0:c1].transpose(1, 2)).sqrt_().add_(b_term)
            sizes.mul_(probs).square_()
            row_dq_terms = row_dq_terms + torch.bmm(sizes, k_sq[:, c0:c1])
            terms[2][:, c0:c1] += torch.bmm(sizes.transpose(1, 2), q_sq)
            del sizes
            probs.square_()
            row_out_terms = row_out_terms + torch.bmm(probs, v_sq[:, c0:c1])
            terms[3][:, c0:c1] += torch.bmm(probs.transpose(1, 2), do_sq)
        del probs
    if dq is not None:
        dq[:, :, q0:q1] = (dqb * softmax_scale).view(pairs, group, n, head_dim)
    if terms is not None:
        both = torch.cat([torch.ones_like(amplified), amplified], -1)
        terms[1][:, :, q0:q1] = (row_dq_terms * both * softmax_scale**2).view(pairs, group, n, 2)
        terms[0][:, :, q0:q1] = (row_out_terms * both * inverse_sum.square()[..., None]).view(pairs, group, n, 2)


def _score_bound_of_all(q: torch.Tensor, k: torch.Tensor, softmax_scale: float) -> float:
    """An upper bound on every |score|: max |q| * max |k| * scale."""
    def largest_norm(t: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(t, dim=-1, dtype=torch.float64).amax()
    return float(largest_norm(q) * largest_norm(k)) * abs(softmax_scale) if q.numel() and k.numel() else 0.0


def _score_bound(q_scaled: torch.Tensor, k_norms: torch.Tensor) -> torch.Tensor:
    """An upper bound on each row's largest score, |q * scale| * max |k| (Cauchy-Schwarz), [b * hkv, rows].

    Used as the softmax shift it needs no pass over the scores, and exp never overflows; only when it is
    hundreds above the true maximum do the sums underflow, and the caller falls back to the exact maximum.
    """
    return q_scaled.norm(dim=-1) * k_norms.amax(dim=-1, keepdim=True)


def _exact_row_max(q_scaled: torch.Tensor, keys: torch.Tensor, tiles: list[tuple[int, int]], mask,
                   seen: torch.Tensor) -> torch.Tensor:
    """Each row's largest visible score (0 for a row that sees none), by one more pass over the key tiles."""
    row_max = None
    for c0, c1 in tiles:
        scores = torch.bmm(q_scaled, keys[:, c0:c1].transpose(1, 2))
        mask(scores, c0, c1)
        tile_max = scores.amax(dim=-1)
        row_max = tile_max if row_max is None else torch.maximum(row_max, tile_max)
    return torch.where(seen, row_max, 0.0)


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
        ref = attention_reference(q, k, v, dout, causal=causal, softmax_scale=softmax_scale, window=window,
                                  with_terms=False)
        return ref.dq, ref.dk, ref.dv, None, None, None


def naive_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    allowed: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
) -> Reference:
    """The plain float64 formula through autograd, materialising all scores (`standalone.dense_reference`,
    what the standalone repro scripts compute; here for tests and benchmarks).

    `allowed` (bool, broadcastable to [batch, heads, seq_q, seq_kv], True = visible) replaces the causal /
    window mask; `bias` is added to the scaled scores; `sink` [heads] is a sink logit per head, whose
    gradient is returned as dsink (through autograd, independently of the tiled formula)."""
    if allowed is None:
        allowed = allowed_mask(torch.arange(q.shape[1], device=q.device), torch.arange(k.shape[1], device=q.device),
                               causal, window)
    return Reference(**standalone.dense_reference(q, k, v, dout, softmax_scale, allowed, bias, sink))


def reference_bytes(batch: int, seq_q: int, seq_kv: int, heads: int, kv_heads: int, head_dim: int,
                    device: torch.device, block_bytes: int | None = None) -> tuple[int, int]:
    """(kept, scratch): bytes of the float64 out, dq, dk, dv, lse and term magnitudes `attention_reference`
    returns, and the peak of what it allocates on top while it works (extended k and v, v squared, the tiles
    of its plan)."""
    group = heads // kv_heads
    pairs = batch * kv_heads
    width = -(-(head_dim + 1) // 8) * 8
    kept = 8 * (2 * batch * seq_q * heads * head_dim + 2 * batch * seq_kv * kv_heads * head_dim + batch * heads * seq_q
                + 2 * batch * seq_q * heads + 2 * batch * seq_kv * kv_heads)
    plan = plan_tiles(pairs, group, seq_q, seq_kv, device, block_bytes)
    if plan.keep:
        tiles = plan.pairs * group * plan.rows * (seq_kv + plan.cols) * 8
    else:
        tiles = plan.pairs * group * plan.rows * plan.cols * 8 * 2
    # a block's q, dout and its square, and their gradient, upcast (the dS tile's place is taken by the
    # term magnitudes' tile once it is done)
    rows = 4 * plan.pairs * group * plan.rows * width * 8
    return kept, 3 * pairs * seq_kv * width * 8 + tiles + rows
