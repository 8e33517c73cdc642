"""What the tools' command lines share: --help with the whole description and every default, size
types that refuse zero and negatives in argparse's one line, output paths checked before any work,
and a wrapper that makes a refusal found later (a file's content, a plan) that same one line."""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, Optional, Sequence, Tuple, Type

from megatron.training.arguments import DefaultsHelpFormatter


class _Formatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """The module docstring as written, and "(default: X)" after each flag's help (the trainer's rule)."""


def parser(doc: str, **kw) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=_Formatter, **kw)


class ToolError(Exception):
    """A refusal found after parsing: one line and exit status 2, as argparse's own."""


def _bounded(kind: type, ok: Callable[[float], bool], words: str) -> Callable[[str], float]:
    def check(text: str):
        value = kind(text)  # argparse turns a ValueError into "invalid <name> value: 'x'"
        if not ok(value):  # NaN included
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value
    check.__name__ = f"{words} {kind.__name__}"
    return check


positive_int = _bounded(int, lambda v: v > 0, "positive")
positive_float = _bounded(float, lambda v: 0 < v < math.inf, "positive and finite")
nonnegative_int = _bounded(int, lambda v: v >= 0, "non-negative")
nonnegative_float = _bounded(float, lambda v: v >= 0, "non-negative")


def output_path(text: str) -> str:
    """A file or directory to be written: its parent directory must exist (checked before the
    work, not after it)."""
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"no directory {parent} to write {text} in")
    return text


def output_file(text: str) -> str:
    """output_path, for a file: an existing directory there is refused before the work."""
    if os.path.isdir(output_path(text)):
        raise argparse.ArgumentTypeError(f"{text} is a directory: name a file")
    return text


IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def image_path(text: str) -> str:
    """output_file, named with a suffix matplotlib writes a drawing by."""
    if os.path.splitext(output_file(text))[1].lower() not in IMAGE_SUFFIXES:
        raise argparse.ArgumentTypeError(f"{text}: name a drawing by its kind, one of {', '.join(IMAGE_SUFFIXES)}")
    return text


def make_directory(path) -> str:
    """Make the directory `path` (with its parents) to write in: why it cannot be, or "" (said
    before the work, not after it)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:  # an existing file included ("File exists")
        return f"cannot make the directory {path}: {err.strerror}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"cannot write in the directory {path}"
    return ""


def run(main: Callable[[Optional[Sequence[str]]], Optional[int]], argv: Optional[Sequence[str]] = None,
        errors: Tuple[Type[BaseException], ...] = ()) -> int:
    """main(argv)'s exit status; a ToolError (or one of `errors`, a library's refusal) is one line
    on stderr and status 2."""
    try:
        return main(argv) or 0
    except (ToolError, *errors) as err:
        prog = os.path.basename(sys.argv[0]) if argv is None else "tool"
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return 2
