"""Every registered variant on a CUDA device, against the same computation on the CPU.

Not part of CI (CI has no GPU): run it on a machine with one, e.g.

    PYTHONPATH=. python tools/cuda_check.py --out cuda_check.json [--variants loha lokr ...]

The contract rows (tests/variant_rows) give each variant's spec and perturbation. Per variant
and layer kind (nn.Linear on a tiny Llama, Conv1D on a tiny GPT-2, where the variant adapts it):

- ``parity64``: a perturbed float64 adapter, its float64 model and inputs moved to the GPU give
  the CPU's logits and per-tensor gradients on every path (lazy, merged, module route), within
  1e-9 of each tensor's scale (DeLoRA: 1e-5, its norms are float32): a tensor left on the CPU, a device-dependent formula or a
  path that drops the adapter on the GPU shows here.
- ``init``: ``init_adapter`` on the model on the GPU (calibration batches on the GPU too) makes
  every tensor on the GPU, gives the base's logits (within the row's identity tolerance) and
  trains (twenty Adam steps lower the loss); how far it is from the CPU's init of the same
  weights and seed is recorded, not judged (GPU SVDs and QRs may differ in sign).
- ``bf16``: a bfloat16 base with a float32 adapter, lazy and merged: the logits stay within a
  tenth of the adapter's effect of the float64 oracle (the row's W_eff on the rounded base).
- ``many``: ``ensemble_call`` (both routes) of three stacked float64 members and
  ``per_example_grads`` on the GPU equal a Python loop of single calls (1e-9 of scale).
- ``dropout`` (``--checks dropout``): every dropout option at 0.5, a training step on the GPU:
  finite outputs and gradients, the dropout acts and draws anew per seed; where the masks come
  from the CPU generator, as peft's (LoHa, LoKr), the GPU's step equals the CPU's.
- ``compile`` (``--compile``, the variants named there): ``torch.compile(fullgraph=True)`` with
  inductor (Triton kernels, which the CPU suite's ``aot_eager`` never generates) of the lazy and
  the merged loss gives eager's value and gradients.

Each (variant, kind) runs in its own process (a pool over the machine's cores, one GPU). The
result is one JSON record per check: ``ok``, the worst scale-relative difference, or the error.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KINDS = ("linear", "conv1d")


def _rel(got, want) -> float:
    """max |got - want| / max |want| (0 for two zero tensors)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _moved(adapter, device, like=None):
    """``adapter``'s values on ``device`` (in ``like``'s dtypes and structure when given)."""
    like = like or adapter

    def cast(key, store):
        return adapter_value(adapter, key).detach().to(device=device, dtype=store[key].dtype)

    return like.with_params({k: cast(k, like.params).requires_grad_(True) for k in like.params}).with_buffers({k: cast(k, like.buffers) for k in like.buffers})


def adapter_value(adapter, key):
    return adapter.params[key] if key in adapter.params else adapter.buffers[key]


def _build64(row, kind):
    """A float64 model (its RMSNorm computing in float64: transformers' computes in float32,
    whose roundings flip between two devices' op orders) and a perturbed float64 adapter."""
    import torch

    import lora_func as lf
    from tests.bank_oracle import rmsnorm_in_input_dtype
    from tests.contract_helpers import calibration_batches, perturbed, spec_for
    from tests.models import LAYER_KIND_MODEL, tiny_model

    model = _rope_in_input_dtype(rmsnorm_in_input_dtype(tiny_model(LAYER_KIND_MODEL[kind], dtype=torch.float64)))
    spec = spec_for(row, LAYER_KIND_MODEL[kind], dtype=torch.float64)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(100), calibration=calibration_batches() if row.calibration else None)
    return model, perturbed(adapter, row.perturb_scale)


