"""Simulated crashes for the all-or-nothing save tests: a power cut or a kill just before, or
just after, the ``nth`` call of one function during a save."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


class Crash(Exception):
    """Stands for the process dying at that point."""


def crashed_during(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, nth: int, when: str, save: Callable[[], Any]
) -> bool:
    """Run ``save()`` with ``owner.name`` patched to raise :class:`Crash` just ``when``
    ("before" or "after") its ``nth`` call; undo the patch. True if the crash happened (a
    save that never reaches that call completes)."""
    real, calls = getattr(owner, name), []

    def crashing(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == nth and when == "before":
            raise Crash(f"killed before call {nth} of {name}")
        out = real(*args, **kwargs)
        if len(calls) == nth:
            raise Crash(f"killed after call {nth} of {name}")
        return out

    monkeypatch.setattr(owner, name, crashing)
    try:
        save()
    except Crash:
        return True
    finally:
        monkeypatch.undo()
    return False
