"""A module's source as a standalone script holds it: its top-level parts after its docstring and imports, all of
them or those a piece of code needs (the repro scripts carry attn-doctor's torch-only modules this way)."""

from __future__ import annotations

import ast
import inspect
from types import ModuleType


def call_lines(opening: str, arguments: list[str], width: int = 120) -> str:
    """`opening` + the arguments + ")", wrapped at `width` with the arguments aligned under the first one."""
    lines, line = [], opening
    indent = " " * len(opening)
    for i, argument in enumerate(arguments):
        piece = argument + (", " if i < len(arguments) - 1 else ")")
        if len(line) + len(piece.rstrip()) > width and line.strip() != opening.strip():
            lines.append(line.rstrip())
            line = indent
        line += piece
    lines.append(line.rstrip() if arguments else line + ")")
    return "\n".join(lines) + "\n"


def module_body(module: ModuleType) -> str:
    """A module's source after its docstring and its imports: what a script holds of it (the script imports
    torch and the standard library itself)."""
    return "".join(text for _, _, text in _parts(module)).lstrip("\n")


def used_source(module: ModuleType, code: str) -> str:
    """The parts of `module_body` that `code` needs, directly or through each other, in their order, each with
    the comments above it; a section's heading comment ("# --- ...") with the section's first part kept."""
    parts = _parts(module)
    needed = _names(ast.parse(code))
    grown = True
    while grown:
        grown = False
        for defined, used, _ in parts:
            if defined & needed and not used <= needed:
                needed |= used
                grown = True
    kept, heading = [], ""
    for defined, _, text in parts:
        cut = text.find("\n# --- ")
        if cut >= 0:
            heading, text = text[:text.index("\n", cut + 1) + 1], text[text.index("\n", cut + 1) + 1:]
        if defined & needed:
            kept.append(heading + text)
            heading = ""
    return "".join(kept).lstrip("\n")


def _parts(module: ModuleType) -> list[tuple[set[str], set[str], str]]:
    """(names it defines, names it uses, its text with the lines above it) of each top-level statement of a
    module after its docstring and imports."""
    source = inspect.getsource(module)
    lines = source.splitlines(keepends=True)
    nodes = ast.parse(source).body
    start = 1 if nodes and isinstance(nodes[0], ast.Expr) and isinstance(nodes[0].value, ast.Constant) else 0
    while start < len(nodes) and isinstance(nodes[start], (ast.Import, ast.ImportFrom)):
        start += 1
    end = nodes[start - 1].end_lineno if start else 0
    parts = []
    for node in nodes[start:]:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined = {node.name}
        else:
            defined = {target.id for target in ast.walk(node) if isinstance(target, ast.Name)
                       and isinstance(target.ctx, ast.Store)}
        parts.append((defined, _names(node), "".join(lines[end:node.end_lineno])))
        end = node.end_lineno
    return parts


def _names(tree: ast.AST) -> set[str]:
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
