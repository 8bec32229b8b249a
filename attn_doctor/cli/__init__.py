"""The command line: parses, wires, prints. Logic lives in the modules it calls."""

from __future__ import annotations

import datetime
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from attn_doctor.core.case import DTYPES, MASKS, Case, load_recipe, make_case
from attn_doctor.core.errors import BadInput
from attn_doctor.core.layouts import LAYOUTS
from attn_doctor.results.document import dumps, write_atomic

EXIT_OK, EXIT_FAULT, EXIT_BAD_INPUT = 0, 1, 2
REPORTS_DIR = Path("reports")


class DoctorGroup(click.Group):
    """A group whose every bad input ends as one line on stderr and exit code 2, never a traceback."""

    invoked_args: list[str] = []
    started = 0.0

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # noqa: D102
        DoctorGroup.invoked_args = list(sys.argv[1:] if args is None else args)
        DoctorGroup.started = time.perf_counter()
        try:
            code = super().main(args, prog_name or "attn-doctor", complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            hint = f" (see `attn-doctor {exc.ctx.info_name} --help`)" if exc.ctx and exc.ctx.parent else ""
            click.echo(f"attn-doctor: error: {exc.format_message()}{hint}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except BadInput as exc:
            click.echo(f"attn-doctor: error: {exc}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("attn-doctor: aborted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else EXIT_OK)


def _console() -> Console:
    return Console(highlight=False, markup=False, soft_wrap=False)


def _command_line() -> str:
    """The command as the user typed it, for the report's reproduce line."""
    return " ".join(["attn-doctor", *(shlex.quote(str(a)) for a in DoctorGroup.invoked_args)])


def _int_list(text: str | None, name: str) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BadInput(f"--{name} takes whole numbers separated by commas, got {text!r}") from None
    if not values:
        raise BadInput(f"--{name} needs at least one whole number, got {text!r}")
    return values


def _window(text: str | None) -> tuple[int, int] | None:
    if text is None or text.lower() == "none":
        return None
    values = _int_list(text, "window")
    if values is None or len(values) != 2:
        raise BadInput(f"--window takes LEFT,RIGHT (e.g. 256,0; -1 = unbounded), got {text!r}")
    return values[0], values[1]


def case_options(fn):
    """The case flags shared by run, sweep and bisect."""
    options = [
        click.option("--recipe", help="A TOML case from recipes/ (name or path); flags override it."),
        click.option("--batch", type=int, help="Batch size [4]."),
        click.option("--seq", type=int, help="Query sequence length [1024]."),
        click.option("--seq-kv", type=int, help="Key/value sequence length (cross-attention) [= --seq]."),
        click.option("--heads", type=int, help="Query heads [16]."),
        click.option("--kv-heads", type=int, help="Key/value heads (GQA when fewer) [= --heads]."),
        click.option("--head-dim", type=int, help="Head dimension [64]."),
        click.option("--dtype", type=click.Choice(DTYPES), help="Input dtype [bf16]."),
        click.option("--mask", type=click.Choice(MASKS), help="Attention mask [causal]."),
        click.option("--window", help="Sliding window LEFT,RIGHT (-1 = unbounded) [none]."),
        click.option("--seed", type=int, help="Seed of q, k, v and the output gradient [1234]."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def backend_options(fn):
    options = [
        click.option("--backend", "backends", multiple=True, metavar="NAME",
                     help="A backend to check (repeatable; 'te' and 'sdpa' name a whole family). "
                          "Default: all built-in backends, or only the --kernel ones when given."),
        click.option("--kernel", "kernels", multiple=True, metavar="[NAME=]TARGET:FUNC",
                     help="Your own kernel fn(q, k, v, *, causal, softmax_scale) on bshd tensors; "
                          "TARGET is a module or a .py path (repeatable)."),
        click.option("--layout", "layouts", multiple=True, type=click.Choice(LAYOUTS),
                     help="A memory layout to feed (repeatable) [all]."),
        click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N."),
        click.option("--timeout", type=float, default=300.0, show_default=True,
                     help="Seconds one probe may take before its worker is killed (ERROR row)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def build_case(options: dict[str, Any]) -> Case:
    """The case from --recipe overridden by explicit flags; validated."""
    fields: dict[str, Any] = {}
    if options.get("recipe"):
        fields.update(load_recipe(options["recipe"]).case)
    for name in ("batch", "seq", "seq_kv", "heads", "kv_heads", "head_dim", "dtype", "mask", "seed"):
        if options.get(name) is not None:
            fields[name] = options[name]
    if options.get("window") is not None:
        fields["window"] = _window(options["window"])
    return make_case(**fields)


def build_specs(backends: tuple[str, ...], kernels: tuple[str, ...]):
    from attn_doctor.backends import resolve
    from attn_doctor.backends.kernel import parse_kernel_spec

    kernel_specs = [parse_kernel_spec(k) for k in kernels]
    specs = resolve(list(backends)) if backends or not kernel_specs else []
    names = [s.name for s in specs]
    for spec in kernel_specs:
        if spec.name in names:
            raise BadInput(f"--kernel name {spec.name!r} is taken; give it another with NAME=TARGET:FUNC")
        names.append(spec.name)
    return specs + kernel_specs


def new_run_dir(kind: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = REPORTS_DIR / f"{kind}-{stamp}"
    suffix = 1
    while path.exists():
        suffix += 1
        path = REPORTS_DIR / f"{kind}-{stamp}-{suffix}"
    return path


@click.group(cls=DoctorGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="attn-doctor", prog_name="attn-doctor")
def cli() -> None:
    """Find which attention kernel path computes a wrong forward or gradient, and by how much.

    Exit codes: 0 every tested path passes, 1 a path FAILs or ERRORs, 2 bad input.
    """


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the fingerprint as JSON.")
@click.option("--no-te", is_flag=True, help="Do not import TE (skips the probe subprocess).")
def env(as_json: bool, no_te: bool) -> int:
    """Fingerprint this machine: GPUs, driver, CUDA, torch, both cuDNNs, TE, flash-attn, NVTE_* variables."""
    from attn_doctor.backends import te_installed
    from attn_doctor.machine.fingerprint import collect_env
    from attn_doctor.render.env_view import env_rich_table

    report = collect_env(probe_te=not no_te and te_installed())
    if as_json:
            click.echo(dumps(report.to_dict()), nl=False)
    else:
        _console().print(env_rich_table(report))
    return EXIT_OK


@cli.command()
@case_options
@backend_options
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the results document here (default: reports/<run-id>/results.json).")
@click.option("--profile", is_flag=True, help="Print where the time went (startup, reference, kernels, ...).")
@click.option("--nproc", type=int, help="Run on N ranks launched with torchrun (N = --tp x --cp), gathering to rank 0.")
@click.option("--tp", "tp_degree", type=int, default=1, show_default=True, help="With --nproc: tensor-parallel ranks.")
@click.option("--cp", "cp_degree", type=int, default=1, show_default=True, help="With --nproc: context-parallel ranks.")
@click.option("--cp-comm-type", default="p2p", show_default=True, help="With --cp: p2p, a2a or all_gather.")
def run(json_path: Path | None, profile: bool, nproc: int | None, tp_degree: int, cp_degree: int, cp_comm_type: str,
        backends, kernels, layouts, device, timeout, **case_flags) -> int:
    """Check every backend x layout on one case against float64 and name the faulty kernel path."""
    from attn_doctor.render.env_view import env_rich_table
    from attn_doctor.render.terminal import notes_lines, results_table
    from attn_doctor.execution.session import diagnose, resolve_device

    case = build_case(case_flags)
    specs = build_specs(backends, kernels)
    device = resolve_device(device)
    out_path = json_path or new_run_dir("run") / "results.json"
    console = _console()
    with console.status(f"checking {len(specs)} backends on {case.short()} ({device})", spinner="dots"):
        if nproc is not None:
            report = _run_distributed(case, specs, device, nproc, tp_degree, cp_degree, cp_comm_type, timeout)
        else:
            report = diagnose([case], specs, list(layouts or LAYOUTS), device, command=_command_line(),
                              timeout_s=timeout)
    if report.env is not None:
        console.print(env_rich_table(report.env))
    console.print(results_table(report.rows, title=f"{case.short()} on {device}"))
    for line in notes_lines(report.rows):
        console.print(line)
    console.print(report.summary, style="bold red" if report.faulty else "bold green")
    if report.env is not None:
        print_defects(console, case_defects(report.env, [case]), "Known TE/cuDNN defects that match this machine and case:")
    write_atomic(out_path, dumps(report.to_dict()))
    console.print(f"results: {out_path}\nreport:  attn-doctor report {out_path} --format markdown")
    if profile:
        report.seconds["command (wall, since start of the CLI)"] = time.perf_counter() - DoctorGroup.started
        for name, seconds in report.seconds.items():
            console.print(f"  {name:<42} {seconds:8.2f} s")
    return report.exit_code


def _run_distributed(case, specs, device, nproc, tp, cp, cp_comm_type, timeout):
    """`run --nproc`: each backend on N torchrun ranks, judged against the baseline rank 0 measured."""
    from attn_doctor.distributed import launch as distributed
    from attn_doctor.verdict.diagnosis import judge
    from attn_doctor.execution.session import finish_report

    comm = cp_comm_type if cp > 1 else None
    distributed.validate_grid(nproc, tp, cp, comm, device)
    outcomes = distributed.launch_many([(spec, case) for spec in specs], nproc=nproc, tp=tp, cp=cp,
                                       cp_comm_type=comm, device=device, timeout_s=timeout)
    baselines = [row for row in map(distributed.baseline_row, outcomes) if row is not None]
    rows = judge(baselines[:1] + [distributed.to_row(outcome) for outcome in outcomes])
    rows = [distributed.apply_rank_verdicts(row) if row.coords else row for row in rows]
    return finish_report(rows, device, _command_line(), te_facts=None)


def grid_options(fn):
    """The case flags of `sweep`: each takes a comma list; the sweep runs their cross product."""
    options = [
        click.option("--recipe", help="A TOML case from recipes/; its [grid] table may declare lists too."),
        click.option("--batch", help="Batch sizes, e.g. 1,4."),
        click.option("--seq", help="Query lengths, e.g. 512,1024,4096."),
        click.option("--seq-kv", help="Key/value lengths (cross-attention)."),
        click.option("--heads", help="Query heads."),
        click.option("--kv-heads", help="Key/value heads, e.g. 16,4,1."),
        click.option("--head-dim", help="Head dimensions, e.g. 64,128."),
        click.option("--dtype", help=f"Dtypes among {', '.join(DTYPES)}."),
        click.option("--mask", help=f"Masks among {', '.join(MASKS)}."),
        click.option("--window", "windows", multiple=True, help="A sliding window LEFT,RIGHT (repeat for a grid)."),
        click.option("--seed", help="Seeds."),
        click.option("--layers", help="Depths of the GPT stack, e.g. 24,128 (checks dQ through L layers)."),
        click.option("--tp", help="Tensor-parallel degrees, e.g. 1,2,4 (heads split into shards)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _recipe_window(value, path) -> tuple[int, int] | None:
    if value is None or value == "none":
        return None
    if not isinstance(value, list) or len(value) != 2 or not all(isinstance(v, int) for v in value):
        raise BadInput(f"recipe {path}: each grid.window entry must be [LEFT, RIGHT] (whole numbers), got {value!r}")
    return value[0], value[1]


def _choices(text: str, allowed: tuple[str, ...], name: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise BadInput(f"--{name} takes a comma list of {', '.join(allowed)}, got {text!r}")
    return values


def build_grid(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]], list[int] | None, list[int] | None]:
    """Base fields, gridded fields, depths and TP degrees from --recipe and the comma-list flags."""
    base: dict[str, Any] = {}
    grid: dict[str, list[Any]] = {}
    depths = degrees = None
    if options.get("recipe"):
        recipe = load_recipe(options["recipe"])
        base.update(recipe.case)
        recipe_grid = dict(recipe.grid)
        depths = recipe_grid.pop("layers", None)
        degrees = recipe_grid.pop("tp", None)
        if "window" in recipe_grid:
            recipe_grid["window"] = [_recipe_window(w, recipe.path) for w in recipe_grid["window"]]
        grid.update(recipe_grid)
    for name in ("batch", "seq", "seq_kv", "heads", "kv_heads", "head_dim", "seed"):
        if options.get(name) is not None:
            grid[name] = _int_list(options[name], name.replace("_", "-"))
    for name, allowed in (("dtype", DTYPES), ("mask", MASKS)):
        if options.get(name) is not None:
            grid[name] = _choices(options[name], allowed, name)
    if options.get("windows"):
        grid["window"] = [_window(w) for w in options["windows"]]
    if options.get("layers") is not None:
        depths = _int_list(options["layers"], "layers")
    if options.get("tp") is not None:
        degrees = _int_list(options["tp"], "tp")
    for name, values in (("layers", depths), ("tp", degrees)):
        if values is not None and (not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                                     for v in values)):
            raise BadInput(f"--{name} (or the recipe's grid.{name}) takes whole numbers >= 1, got {values}")
    return base, grid, depths, degrees


@cli.command()
@grid_options
@backend_options
@click.option("--resume", type=click.Path(file_okay=False, path_type=Path),
              help="Continue the sweep in this directory, skipping the points already in its results.jsonl.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Directory for results.jsonl, results.json and the plot (default: reports/sweep-<stamp>).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Worker processes per backend family, each taking whole points  [default: 2 on a GPU, "
                   "1 on the CPU; depth sweeps always 1]")
def sweep(backends, kernels, layouts, device, timeout, resume, out_dir, workers, **grid_flags) -> int:
    """Run a grid of cases, depth stacks (--layers) or TP shards (--tp); stream results; summarise."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from attn_doctor.workflows import sweep as sweeping
    from attn_doctor.render.terminal import depth_table, notes_lines, tally_table
    from attn_doctor.execution.session import Session, finish_report, resolve_device

    base, grid, depths, degrees = build_grid(grid_flags)
    cases = sweeping.expand_grid(base, grid)
    specs = build_specs(backends, kernels)
    device = resolve_device(device)
    if resume is not None and out_dir is not None and resume != out_dir:
        raise BadInput("give either --resume DIR or --out DIR, not both")
    directory = resume or out_dir or new_run_dir("sweep")
    if resume is not None and not (resume / sweeping.RESULTS_FILE).exists():
        raise BadInput(f"--resume {resume}: no {sweeping.RESULTS_FILE} there; start the sweep with --out instead")
    log = sweeping.ResultsLog(directory)
    if resume is None and log.path.exists():
        raise BadInput(f"{directory} already holds a sweep ({log.path.name}); continue it with --resume {directory} "
                       "or choose another --out")
    done_rows, done_points = log.load()
    points = sweeping.plan_points(cases, list(layouts or LAYOUTS), depths, degrees)
    sweeping.check_resumable(directory, done_rows, points, specs)
    todo = [p for p in points if p.id not in done_points]
    console = _console()
    if done_points:
        console.print(f"resuming {directory}: {len(points) - len(todo)} of {len(points)} points already done")
    rows = list(done_rows)
    groups = [point.jobs(specs) for point in todo]
    if workers is None:
        workers = 2 if device.startswith("cuda") else 1
    with Session(device, timeout, workers_per_family=workers) as session, Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=Console(stderr=True), transient=True,
    ) as progress:
        task = progress.add_task("sweep", total=sum(len(jobs) for jobs in groups))

        def point_done(index: int, point_rows: list) -> None:
            log.append(todo[index], point_rows)  # streamed as each point completes, in any order
            progress.update(task, description=f"{todo[index].case.short()} [{todo[index].kind}] done")

        for point_rows in session.run_groups(groups, on_row=lambda _row: progress.advance(task), on_group=point_done):
            rows.extend(point_rows)
        report = finish_report(rows, device, _command_line(), te_facts=session.te_facts)
    lines = sweeping.depth_lines(rows)
    findings = sweeping.depth_findings(lines)
    plot = sweeping.plot_depth(lines, directory / sweeping.PLOT_FILE) if lines else None
    depth_text = sweeping.depth_sentence(findings)
    if depth_text:
        report.summary = f"{report.summary} {depth_text}"
    report.artifacts = {"plot": plot.name} if plot else {}
    console.print(tally_table(sweeping.tally(rows)))
    if lines:
        console.print(depth_table(lines))
    for line in notes_lines([r for r in rows if r.verdict == "ERROR"]):
        console.print(line)
    console.print(report.summary, style="bold red" if report.faulty else "bold green")
    write_atomic(directory / "results.json", dumps(report.to_dict()))
    console.print(f"results: {directory / 'results.json'} (streamed: {log.path})")
    if plot:
        console.print(f"plot:    {plot}")
    console.print(f"report:  attn-doctor report {directory} --format markdown")
    return report.exit_code


@cli.command()
@case_options
@backend_options
@click.option("--tp", type=int, default=1, show_default=True, help="Start from TP shards of this degree.")
@click.option("--layers", type=int, default=0, help="Start from an L-layer stack (0: one attention call).")
@click.option("--from", "from_results", type=click.Path(path_type=Path),
              help="Start from a failing row of a results file or sweep directory instead of the flags.")
@click.option("--row", "row_index", type=int, default=0, show_default=True,
              help="With --from: which failing row (0 = the first).")
@click.option("--repeats", type=int, default=1, show_default=True,
              help="Run each probe N times; any failing run counts (guards against nondeterministic kernels).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write {start_case, minimal_case, necessary, probes, repro} here.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the repro script goes (default: beside --from, else reports/bisect-<stamp>).")
def bisect(backends, kernels, layouts, device, timeout, tp, layers, from_results, row_index, repeats, json_path,
           out_dir, **case_flags) -> int:
    """Shrink a failing case to the smallest one that still fails, name the conditions it needs, and write a
    standalone repro script. Exit 0 when bisected, 1 when the start does not fail, 2 on bad input."""
    from attn_doctor import __version__
    from attn_doctor.bisect import engine as bisecting
    from attn_doctor.bisect.driver import bisect_probe, depth_diagnosis
    from attn_doctor.render.terminal import bisect_tables
    from attn_doctor.bisect.repro import write_repro
    from attn_doctor.execution.session import Session, resolve_device
    from attn_doctor.machine.fingerprint import collect_env

    if repeats < 1:
        raise BadInput("--repeats takes a whole number >= 1")
    if from_results is not None:
        spec, start, directory = _start_from_results(from_results, row_index)
    else:
        specs = build_specs(backends, kernels)
        if len(specs) != 1:
            raise BadInput("bisect follows one kernel path: give exactly one --backend or --kernel "
                           f"(got {len(specs)}), or --from RESULTS")
        if len(layouts) > 1:
            raise BadInput("bisect starts from one layout: give --layout at most once")
        spec = specs[0]
        start = bisecting.Config(build_case(case_flags), layouts[0] if layouts else "contiguous", tp, layers)
        directory = None
    if not bisecting.valid_config(start):
        raise BadInput(f"the starting point is impossible: {start.describe()} (check --layout, --tp and the heads)")
    device = resolve_device(device)
    directory = out_dir or directory or new_run_dir("bisect")
    console = _console()
    with Session(device, timeout) as session:
        probe = bisect_probe(session, spec)
        engine = bisecting.Bisector(probe, repeats=repeats, valid=bisecting.valid_config)
        try:
            with console.status(f"bisecting {spec.name} from {start.describe()}", spinner="dots"):
                result = engine.run(start)
        except bisecting.NothingToBisect as exc:
            console.print(f"nothing to bisect: {exc}", style="bold yellow")
            return EXIT_FAULT
        diagnosis = depth_diagnosis(session, spec, result)
        te_facts = session.te_facts
    for renderable in bisect_tables(result, spec.name, diagnosis):
        console.print(renderable)
    env = collect_env(te_facts=te_facts, probe_te=False)
    document = result.to_dict()
    document["backend"] = spec.name
    document["diagnosis"] = diagnosis
    repro_config = result.minimal if not result.minimal.layers else bisecting.Config(result.minimal.case,
                                                                                     result.minimal.layout)
    repro = write_repro(directory, spec.name, spec.family, spec.options, repro_config, env, __version__,
                        _command_line())
    document["repro"] = str(repro)
    console.print(f"repro:   {repro}  (python3 {repro.name}: exit 1 while wrong, 0 when fixed)")
    if result.minimal.layers:
        console.print("note: the failure needs depth; the repro checks the single call of the minimal case, "
                      f"reproduce the stack with: attn-doctor sweep --backend {spec.name} "
                      f"{result.minimal.case.cli_flags()} --layers {result.minimal.layers}")
    if json_path:
        write_atomic(json_path, dumps(document))
        console.print(f"json:    {json_path}")
    return EXIT_OK


def _start_from_results(path: Path, index: int):
    from attn_doctor.backends import BackendSpec
    from attn_doctor.bisect.engine import Config
    from attn_doctor.render.report_data import load_results

    data = load_results(path)
    failing = [r for r in data.report.rows if r.verdict in ("FAIL", "ERROR")]
    if not failing:
        raise BadInput(f"{path} has no failing row to start from; every path passed there")
    if not 0 <= index < len(failing):
        raise BadInput(f"--row {index}: {path} has {len(failing)} failing rows (0..{len(failing) - 1})")
    row = failing[index]
    spec = BackendSpec(row.backend, row.family, row.options)
    probe = row.coords.get("probe")
    layers = row.coords.get("layers", 0) if probe == "depth" else 0
    tp = row.coords.get("tp", 1)
    layout = row.layout if probe != "depth" else "contiguous"
    return spec, Config(row.case, layout, tp, layers), data.directory


@cli.command()
@click.argument("results", required=False, type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["markdown", "html", "csv", "json"]), default="markdown",
              show_default=True)
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), help="Write here instead of stdout.")
def report(results: Path | None, fmt: str, output: Path | None) -> int:
    """Render a run's results.json or a sweep directory (default: the newest under reports/) for a bug report."""
    from attn_doctor.render.report_data import load_results

    data = load_results(results if results is not None else newest_results())
    data.known = known_defects(data.report)
    if fmt == "markdown":
        from attn_doctor.render.markdown import report_markdown

        text = report_markdown(data)
    elif fmt == "html":
        from attn_doctor.render.html import report_html

        text = report_html(data)
    elif fmt == "csv":
        from attn_doctor.render.tabular import report_csv

        text = report_csv(data.report)
    else:
        text = dumps(data.report.to_dict())
    if output:
        write_atomic(output, text)
    else:
        click.echo(text, nl=False)
    return EXIT_OK


def known_defects(report) -> list[str]:
    """Descriptions of the known TE/cuDNN defects that match the report's environment and cases."""
    if report.env is None:
        return []
    return case_defects(report.env, list({row.case.key(): row.case for row in report.rows}.values()))


def case_defects(env, cases: list[Case]) -> list[str]:
    from attn_doctor.machine.known_bugs import MatchContext, describe, load_known_bugs, match_case

    bugs = load_known_bugs()
    context = MatchContext.from_env(env, qkv_format="sbhd")  # the format attn-doctor's TE paths use
    found: dict[str, str] = {}
    for case in cases:
        for match in match_case(bugs, env, case, context):
            found.setdefault(match.bug.id, describe(match))
    return list(found.values())


def print_defects(console: Console, lines: list[str], heading: str) -> None:
    if lines:
        console.print(heading, style="bold yellow")
        for line in lines:
            console.print(f"  - {line}")


def newest_results() -> Path:
    candidates = sorted({p.parent for p in REPORTS_DIR.glob("*/results.json*")}, key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise BadInput("no results under reports/; run `attn-doctor run` first or pass a results file")
    return candidates[-1]


def main() -> None:
    cli.main()
