"""Old public names and keywords, still answered until lora_func 0.2 with a ``DeprecationWarning``
that names the new one. Every rename goes through the three helpers here (a function's old
name, a method's old name, a keyword's old name), so each warning reads the same and the
removal in 0.2 is deleting their uses.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

__all__ = ["REMOVED_IN", "deprecated_method", "renamed", "renamed_keywords", "warn_renamed"]

REMOVED_IN = "0.2"

P = ParamSpec("P")
R = TypeVar("R")


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """``DeprecationWarning``: ``old`` is now ``new`` (pointed at the caller's caller by default)."""
    warnings.warn(
        f"{old} is deprecated and will be removed in lora_func {REMOVED_IN}; use {new} (same behaviour)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed(function: Callable[P, R], old: str, new: str) -> Callable[P, R]:
    """``function`` under its old name ``old`` (as users wrote it, e.g. ``"lora_func.check_params"``):
    each call warns that it is ``new``, then calls ``function``."""

    @functools.wraps(function)
    def old_name(*args: P.args, **kwargs: P.kwargs) -> R:
        warn_renamed(old, new)
        return function(*args, **kwargs)

    return old_name


def renamed_keywords(where: str, **renames: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator: ``where``'s keywords ``old=`` (the keys of ``renames``) are still accepted,
    passed on as the new name (the value), with a warning; both at once is a ``TypeError``."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def accepting_old_keywords(*args: P.args, **kwargs: P.kwargs) -> R:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(  # error: deprecated-keyword-twice
                            f"{where}() got both {old}= and {new}=; {old}= is the deprecated name of {new}=: pass {new}= only"
                        )
                    warn_renamed(f"{where}({old}=...)", f"{where}({new}=...)")
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return accepting_old_keywords

    return decorate


def deprecated_method(new: str, old: str, owner: str) -> Any:
    """A method ``old`` of class ``owner`` that warns and calls ``self.<new>`` (a class attribute)."""

    def old_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        warn_renamed(f"{owner}.{old}", f"{owner}.{new}")
        return getattr(self, new)(*args, **kwargs)

    old_method.__name__ = old
    old_method.__doc__ = f"Deprecated: use :meth:`{new}` (removed in lora_func {REMOVED_IN})."
    return old_method
