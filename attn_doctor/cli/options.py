"""The options the commands share, and turning their text into plain values (cases, grids, specs).

Only click and torch-free modules are imported here: `--help`, `--version` and argument errors answer
without loading torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from attn_doctor.core.case import (
    ALIBI_SLOPES,
    BIASES,
    DTYPES,
    FP8_BACKWARDS,
    FP8_RECIPES,
    INPUTS,
    MASK_NAMES,
    MASKS,
    QKV_FORMATS,
    SOFTMAX_TYPES,
    Case,
    make_case,
)
from attn_doctor.core.errors import BadInput
from attn_doctor.core.layouts import LAYOUT_ALIASES, LAYOUTS
from attn_doctor.core.processes import MAX_TIMEOUT_S
from attn_doctor.core.probe_kinds import layout_choices

MAX_COUNT = 2**31 - 1  # sizes, lengths, degrees, depths and indices: what a CUDA kernel's int32 index holds
MAX_SEED = 2**63 - 1  # torch seeds take 0 .. 2**64-1; the tool adds small offsets to a seed (side inputs, stacks)
MAX_REPEATS = 1000  # x --timeout stays within a lock's longest wait
MAX_WORKERS = 256
MAX_SCALE = 1000.0  # --softmax-scale: far past any model's (1/sqrt(head dim) and its layer scalings)


class Number(click.ParamType):
    """A whole or real number within [low, high], finite, as click parses an option's value. A value out of
    range is refused (BadInput: exit 2, one line naming the option and saying what it takes) before any work
    starts; `values` checks the items of a comma list the same way."""

    def __init__(self, kind: type, low: float | None, high: float | None, noun: str, bounds: str,
                 low_open: bool = False):
        self.kind, self.low, self.high, self.low_open = kind, low, high, low_open
        self.noun, self.bounds = noun, bounds  # "whole number", "from 1 to 2147483647"
        self.name = "integer" if kind is int else "float"

    def parse(self, raw: Any, option: str) -> tuple[int | float | None, str]:
        """`raw` (text, or a default) as a number in range, or None and what is wrong with it ("" when it is no
        finite number at all)."""
        number: int | float | None = None
        if self.kind is int and isinstance(raw, int) and not isinstance(raw, bool):
            number = raw
        elif self.kind is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
            number = float(raw)
        elif isinstance(raw, str):
            try:
                number = self.kind(raw.strip())
            except (ValueError, OverflowError):
                number = None
        if number is None or (self.kind is float and not math.isfinite(number)):
            return None, ""
        field = option.lstrip("-").replace("-", "_")  # as the case's own checks name it (--head-dim: head_dim)
        if self.low is not None and (number <= self.low if self.low_open else number < self.low):
            return None, f"{field} must be {'above' if self.low_open else 'at least'} {_number(self.low)}"
        if self.high is not None and number > self.high:
            return None, f"{field} must be at most {_number(self.high)}"
        return number, ""

    def value(self, raw: Any, option: str) -> int | float:
        """One number; BadInput naming `option` and what it takes otherwise."""
        number, wrong = self.parse(raw, option)
        if number is None:
            takes = f"a {self.noun} {self.bounds}"
            raise BadInput(f"{option} {_shown(raw)}: " + (f"{wrong} ({takes})" if wrong else f"expected {takes}"))
        return number

    def values(self, text: str, option: str) -> list:
        """A comma list of such numbers (at least one)."""
        takes = f"{self.noun}s {self.bounds}, separated by commas"
        parts = [part.strip() for part in str(text).split(",") if part.strip()]
        if not parts:
            raise BadInput(f"{option} {_shown(text)}: expected {takes}")
        numbers = []
        for part in parts:
            number, wrong = self.parse(part, option)
            if number is None:
                raise BadInput(f"{option} {_shown(text)}: " + (f"{wrong}, got {_shown(part)} ({takes})" if wrong
                                                               else f"expected {takes}, got {_shown(part)}"))
            numbers.append(number)
        return numbers

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | float:
        return self.value(value, param.opts[0] if param is not None and param.opts else "the value")


def _number(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _shown(raw: Any) -> str:
    text = str(raw).strip()
    return text if len(text) <= 40 else text[:37] + "..."


def count(low: int = 1, high: int = MAX_COUNT) -> Number:
    return Number(int, low, high, "whole number", f"from {low} to {high}")


SIZE = count()  # batch, seq, heads, head dims, TP and CP degrees, ranks, depths
INDEX = count(0)  # layer, step, rank, call and row indices; sequence lengths (0 allowed)
WINDOW_SIDE = count(-1)  # -1: unbounded
SEED = Number(int, 0, MAX_SEED, "whole number", f"from 0 to {MAX_SEED} = 2**63-1")
SECONDS = Number(float, 0, MAX_TIMEOUT_S, "number of seconds", f"above 0 and at most {MAX_TIMEOUT_S:.0f}, a week",
                 low_open=True)
REPEATS = count(1, MAX_REPEATS)
WORKERS = count(1, MAX_WORKERS)
SCALE = Number(float, 0, MAX_SCALE, "positive number", f"at most {MAX_SCALE:g}, e.g. 0.125", low_open=True)


class Shard(click.ParamType):
    """`--shard I/N`: the I-th of N slices of a sweep (1 <= I <= N <= MAX_COUNT), as (I, N)."""

    name = "I/N"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        index, _, total = str(value).partition("/")
        count_of = count(1).value(total, "--shard N") if total else None
        number = count(1, count_of or MAX_COUNT).value(index, "--shard I") if count_of else None
        if number is None:
            raise BadInput(f"--shard {_shown(value)}: expected I/N, the I-th of N slices (1 <= I <= N), e.g. 2/4")
        return number, count_of


SHARD = Shard()


# Sizes as the options read them (`capture --max-bytes`, `--max-memory`): binary units, however spelled (K, KB and
# KiB are 1024 bytes), as SLURM's --mem and nvidia-smi's MiB read them; one table, so a size means the same everywhere.
BYTE_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "m": 2**20, "mb": 2**20, "g": 2**30, "gb": 2**30}


class MemorySize(click.ParamType):
    """`--max-memory 24GiB`: bytes, in `BYTE_UNITS` (and T, TB, TiB); a bare number is refused, so that 24 is never
    read as 24 bytes."""

    name = "size"
    UNITS = {**{unit: scale for unit, scale in BYTE_UNITS.items() if unit not in ("", "b")}, "t": 2**40, "tb": 2**40}

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        import re

        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*", str(value))
        unit = found.group(2).lower() if found else ""
        scale = self.UNITS.get(unit[:-2] + "b" if unit.endswith("ib") else unit)  # KiB as KB
        size = float(found.group(1)) * scale if scale else 0.0
        if not scale or not 1 << 20 <= size <= 1 << 60:
            raise BadInput(f"{_option_name(param)} {_shown(value)}: expected a size with its unit from 1 MiB, "
                           "e.g. 24GiB, 48G or 500MiB")
        return int(size)


MEMORY_SIZE = MemorySize()


def _option_name(param: click.Parameter | None) -> str:
    """How the user named the parameter: its flag, or an argument's name in capitals (RESULTS)."""
    if param is None:
        return "the path"
    return param.opts[0] if isinstance(param, click.Option) and param.opts else param.human_readable_name


