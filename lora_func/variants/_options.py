"""Options as a schema: one :class:`Option` per variant option (its default, what values it
allows, the peft config field it is stored as and how: a :class:`Codec`), and the one function
that validates a spec's options against them (:func:`resolve_options`), used for
``AdapterSpec`` and for peft configs alike. A :class:`Check` is a test plus the words for what it allows, so every refusal reads
the same: ``"<variant> option <name>=<value> must be <allowed>"``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "DROPOUT",
    "FLAG",
    "SEED",
    "Check",
    "Codec",
    "Option",
    "dropout_option",
    "is_finite_number",
    "mapped",
    "nullable",
    "one_of",
    "real",
    "resolve_options",
    "whole",
]


def is_finite_number(value: Any) -> bool:
    """A JSON number that is finite (json reads ``NaN`` and ``1e999``), not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class Check:
    """What values an option allows: ``test(value) -> bool``, and ``refusal``, the words that
    follow ``"<variant> option <name>=<value> "`` when the test fails (``"must be in [0, 1)"``,
    ``"is not one of ['a', 'b']"``)."""

    test: Callable[[Any], bool]
    refusal: str


FLAG = Check(lambda v: isinstance(v, bool), "must be True or False")


def whole(low: int | None = 0, high: int | None = None, *, why: str = "") -> Check:
    """An integer (not a bool, not a float) in ``[low, high)``; ``None``: unbounded."""
    bounds = " >= " + str(low) if high is None and low is not None else f" in [{low}, {high})" if low is not None else ""

    def test(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and (low is None or v >= low) and (high is None or v < high)

    return Check(test, f"must be an integer{bounds}{f' ({why})' if why else ''}")


def real(low: float | None = None, high: float | None = None, *, closed: str = "[)", finite: bool = True, why: str = "") -> Check:
    """A number (an int is taken as a float, a bool is not) between ``low`` and ``high``;
    ``closed`` says which ends belong to the range (``"[)"``, ``"()"``, ``"[]"``, ``"(]"``), and
    ``finite=False`` admits ``inf`` where it has a meaning."""

    def test(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or (finite and math.isinf(v)):
            return False
        above = low is None or (v >= low if closed[0] == "[" else v > low)
        below = high is None or (v <= high if closed[1] == "]" else v < high)
        return above and below

    kind = "a finite number" if finite else "a number (not NaN)"
    if low is not None and high is not None:
        text = f"must be in {closed[0]}{low:g}, {high:g}{closed[1]}"
    elif low is not None:
        text = f"must be {kind} {'>=' if closed[0] == '[' else '>'} {low:g}"
    elif high is not None:
        text = f"must be {kind} {'<=' if closed[1] == ']' else '<'} {high:g}"
    else:
        text = f"must be {kind}"
    return Check(test, text + (f" ({why})" if why else ""))


def one_of(*values: Any) -> Check:
    """One of ``values`` (compared with ``==`` and by type, so ``True`` is not ``1``)."""
    return Check(lambda v: any(type(v) is type(w) and v == w for w in values), f"is not one of {list(values)}")


SEED = whole(0, 2**63, why="a torch.Generator seed")
DROPOUT = real(0, 1, why="the probability of zeroing an input in a training step")


@dataclasses.dataclass(frozen=True)
class Codec:
    """An option's value as peft's config writes it and back: ``to_peft(value)``, and
    ``from_peft(config value)`` (``None`` when the config holds ``null``); a value it does not
    know comes back unchanged, so the option's check names it."""

    to_peft: Callable[[Any], Any]
    from_peft: Callable[[Any], Any]


class _Unread:
    """A peft config value that a :func:`mapped` codec does not know: no option's check passes it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def mapped(values: Mapping[Any, Any], *, also: Mapping[Any, Any] | None = None) -> Codec:
    """A :class:`Codec` for an enumeration: ``values`` maps each of lora_func's values to peft's
    (``{"identity": True, "random": False}``); ``also`` maps further peft values that read as one of lora_func's (older spellings). A peft
    value it does not know is refused on load, even one that is lora_func's name for another
    (peft's ``init_weights="kaiming"`` is not lora_func's ``init="kaiming"``)."""
    back = [(values.get(ours, ours), ours) for ours in values] + list((also or {}).items())

    def from_peft(value: Any) -> Any:
        # by type too: peft's True is not lora_func's 1
        return next((ours for peft, ours in back if type(peft) is type(value) and peft == value), _Unread(value))

    return Codec(lambda value: values.get(value, value), from_peft)


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a variant.

    Attributes:
      default: the value when the spec leaves it out. Its type is the option's: a ``bool``
        takes a bool, an ``int`` an integer (not ``2.0``), a ``float`` a number (an int is stored
        as a float), a ``str`` a string, a ``tuple`` a tuple or list (stored as a tuple); ``None``:
        the check alone decides.
      check: what values it allows beyond the type (``None``: any of the type; a float must
        then be finite). A peft config's value is checked the same way (``null`` too, unless
        the codec reads it: :func:`nullable`).
      peft: the peft config field that holds it (``"lora_dropout"``; a dotted name is a field of
        a nested object, ``"eva_config.rho"``), or ``None`` where peft has none: a checkpoint then
        reads as the default.
      codec: how the value is written in peft's config where it is not written as it is (an
        enumeration stored as a bool: :func:`lora_func.variants.mapped`).
    """

    default: Any
    check: Check | None = None
    peft: str | None = None
    codec: Codec | None = None

    def of_type(self, value: Any) -> bool:
        """Whether ``value`` has the option's type (see :attr:`default`); a float given for an
        integer option has its type (a number) and fails its value check instead."""
        kind = self.default
        if isinstance(kind, bool):
            return isinstance(value, bool)
        if isinstance(kind, (int, float)):
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if isinstance(kind, tuple):  # a sequence: JSON (native files, peft configs) holds it as a list
            return isinstance(value, (tuple, list))
        return kind is None or isinstance(value, type(kind))

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is refused (``"must be an integer >= 1"``), or ``None`` when it is valid."""
        if not self.of_type(value):
            return f"must be a {type(self.default).__name__}"
        if isinstance(self.default, int) and not isinstance(self.default, bool) and not isinstance(value, int):
            return self.check.refusal if self.check is not None else "must be an integer"
        if self.check is not None:
            return None if self.check.test(value) else self.check.refusal
        if isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number (the outputs would be NaN or silently wrong)"
        return None

    def normalised(self, value: Any) -> Any:
        """``value`` in the option's own type (an int given for a float option as a float, a list
        for a tuple option as a tuple: options are hashable)."""
        if isinstance(self.default, float) and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(self.default, tuple) and isinstance(value, list):
            return tuple(value)
        return value


def nullable(default: Any) -> Codec:
    """A :class:`Codec` for a config field peft may hold as ``null`` meaning ``default`` (a
    dropout of ``None``), written as it is."""
    return Codec(lambda value: value, lambda value: default if value is None else value)


def dropout_option(peft: str | None) -> Option:
    """The ``dropout`` option (peft's ``lora_dropout``, ``vera_dropout``, ...): the probability of
    zeroing the low-rank path's input in a training step (``null`` in peft's config: none)."""
    return Option(0.0, DROPOUT, peft, nullable(0.0))


def resolve_options(
    variant: str, schema: Mapping[str, Option], given: Mapping[str, Any], check: Callable[[Mapping[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Every option of ``schema`` with its value from ``given`` or its default, each checked
    once; ``check`` (the variant's) then sees them together. Raises ``TypeError`` for an
    unknown name or a value of the wrong type, ``ValueError`` for a value out of range."""
    unknown = sorted(set(given) - set(schema))
    if unknown:
        raise TypeError(  # error: spec-unknown-option
            f"unknown option(s) {unknown} for variant {variant!r}; it accepts {sorted(schema) or 'no options'}"
        )
    resolved = {}
    for name, option in schema.items():
        value = given.get(name, option.default)
        if not option.of_type(value):
            raise TypeError(f"option {name}={value!r} for variant {variant!r} must be a {type(option.default).__name__}")  # error: spec-option-type
        problem = option.problem(value)
        if problem is not None:
            peft = f" (peft's {option.peft})" if option.peft else ""
            raise ValueError(  # error: spec-option-value
                f"{variant} option {name}={value!r} {problem}{peft}; leave it out for the default {option.default!r}"
            )
        resolved[name] = option.normalised(value)
    if check is not None:
        check(resolved)
    return resolved
