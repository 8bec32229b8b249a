"""A fingerprint of a model's weights that is the same at any tensor-parallel size, and that tells two draws
apart: what `capture` records of the weights (never the weights themselves) and `compare` reads first.

Per parameter: its dtype, its *global* shape, the sum of its squares and CHECKSUMS dot products with pseudo-random
signs, in float64. The sign of an element is a function of its *global* index (its index in the unsplit
tensor): the product of one hashed sign per dimension of that index (`axis_signs`), so every TP rank can compute
its shard's part of each sum as one matrix product (`_sign_vectors`), and the parts add up (`joined`, at reading)
to what TP=1 gets on the whole tensor:

- a TP rank's shard of a parameter Megatron splits (`tensor_model_parallel`, `partition_dim`,
  `partition_stride`, as `megatron.core.tensor_parallel.layers` sets them) is the rank's blocks along that
  dimension: with stride s the whole dimension is s·TP blocks and rank r holds blocks r, r+TP, r+2·TP, ...
  (`_initialize_affine_weight_cpu`'s `weight_list[rank::world_size]`); its local positions are mapped back to
  the global ones (`_global_positions`);
- Megatron's fused QKV weight is interleaved per query group (each group's q heads, then its k, then its v), so
  a rank's rows are whole query groups, contiguous in the global layout: the same map, no special case;
- a parameter every TP rank holds whole (layer norms, a row-parallel layer's bias) is taken from TP rank 0.

Why dot products with random signs: for weights A and B, E[(Σ (a_i − b_i) s_i)^2] = ‖A − B‖^2 whenever distinct
elements' signs are uncorrelated (a product of independent per-dimension signs is), so the checksums'
differences estimate how far the weights are apart (`WeightPrint.distance`): 0 up to float64 summation for the
same weights at any TP size, the dtype's rounding for one draw kept in two dtypes (bf16: 1.5e-3), and √2
relative to their norms for two independent draws of one distribution, which equal norms alone would not show.
With 16 checksums, 98% of independent draws measured 0.83 to 1.95 apart (300 pairs each of [64, 64], [1024]
and [16, 4, 32] normal tensors): the three cases are orders of magnitude apart.

Parameter names are made comparable across runs (`canonical_name`): wrappers' `module.` prefixes dropped
(DDP, Megatron's Float16Module), a pipeline stage's local layer index replaced by its global one (Megatron's
`layer_number`), and the TE spec's layer norms fused into the next linear layer named as the local spec
names them (`linear_qkv.layer_norm_weight` as `input_layernorm.weight`, ...), so TE against local is checked too.

Cost: one pass over the weights, a matrix product with CHECKSUMS columns per BATCH elements on the weights' own
device (float32 on the CPU, float64 on a GPU: `_compute_dtype`; small parameters of one shape and split
stacked), taken once per capture, at the model's first forward pass. On this project's 2-core CPU
(`benchmarks/bench_weight_fingerprint.py`, `benchmarks/RESULTS.md`), with the settings and the data hash: 15 ms,
1.0% of a training step, for the Megatron test GPT at hidden 512, seq 512, batch 4, 4 layers (17M weights);
6 ms, 3% of a step, at hidden 256; 3 ms at the tests' tiny default, whose step takes 5 ms (a fixed cost of
about 50 µs per parameter shape).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

CHECKSUMS = 16
BATCH = 1 << 20  # elements per matrix product
STACKED = 1 << 16  # tensors smaller than this are stacked, several to a matrix product
ROW_SUM = 1 << 14  # elements a row's product sums in its compute dtype, at most (`_compute_dtype`)
SAME = 1e-5  # a distance at most this is summation order (`_compute_dtype`): the same weights
INDEPENDENT = 1.0  # a distance above this is what two unrelated draws give (√2 for equal norms; 99% above 0.83)

# The TE spec's names of the layer norms fused into the next linear layer, by the local spec's names.
TE_SPEC_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                 "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
                 "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
                 "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP, Float16Module, torch.compile


@dataclass(frozen=True)
class Partition:
    """How one TP rank holds a parameter: `dim` -1 when whole on every rank."""

    size: int = 1
    rank: int = 0
    dim: int = -1
    stride: int = 1


def partition_of(parameter: torch.Tensor, tp: int, tp_rank: int) -> Partition:
    """Megatron's tensor-parallel attributes of a parameter; whole when it has none (any other framework)."""
    if tp <= 1 or not getattr(parameter, "tensor_model_parallel", False):
        return Partition()
    dim = int(getattr(parameter, "partition_dim", -1))
    if not 0 <= dim < parameter.dim():
        return Partition()
    return Partition(tp, tp_rank, dim, max(1, int(getattr(parameter, "partition_stride", 1))))