class OutputPath(click.ParamType):
    """Where results go (a file, or with `directory` a folder), checked writable as it is parsed: before anything
    runs (`attn_doctor.core.paths.check_output`)."""

    name = "path"

    def __init__(self, directory: bool = False):
        self.directory = directory

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        from attn_doctor.core.paths import check_output

        check_output(Path(value), _option_name(param), self.directory)
        return Path(value)


class InputPath(click.ParamType):
    """A file or folder to read (`kind`: "file", "folder" or "any"), checked readable as it is parsed; one that is
    missing is left to the command, which says what belongs there (`attn_doctor.core.paths.check_input`)."""

    name = "path"

    def __init__(self, kind: str = "any"):
        self.kind = kind

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        from attn_doctor.core.paths import check_input

        check_input(Path(value), _option_name(param), self.kind)
        return Path(value)


OUTPUT_FILE, OUTPUT_FOLDER = OutputPath(), OutputPath(directory=True)
INPUT_FILE, INPUT_FOLDER, INPUT_ANY = InputPath("file"), InputPath("folder"), InputPath()


def _stack(fn: Callable, options: list[Callable]) -> Callable:
    for option in reversed(options):
        fn = option(fn)
    return fn


def int_list(text: str | None, name: str, number: Number = INDEX) -> list[int] | None:
    """`--NAME`'s comma list of whole numbers, each checked by `number` (default: an index, >= 0)."""
    return None if text is None else number.values(text, f"--{name}")


