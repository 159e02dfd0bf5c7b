"""The declarative contract: every variant's option schema is the one check of its options, for
``AdapterSpec`` and for peft configs alike, and its tensor schema and peft record are all the
generic reader and writer need.

Over every option of every registered variant, with probe values of every kind (wrong types,
floats for integers, NaN, infinities, negatives, the edges): ``AdapterSpec`` refuses exactly
the values the option's schema refuses, with the catalogued message naming the variant, the
option, the value and the default; a peft config holding the same value (as the option's codec
writes it) is refused on load naming the config field, and a valid one reads back as itself.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

import lora_func as lf
from lora_func.io._peft_config import _config_problems, config_of, options_from
from lora_func.variants import Option
from tests.variant_checks import read_options

PROBES = [None, "x", True, False, -1, 0, 1, 2, 3, 4, 1.5, 2.0, -0.5, 0.5, 1.0, 0.999, math.nan, math.inf, -math.inf, 2**63]

OPTIONS = [
    pytest.param(variant, name, id=f"{variant}-{name}") for variant in lf.list_variants() for name in lf.get_variant(variant).options
]


def _refused(variant: str, **options) -> Exception | None:
    try:
        lf.AdapterSpec(variant, targets=["x"], **options)
    except (TypeError, ValueError) as err:
        return err
    return None


@pytest.mark.parametrize(("variant", "name"), OPTIONS)
def test_the_spec_refuses_exactly_what_the_option_schema_refuses(variant, name):
    option: Option = lf.get_variant(variant).options[name]
    assert option.problem(option.default) is None, "a default must be valid"
    assert _refused(variant) is None
    accepted = refused = 0
    for value in PROBES:
        problem = option.problem(value)
        err = _refused(variant, **{name: value})
        cross = lf.get_variant(variant).check is not None and problem is None and err is not None
        if problem is None and not cross:
            assert err is None, (value, err)
            spec = lf.AdapterSpec(variant, targets=["x"], **{name: value})
            assert spec.option(name) == value and type(spec.option(name)) is type(option.normalised(value))
            accepted += 1
        elif problem is not None:
            assert err is not None, value
            message = str(err)
            assert f"{name}={value!r}" in message, message
            if isinstance(err, ValueError):
                assert message.startswith(f"{variant} option {name}=") and f"default {option.default!r}" in message, message
                # the peft field it maps to, where it has one, so a peft user finds it
                assert (f"(peft's {option.peft})" in message) == (option.peft is not None), message
            refused += 1
    assert refused > 0, "every option refuses some probe"
    # NaN never passes, and an integer option takes no float (2.0 built adapters that failed later)
    assert option.problem(math.nan) is not None
    if isinstance(option.default, int) and not isinstance(option.default, bool):
        assert option.problem(2.0) is not None and isinstance(_refused(variant, **{name: 2.0}), ValueError)


PEFT_OPTIONS = [
    pytest.param(variant, name, id=f"{variant}-{name}")
    for variant in lf.list_variants()
    if lf.variants.peft_format(variant) is not None
    for name, option in lf.get_variant(variant).options.items()
    if option.peft is not None
]


@pytest.mark.parametrize(("variant", "name"), PEFT_OPTIONS)
def test_a_peft_config_is_checked_by_the_same_schema(variant, name):
    """Each probe the schema accepts, written as the codec writes it, reads back as itself; each
    probe it refuses, in the config field, is a config problem naming the field; the spec's
    defaults make a config that reads as the defaults."""
    fmt, declared = lf.variants.peft_format(variant), lf.get_variant(variant)
    option = declared.options[name]
    defaults = dict(lf.AdapterSpec(variant, targets=["x"]).options)
    base = config_of(declared, fmt, defaults)
    # (a variant stored converted, PiSSA's family, is written as a plain LoRA: its options read directly)
    assert (options_from(declared, base)[0] if fmt.export is not None else read_options(variant, base)) == defaults
    field = option.peft.split(".")[0]
    if field in (fmt.reads or {}):
        return  # a field that marks the variant (init_lora_weights): a config with another value is another variant's
    for value in PROBES:
        if option.problem(value) is not None:
            if option.codec is not None and (option.codec.to_peft(value) != value or option.problem(option.codec.from_peft(value)) is None):
                continue  # a value peft spells otherwise, or one peft's config means otherwise (null: the default)
            config = config_of(declared, fmt, defaults)
            _put(config, option.peft, value)
            problems = _config_problems({"peft_type": fmt.method.peft_type, **config})
            assert any(p.startswith(f"{option.peft}=") or p.startswith(f"{field}=") for p in problems), (value, problems)
            continue
        if option.codec is not None and option.codec.from_peft(option.codec.to_peft(value)) != value:
            continue  # written as peft's fixed value (WaveFT's proportional sizes are written per layer)
        try:
            options = dict(lf.AdapterSpec(variant, targets=["x"], **{name: value}).options)
        except ValueError:
            continue  # valid alone, not with the other defaults (the variant's check)
        config = config_of(declared, fmt, options)
        read, problems = options_from(declared, config)
        assert problems == [] and read[name] == options[name], (value, problems, read[name])


def _put(config: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        if not isinstance(config.get(part), dict):
            config[part] = {}
        config = config[part]
    config[last] = value


def test_the_float_options_of_the_issue_are_refused_at_the_spec():
    """Issue 48: a float for an integer option built adapters that failed later with raw
    errors, and one RoAd call with group_size=4.0 broke every later RoAd call (einops caches its
    recipe under 4.0 == 4); now the spec refuses them, naming the option."""
    for variant, options in [("gralora", {"gralora_k": 2.0}), ("road", {"group_size": 4.0}), ("oft", {"oft_block_size": 4.0}), ("lokr", {"decompose_factor": 2.0})]:
        err = _refused(variant, **options)
        assert isinstance(err, ValueError) and f"{next(iter(options))}=" in str(err), (variant, err)


def test_the_contract_stays_small():
    """Issue 42's measure: a new method costs a small file, not new contract fields."""
    from lora_func.variants import Codec, PeftFormat, PeftLayer, PeftMethod, Variant

    # 15: Variant.groups (issue 43: Lily's A and B are shared within groups of layers, not adapter-wide).
    assert len(dataclasses.fields(Variant)) <= 15
    assert sum(len(dataclasses.fields(record)) for record in (PeftMethod, PeftFormat, PeftLayer, Codec)) <= 24