def canonical_name(name: str, layer_numbers: dict[str, int] | None = None) -> str:
    """A parameter's name as every run of the model names it (see the module docstring); `layer_numbers` maps a
    layer's module path (`decoder.layers.3`) to its global 0-based index."""
    while name.startswith(WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    if layer_numbers:
        match = re.match(r"(.*?layers\.)(\d+)(\..*)", name)
        if match and f"{match[1]}{match[2]}" in layer_numbers:
            name = f"{match[1]}{layer_numbers[match[1] + match[2]]}{match[3]}"
    for te, local in TE_SPEC_NAMES.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def layer_numbers(model: torch.nn.Module) -> dict[str, int]:
    """The global 0-based index of each `...layers.N` module of a pipeline stage whose `layer_number` (Megatron's,
    1-based over the whole model) says another, by the module's canonical path."""
    numbers = {}
    for name, module in model.named_modules():
        number = getattr(module, "layer_number", None)
        if isinstance(number, int) and re.search(r"layers\.\d+$", name) and not name.endswith(f".{number - 1}"):
            numbers[canonical_name(name)] = number - 1
    return numbers


@dataclass
class ShardPrint:
    """What one process records of one parameter: its part of the sums (the whole, for an unsplit one)."""

    name: str
    dtype: str
    shape: list[int]  # global
    split_dim: int  # -1: every TP rank holds it whole
    sum_squares: float
    checksums: list[float]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)


def axis_signs(axis: int, index: torch.Tensor) -> torch.Tensor:
    """[len(index), CHECKSUMS] of ±1 (int8): a hash (splitmix64's finaliser; int64 arithmetic wraps alike on
    the CPU and GPUs) of the axis number, each global index along it and the checksum number."""
    z = ((axis << 40) + index[:, None]) * CHECKSUMS + torch.arange(CHECKSUMS, device=index.device)
    z = z * _GOLDEN
    z = (z ^ (z >> 30)) * _MIX_1
    z = (z ^ (z >> 27)) * _MIX_2
    z = z ^ (z >> 31)
    return (((z >> 62) & 1) * 2 - 1).to(torch.int8)


def _global_positions(length: int, partition: Partition, device: torch.device) -> torch.Tensor:
    """The global indices of a TP rank's `length` positions along the split dimension: with stride s the whole
    dimension is s·TP blocks, of which the rank holds every TP-th from its own (Megatron's
    `_initialize_affine_weight_cpu`)."""
    local = torch.arange(length, device=device)
    per_block = length // partition.stride
    block, within = torch.div(local, per_block, rounding_mode="floor"), local % per_block
    return (block * partition.size + partition.rank) * per_block + within