def _rope_in_input_dtype(model):
    """transformers' rotary embedding computes its cos/sin in float32, and a GPU's float32
    sin/cos differ from the CPU's in the last bit: in float64 they compute in float64."""
    import types

    import torch

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(device=x.device, dtype=x.dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(forward, module)
    return model


def _bound64(variant):
    """1e-9 of scale; DeLoRA computes its column norms in float32 whatever the base
    (tests/test_properties.PRECISION_FLOOR), so its floor is float32's."""
    return 1e-5 if variant == "delora" else 1e-9


def _value_and_grads(model, base, adapter, ids, path):
    import torch

    from tests.contract_helpers import loss_fn

    params = {k: v.detach().requires_grad_(True) for k, v in adapter.params.items()}
    loss, out = loss_fn(model, base, adapter, ids, path=path, with_output=True)(params)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return out.detach(), {k: (torch.zeros_like(p) if g is None else g) for (k, p), g in zip(params.items(), grads, strict=True)}


def _parity64(row, kind, device):
    import copy

    import torch

    import lora_func as lf
    from tests.contract_helpers import PATHS
    from tests.models import tokens

    model, adapter = _build64(row, kind)
    # transformers' eager Llama attention takes its softmax in float32 (and a GPU's float32 exp
    # is not the CPU's); SDPA computes in the input dtype on both devices
    model.config._attn_implementation = "sdpa"
    ids = tokens()
    gpu_model = copy.deepcopy(model).to(device)
    gpu_adapter = _moved(adapter, device)
    assert all(v.dtype == torch.float64 for v in gpu_adapter.params.values())
    base, gpu_base = lf.base_params(model), lf.base_params(gpu_model)
    with torch.no_grad():  # the base alone, for the record: what the device adds without an adapter
        detail = {"base:logits": _rel(gpu_model(ids.to(device)).logits, model(ids).logits)}
    worst = 0.0
    for path in PATHS:
        want_out, want_grads = _value_and_grads(model, base, adapter, ids, path)
        got_out, got_grads = _value_and_grads(gpu_model, gpu_base, gpu_adapter, ids.to(device), path)
        assert got_out.device.type == torch.device(device).type
        detail[f"{path}:logits"] = _rel(got_out, want_out)
        for key, want in want_grads.items():
            if float(want.abs().max()) > 0:
                detail[f"{path}:{key}"] = _rel(got_grads[key], want)
        worst = max(worst, *detail.values())
    return {"ok": worst <= _bound64(row.variant), "worst": worst, "base": detail["base:logits"], "checked": len(detail)}


def _init(row, kind, device):
    import copy

    import torch

    import lora_func as lf
    from tests.contract_helpers import calibration_batches, spec_for
    from tests.models import LAYER_KIND_MODEL, tiny_model, tokens

    model = tiny_model(LAYER_KIND_MODEL[kind])
    gpu_model = copy.deepcopy(model).to(device)
    spec = spec_for(row, LAYER_KIND_MODEL[kind])
    batches = calibration_batches() if row.calibration else None
    cpu = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(5), calibration=batches)
    gpu_batches = None if batches is None else [{k: v.to(device) for k, v in b.items()} for b in batches]
    gpu = lf.init_adapter(gpu_model, spec, generator=torch.Generator().manual_seed(5), calibration=gpu_batches)
    off_device = sorted(k for k, v in {**gpu.params, **gpu.buffers}.items() if v.device.type != torch.device(device).type)
    ids = tokens().to(device)
    with torch.no_grad():
        identity = _rel(lf.adapted_call(gpu_model, gpu, ids).logits, gpu_model(ids).logits)
    same = {k: _rel(gpu.params.get(k, gpu.buffers.get(k)), v) for k, v in {**cpu.params, **cpu.buffers}.items() if v.is_floating_point()}
    # it trains on the GPU: twenty Adam steps on one batch lower its loss
    trained = gpu.detach()
    optimizer = torch.optim.Adam(trained.params.values(), lr=1e-2)
    losses = []
    for _ in range(20):
        out = lf.adapted_call(gpu_model, trained, ids).logits
        loss = torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    ok = not off_device and identity <= max(row.identity_rtol, 1e-6) and losses[-1] < losses[0] - 1e-3
    return {
        "ok": ok,
        "loss_first_last": [losses[0], losses[-1]],
        "off_device": off_device,
        "identity": identity,
        "vs_cpu_init": max(same.values(), default=0.0),
        "vs_cpu_init_over_1e-5": sorted(k for k, d in same.items() if d > 1e-5),
    }