def test_only_the_variants_that_take_r_directions_of_the_weight_bound_r():
    """Issue 48: VeRA (and every method) takes the r peft takes. Only the variants whose init takes
    r directions of each weight (the ``rank_within_layer`` trait: SVD/QR inits) refuse r above
    min(d_in, d_out), before any init; VeRA r=256 on 32-wide layers builds and is the base at init."""
    import torch

    from tests.models import tiny_model, tokens

    model = tiny_model("llama")
    ids = tokens()
    for variant in lf.list_variants():
        bounded = "rank_within_layer" in lf.get_variant(variant).traits
        try:
            lf.init_adapter(model, lf.AdapterSpec(variant, targets=["q_proj"], r=33), generator=torch.Generator().manual_seed(0))
        except (TypeError, ValueError) as err:
            assert ("exceeds min(d_in, d_out)" in str(err)) == bounded, (variant, err)
            continue
        except RuntimeError:
            assert not bounded, variant
            continue
        assert not bounded, variant
    vera = lf.init_adapter(model, lf.AdapterSpec("vera", targets=["q_proj", "v_proj"], r=256), generator=torch.Generator().manual_seed(0))
    assert vera.layers[0].info.r == 256
    torch.testing.assert_close(lf.adapted_call(model, vera, ids).logits, model(ids).logits, rtol=0, atol=0)


def test_the_checks_accept_and_refuse_what_their_words_say():
    """The check factories against literal expectations (an oracle independent of the schema the
    tests above compare with itself): each accepts and refuses exactly these probes, and its
    refusal says the range."""
    from lora_func.variants import DROPOUT, FLAG, SEED, one_of, real, whole

    cases = [
        (whole(), [0, 1, 7], [-1, 1.5, True, "1", None], "must be an integer >= 0"),
        (whole(1), [1, 2, 10**9], [0, -3, 2.0, False], "must be an integer >= 1"),
        (whole(0, 4), [0, 3], [4, -1], "must be an integer in [0, 4)"),
        (SEED, [0, 2**63 - 1], [2**63, -1], "must be an integer in [0, 9223372036854775808) (a torch.Generator seed)"),
        (whole(-1, why="x"), [-1, 0], [-2], "must be an integer >= -1 (x)"),
        (real(0, 1), [0, 0.0, 0.5, 0.999], [1, 1.0, -0.1, math.nan, math.inf, True, "0.1"], "must be in [0, 1)"),
        (real(0, 1, closed="()"), [0.5], [0, 0.0, 1.0], "must be in (0, 1)"),
        (real(0, 1, closed="[]"), [0, 1, 1.0], [1.01, -0.01], "must be in [0, 1]"),
        (real(0, 1, closed="(]"), [1.0], [0.0], "must be in (0, 1]"),
        (real(0), [0, 3.5], [-0.1, math.inf, math.nan], "must be a finite number >= 0"),
        (real(0, closed="()"), [1e-12], [0, 0.0], "must be a finite number > 0"),
        (real(0, closed="()", finite=False), [math.inf, 1.0], [0.0, math.nan, -math.inf], "must be a number (not NaN) > 0"),
        (real(high=2), [2.0 - 1e-9, -5], [2, 3], "must be a finite number < 2"),
        (real(high=2, closed="[]"), [2], [2.5], "must be a finite number <= 2"),
        (real(), [-1e9, 0, 1.5], [math.nan, math.inf, -math.inf, None], "must be a finite number"),
        (real(finite=False), [math.inf, -math.inf], [math.nan], "must be a number (not NaN)"),
        (DROPOUT, [0.0, 0.5], [1.0, -0.5], "must be in [0, 1) (the probability of zeroing an input in a training step)"),
        (FLAG, [True, False], [0, 1, "true", None], "must be True or False"),
        (one_of("a", 1), ["a", 1], ["b", True, 1.0], "is not one of ['a', 1]"),
    ]
    for check, good, bad, words in cases:
        assert all(check.test(v) for v in good), (words, [v for v in good if not check.test(v)])
        assert not any(check.test(v) for v in bad), (words, [v for v in bad if check.test(v)])
        assert check.refusal == words, check.refusal


def test_an_option_takes_its_default_type_and_normalises_ints_for_floats():
    from lora_func.variants import Option, whole

    assert Option(0.5).problem(1) is None and type(Option(0.5).normalised(1)) is float and Option(0.5).normalised(True) is True
    assert Option(0.5).problem(True) == "must be a float" and Option(0.5).problem(math.nan) is not None and Option(0.5).problem(math.inf) is not None
    assert Option(3).problem(3.0) == "must be an integer" and Option(3, whole(1)).problem(3.0) == "must be an integer >= 1"
    assert Option(3).problem(True) == "must be a int" and Option(True).problem(1) == "must be a bool" and Option("a").problem(1) == "must be a str"
    assert Option(None).problem(object()) is None and Option(2).normalised(2) == 2 and type(Option(2).normalised(2)) is int
