"""Checks of a variant's init draws, shared by the per-variant test files (mutation killers:
a wrong kaiming ``a``, a wrong fan-in axis, a dropped dtype cast)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lora_func.variants import LayerInfo


def layer_info(variant: str, r: int, d_in: int, d_out: int, alpha: float = 6.0, **options) -> LayerInfo:
    import lora_func as lf

    opts = {**lf.get_variant(variant).default_options, **options}
    return LayerInfo(d_in=d_in, d_out=d_out, r=r, alpha=alpha, has_bias=False, options=tuple(sorted(opts.items())))


def assert_kaiming(t: Tensor, fan_in: int, name: str = "") -> None:
    """``t`` is a kaiming-uniform draw with ``a = √5`` (peft's ``U(-1/√fan_in, 1/√fan_in)``):
    inside the bound and close to it (``a = √6`` gives a bound 0.93 times as large, ``a = 5``
    0.48 times; the draws must number a few hundred for the 0.98 margin)."""
    bound = 1 / math.sqrt(fan_in)
    top = float(t.detach().abs().max())
    assert top <= bound * (1 + 1e-6) and top > 0.98 * bound, (name, top, bound)


def init_params(module, variant: str, r: int, d_in: int, d_out: int, *, seed: int = 0, weight: Tensor | None = None, **options):
    """``module.init`` (the variant file) on a random float32 weight, asked for float64 params:
    ``(params, buffers)``; asserts every floating tensor came back float64."""
    info = layer_info(variant, r, d_in, d_out, **options)
    if weight is None:
        weight = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(seed + 100))
    params, buffers = module.init(weight, None, info, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    for key, value in {**params, **buffers}.items():
        if value.is_floating_point():
            assert value.dtype == torch.float64, (key, value.dtype)
    return params, buffers


def assert_config_checks(
    variant: str, peft_config_cls, bad: dict[str, list], good: dict[str, list] | None = None, peft_defaults: dict | None = None
) -> None:
    """The variant's peft config checks (``PeftMethod.checks`` and ``PeftFormat.checks``): peft's
    default config passes them and reads as lora_func's default options (a config without the
    fields too); each value in ``bad`` (one field wrong at a time, out of range, of the wrong
    type, not finite) is refused by the loader's check with the field's name; each value in
    ``good`` (the edges of the valid range) passes. ``peft_defaults``: the options peft's default
    config reads as, where they are not lora_func's defaults."""
    import lora_func as lf
    from lora_func.io._peft_config import _config_problems

    fmt = lf.variants.peft_format(variant)
    defaults = {k: v for k, v in peft_config_cls(target_modules=["x"]).to_dict().items() if k in read_fields(variant)}
    config = {"peft_type": fmt.method.peft_type, **defaults}
    assert _config_problems(config) == [], _config_problems(config)
    options = dict(lf.AdapterSpec(variant, targets=["x"]).options)
    assert read_options(variant, config) == (options if peft_defaults is None else peft_defaults) and read_options(variant, {}) == options
    for name, values in bad.items():
        for value in values:
            problems = _config_problems({**config, name: value})
            assert [p for p in problems if p.startswith(f"{name}=")], (name, value, problems)
    for name, values in (good or {}).items():
        for value in values:
            assert _config_problems({**config, name: value}) == [], (name, value)


def assert_other_adapter_dtype(variant: str, d_in: int, d_out: int, *, adapter_dtype: torch.dtype = torch.float64, seed: int = 0, w_eff_fn=None, rows: int = 3, **spec_kwargs) -> None:
    """An adapter in another dtype than its float32 ``nn.Linear`` base (float64: wider; bf16:
    narrower): both overlays run (no mixed-dtype product), give float32 outputs, and agree with
    the contract row's ``W_eff`` (or ``w_eff_fn``, the row's signature) in float64 to the narrower dtype's round-off (relative to the
    output's scale). Kills dropped casts in a form's branch that the contract row's options
    do not reach."""
    import lora_func as lf
    from tests.one_layer import one_layer, oracle_forms, perturbed, run

    model = one_layer("linear", d_in, d_out, True, torch.float32, seed)
    spec = lf.AdapterSpec(variant, targets=["proj"], dtype=adapter_dtype, **spec_kwargs)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(seed + 1)), seed=seed + 2)
    assert all(v.dtype == adapter_dtype for v in adapter.params.values())
    x = torch.randn(rows, d_in, generator=torch.Generator().manual_seed(seed + 3))
    w_eff, b_eff = oracle_forms(model, adapter, w_eff_fn=w_eff_fn)
    want = x.double() @ w_eff.T + b_eff
    base = lf.base_params(model)
    tol = (1e-5 if adapter_dtype == torch.float64 else 3e-2) * float(want.abs().max())
    for make in (lf.overlay, lf.merge_overlay):
        got = run(model, make(base, adapter), x).detach()
        assert got.dtype == torch.float32, (make.__name__, got.dtype)
        err = float((got.double() - want.detach()).abs().max())
        assert err < tol, (make.__name__, err, tol)


def saved_bytes(call) -> int:
    """Bytes autograd keeps for backward during ``call()`` (which activation form a layer takes
    shows here, where the outputs are equal)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return total


def assert_peft_round_trip(variant: str, options: dict) -> None:
    """``options`` (every one away from its default) written to a peft config and read back
    are the same options: each field is written and read, none swapped or dropped."""
    import lora_func as lf
    from lora_func.io._peft_config import config_of

    fmt = lf.variants.peft_format(variant)
    defaults = dict(lf.AdapterSpec(variant, targets=["x"]).options)
    assert all(options[k] != defaults[k] for k in options), "each option must differ from its default"
    read = read_options(variant, config_of(lf.get_variant(variant), fmt, {**defaults, **options}))
    assert read is not None and {k: read[k] for k in options} == options, read


def read_fields(variant: str) -> set[str]:
    """The top-level peft config fields the variant's format reads: its options' and the fields
    that mark it, with the method's rank and alpha fields."""
    import lora_func as lf

    fmt = lf.variants.peft_format(variant)
    method = fmt.method
    fields = {o.peft.split(".")[0] for o in lf.get_variant(variant).options.values() if o.peft} | set(fmt.reads or {})
    return fields | ({method.rank[0]} if method.rank else set()) | ({method.alpha} if method.alpha else set())


def read_options(variant: str, config: dict, module: str = "x") -> dict | None:
    """The options a peft ``config``'s layer ``module`` reads as for ``variant``, or ``None`` when the
    config is not one of ``variant`` (what the loader does to pick a layer's variant)."""
    import lora_func as lf
    from lora_func.io._peft_config import options_from, reads_as

    if not reads_as(lf.variants.peft_format(variant), config, module):
        return None
    return options_from(lf.get_variant(variant), config)[0]