def float_list(text: str, name: str, number: Number = SCALE) -> list[float]:
    return number.values(text, f"--{name}")


def _one(values: list, option: str) -> int | float:
    """The one value of an option that takes a list only under `sweep`."""
    if len(values) != 1:
        raise BadInput(f"{option} takes one value here, got {len(values)}: sweep the values with `attn-doctor sweep`")
    return values[0]


def window(text: str | None) -> tuple[int, int] | None:
    if text is None or text.lower() == "none":
        return None
    values = int_list(text, "window", WINDOW_SIDE)
    if values is None or len(values) != 2:
        raise BadInput(f"--window takes LEFT,RIGHT (e.g. 256,0; -1 = unbounded), got {text!r}")
    return values[0], values[1]


def choices(text: str, allowed: tuple[str, ...], name: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise BadInput(f"--{name} takes a comma list of {', '.join(allowed)}, got {text!r}")
    return values


def alibi_slopes(text: str) -> str | tuple[float, ...]:
    """--alibi-slopes: random, random-batch, or a comma list of numbers (checked against the heads by the case)."""
    text = text.strip()
    if text in ALIBI_SLOPES:
        return text
    return tuple(float_list(text, "alibi-slopes"))


def case_options(fn: Callable) -> Callable:
    """The case flags of run and bisect."""
    return _stack(fn, [
        click.option("--recipe", help="A TOML case from recipes/ (name or path); flags override it."),
        click.option("--batch", type=SIZE, help="Batch size [4]."),
        click.option("--seq", type=SIZE, help="Query sequence length [1024]."),
        click.option("--seq-kv", type=SIZE, help="Key/value sequence length (cross-attention) [= --seq]."),
        click.option("--heads", type=SIZE, help="Query heads [16]."),
        click.option("--kv-heads", type=SIZE, help="Key/value heads (GQA when fewer) [= --heads]."),
        click.option("--head-dim", type=SIZE, help="Head dimension [64]."),
        click.option("--dtype", type=click.Choice(DTYPES), help="Input dtype [bf16]."),
        click.option("--mask", type=click.Choice(MASK_NAMES),
                     help="TE's attn_mask_type (none = no_mask) [causal]."),
        click.option("--window", help="Sliding window LEFT,RIGHT (-1 = unbounded) [none]."),
        click.option("--seed", type=SEED, help="Seed of q, k, v and the output gradient [1234]."),
        click.option("--inputs", type=click.Choice(INPUTS),
                     help="Distribution of q, k, v (the output gradient stays normal) [normal]."),
        *api_options(grid=False),
    ])


def api_options(grid: bool) -> list[Callable]:
    """The flags of TE's attention API beyond shapes and masks (comma lists under `sweep`)."""
    listing = "Comma list of " if grid else ""
    return [
        click.option("--qkv-format", help=f"{listing}TE's qkv_format: {', '.join(QKV_FORMATS)} [sbhd]."),
        click.option("--seqlens", multiple=grid,
                     help="Per-sequence query lengths, e.g. 512,387,257 (needs a padding mask; sets --batch)"
                          + (" (repeat for a grid)." if grid else ".")),
        click.option("--seqlens-kv", multiple=grid, help="Per-sequence key/value lengths [= --seqlens]."),
        click.option("--pad-between-seqs", is_flag=True, default=None,
                     help="thd: padding after each sequence in the packed tensor (cu_seqlens_*_padded)."),
        click.option("--head-dim-v", help=f"{listing}v's head dim for MLA, e.g. 128 with --head-dim 192 [= --head-dim]."),
        click.option("--bias", help=f"{listing}core_attention_bias: {', '.join(BIASES)} [no_bias]."),
        click.option("--softmax", help=f"{listing}TE's softmax_type: {', '.join(SOFTMAX_TYPES)} [vanilla]."),
        click.option("--fp8", help=f"{listing}FP8 attention recipe: {', '.join(FP8_RECIPES)} [none]."),
        click.option("--mask-source", help="The explicit mask of --mask arbitrary: random:P (P masked out)."),
        click.option("--softmax-scale", help=f"{listing}TE's softmax_scale [1/sqrt(head dim)]."),
        click.option("--alibi-slopes", help="Custom ALiBi slopes with --bias alibi: random (|N(0,1)| per head, "
                                            "seeded), random-batch (per sequence and head), or one number per head "
                                            "(e.g. 0.5,0.25) [TE's own]."),
        click.option("--max-logit", is_flag=True, default=None,
                     help="TE's return_max_logit: the max score per head is returned too, judged against float64."),
        click.option("--num-splits", help=f"{listing}TE's num_splits (FlashAttention 3's split control) [1]."),
        click.option("--padding-mask", is_flag=True, default=None,
                     help="Padding masks: pass TE's boolean attention_mask alongside cu_seqlens (sbhd/bshd)."),
        click.option("--forward-only", is_flag=True, default=None,
                     help="Run the forward alone (the module in eval mode), judged on out (and the max logit)."),
        click.option("--fp8-backward", help=f"{listing}The backward of FP8 attention: {', '.join(FP8_BACKWARDS)} "
                                            "(f16: NVTE_FP8_DPA_BWD=0, an F16/BF16 backward of the FP8 forward) "
                                            "[fp8]."),
    ] + ([] if grid else [click.option("--replay", help="A captured call to check (DIR@RANK.PID.INDEX, as "
                                                        "`attn-doctor replay` names it): its shapes and values.")])


def grid_options(fn: Callable) -> Callable:
    """The case flags of `sweep`: each takes a comma list; the sweep runs their cross product."""
    return _stack(fn, [
        click.option("--recipe", help="A TOML case from recipes/; its [grid] table may declare lists too."),
        click.option("--family", help="Comma list of the recipe's grid families to run (e.g. --recipe te-tests "
                                      "--family fa4_base,fa4_mla) [all]."),
        click.option("--batch", help="Batch sizes, e.g. 1,4."),
        click.option("--seq", help="Query lengths, e.g. 512,1024,4096."),
        click.option("--seq-kv", help="Key/value lengths (cross-attention)."),
        click.option("--heads", help="Query heads."),
        click.option("--kv-heads", help="Key/value heads, e.g. 16,4,1."),
        click.option("--head-dim", help="Head dimensions, e.g. 64,128."),
        click.option("--dtype", help=f"Dtypes among {', '.join(DTYPES)}."),
        click.option("--mask", help=f"Masks among {', '.join(MASKS)}."),
        *api_options(grid=True),
        click.option("--window", "windows", multiple=True, help="A sliding window LEFT,RIGHT (repeat for a grid)."),
        click.option("--seed", help="Seeds."),
        click.option("--inputs", help=f"Distributions of q, k, v among {', '.join(INPUTS)}."),
        click.option("--layers", help="Depths of the GPT stack, e.g. 24,128 (checks dQ through L layers)."),
        click.option("--tp", help="Tensor-parallel degrees, e.g. 1,2,4 (heads split into shards)."),
    ])


def backend_options(fn: Callable) -> Callable:
    return _stack(fn, [
        click.option("--backend", "backends", multiple=True, metavar="NAME",
                     help="A backend to check (repeatable; 'te' and 'sdpa' name a whole family). "
                          "Default: all built-in backends but TE's layers (te.mha, te.layer: named only), or only "
                          "the --kernel ones when given."),
        click.option("--kernel", "kernels", multiple=True, metavar="[NAME=]TARGET:FUNC",
                     help="Your own kernel fn(q, k, v, *, causal, softmax_scale, **more) on bshd tensors; "
                          "TARGET is a module or a .py path (repeatable). Masks, lengths, bias and sinks arrive "
                          "as the keywords allowed, seqlens_q/kv, bias, softmax_offset when it takes them."),
        click.option("--layout", "layouts", multiple=True, metavar="NAME",
                     type=click.Choice(layout_choices() + tuple(LAYOUT_ALIASES)),
                     help=f"A memory layout to feed (repeatable): {', '.join(LAYOUTS)}, or TE's names (sb3hd, "
                          "thd_t2hd, ...) [contiguous, sb3hd_packed, sbh3d_packed, head_slice, transposed; thd: "
                          "contiguous, head_slice, qkv_3hd, kv_2hd]."),
        click.option("--te", "te_release", metavar="VERSION[,...]",
                     help="Run TE's paths on this TE release, prepared with `attn-doctor te add VERSION`; a list "
                          "runs each path once per release. The TE each worker imported is read back."),
        click.option("--cudnn", metavar="VERSION|PATH[,...]",
                     help="Run TE's paths on this cuDNN build (a version `attn-doctor env` lists, or a library "
                          "folder); a list runs each path once per build. What TE loaded is read back per row."),
        click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N."),
        click.option("--max-memory", type=MEMORY_SIZE, metavar="SIZE",
                     help="Memory all of attn-doctor's processes may use together, e.g. 24GiB: a budget below the "
                          "card's size behaves like a smaller card (on the CPU: of the RAM). Default: what is free "
                          "when the command starts, less a margin."),
        click.option("--timeout", type=SECONDS, default=300.0, show_default=True,
                     help=f"Seconds one probe may take before its worker is killed (ERROR row); at most "
                          f"{MAX_TIMEOUT_S:.0f} (a week)."),
    ])


def repeats_option(fn: Callable) -> Callable:
    """`--repeats N` of run and sweep (bisect has its own: any failing run counts). Not a recipe key: like
    --timeout it says how to run a case, not which case."""
    return click.option(
        "--repeats", type=REPEATS, default=1, show_default=True,
        help="Run each single call N times on the same inputs: whether the repeats are bitwise identical, their "
             "spread, and the verdict on the worst repeat (not with --tp, --layers or --nproc).")(fn)


def given(name: str) -> bool:
    """Whether the user gave the option whose parameter is `name` (on the command line or in the environment),
    not its default: an option whose default is shown may still be one that would be ignored."""
    from click.core import ParameterSource

    source = click.get_current_context().get_parameter_source(name)
    return source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def refuse_ignored(option: str, applies: str, fix: str) -> None:
    """An option that would be ignored is bad input (the README's promise): `option` only applies `applies`."""
    raise BadInput(f"{option} only applies {applies}: {fix}")


def build_case(options: dict[str, Any]) -> Case:
    """The case from --recipe overridden by explicit flags; validated."""
    from attn_doctor.core.recipes import load_recipe

    fields: dict[str, Any] = {}
    if options.get("recipe"):
        fields.update(load_recipe(options["recipe"]).case)
    if options.get("replay"):  # the captured call's case; flags still override (and must keep its shapes)
        from attn_doctor.tracing.replay_case import case_of_reference

        fields.update(case_of_reference(options["replay"]).to_dict())
    for name in ("batch", "seq", "seq_kv", "heads", "kv_heads", "head_dim", "dtype", "mask", "seed", "inputs",
                 "qkv_format", "bias", "softmax", "fp8", "mask_source", "pad_between_seqs", "replay", "fp8_backward",
                 "padding_mask", "forward_only"):
        if options.get(name) is not None:
            fields[name] = options[name]
    if options.get("max_logit") is not None:
        fields["return_max_logit"] = options["max_logit"]
    if options.get("num_splits") is not None:
        fields["num_splits"] = _one(int_list(options["num_splits"], "num-splits", SIZE), "--num-splits")
    if options.get("alibi_slopes") is not None:
        fields["alibi_slopes"] = alibi_slopes(options["alibi_slopes"])
    if options.get("window") is not None:
        fields["window"] = window(options["window"])
    if options.get("head_dim_v") is not None:
        fields["head_dim_v"] = _one(int_list(options["head_dim_v"], "head-dim-v", SIZE), "--head-dim-v")
    if options.get("softmax_scale") is not None:
        fields["scale"] = _one(float_list(options["softmax_scale"], "softmax-scale"), "--softmax-scale")
    for name in ("seqlens", "seqlens_kv"):
        if options.get(name) is not None:
            fields[name] = tuple(int_list(options[name], name.replace("_", "-")))
    case = check_seed(make_case(**fields))
    if case.replay is not None:
        from attn_doctor.tracing.replay_case import check_captured_shapes

        check_captured_shapes(case)
    return case


def given_case_fields(options: dict[str, Any]) -> set[str]:
    """The case fields the user chose, by a flag or in the recipe's [case] (the others are the defaults, which
    `run` may size to the machine: `attn_doctor.core.cpu_sizing`)."""
    from attn_doctor.core.recipes import load_recipe

    chosen = set(load_recipe(options["recipe"]).case) if options.get("recipe") else set()
    return chosen | {name for name, value in options.items() if value is not None and name != "recipe"}


def build_grid(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]], list[int] | None,
                                                   list[int] | None]:
    """Base fields, gridded fields, depths and TP degrees from --recipe and the comma-list flags."""
    from attn_doctor.core.recipes import load_recipe

    base: dict[str, Any] = {}
    grid: dict[str, list[Any]] = {}
    depths = degrees = None
    if options.get("recipe"):
        recipe = load_recipe(options["recipe"])
        base.update(recipe.case)
        recipe_grid = dict(recipe.grid)
        depths = recipe_grid.pop("layers", None)
        degrees = recipe_grid.pop("tp", None)
        grid.update(recipe_grid)
    for name in ("batch", "seq", "seq_kv", "heads", "kv_heads", "head_dim", "seed"):
        if options.get(name) is not None:
            grid[name] = int_list(options[name], name.replace("_", "-"), SEED if name == "seed" else SIZE)
    for name, allowed in (("dtype", DTYPES), ("mask", MASK_NAMES), ("inputs", INPUTS), ("qkv_format", QKV_FORMATS),
                          ("bias", BIASES), ("softmax", SOFTMAX_TYPES), ("fp8", FP8_RECIPES),
                          ("fp8_backward", FP8_BACKWARDS)):
        if options.get(name) is not None:
            grid[name] = choices(options[name], allowed, name.replace("_", "-"))
    if options.get("head_dim_v") is not None:
        grid["head_dim_v"] = int_list(options["head_dim_v"], "head-dim-v", SIZE)
    if options.get("softmax_scale") is not None:
        grid["scale"] = float_list(options["softmax_scale"], "softmax-scale")
    for name in ("seqlens", "seqlens_kv"):
        if options.get(name):
            grid[name] = [tuple(int_list(text, name.replace("_", "-"))) for text in options[name]]
    if options.get("num_splits") is not None:
        grid["num_splits"] = int_list(options["num_splits"], "num-splits", SIZE)
    for name in ("mask_source", "pad_between_seqs", "padding_mask", "forward_only"):
        if options.get(name) is not None:
            base[name] = options[name]
    if options.get("max_logit") is not None:
        base["return_max_logit"] = options["max_logit"]
    if options.get("alibi_slopes") is not None:
        base["alibi_slopes"] = alibi_slopes(options["alibi_slopes"])
    if options.get("windows"):
        grid["window"] = [window(w) for w in options["windows"]]
    if options.get("layers") is not None:
        depths = int_list(options["layers"], "layers", SIZE)
    if options.get("tp") is not None:
        degrees = int_list(options["tp"], "tp", SIZE)
    for name, values in (("layers", depths), ("tp", degrees)):
        if values is not None and (not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                                     for v in values)):
            raise BadInput(f"--{name} (or the recipe's grid.{name}) takes whole numbers >= 1, got {values}")
    return base, grid, depths, degrees


