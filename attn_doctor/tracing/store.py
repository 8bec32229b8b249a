"""A capture folder on disk: what `attn-doctor capture` writes (and what replay and compare are to read).

    DIR/capture.json                          what was asked (selection, budget) and when
    DIR/rank<R>/env.json                      the environment fingerprint of rank R's process
    DIR/rank<R>/calls-<PID>.jsonl             the attention calls of process PID: a line per call, naming
                                              the line above that holds the rest of its metadata (a signature);
                                              and a line per output gradient, naming its geometry's line
    DIR/rank<R>/<PID>-call-<NNNNNN>.safetensors        its q, k, v, out (and masks) values, when selected
    DIR/rank<R>/<PID>-call-<NNNNNN>.dout.safetensors   its output gradient, once the backward reached it
    DIR/rank<R>/<PID>-call-<NNNNNN>.d{q,k,v}.safetensors  its input gradients, likewise
    DIR/rank<R>/notes-<PID>.jsonl             calls of a module named with --module that could not be
                                              recorded, and why (once per module and reason)
    DIR/rank<R>/model-<PID>.json              what process PID recorded of the model at its first forward
                                              pass: its weights' fingerprint, run settings, data hash
                                              (`attn_doctor.tracing.model_facts`)

Each call is written whole or not at all: its values first (a temp file, then a rename), then its signature's
line when the signature is new (`attn_doctor.tracing.describe`), then its own line, stored into a memory map of
the calls file (`CallLog`: a file per call cost a millisecond, a flushed write per line a fifth of a call's
capture cost). A killed run leaves every call whose line was stored (in a training step, a call's lines wait for
the end of the model's forward pass: `attn_doctor.tracing.record`); a line it cut off mid-write, and the unused
end of the file, are ignored on reading, like a sweep's results.jsonl. Calls written by an earlier attn-doctor
(format 1: a whole line per call, naming no signature) read the same. Values are safetensors and metadata JSON:
loading someone else's capture never runs code (no pickle).
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attn_doctor.core import schemas
from attn_doctor.core.errors import BadInput
from attn_doctor.results.files import write_atomic, write_atomic_bytes

FORMAT = "attn-doctor/capture"
FORMAT_VERSION = 3  # 2: a signature's line per distinct call, a short line per call naming it; 3: dO's geometry
HEADER = "capture.json"
DAMAGED = "the capture is damaged: capture again"


def rank_dir(root: Path, rank: int) -> Path:
    return Path(root) / f"rank{rank}"


def values_stem(root: Path, rank: int, pid: int, index: int) -> Path:
    return rank_dir(root, rank) / f"{pid}-call-{index:06d}"


def model_facts_path(root: Path, rank: int, pid: int) -> Path:
    return rank_dir(root, rank) / f"model-{pid}.json"


def read_model_facts(root: Path) -> list[dict[str, Any]]:
    """What each process of a capture recorded of the model (`model_facts_path`), by rank; none in a capture made
    before attn-doctor recorded it, or where no model module ran. Bad input when a file is damaged."""
    facts = []
    for path in sorted(Path(root).glob("rank*/model-*.json")):
        try:
            document = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadInput(f"{path} is unreadable ({type(exc).__name__}); {DAMAGED}") from None
        schemas.check(document, schemas.MODEL_FACTS, str(path), DAMAGED)
        facts.append(document)
    return sorted(facts, key=lambda d: d.get("rank", 0))


def write_json(path: Path, document: dict) -> None:
    write_atomic(path, json.dumps(document, indent=1, sort_keys=True) + "\n")


class CallLog:
    """One process's calls-<PID>.jsonl: a line per call, stored into a shared memory map of the file.

    Why a map: within a training step, the write system call of each line cost about a fifth of the capture's
    time per call (on this project's CPU machine, 66 µs per call against 52 µs with nothing written, 62 µs with
    the map: a kernel entry from cold caches); a store into the map makes none, and since the page cache
    holds what is stored, a process killed mid-run loses no line it finished, as with a flushed write. The file
    is grown a chunk ahead of the lines, so a killed process leaves NUL bytes after its last line (the reader
    drops them with any cut-off last line); `close` cuts them off. Where a file cannot be mapped, each line is
    written with one system call."""

    CHUNK = 1 << 20

    def __init__(self, root: Path, rank: int, pid: int):
        path = rank_dir(root, rank) / f"calls-{pid}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        with open(path, "rb") as existing:  # an earlier capture of this process into this folder: append to it
            self._end = existing.read().rfind(b"\n") + 1
        self._size = 0
        self._map: mmap.mmap | None = None
        try:
            self._grow(0)
        except (OSError, ValueError):  # no shared maps on this file system
            os.ftruncate(self._fd, self._end)
            os.lseek(self._fd, self._end, os.SEEK_SET)

    def _grow(self, needed: int) -> None:
        size = self._end + needed + max(self.CHUNK, min(self._size, 64 * self.CHUNK))
        if self._map is not None:
            self._map.close()
            self._map = None
        os.ftruncate(self._fd, size)
        self._map, self._size = mmap.mmap(self._fd, size), size

    def append(self, line: str) -> None:
        """One line: JSON text and its newline (JSON text never holds a raw newline)."""
        data = line.encode()
        if self._map is None:
            os.write(self._fd, data)
            return
        end = self._end + len(data)
        if end > self._size:
            self._grow(len(data))
        self._map[self._end:end] = data
        self._end = end

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            os.ftruncate(self._fd, self._end)
        os.close(self._fd)


def write_note(root: Path, rank: int, pid: int, note: dict[str, Any]) -> None:
    """Append a note (a JSON object on one line) to the process's notes file: what the capture could not
    record. Rare, so a plain append."""
    path = rank_dir(root, rank) / f"notes-{pid}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as notes:
        notes.write(json.dumps(note, sort_keys=True) + "\n")


def read_notes(root: Path) -> list[dict[str, Any]]:
    """Every note of a capture folder (a line cut off mid-write is left out)."""
    notes = []
    for path in sorted(Path(root).glob("rank*/notes-*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                notes.append(json.loads(line))
    return notes


def save_values(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """The tensors' values (as their views show them, contiguous, on the CPU) in one safetensors file, written
    atomically; returns its size in bytes. Each is a copy of its own: safetensors refuses two names for one
    memory, which a call like `sdpa(q, q, q)` on the CPU would otherwise hand it."""
    from safetensors.torch import save

    data = save({name: t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
                 for name, t in tensors.items()})
    write_atomic_bytes(path, data)
    return len(data)


def load_values(path: Path, wanted: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """A values file's tensors, or only those whose names `wanted` accepts (the others are not read). Bad input
    when the file is damaged (cut off, overwritten): it is the capture's, not attn-doctor's."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as values:
            return {name: values.get_tensor(name) for name in values.keys() if wanted is None or wanted(name)}
    except Exception as exc:  # noqa: BLE001 - safetensors' own error type varies between its versions
        raise BadInput(f"{path} is not a readable values file ({type(exc).__name__}: {str(exc)[:120]}); the "
                       "capture is damaged: capture again") from None


