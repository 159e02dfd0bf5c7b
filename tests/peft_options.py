"""The options half of the count in docs/io.md: the peft options users write for lora_func's
methods (each method's init variants, ``use_rslora``, ``use_dora`` on each kind, ``bias``,
``layer_replication``, ``fan_in_fan_out``, ``target_parameters``), one peft configuration each.

Each cell, on the tiny model of tests/models.py in float64: peft builds the config
(``get_peft_model``, the global seed fixed), every trainable tensor is perturbed, peft saves it,
and ``load_peft`` reads it (a ``layer_replication`` config onto ``replicated(model, layer_map)``):
**exact** when lora_func's outputs are peft's (relative 1e-9; the PiSSA / OLoRA inits in float32,
2e-5, as peft initialises them in float32 only), so is every trainable tensor's gradient (as
tests/peft_coverage.py: per tensor under peft's keys, finite differences where peft's autograd is
not its forward's), and ``init_adapter`` from the loaded spec draws peft's initial tensors
(``init n/a`` where the adapter has no single spec or per-layer ranks); **refused** with the first
words of lora_func's reason, **peft ✗** when peft itself refuses the config on that model.

Run ``python -m tests.peft_options`` from the repository root to print the table;
tests/test_peft_coverage.py checks docs/io.md's against it (a few cells re-measured).
"""

from __future__ import annotations

import re
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import lora_func as lf
from tests.models import tiny_model, tokens
from tests.peft_coverage import _BlockDiag, _in_input_dtype, _logits

QV = ["q_proj", "v_proj"]


def _lora(**kw: Any) -> tuple[str, Callable[[], Any]]:
    from peft import LoraConfig

    model = kw.pop("model", "llama")
    kw.setdefault("target_modules", QV)
    kw.setdefault("r", 2)
    return model, lambda: LoraConfig(lora_alpha=6, **kw)


def _of(cls_name: str, model: str = "llama", **kw: Any) -> tuple[str, Callable[[], Any]]:
    import peft

    kw.setdefault("target_modules", QV)
    return model, lambda: getattr(peft, cls_name)(**kw)