def _bf16(row, kind, device):
    import torch

    import lora_func as lf
    from tests.contract_helpers import build, calibration_batches, logits, oracle_params, perturbed, spec_for
    from tests.models import LAYER_KIND_MODEL, tiny_model, tokens

    model_kind = LAYER_KIND_MODEL[kind]
    model, adapter = build(row, kind)
    adapter = perturbed(adapter, row.perturb_scale)
    ids = tokens()
    # the oracle runs on the bf16 base's own rounded weights (in float64): the comparison sees
    # the adapter's arithmetic on the GPU, not the base's rounding
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    rounded = tiny_model(model_kind, dtype=torch.float64)
    rounded.load_state_dict({k: v.double() for k, v in state.items()})
    oracle = logits(rounded, oracle_params(lf.base_params(rounded), adapter, row), ids)
    moved = _rel(rounded(ids).logits, oracle)
    bf16 = tiny_model(model_kind).to(device=device, dtype=torch.bfloat16)
    bf16.load_state_dict(state)
    batches = None if not row.calibration else [{k: v.to(device) for k, v in b.items()} for b in calibration_batches()]
    structure = lf.init_adapter(bf16, spec_for(row, model_kind, dtype=torch.float32), generator=torch.Generator().manual_seed(0), calibration=batches)
    gpu_adapter = _moved(adapter, device, like=structure)
    out = {}
    for merged in (False, True):
        got = lf.adapted_call(bf16, gpu_adapter, ids.to(device), merged=merged).logits
        assert got.dtype == torch.bfloat16
        out["merged" if merged else "lazy"] = _rel(got, oracle)
    # bf16 round-off (about 1e-2 of scale here) well under the adapter's effect on the logits
    return {"ok": max(out.values()) <= 0.1 * moved, "worst": max(out.values()), "adapter_moves_logits": moved, **out}


def _many(row, kind, device):
    import copy

    import torch

    import lora_func as lf
    from tests.contract_helpers import perturbed
    from tests.models import tokens

    model, adapter = _build64(row, kind)
    gpu_model = copy.deepcopy(model).to(device)
    members = [_moved(perturbed(adapter, row.perturb_scale, seed=s), device) for s in (1, 2, 3)]
    ids = tokens(batch=3).to(device)
    detail = {}
    with torch.no_grad():
        loop = [lf.adapted_call(gpu_model, m, ids).logits for m in members]
        for route in ("layers", "vmap"):
            stacked = lf.ensemble_call(gpu_model, lf.stack(members), ids, route=route, use_cache=False).logits
            detail[f"ensemble_{route}"] = max(_rel(stacked[i], loop[i]) for i in range(3))
        assert _rel(loop[0], loop[1]) > 1e-4

    def loss(a, x):
        out = lf.adapted_call(gpu_model, a, x).logits
        return torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), x[:, 1:].flatten())

    member = members[0]
    per_example = lf.per_example_grads(loss, member, ids)
    worst = 0.0
    for i in range(ids.shape[0]):
        params = {k: v.detach().requires_grad_(True) for k, v in member.params.items()}
        grads = torch.autograd.grad(loss(member.with_params(params), ids[i : i + 1]), list(params.values()), allow_unused=True)
        for (key, _), g in zip(params.items(), grads, strict=True):
            if g is not None and float(g.abs().max()) > 0:
                worst = max(worst, _rel(per_example[key][i], g))
    detail["per_example_grads"] = worst
    return {"ok": max(detail.values()) <= _bound64(row.variant), **detail}