def _sign_vectors(shape: list[int], partition: Partition, tables: list[torch.Tensor],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The signs of a local tensor seen as a matrix [rows, columns] (its last dimension the columns, the others
    the rows): the sign of an element is the product of one sign per dimension of its global index (`tables`:
    per dimension, `axis_signs` of every global index), so checksum k is rows[:, k] · (M @ columns[:, k]), a
    matrix product, and any split of any dimension is the same function of the whole tensor."""
    axes = []
    for axis, length in enumerate(shape):
        if axis == partition.dim:
            axes.append(tables[axis][_global_positions(length, partition, tables[axis].device)].to(dtype))
        else:
            axes.append(tables[axis][:length].to(dtype))
    rows = torch.ones(1, CHECKSUMS, dtype=dtype, device=tables[0].device)
    for signs in axes[:-1]:
        rows = (rows[:, None, :] * signs[None, :, :]).reshape(-1, CHECKSUMS)
    return rows, axes[-1]


def _sign_tables(shapes: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Per dimension, the signs of every global index up to the longest global extent `shapes` have there: made
    once per call, so that the parameters' many equal dimensions hash nothing again."""
    extents = [max((shape[axis] for shape in shapes if len(shape) > axis), default=0)
               for axis in range(max(len(shape) for shape in shapes))]
    return [axis_signs(axis, torch.arange(extent, device=device)) for axis, extent in enumerate(extents)]


def shard_prints(named: Iterable[tuple[str, torch.Tensor]], tp: int = 1, tp_rank: int = 0) -> list[ShardPrint]:
    """The fingerprints of the parameters `named` (canonical name, tensor) as TP rank `tp_rank` of `tp` holds
    them; a rank other than 0 leaves out those every rank holds whole. Parameters of one shape and split (a
    model's layers) are stacked and summed in one matrix product per BATCH elements."""
    parameters = []
    for name, tensor in named:
        partition = partition_of(tensor, tp, tp_rank)
        if partition.dim < 0 and tp_rank != 0:
            continue
        parameters.append((name, tensor.detach(), partition))
    groups: dict[tuple, list[int]] = {}
    for number, (_, tensor, partition) in enumerate(parameters):
        groups.setdefault((tuple(tensor.shape), partition, tensor.device), []).append(number)
    global_shapes = [_global_shape(tensor, partition) for _, tensor, partition in parameters]
    rows: list[list[float]] = [[] for _ in parameters]
    for device in dict.fromkeys(key[2] for key in groups):
        on_device = {key: numbers for key, numbers in groups.items() if key[2] == device}
        tables = _sign_tables([global_shapes[n] for numbers in on_device.values() for n in numbers], device)
        sums = torch.cat([_group_sums([parameters[n][1] for n in numbers], list(shape) or [1], partition, tables)
                          for (shape, partition, _), numbers in on_device.items()])
        order = [n for numbers in on_device.values() for n in numbers]
        for number, row in zip(order, sums.tolist()):  # one copy to the host per device
            rows[number] = row
    prints = []
    for (name, tensor, partition), shape, row in zip(parameters, global_shapes, rows):
        prints.append(ShardPrint(name, str(tensor.dtype).removeprefix("torch."), shape, partition.dim, row[-1],
                                 row[:-1]))
    return prints


def _global_shape(tensor: torch.Tensor, partition: Partition) -> list[int]:
    shape = list(tensor.shape) or [1]
    if partition.dim >= 0:
        shape[partition.dim] *= partition.size
    return shape


def _group_sums(tensors: list[torch.Tensor], shape: list[int], partition: Partition,
                tables: list[torch.Tensor]) -> torch.Tensor:
    """[len(tensors), CHECKSUMS + 1]: each tensor's checksums and sum of squares, accumulated in float64 over
    chunks of BATCH elements, each chunk's in its compute dtype (`_compute_dtype`)."""
    device = tables[0].device
    dtype = _compute_dtype(tensors[0].dtype, device)
    row_signs, column_signs = _sign_vectors(shape, partition, tables, dtype)
    n_rows, n_columns = row_signs.shape[0], column_signs.shape[0]
    totals = torch.zeros(len(tensors), CHECKSUMS + 1, dtype=torch.float64, device=device)
    size = n_rows * n_columns
    per_chunk = max(1, BATCH // size) if size < STACKED else 1  # small tensors stacked (a copy), large ones not
    column_step = min(n_columns, ROW_SUM)
    row_step = max(1, BATCH // column_step)
    for first in range(0, len(tensors), per_chunk):
        members = [t.reshape(n_rows, n_columns) for t in tensors[first:first + per_chunk]]
        chosen = slice(first, first + len(members))
        for r in range(0, n_rows, row_step):
            for c in range(0, n_columns, column_step):
                parts = [m[r:r + row_step, c:c + column_step] for m in members]
                block = (torch.stack(parts) if len(parts) > 1 else parts[0][None]).to(dtype)
                projected = (block @ column_signs[c:c + column_step]) * row_signs[r:r + row_step]
                totals[chosen, :CHECKSUMS] += projected.sum(1)
                flat = block.reshape(len(parts), -1)
                totals[chosen, CHECKSUMS] += torch.linalg.vecdot(flat, flat)
    return totals


def _compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float32 on the CPU, where float32 matrix products are exact products with rounded sums, for weights other
    than float64: bf16 and fp16 values are exact in float32 and the signs are ±1, so only the sums round, each
    over at most ROW_SUM elements (measured: the same weights at TP 1, 2, 4 and 8 at most 4e-7 apart, against the
    bf16 rounding of a weight, 1.5e-3), at a fifth of float64's cost. float64 elsewhere, and wherever float32
    products may be rounded to TF32 or bf16 (`torch.set_float32_matmul_precision` other than "highest", which
    a training script may set): a GPU's float64 is fast enough for one pass, and no setting rounds it."""
    cpu_exact = device.type == "cpu" and torch.get_float32_matmul_precision() == "highest"
    return torch.float32 if cpu_exact and dtype != torch.float64 else torch.float64


@dataclass(frozen=True)
class WeightPrint:
    """One parameter's fingerprint over the whole model (every TP rank's part summed)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    norm: float
    checksums: tuple[float, ...]

    def distance(self, other: "WeightPrint") -> float:
        """How far the two parameters' values are apart, relative to their norms' root mean square (see the
        module docstring): 0 the same, √2 two independent draws of equal norm."""
        squared = sum((a - b) ** 2 for a, b in zip(self.checksums, other.checksums)) / len(self.checksums)
        scale = math.sqrt((self.norm ** 2 + other.norm ** 2) / 2)
        return math.sqrt(squared) / scale if scale > 0 else 0.0


@dataclass
class JoinedPrints:
    """A run's weights as the ranks recorded them, joined: by canonical name, in the model's order."""

    prints: dict[str, WeightPrint] = field(default_factory=dict)
    incomplete: list[str] = field(default_factory=list)  # split parameters some TP rank's part of is missing


def joined(records: list[dict[str, Any]]) -> JoinedPrints:
    """One run's per-rank records (`model-<PID>.json`'s "weights" with the rank's "parallel" sizes) joined: the
    replicas of data and context parallelism left out (their rank 0 kept), each split parameter's TP parts summed."""
    parts: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    sizes: dict[str, int] = {}
    for record in records:
        parallel = record.get("parallel") or {}
        if parallel.get("dp_rank", 0) or parallel.get("cp_rank", 0):
            continue
        for shard in record.get("weights") or []:
            parts.setdefault(shard["name"], []).append((parallel.get("tp_rank", 0), shard))
            sizes[shard["name"]] = parallel.get("tp", 1)
    result = JoinedPrints()
    for name, shards in parts.items():
        by_rank = dict(sorted(shards, key=lambda pair: pair[0]))
        first = next(iter(by_rank.values()))
        if first["split_dim"] < 0:
            chosen = [first]
        elif sorted(by_rank) == list(range(sizes[name])):
            chosen = list(by_rank.values())
        else:
            result.incomplete.append(name)
            continue
        result.prints[name] = WeightPrint(
            name, first["dtype"], tuple(first["shape"]), math.sqrt(sum(s["sum_squares"] for s in chosen)),
            tuple(sum(s["checksums"][k] for s in chosen) for k in range(len(first["checksums"]))))
    return result


__all__ = ["CHECKSUMS", "INDEPENDENT", "SAME", "JoinedPrints", "Partition", "ShardPrint", "WeightPrint",
           "canonical_name", "joined", "layer_numbers", "partition_of", "shard_prints"]