def value_shapes(path: Path) -> dict[str, list[int]] | str:
    """The shape of each tensor in a values file (its header only), or why it cannot be read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as values:
            return {name: list(values.get_slice(name).get_shape()) for name in values.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors' own error type varies between its versions
        return f"its values file {path} is not readable ({type(exc).__name__}: {str(exc)[:120]})"


@dataclass(frozen=True)
class CapturedCall:
    """One recorded attention call: its metadata (`meta`, as written) and where its values are."""

    folder: Path  # its rank's folder
    meta: dict[str, Any]

    @property
    def rank(self) -> int:
        return int(self.meta["rank"])

    @property
    def index(self) -> int:
        return int(self.meta["index"])

    def _file(self, suffix: str) -> Path | None:
        path = self.folder / f"{self.meta['process']['pid']}-call-{self.index:06d}{suffix}"
        return path if path.exists() else None

    @property
    def values_path(self) -> Path | None:
        return self._file(".safetensors") if (self.meta.get("values") or "").endswith(".safetensors") else None

    @property
    def dout_path(self) -> Path | None:
        return self._file(".dout.safetensors")

    def where(self) -> str:
        """The call as a person finds it in the capture: "rank 0, call 3 of process 4242 (layer 1)"."""
        pid, layer = self.meta["process"]["pid"], self.meta.get("layer")
        return f"rank {self.rank}, call {self.index} of process {pid} (layer {layer})"

    def values_problem(self) -> str | None:
        """Why the values recorded for this call cannot be used, or None: its forward's values file is gone,
        damaged, or holds other tensors than the call's q, k, v (by name and shape), or its output gradient's
        file holds no output gradient of the call's size. Replay never judges a call on other numbers (seeded
        ones, say) without saying so. Reads only the files' headers."""
        recorded = self.meta.get("values") or ""
        if recorded.endswith(".safetensors"):
            path = self.folder / Path(recorded).name
            if not path.is_file():
                return f"its values file {path} is gone"
            shapes = value_shapes(path)
            if isinstance(shapes, str):
                return shapes
            for name in ("q", "k", "v"):
                wanted = (self.meta["tensors"].get(name) or {}).get("shape")
                if wanted is not None and shapes.get(name) != wanted:
                    held = f"{name} of shape {shapes[name]}" if name in shapes else f"no {name}"
                    return f"its values file {path} holds {held}, not the call's {name} of shape {wanted}"
        dout_path = self.dout_path
        wanted = (self.meta["tensors"].get("dout") or {}).get("shape")
        if dout_path is not None and wanted is not None:
            shapes = value_shapes(dout_path)
            if isinstance(shapes, str):
                return shapes
            if "dout" not in shapes or math.prod(shapes["dout"]) != math.prod(wanted):
                return f"its output gradient's file {dout_path} holds no output gradient of shape {wanted}"
        return None

    def gradient(self, name: str) -> torch.Tensor | None:
        """dq, dk or dv as the captured run's backward computed it, when recorded."""
        path = self._file(f".{name}.safetensors")
        return load_values(path)[name] if path is not None else None

    def signature(self) -> str:
        """What makes two calls the same question: the API, its arguments and every tensor's geometry and
        dtype (not the values, the module path, the step or the rank)."""
        tensors = {name: {k: v for k, v in t.items() if k != "device"} for name, t in self.meta["tensors"].items()}
        return json.dumps([self.meta["api"], self.meta["arguments"], tensors], sort_keys=True)