def _compile(row, kind, device):
    import copy

    import torch

    import lora_func as lf
    from tests.contract_helpers import build, perturbed
    from tests.models import tokens

    model, adapter = build(row, kind)
    gpu_model = copy.deepcopy(model).to(device)
    adapter = _moved(perturbed(adapter, row.perturb_scale), device)
    ids = tokens().to(device)
    base = lf.base_params(gpu_model)

    def losses(params):
        a = adapter.with_params(params)
        out = []
        for merged in (False, True):
            logits = lf.adapted_call(gpu_model, a, ids, merged=merged, base=base).logits
            out.append(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
        return torch.stack(out)

    # two losses' gradients from one graph need retain_graph, which donated buffers refuse
    torch._functorch.config.donated_buffer = False
    compiled = torch.compile(losses, fullgraph=True)
    detail, worst = {}, 0.0
    for shift in (0.0, 0.05):
        params = {k: (v.detach() + shift).requires_grad_(True) for k, v in adapter.params.items()}
        want = losses(params)
        got = compiled(params)
        detail[f"value{shift}"] = _rel(got, want)
        for i in range(2):
            wg = torch.autograd.grad(want[i], list(params.values()), retain_graph=True, allow_unused=True)
            gg = torch.autograd.grad(got[i], list(params.values()), retain_graph=True, allow_unused=True)
            for w, g in zip(wg, gg, strict=True):
                if w is not None and float(w.abs().max()) > 0:
                    worst = max(worst, _rel(g, w))
    detail["grads"] = worst
    return {"ok": max(detail.values()) <= 1e-4, **detail}


def _dropout(row, kind, device):
    import copy

    import torch

    import lora_func as lf
    from tests.contract_helpers import calibration_batches, perturbed, spec_for
    from tests.models import LAYER_KIND_MODEL, tiny_model, tokens

    options = lf.get_variant(row.variant).default_options
    rates = {k: 0.5 for k, v in options.items() if "dropout" in k and isinstance(v, float)}
    if not rates:
        return {"ok": True, "skipped": "no dropout option"}
    model = tiny_model(LAYER_KIND_MODEL[kind])
    spec = spec_for(row, LAYER_KIND_MODEL[kind], **rates)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(100), calibration=calibration_batches() if row.calibration else None), row.perturb_scale)
    gpu_model = copy.deepcopy(model).to(device).train()
    model.train()
    gpu_adapter = _moved(adapter, device)
    ids = tokens()
    with torch.no_grad():
        plain = lf.adapted_call(gpu_model.eval(), gpu_adapter, ids.to(device)).logits
    gpu_model.train()
    outs, same_as_cpu = [], []
    for seed in range(4):
        torch.manual_seed(seed)  # seeds the CPU and every CUDA generator
        params = {k: v.detach().requires_grad_(True) for k, v in gpu_adapter.params.items()}
        out = lf.adapted_call(gpu_model, gpu_adapter.with_params(params), ids.to(device)).logits
        grads = torch.autograd.grad(out.square().mean(), list(params.values()), allow_unused=True)
        assert out.device.type == torch.device(device).type and bool(out.isfinite().all())
        assert all(g is None or bool(g.isfinite().all()) for g in grads)
        torch.manual_seed(seed)
        with torch.no_grad():
            cpu = lf.adapted_call(model, adapter, ids).logits
        outs.append(out.detach())
        same_as_cpu.append(_rel(out, cpu))
    acts = max(_rel(o, plain) for o in outs)
    draws = len({tuple(o.flatten().tolist()) for o in outs})
    # LoHa/LoKr draw their masks on the CPU generator, as peft: the GPU's step is the CPU's (the
    # others draw on the device, as torch's dropout does)
    cpu_drawn = row.variant in ("loha", "lokr")
    ok = acts > 1e-3 and draws > 1 and (max(same_as_cpu) <= 1e-4 if cpu_drawn else True)
    return {"ok": ok, "rates": rates, "dropout_moves_logits": acts, "distinct_draws": draws, "vs_cpu_same_seed": max(same_as_cpu)}


CHECKS = {"parity64": _parity64, "init": _init, "bf16": _bf16, "many": _many, "compile": _compile, "dropout": _dropout}


def _job(args):
    variant, kind, checks, device = args
    import torch

    torch.set_num_threads(1)
    import lora_func as lf
    from tests.variant_table import ROWS

    if kind not in lf.get_variant(variant).kinds:
        return []
    out = []
    for check in checks:
        start = time.perf_counter()
        try:
            result = CHECKS[check](ROWS[variant], kind, device)
        except Exception as error:  # recorded; the run goes on
            result = {"ok": False, "error": f"{type(error).__name__}: {error}"[:600], "trace": traceback.format_exc()[-1500:]}
        out.append({"variant": variant, "kind": kind, "check": check, "seconds": round(time.perf_counter() - start, 2), **result})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="cuda_check.json")
    parser.add_argument("--variants", nargs="*", help="default: every registered variant")
    parser.add_argument("--checks", nargs="*", default=["parity64", "init", "bf16", "many"])
    parser.add_argument("--compile", nargs="*", default=[], help="variants to also torch.compile (inductor)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--processes", type=int, default=12)
    args = parser.parse_args()

    import torch

    import lora_func as lf

    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    variants = args.variants or lf.list_variants()
    jobs = [(v, k, args.checks, args.device) for v in variants for k in KINDS]
    jobs += [(v, k, ["compile"], args.device) for v in args.compile for k in KINDS]
    start = time.perf_counter()
    with mp.get_context("spawn").Pool(args.processes) as pool:
        results = [r for rs in pool.imap_unordered(_job, jobs) for r in rs]
    results.sort(key=lambda r: (r["variant"], r["kind"], r["check"]))
    Path(args.out).write_text(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else args.device,
                                          "seconds": round(time.perf_counter() - start, 1), "results": results}, indent=1))
    failed = [r for r in results if not r["ok"]]
    for r in failed:
        print("FAIL", r["variant"], r["kind"], r["check"], {k: v for k, v in r.items() if k not in ("variant", "kind", "check", "trace")})
    print(f"{len(results) - len(failed)}/{len(results)} checks passed in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