# option -> (tiny model kind, () -> peft config)
OPTIONS: dict[str, tuple[str, Callable[[], Any]]] = {
    "lora init_lora_weights=True": _lora(init_lora_weights=True),
    "lora init_lora_weights=False": _lora(init_lora_weights=False),
    "lora init_lora_weights='gaussian'": _lora(init_lora_weights="gaussian"),
    "lora init_lora_weights='orthogonal'": _lora(init_lora_weights="orthogonal"),
    "lora init_lora_weights='pissa'": _lora(init_lora_weights="pissa"),
    "lora init_lora_weights='pissa_niter_4'": _lora(init_lora_weights="pissa_niter_4"),
    "lora init_lora_weights='olora'": _lora(init_lora_weights="olora"),
    "lora use_rslora=True": _lora(use_rslora=True),
    "lora use_dora=True (Linear)": _lora(use_dora=True),
    "lora use_dora=True, use_rslora=True": _lora(use_dora=True, use_rslora=True),
    "lora use_dora=True (GPT-2 Conv1D)": _lora(model="gpt2", target_modules=["c_attn"], use_dora=True, fan_in_fan_out=True),
    "lora use_dora=True (Conv2d)": _lora(model="convlm", target_modules=["grid"], use_dora=True),
    "lora use_dora=True (Conv1d)": _lora(model="convlm", target_modules=["seq"], use_dora=True),
    "lora use_dora=True (Embedding)": _lora(target_modules=["embed_tokens"], use_dora=True),
    "lora bias='all'": _lora(model="gpt2", target_modules=["c_attn"], bias="all", fan_in_fan_out=True),
    "lora bias='lora_only'": _lora(model="gpt2", target_modules=["c_attn"], bias="lora_only", fan_in_fan_out=True),
    "lora bias='all', modules_to_save": _lora(model="gpt2", target_modules=["c_attn"], bias="all", fan_in_fan_out=True, modules_to_save=["ln_f"]),
    "lora layer_replication": _lora(layer_replication=[[0, 2], [1, 2]]),
    "lora fan_in_fan_out=True (GPT-2 Conv1D)": _lora(model="gpt2", target_modules=["c_attn"], fan_in_fan_out=True),
    "lora target_parameters (2-D)": _lora(model="parameters", target_modules=[], target_parameters=["hold.w"]),
    "lora target_parameters (2-D and 3-D)": _lora(model="parameters", target_modules=[], target_parameters=["hold.w", "hold.experts"]),
    # (peft takes a grouped conv at a rank its groups divide: seq has 4)
    "lora use_dora=True (grouped Conv)": _lora(model="gconvlm", target_modules=["seq"], use_dora=True, r=4),
    "lora lora_dropout=0.1": _lora(lora_dropout=0.1),
    "lora rank_pattern, alpha_pattern (regex)": _lora(rank_pattern={r"layers\.1\..*q_proj": 4}, alpha_pattern={"v_proj": 3}),
    "lora layers_to_transform, layers_pattern": _lora(layers_to_transform=[1], layers_pattern="layers"),
    "lora exclude_modules": _lora(target_modules=r".*_proj", exclude_modules=["o_proj", "gate_proj", "up_proj", "down_proj", "k_proj"]),
    "ia3 init_ia3_weights=False": _of("IA3Config", target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"], init_ia3_weights=False),
    "loha init_weights=False": _of("LoHaConfig", r=2, init_weights=False),
    "lokr init_weights=False": _of("LoKrConfig", r=2, init_weights=False),
    "lokr init_weights='lycoris'": _of("LoKrConfig", r=2, init_weights="lycoris"),
    "oft init_weights=False": _of("OFTConfig", r=0, oft_block_size=4, init_weights=False),
    "oft bias='oft_only'": _of("OFTConfig", r=0, oft_block_size=4, bias="oft_only"),
    "boft init_weights=False": _of("BOFTConfig", boft_block_size=4, init_weights=False),
    "boft bias='boft_only'": _of("BOFTConfig", boft_block_size=4, bias="boft_only"),
    "hra init_weights=False": _of("HRAConfig", r=2, init_weights=False),
    "hra bias='hra_only'": _of("HRAConfig", r=2, bias="hra_only"),
    "vera bias='all'": _of("VeraConfig", "gpt2", target_modules=["c_attn"], r=4, bias="all", fan_in_fan_out=True),
    "vera init_weights=False": _of("VeraConfig", r=4, init_weights=False),
    "adalora init_lora_weights=False": _of("AdaLoraConfig", init_r=4, target_r=2, total_step=10, init_lora_weights=False),
}


# peft initialises PiSSA and OLoRA in float32 only: these run in float32, relative 2e-5
FLOAT32 = {"lora init_lora_weights='pissa'", "lora init_lora_weights='pissa_niter_4'", "lora init_lora_weights='olora'"}


def _reason(err: Exception, tmp: Path) -> str:
    text = str(err).replace(str(tmp), "").replace("/peft", "").strip()
    text = re.sub(r"^[:/ ]+", "", text)
    return text.split(";")[0][:90]


def cell(option: str, tmp: Path) -> str:
    """``"exact"`` (``"exact, init n/a"``, ``"exact but init ≈ <rel>"``; `` (FD)`` appended where
    finite differences were the gradients' oracle), ``"differs (<rel>)"``, ``"grad differs
    (<rel>)"``, ``"refused: <reason>"`` or ``"peft refuses: <reason>"``."""
    import peft.tuners.boft.layer as boft_layer
    import pytest
    from peft import get_peft_model

    model_kind, make = OPTIONS[option]
    dtype, rtol = (torch.float32, 2e-5) if option in FLOAT32 else (torch.float64, 1e-9)
    with pytest.MonkeyPatch.context() as mend, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mend.setattr(boft_layer, "_FBD_CUDA", object())  # peft with its CUDA extension, emulated
        mend.setattr(boft_layer, "FastBlockDiag", _BlockDiag)
        torch.manual_seed(0)
        try:
            peft_model = get_peft_model(_in_input_dtype(tiny_model(model_kind, dtype=dtype)), make()).eval()
        except Exception as err:  # peft's own refusal, whatever its type
            return f"peft refuses: {type(err).__name__}: {str(err)[:60]}"
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in sorted(peft_model.named_parameters()):
                # (AdaLoRA's ranknum: marked trainable, but a constant peft neither trains nor saves)
                if p.requires_grad and "ranknum" not in name:
                    p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        peft_model.save_pretrained(tmp / "peft")
        model = _in_input_dtype(tiny_model(model_kind, dtype=dtype))
        layer_map = getattr(peft_model.peft_config["default"], "layer_replication", None)
        if layer_map:  # the deeper model peft built, as lora_func's view of the untouched base
            from lora_func.replication import replicated

            model = replicated(model, layer_map)
        try:
            adapter = lf.load_peft(tmp / "peft", model)
        except (ValueError, TypeError) as err:
            return f"refused: {_reason(err, tmp)}"
        ids = tokens()
        want = _logits(peft_model(ids))
        got = _logits(lf.adapted_call(model, adapter, ids))
        off = float((got - want).abs().max() / want.abs().max())
        if off > rtol:
            return f"differs ({off:.0e})"
        worst, by_fd = _gradients_off(peft_model, model, adapter, ids, want, tmp, rtol)
        if worst > rtol:
            return f"grad differs ({worst:.0e})"
        init = _init_off(option, adapter, tmp)
        text = "exact" if init == 0.0 else "exact, init n/a" if init is None else f"exact but init ≈ {init:.0e}" if init < 1 else "exact but init ✗"
        return text + (" (FD)" if by_fd else "")


def _init_off(option: str, adapter, tmp: Path) -> float | None:
    """``init_adapter`` (the loaded adapter's spec, float32, a generator seeded 11) against peft's
    initial tensors for the option's config, as peft writes them, under the first of
    tests/peft_coverage.py's whole-model ``INIT_CONVENTIONS`` that agrees: the worst relative
    difference (0.0: every tensor equal), ``None`` where the adapter has no single spec (a trained
    bias, IA3's feed-forward layers load composed) or its layers' ranks differ (``rank_pattern``)."""
    from tests.peft_coverage import INIT_CONVENTIONS, _as_peft, _rel, _saved, _seeded_peft, _spec_kwargs

    spec = getattr(adapter, "spec", None)
    if spec is None or any(layer.info.r != spec.r for layer in adapter.layers):
        return None  # (init_adapter draws one rank per spec: a rank_pattern is read, not drawn)
    model_kind, make = OPTIONS[option]

    def base():
        model = _in_input_dtype(tiny_model(model_kind, dtype=torch.float32))
        layer_map = getattr(make(), "layer_replication", None)
        if layer_map:
            from lora_func.replication import replicated

            model = replicated(model, layer_map)
        return model

    model = base()
    ours = lf.init_adapter(model, lf.AdapterSpec(spec.variant, **{**_spec_kwargs(spec), "dtype": torch.float32}), generator=torch.Generator().manual_seed(11))
    mapped = _as_peft(ours, dict(ours.params), model, tmp / "init-ours")
    best = float("inf")
    for i, (per_layer, constructors, at_reset) in enumerate(INIT_CONVENTIONS):
        if per_layer:
            continue
        peft_base = _in_input_dtype(tiny_model(model_kind, dtype=torch.float32))
        theirs = _saved(_seeded_peft(peft_base, make(), 11, constructors=constructors, at_reset=at_reset), tmp / f"init-peft-{i}")
        worst = 0.0
        for key, tensor in theirs.items():
            by_name = key.removeprefix("base_model.model.").removesuffix(".weight")
            if key in mapped and mapped[key].numel() == tensor.numel():
                mine = mapped[key]
            elif by_name in ours.params and ours.params[by_name].numel() == tensor.numel():
                mine = ours.params[by_name]  # (a variant stored converted, PiSSA / OLoRA: by name)
            else:
                worst = float("inf")
                break
            mine = mine.reshape(tensor.shape).to(tensor.dtype)
            worst = max(worst, 0.0 if torch.equal(mine, tensor) else _rel(mine, tensor))
        best = min(best, worst)
        if best == 0.0:
            break
    return best


def _gradients_off(peft_model, model, adapter, ids, want, tmp: Path, rtol: float) -> tuple[float, list[str]]:
    """Every gradient of a loss of the logits, per tensor under peft's checkpoint keys
    (tests/peft_coverage.py's ``gradients_off``): the worst relative difference to peft's autograd,
    and the keys that equal finite differences of peft's forward instead."""
    from torch.func import grad

    from tests.peft_coverage import _loss, gradients_off

    peft_model.zero_grad()
    _loss(want).backward()
    ours = grad(lambda params: _loss(_logits(lf.adapted_call(model, adapter.with_params(params), ids))))(dict(adapter.params))
    worst, _, by_fd = gradients_off(peft_model, adapter, ours, model, tmp / "grads", rtol, lambda: _loss(_logits(peft_model(ids))))
    return worst, by_fd


def table() -> dict[str, str]:
    out = {}
    for option in OPTIONS:
        with tempfile.TemporaryDirectory() as tmp:
            out[option] = cell(option, Path(tmp))
    return out


def label(cell_text: str) -> str:
    if cell_text.startswith("exact"):
        return cell_text.replace("exact but init", "init")
    if cell_text.startswith("differs"):
        return f"≈ {cell_text.split('(')[1].rstrip(')')}"
    if cell_text.startswith("grad differs"):
        return f"grad ≈ {cell_text.split('(')[1].rstrip(')')}"
    if cell_text.startswith("peft refuses"):
        return "peft ✗"
    return cell_text.replace("|", "/")


def count_line(labels: list[str]) -> str:
    counts = Counter(
        "refused" if c.startswith("refused") else "≈" if c.startswith("grad") else "init n/a" if "init n/a" in c else c.split(" ")[0].rstrip(",")
        for c in labels
    )
    return f"{len(labels)} options: " + ", ".join(f"{counts[k]} {name}" for k, name in (
        ("exact", "exact (outputs, gradients and init)"), ("init n/a", "exact on outputs and gradients, init not compared (init n/a)"),
        ("init", "exact on outputs and gradients, init differing (init ≈ / ✗)"), ("≈", "differing (≈)"), ("refused", "refused by lora_func"), ("peft", "refused by peft itself (peft ✗)")) if counts[k]) + "."


def markdown(cells: dict[str, str]) -> str:
    lines = [count_line([label(c) for c in cells.values()]), "", "| peft option | load_peft |", "|---|---|"]
    lines += [f"| `{option}` | {label(text)} |" for option, text in cells.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(table()))