def read_capture(root: Path) -> list[CapturedCall]:
    """Every call of a capture folder, by rank, process start and call index. Bad input when the folder is
    not a capture; a last line cut off mid-write (a killed run) is left out."""
    root = Path(root)
    header = root / HEADER
    if not header.is_file():
        raise BadInput(f"{root} is not an attn-doctor capture (no {HEADER}); make one with "
                       "`attn-doctor capture --out DIR -- <command>`")
    try:
        document = json.loads(header.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BadInput(f"{header} is unreadable ({type(exc).__name__}); capture again") from None
    schemas.check(document, schemas.CAPTURE_HEADER, str(header), "capture again")
    if document.get("format") != FORMAT or document.get("format_version", 0) > FORMAT_VERSION:
        raise BadInput(f"{header} is not a capture this attn-doctor reads (format {document.get('format')!r}, "
                       f"version {document.get('format_version')!r}); upgrade attn-doctor")
    calls = [CapturedCall(path.parent, meta) for path in sorted(root.glob("rank*/calls-*.jsonl"))
             for meta in read_calls(path)]
    return sorted(calls, key=lambda c: (c.rank, c.meta["process"].get("started", ""), c.index))


def _line_schema(document: Any) -> dict[str, Any]:
    """The schema of a calls file's line, by its kind (`read_calls` tells the kinds apart the same way)."""
    if not isinstance(document, dict):
        return schemas.CALL  # the check says it is no object
    if "gradient_of" in document:
        return schemas.GRADIENT_OF
    if "gradient_geometry" in document:
        return schemas.GRADIENT_GEOMETRY
    if "index" not in document:
        return schemas.SIGNATURE
    return schemas.CALL_OF_SIGNATURE if "signature" in document else schemas.CALL


def read_calls(path: Path) -> list[dict[str, Any]]:
    """The calls of one calls file, each as one document: a call's line with the signature it names (the
    latest line defining that number above it) merged in, and its output gradient's geometry as the tensor
    `dout`: the geometry a line below gave for it (written when the backward reached the call), else the one
    given above for its call site, the same module path and signature (a site's dO is written once). Bad input
    when a line is not JSON or names a signature (or geometry) no line above defines."""
    lines = Path(path).read_bytes().split(b"\n")
    lines.pop()  # b"" after the last newline, or what a killed run left: a cut-off line, unused NUL bytes
    signatures: dict[int, dict[str, Any]] = {}
    geometries: dict[int, dict[str, Any]] = {}
    latest: dict[int, tuple[dict[str, Any], tuple]] = {}  # call index -> the latest call above with it, its site
    # (a process's later capture into the same folder appends to its file, numbering its calls from 0 again)
    sites: dict[tuple, dict[str, Any]] = {}  # (module path, signature) -> its dO's geometry, once written
    calls = []
    for number, line in enumerate(lines, start=1):
        try:
            document = json.loads(line)
            schemas.check(document, _line_schema(document), f"{path}:{number}", DAMAGED)
            if "gradient_of" in document:  # after its call's line: the hook that writes it is set then
                call, site = latest.get(document["gradient_of"], (None, None))
                if call is not None and "dout" not in call["tensors"]:  # a copy: a signature's calls share its dict
                    call["tensors"] = {**call["tensors"], "dout": geometries[document["geometry"]]}
                    if site[1] is not None:
                        sites.setdefault(site, call["tensors"]["dout"])
                continue
            if "gradient_geometry" in document:
                geometries[document["gradient_geometry"]] = document["tensor"]
                continue
            if "index" not in document:  # a signature: the part of its calls' description they share
                defined = signatures[document.pop("signature")] = document
                sites = {site: dout for site, dout in sites.items() if signatures.get(site[1]) is not defined}
                continue
            named = document.pop("signature", None)
            if named is not None:
                document.update(signatures[named])
            site = (document.get("module"), named)
            if site in sites:  # the site's dO, written once (`Recorder._gradient_seen`)
                document["tensors"] = {**document["tensors"], "dout": sites[site]}
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError, AttributeError, KeyError):
            raise BadInput(f"{path}:{number} is not a captured call; {DAMAGED}") from None
        calls.append(document)
        latest[document["index"]] = document, site
    return calls
