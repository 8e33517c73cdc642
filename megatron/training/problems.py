"""The problems one validation finds: a check records each bad flag and goes on, so that every bad
flag of a command line is reported at once, in one line."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

from megatron.training.arguments import ArgsError

# None outside `collecting`: a check called on its own raises its first problem.
_PROBLEMS: ContextVar[list | None] = ContextVar("validation_problems", default=None)


@contextmanager
def collecting(problems: list):
    """Within this block, `require` appends to `problems` instead of raising."""
    token = _PROBLEMS.set(problems)
    try:
        yield problems
    finally:
        _PROBLEMS.reset(token)


def require(cond: bool, message: str) -> bool:
    """Record `message` unless `cond`, and go on (nothing after it is computed from it); returns `cond`."""
    problems = _PROBLEMS.get()
    if not cond and problems is None:
        raise ArgsError(message)
    if not cond:
        problems.append(message)
    return bool(cond)


def guard(cond: bool, message: str) -> None:
    """Stop the check here unless `cond`: what follows in it is computed from this value."""
    if not cond:
        raise ArgsError(message)


def flag(name: str) -> str:
    """An argparse destination as the command line spells it."""
    return "--" + name.replace("_", "-")