def build_cases(options: dict[str, Any]) -> tuple[list[Case], list[str], list[int] | None, list[int] | None,
                                                   list[str]]:
    """`sweep`'s cases: the recipe's grids (each over its [case] and [grid]) with the flags' lists over them
    all, expanded; the reasons of the combinations left out (a recipe with drop_invalid); depths, TP degrees;
    the recipe's layouts."""
    from attn_doctor.core.case import expand_grids
    from attn_doctor.core.recipes import load_recipe

    base, grid, depths, degrees = build_grid(options)
    recipe = load_recipe(options["recipe"]) if options.get("recipe") else None
    families = [name.strip() for name in options["family"].split(",")] if options.get("family") else None
    if families is not None and (recipe is None or not recipe.family_names()):
        raise BadInput("--family picks grids of a recipe that names families ([[grids]] family = ...): add --recipe "
                       "te-tests, or drop --family")
    if recipe is None or not recipe.grids:
        cases, dropped = expand_grids(base, [grid], drop_invalid=recipe is not None and recipe.drop_invalid)
        return [check_seed(c) for c in cases], dropped, depths, degrees, list(recipe.layouts) if recipe else []
    _, flags, _, _ = build_grid({**options, "recipe": None})
    grids = [{**recipe.grid, **sub, **flags} for sub in recipe.grids_of(families)]
    cases, dropped = expand_grids(base, grids, drop_invalid=recipe.drop_invalid)
    return [check_seed(c) for c in cases], dropped, depths, degrees, list(recipe.layouts)


def check_seed(case: Case) -> Case:
    """A case's seed (a recipe's too) in the range the flags take: torch's generators take it, and what the
    tool adds to it (the side inputs' and the stack's seeds) too."""
    SEED.value(case.seed, "--seed (or the recipe's seed)")
    return case
