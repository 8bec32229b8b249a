"""`attn-doctor capture --out DIR -- <command ...>`: run a user's own script unchanged and record every
attention call it makes (`attn_doctor.tracing.record`). Exit 0 when the command succeeded and calls were
recorded, 1 when the command failed (what it recorded is kept), 2 when nothing could be recorded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import click

import attn_doctor
from attn_doctor.cli.app import EXIT_FAULT, EXIT_OK, Application, Interrupted
from attn_doctor.cli.epilogs import epilog
from attn_doctor.cli.options import BYTE_UNITS, OUTPUT_FOLDER, given, int_list, refuse_ignored
from attn_doctor.core.errors import BadInput


def byte_size(text: str) -> int:
    number = text.strip().lower().rstrip("ib")
    unit = number.lstrip("0123456789.")
    try:
        return int(float(number[: len(number) - len(unit)]) * BYTE_UNITS[unit or ""])
    except (KeyError, ValueError):
        raise BadInput(f"--max-bytes takes a size such as 256MB, 2GB or 1048576, got {text!r}") from None


def _check_command(command: tuple[str, ...]) -> None:
    """The command is one this machine can start, and the environment's RANK (torchrun's) a number: else bad
    input, one line, before anything is created or run."""
    if not command or not command[0]:
        raise BadInput("no command to run: attn-doctor capture --out DIR -- python train.py ...")
    program = command[0]
    if shutil.which(program) is None:
        path = Path(program)
        if not path.exists():
            raise BadInput(f"{program!r} is not a program on PATH; give the command as you would run it")
        if path.is_dir():
            raise BadInput(f"{program!r} is a folder, not a program; give the command as you would run it")
        if not os.access(path, os.X_OK):
            raise BadInput(f"{program!r} is not executable; run it with its interpreter (python3 {program} ...)")
    rank = os.environ.get("RANK")
    if rank is not None and not rank.strip().isdigit():
        raise BadInput(f"RANK={rank!r} in the environment is not a rank number; unset it or set it as torchrun does")


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
               epilog=epilog("capture"))
@click.option("--out", "out", required=True, type=OUTPUT_FOLDER,
              help="The capture folder (created; calls of every rank go under it).")
@click.option("--values", is_flag=True, help="Also record the tensors' values (forward and output gradient) of "
              "the selected calls, as safetensors.")
@click.option("--layers", help="With --values: only these layers, e.g. 0,23.")
@click.option("--steps", help="With --values: only these forward passes (0 = the first), e.g. 1.")
@click.option("--ranks", help="With --values: only these ranks, e.g. 0.")
@click.option("--max-bytes", default="256MB", show_default=True,
              help="With --values: at most this much per process; later calls keep their metadata only.")
@click.option("--module", "modules", multiple=True, metavar="PKG.Class[:MAPPING]",
              help="Also wrap this attention module (repeatable): q, k, v by MAPPING q=NAME,k=NAME,v=NAME (names or "
                   "positions; default 0,1,2), layout=bshd|sbhd|bhsd, causal=true|false, scale=NUMBER.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
def capture(app: Application, out: Path, values: bool, layers: str | None, steps: str | None, ranks: str | None,
            max_bytes: str, modules: tuple[str, ...], command: tuple[str, ...]) -> int:
    """Run COMMAND (after --) unchanged and record every attention call it makes: TE DotProductAttention,
    torch's scaled_dot_product_attention, flash-attn and Megatron-Core's own core attention (and each --module),
    in every Python process it starts (torchrun too). Metadata always (shapes, strides, storage offsets, masks,
    lengths, TE's chosen backend, rank, layer); values only with --values, for the selected calls. Of the model,
    once: a fingerprint of its weights, its dropout and softmax settings, a hash of its token ids (compare reads
    them first). Never captured: weights, data, other activations."""
    from attn_doctor.tracing.clients import parse_module_spec, unrecorded_module

    specs = [parse_module_spec(text) for text in modules]
    if command and command[0] == "--":
        command = command[1:]
    _check_command(command)
    selection = {"values": values, "max_bytes": byte_size(max_bytes),
                 **{name: int_list(text, name) for name, text in (("layers", layers), ("steps", steps),
                                                                  ("ranks", ranks))}}
    if not values and any(selection[name] is not None for name in ("layers", "steps", "ranks")):
        raise BadInput("--layers, --steps and --ranks choose whose values are recorded: add --values")
    if not values and given("max_bytes"):
        refuse_ignored("--max-bytes", "with --values (it bounds the values recorded)",
                       "add --values, or drop --max-bytes")
    if selection["max_bytes"] <= 0:
        raise BadInput(f"--max-bytes {max_bytes}: the values' budget must be above 0 (e.g. 256MB)")
    from attn_doctor.tracing.store import HEADER, read_capture, read_notes

    if (out / HEADER).exists():
        raise BadInput(f"--out {out} already holds a capture; give a new folder (a capture is one run's calls)")
    out.mkdir(parents=True, exist_ok=True)  # checked writable as it was parsed

    bootstrap = Path(attn_doctor.__file__).parent / "tracing" / "bootstrap"
    package_root = Path(attn_doctor.__file__).parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(bootstrap), str(package_root)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["ATTN_DOCTOR_CAPTURE"] = json.dumps({"out": str(out.resolve()), **selection,
                                            "modules": [spec.to_text() for spec in specs]})
    try:
        child = subprocess.Popen(list(command), env=env)
    except OSError as exc:  # what the checks above cannot foresee (a bad interpreter line, a vanished file)
        raise BadInput(f"cannot run {command[0]!r}: {exc.strerror or exc}; give the command as you would run it") \
            from None
    try:
        code = child.wait()
    except KeyboardInterrupt:
        child.terminate()
        try:
            child.wait(timeout=1.5)
        except subprocess.TimeoutExpired:
            child.kill()
        calls = len(read_capture(out)) if (out / "capture.json").exists() else 0
        raise Interrupted(f"interrupted; the {calls} calls recorded so far are in {out}") from None
    calls = read_capture(out) if (out / "capture.json").exists() else []
    ranks_seen = sorted({c.rank for c in calls})
    with_values = sum(1 for c in calls if c.values_path is not None)
    summary = (f"{len(calls)} attention calls recorded in {out} (ranks {', '.join(map(str, ranks_seen))}; "
               f"{with_values} with values)") if calls else ""
    if code != 0:
        click.echo(f"the command exited with {code}" + (f"; {summary}" if summary else ""), err=True)
        return EXIT_FAULT
    missing = unrecorded_module(specs, {c.meta["api"] for c in calls}, read_notes(out)) if specs else None
    if missing is not None:
        raise BadInput(missing)
    if not calls:
        raise BadInput("the command ran but made no attention call attn-doctor wraps (TE DotProductAttention, "
                       "torch scaled_dot_product_attention, flash-attn, Megatron-Core's DotProductAttention; "
                       "name another with --module PKG.Class), or it is not a Python program")
    click.echo(summary)
    app.say_command("replay:", "replay", out)
    return EXIT_OK
