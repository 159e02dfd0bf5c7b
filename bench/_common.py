"""Shared pieces of the benchmark scripts: the model, the inputs, the adapters (ours and peft's),
the training step, and an interleaved timer.

Definitions used by every script (see docs/benchmarks.md):

- A *step* is one forward pass, a cross-entropy loss over every position, and one backward
  pass computing the gradients of the adapter's trainable tensors AND of the input
  embeddings (``torch.autograd.grad``); no optimizer update.
- The *frozen base* step is the same model with no adapter, every weight
  ``requires_grad=False``, called directly (no ``functional_call``), with the same input
  embeddings (which require grad), so it runs the full backward down to the embeddings.
  Every adapted step runs that same backward, so ``ratio = step / frozen base step``
  isolates the adapter's cost (its extra math, its Python overhead, its extra memory traffic).
- peft configurations use exactly the same model weights, inputs, loss and backward.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lora_func as lf

ALL_VARIANTS = ("lora", "pissa", "delora", "ia3", "ia3_ff", "ia3_kv_down", "dora", "hra", "eva", "antipasto")
# Target modules per benchmark row; "ia3_kv_down" is peft's usual IA3 recipe (k, v scaled on the
# output, down_proj on the input): ours is compose(ia3 on k/v, ia3_ff on down_proj).
QV = ("q_proj", "v_proj")
ROW_TARGETS = {
    "lora": QV, "pissa": QV, "delora": QV, "dora": QV, "hra": QV, "eva": QV, "antipasto": QV,
    "ia3": ("k_proj", "v_proj"), "ia3_ff": ("down_proj",), "ia3_kv_down": ("k_proj", "v_proj", "down_proj"),
}
# Issue 30, structured family (b): peft's defaults on q, v, except RoAd's group of 64, which does
# not divide the 32-wide layers of the benchmarks' tiny modes (the counts do not depend on it).
ROW_OPTIONS: dict[str, dict[str, Any]] = {"oft": {}, "boft": {}, "road": {"group_size": 32}, "hira": {}}
ALL_VARIANTS += tuple(ROW_OPTIONS)
ROW_TARGETS |= {row: QV for row in ROW_OPTIONS}
# Issue 30's structured family, first part (LoHa, LoKr, GraLoRA, MiSS): q, v as LoRA.
STRUCTURED_A = ("loha", "lokr", "gralora", "miss")
ALL_VARIANTS += STRUCTURED_A
ROW_TARGETS |= dict.fromkeys(STRUCTURED_A, QV)


def structured_a_peft_config(row: str, rank: int, common: dict[str, Any]) -> Any:
    """peft's config for a STRUCTURED_A row, with lora_func's defaults."""
    import peft

    if row == "loha":
        return peft.LoHaConfig(r=rank, alpha=8, **common)
    if row == "lokr":
        return peft.LoKrConfig(r=rank, alpha=8, **common)
    if row == "gralora":
        return peft.GraloraConfig(r=rank, alpha=16, gralora_k=2, **common)
    return peft.MissConfig(r=rank, **common)
# issue 30 (structured family): r is SHiRA's r (r·(d_in + d_out) values, LoRA's count), C3A's
# block size and FourierFT's number of frequencies (peft's default 1000, not the rank).
ALL_VARIANTS += ("shira", "fourierft", "c3a")
ROW_TARGETS |= {"shira": QV, "fourierft": QV, "c3a": QV}
ROW_SIZES = {"fourierft": 1000}
# issue 30: WaveFT on q, v with peft's defaults (Haar, scaling 25) but FourierFT's n = 1000 (peft's
# 2592 exceeds the 32 × 32 layers of the benchmarks' tiny modes; the counts scale with d_in·d_out).
ALL_VARIANTS += ("waveft",)
ROW_TARGETS |= {"waveft": QV}
ROW_SIZES |= {"waveft": 1000}
# Issue 46: every other method peft has, on q, v with peft's defaults (LN tuning: the two norms of
# each layer). peft's model of each is read from our own adapter written in peft's format
# (`save_peft`, then `PeftModel.from_pretrained`): the same weights on both sides and peft's own
# layer code at run time.
SAVED_PEFT_ROWS = ("adalora", "adamss", "kasa", "ln_tuning", "mica", "pvera", "randlora", "tinylora", "unilora", "vblora", "vera")
# LoRA inits whose peft form changes the base weights (OLoRA, CorDA, LoRA-GA) or quantizes them
# (LoftQ): `save_peft` writes them as a LoRA of twice the rank on the untouched base (peft's own
# conversion), so their peft row is what peft runs after its init instead: its LoRA of rank r on
# the changed base (OLoRA's init is peft's; the others' need calibration or a quantizer, and the
# step does not depend on the values).
LORA_INIT_ROWS = ("olora", "corda", "lora_ga", "loftq")
ALL_VARIANTS += SAVED_PEFT_ROWS + LORA_INIT_ROWS
ROW_TARGETS |= dict.fromkeys(SAVED_PEFT_ROWS + LORA_INIT_ROWS, QV) | {"ln_tuning": ("input_layernorm", "post_attention_layernorm")}
# VB-LoRA: peft's vector_length 256 does not divide the tiny modes' 32-wide layers; 32 divides
# every width here (the counts scale with the number of sub-vectors, not with their length).
SPEC_OPTIONS: dict[str, dict[str, Any]] = {"vblora": {"vector_length": 32}}
CALIBRATED = ("eva", "corda", "lora_ga")  # init_adapter needs calibration batches
# issue 43: BEFT, GLoRA (its defaults: lora A/B and C, constant D/E), OSF (half of each layer frozen)
# and PSOFT (its defaults but r and psoft_alpha, which are LoRA's) on q, v with peft's defaults.
ISSUE_43 = ("beft", "glora", "osf", "psoft")
ALL_VARIANTS += ISSUE_43
ROW_TARGETS |= dict.fromkeys(ISSUE_43, QV)
ROW_OPTIONS_43: dict[str, dict[str, Any]] = {"psoft": {"alpha": 8.0}}
# issue 43 (Lily): on q, v with peft's defaults (num_B 2, stride_A 1); each name's B tied over its
# layers; peft's model is read from our save_peft, which writes the tied tensors under each layer.
SAVED_PEFT_ROWS += ("lily",)
ALL_VARIANTS += ("lily",)
ROW_TARGETS |= {"lily": QV}


def issue_43_peft_config(row: str, rank: int, common: dict[str, Any]) -> Any:
    """peft's config for an ISSUE_43 row, with lora_func's defaults."""
    import peft

    if row == "beft":
        return peft.BeftConfig(**common)
    if row == "glora":
        return peft.GloraConfig(r=rank, **common)
    if row == "osf":
        return peft.OSFConfig(**common)
    return peft.PsoftConfig(r=rank, psoft_alpha=8, **common)
# issue 43 (methods b): DEFT, PEANuT and Super-Tuning on q, v with peft's defaults (PEANuT's r the
# benchmark's rank, not peft's 32; Super-Tuning: sparsity 0.99, no LoRA).
METHODS_B = ("deft", "peanut", "supertuning")
ALL_VARIANTS += METHODS_B
ROW_TARGETS |= dict.fromkeys(METHODS_B, QV)


# issue 43 (FRoD): on q, v with peft's defaults (sparse_rate 0.01, save_projection); peft's model is
# read from our save_peft (the same V, positions and trained values; U solved on load, as ours).
SAVED_PEFT_ROWS += ("frod",)
ALL_VARIANTS += ("frod",)
ROW_TARGETS |= {"frod": QV}


def methods_b_peft_config(row: str, rank: int, common: dict[str, Any]) -> Any:
    """peft's config for a METHODS_B row, with lora_func's defaults."""
    import peft

    if row == "deft":
        return peft.DeftConfig(r=rank, **common)
    if row == "peanut":
        return peft.PeanutConfig(r=rank, **common)
    return peft.SupertuningConfig(**common)
# Issue 43: LoRA's own variants on q, v. BD-LoRA with A block-diagonal in 2 blocks; QALoRA's groups
# of 16 (peft runs it on GPTQ layers only: no peft row); aLoRA acting on every token (the benchmark
# feeds inputs_embeds, from which peft finds no offsets: no peft row). VeLoRA differs from LoRA in
# training steps only (the benchmark's model is in eval mode); MonteCLoRA too, and its priors get no
# gradient in eval (no row). lora_bias needs targets with a bias, which the benchmark's Llama has
# not; trainable tokens an embedding, which inputs_embeds skip.
LORA_VARIANT_OPTIONS: dict[str, dict[str, Any]] = {"bdlora": {"nblocks": 2}, "qalora": {"group_size": 16}, "velora": {}, "alora": {}}
ALL_VARIANTS += tuple(LORA_VARIANT_OPTIONS)
ROW_TARGETS |= dict.fromkeys(LORA_VARIANT_OPTIONS, QV)
# Rows without a merged path on the benchmark model: BEFT on its bias-free q, v (no weight holds a
# bias; peft's merge refuses it too).
NO_MERGED_ROWS = ("beft", "lily")  # lily: no merged weight at all (the no_merged_weight trait)
# Rows without a peft model here (peft_model returns None): AntiPaSTO (not in peft), QALoRA and
# aLoRA (above).
NO_PEFT_ROWS = ("antipasto", "qalora", "alora")


# glibc's malloc hands every block over 32 MiB back to the kernel when it is freed (and, by
# default, lowers that threshold only as it sees frees), so each step page-faults its large
# activations in again: 4,000-10,000 faults and 10-40 ms of system time per benchmark step,
# varying from step to step. Keeping freed memory in the process (as jemalloc and tcmalloc
# do, and as PyTorch's CUDA caching allocator does on the GPU) removes that cost and its
# noise for every configuration alike; peft's ratios then land between 2 points below and 5
# above the ones the targets were set against (docs/benchmarks.md).
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def reexec_with_steady_allocator() -> None:
    """Re-run this script once with :data:`MALLOC_TUNABLES` (read by glibc at process start),
    unless ``GLIBC_TUNABLES`` is already set (then the caller's choice stands) or this is
    not Linux. Call it from ``if __name__ == "__main__"``, never from code a test imports."""
    if platform.system() != "Linux" or "GLIBC_TUNABLES" in os.environ:
        return
    os.environ["GLIBC_TUNABLES"] = MALLOC_TUNABLES
    os.execv(sys.executable, [sys.executable, *sys.argv])


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="base model dtype")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    parser.add_argument("--seed", type=int, default=0)


def setup(args: argparse.Namespace) -> None:
    """Threads, seeds and the clock; on CUDA the clock is always the wall clock (kernels run
    asynchronously, so process CPU time would count only their launches)."""
    if args.device.startswith("cuda") and hasattr(args, "clock"):
        args.clock = "wall"
    if hasattr(args, "clock"):
        set_clock(args.clock)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(args: argparse.Namespace) -> str:
    dev = args.device
    if dev.startswith("cuda"):
        dev = f"{dev} ({torch.cuda.get_device_name()})"
    else:
        dev = f"cpu ({_cpu_name()}, {args.threads} threads of {os.cpu_count()} cores)"
    return f"torch {torch.__version__}, {dev}, base dtype {args.dtype}"


@dataclasses.dataclass
class Setup:
    """The frozen model, its base dict, and the step inputs."""

    model: nn.Module
    base: dict[str, Tensor]
    embeds: Tensor  # (batch, seq, hidden), requires grad: the backward reaches the embeddings
    labels: Tensor  # (batch * seq,)
    calib_ids: Tensor  # (batch, seq) token ids for EVA's calibration
    dtype: torch.dtype
    device: torch.device


def build_model(args: argparse.Namespace, *, layers: int | None = None, hidden: int | None = None) -> nn.Module:
    """A Llama with random weights: hidden ``--hidden``, 4 heads of hidden/4 (MHA), MLP 2.6875 x
    hidden (688 at 256), vocab ``--vocab``, SDPA attention, eval mode, frozen."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = hidden or args.hidden
    torch.manual_seed(args.seed)
    heads = max(1, hidden // 64)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.6875), num_hidden_layers=layers or args.layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max(256, args.seq),
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    model.requires_grad_(False)
    return model


def gqa_llama(hidden: int, layers: int, vocab: int, *, attention: str, seed: int = 0, **config: Any) -> nn.Module:
    """A Llama with random weights from ``seed`` and grouped-query attention (heads of 32, key/value
    heads of 64), MLP 8/3 x hidden, eval mode, ``attention`` its attention implementation;
    ``config``: further ``LlamaConfig`` fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
            num_attention_heads=max(hidden // 32, 1), num_key_value_heads=max(hidden // 64, 1), **config,
        )
    ).eval()
    model.set_attn_implementation(attention)
    return model


def build_setup(
    args: argparse.Namespace, *, layers: int | None = None, hidden: int | None = None, model: nn.Module | None = None
) -> Setup:
    """The frozen model (``model`` if given, e.g. one built earlier, reused for new inputs)
    and the step inputs for ``args.batch`` x ``args.seq`` tokens."""
    model = model if model is not None else build_model(args, layers=layers, hidden=hidden)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=g)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids.to(args.device))
    labels = torch.randint(0, args.vocab, (args.batch * args.seq,), generator=g).to(args.device)
    calib = torch.randint(3, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
    return Setup(model, lf.base_params(model), embeds.detach().clone().requires_grad_(True), labels, calib, dtype, torch.device(args.device))


def loss_of(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels)


# ------------------------------------------------------------------------------ adapters


def _perturbed(adapter: Any, scale: float = 0.02, seed: int = 3) -> Any:
    """The adapter with every trainable tensor moved off its init (B = 0 etc.), values only."""
    g = torch.Generator().manual_seed(seed)
    params = {
        k: (v.detach() + scale * torch.randn(v.shape, generator=g, dtype=torch.float32).to(v)).requires_grad_(True)
        for k, v in adapter.params.items()
    }
    return adapter.with_params(params)


def our_adapter(s: Setup, row: str, rank: int, *, targets: Sequence[str] | None = None, options_override: dict[str, Any] | None = None) -> Any:
    """Our adapter for a benchmark row (perturbed off its init); ``options_override`` replaces the row's options."""
    targets = list(targets or ROW_TARGETS[row])
    model = s.model
    if row == "ia3_kv_down":
        kv = [t for t in targets if t != "down_proj"]
        down = [t for t in targets if t == "down_proj"]
        parts = []
        if kv:
            parts.append(lf.init_adapter(model, lf.AdapterSpec("ia3", kv), generator=torch.Generator().manual_seed(0)))
        if down:
            parts.append(lf.init_adapter(model, lf.AdapterSpec("ia3_ff", down), generator=torch.Generator().manual_seed(0)))
        return _perturbed(lf.compose(*parts))
    options: dict[str, Any] = dict(ROW_OPTIONS.get(row, {})) | SPEC_OPTIONS.get(row, {}) | LORA_VARIANT_OPTIONS.get(row, {})
    if row == "adalora":  # peft stores AdaLoRA's initial rank as init_r: the same as r
        options |= {"init_r": rank, "target_r": rank}
    options |= options_override or {}
    spec_extra = ROW_OPTIONS_43.get(row, {})
    calibration = None
    if row in CALIBRATED:
        calibration = [{"input_ids": s.calib_ids}]
    spec = lf.AdapterSpec(row, targets, r=ROW_SIZES.get(row, rank), **options, **spec_extra)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0), calibration=calibration)
    return _perturbed(adapter)


def saved_peft_model(s: Setup, adapter: Any) -> nn.Module:
    """peft's model of ``adapter`` on a deep copy of the same weights, in eval mode: the adapter
    written with ``save_peft`` and read back by ``PeftModel.from_pretrained`` (trainable, same
    values)."""
    import tempfile
    import warnings

    import peft

    with tempfile.TemporaryDirectory() as directory, warnings.catch_warnings():
        lf.save_peft(adapter, directory, model=s.model)
        # peft's warnings for what it loads as intended: LN tuning's copy of a norm layer (its
        # target by design) and the shared random bases of RandLoRA-like methods, which save_peft
        # writes once where peft expects a copy per layer (docs/io.md).
        warnings.filterwarnings("ignore", message="Unsupported layer type", category=UserWarning)
        warnings.filterwarnings("ignore", message="Found missing adapter keys", category=UserWarning)
        model = peft.PeftModel.from_pretrained(copy.deepcopy(s.model), directory, is_trainable=True)
    # Its new layers start in training mode, where PVeRA samples its noise: the benchmarks' step
    # runs the model in eval mode, ours too (the same function on both sides).
    return model.eval()


def peft_model(s: Setup, row: str, rank: int, *, targets: Sequence[str] | None = None, adapter: Any = None) -> nn.Module | None:
    """peft's model for a benchmark row on a deep copy of the same weights, or ``None`` when
    peft has no such adapter (antipasto). For the ``SAVED_PEFT_ROWS``, ``adapter`` (ours, built
    if not given) is the one peft loads."""
    import peft

    targets = list(targets or ROW_TARGETS[row])
    if row in SAVED_PEFT_ROWS:
        return saved_peft_model(s, adapter if adapter is not None else our_adapter(s, row, rank, targets=targets))
    common: dict[str, Any] = {"target_modules": targets}
    if row in LORA_INIT_ROWS:
        config = peft.LoraConfig(r=rank, lora_alpha=8, lora_dropout=0.0, init_lora_weights="olora" if row == "olora" else True, **common)
    elif row in ("lora", "pissa", "dora", "eva"):
        init = {"lora": True, "dora": True, "pissa": "pissa", "eva": "eva"}[row]
        extra: dict[str, Any] = {}
        if row == "eva":
            extra["eva_config"] = peft.EvaConfig(rho=1.0)
        config = peft.LoraConfig(r=rank, lora_alpha=8, lora_dropout=0.0, init_lora_weights=init, use_dora=row == "dora", **common, **extra)
    elif row == "delora":
        config = peft.DeloraConfig(r=rank, delora_lambda=15, **common)
    elif row == "hra":
        config = peft.HRAConfig(r=rank, **common)
    elif row in ("ia3", "ia3_ff", "ia3_kv_down"):
        # ia3 scales outputs, ia3_ff inputs (peft's feedforward modules), ia3_kv_down's down_proj only
        feedforward = {"ia3": [], "ia3_ff": targets}.get(row, [t for t in targets if t == "down_proj"])
        config = peft.IA3Config(feedforward_modules=feedforward, **common)
    elif row in ROW_OPTIONS:
        import peft.tuners.boft.layer

        # Without its CUDA extension peft's BOFT uses one butterfly factor (our default too); never
        # let it try to compile the extension here.
        peft.tuners.boft.layer._FBD_CUDA = peft.tuners.boft.layer._FBD_CUDA or False
        config = {"oft": peft.OFTConfig, "boft": peft.BOFTConfig, "road": peft.RoadConfig}.get(row, peft.HiraConfig)(
            **({"r": rank} if row == "hira" else {}), **ROW_OPTIONS[row], **common
        )
    elif row in STRUCTURED_A:
        config = structured_a_peft_config(row, rank, common)
    elif row == "shira":
        config = peft.ShiraConfig(r=rank, **common)
    elif row == "fourierft":
        config = peft.FourierFTConfig(n_frequency=ROW_SIZES[row], **common)
    elif row == "c3a":
        config = peft.C3AConfig(block_size=rank, **common)
    elif row == "waveft":
        config = peft.WaveFTConfig(n_frequency=ROW_SIZES[row], **common)
    elif row in ISSUE_43:
        config = issue_43_peft_config(row, rank, common)
    elif row in METHODS_B:
        config = methods_b_peft_config(row, rank, common)
    elif row in ("bdlora", "velora"):
        from peft.tuners.lora.config import BdLoraConfig, VeloraConfig

        variant = {"bdlora": {"use_bdlora": BdLoraConfig(target_modules_bd_a=targets, nblocks=2)}, "velora": {"velora_config": VeloraConfig()}}[row]
        config = peft.LoraConfig(r=rank, lora_alpha=8, lora_dropout=0.0, **variant, **common)
    else:
        return None
    model = copy.deepcopy(s.model)
    if row == "eva":
        # EVA needs a model whose forward takes input_ids; calibrate on the same ids as ours.
        pm = peft.get_peft_model(model, config, low_cpu_mem_usage=True)
        loader = [{"input_ids": s.calib_ids}]
        with torch.no_grad():
            peft.initialize_lora_eva_weights(pm, loader)
    else:
        pm = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p))
    return pm


# ------------------------------------------------------------------------------ steps


@dataclasses.dataclass
class Step:
    """``forward()`` returns the loss; ``step()`` is forward + backward (the timed unit)."""

    forward: Callable[[], Tensor]
    inputs: list[Tensor]  # what the backward differentiates: the embeddings, then the trainables

    def step(self) -> Any:
        return torch.autograd.grad(self.forward(), self.inputs)


def base_step(s: Setup) -> Step:
    model, embeds, labels = s.model, s.embeds, s.labels
    return Step(lambda: loss_of(model(inputs_embeds=embeds).logits, labels), [embeds])


def our_step(s: Setup, adapter: Any, *, merged: bool) -> Step:
    """``functional_call(model, overlay(base, adapter), ...)``: the overlay is rebuilt every step,
    as in a training loop whose adapter values change."""
    model, base, embeds, labels = s.model, s.base, s.embeds, s.labels
    make = lf.merge_overlay if merged else lf.overlay

    def forward() -> Tensor:
        out = torch.func.functional_call(model, make(base, adapter), (), {"inputs_embeds": embeds}, tie_weights=True, strict=False)
        return loss_of(out.logits, labels)

    return Step(forward, [embeds, *adapter.params.values()])


def peft_step(s: Setup, pm: nn.Module) -> Step:
    embeds, labels = s.embeds, s.labels
    return Step(lambda: loss_of(pm(inputs_embeds=embeds).logits, labels), [embeds, *(p for p in pm.parameters() if p.requires_grad)])


# ------------------------------------------------------------------------------ timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# What the timer reads: "wall" (time.perf_counter, the default and the one the targets are
# stated in) or "cpu" (time.process_time: CPU seconds of all this process's threads, far less
# sensitive to other processes on a shared machine, but it weighs single-threaded Python
# overhead half as much as 2-thread kernels). Set by the scripts' --clock option.
CLOCK = {"now": time.perf_counter}


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def set_clock(kind: str) -> None:
    CLOCK["now"] = CLOCKS[kind]


def print_paired_table(title: str, times: dict[str, list[float]], references: dict[str, str]) -> None:
    """A markdown table of :func:`timed_rounds`' results: each method's median and, where
    ``references`` names one, its median paired ratio to that method."""
    print(f"\n{title}")
    print(f"| {'method':<58} | {'median ms':>9} | {'ratio':>6} | vs |")
    print(f"|{'-' * 60}|{'-' * 11}|{'-' * 8}|----|")
    for name, seconds in times.items():
        ref = references.get(name)
        shown = f"{paired_ratio(times, name, ref):6.2f} | {ref}" if ref else f"{'':>6} | "
        print(f"| {name:<58} | {1e3 * statistics.median(seconds):9.1f} | {shown} |")


def add_interleaved_args(parser: argparse.ArgumentParser, *, rounds: int) -> None:
    """The options of the scripts timed with :func:`timed_rounds`: ``--rounds``, ``--clock``
    (``CLOCKS``: this process's CPU time by default), ``--threads``, ``--quick``."""
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="process CPU time (default) or wall time")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round (a smoke test)")


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    now = CLOCK["now"]
    _sync(device)
    t0 = now()
    fn()
    _sync(device)
    return now() - t0


@dataclasses.dataclass
class RatioStats:
    median: float  # median over rounds of the paired ratio (the headline number)
    ms: float  # median step time, milliseconds
    lo: float  # 95 % confidence interval of the median (median_ci)
    hi: float
    samples: tuple[float, ...] = ()  # the paired ratio of every round, in round order

    def fmt(self) -> str:
        return f"{self.median:.3f}"


def median_ci(xs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median that ``xs`` were drawn from.

    The order statistics ``(x_(j), x_(n+1-j))`` cover the true median with probability
    ``1 - 2 P(K < j)``, ``K ~ Binomial(n, 1/2)``, whatever the distribution (no normality:
    step times here have a long right tail). ``j`` is the largest index reaching ``level``;
    with too few samples for any (fewer than 6 at 95 %) the interval is unbounded.
    """
    xs = sorted(xs)
    n = len(xs)
    below, j = 0.0, 0  # below = P(K < j + 1) = P(K <= j)
    while j < n // 2:
        below += math.comb(n, j) / 2**n
        if 1 - 2 * below < level:
            break
        j += 1
    if j == 0:
        return -math.inf, math.inf
    return xs[j - 1], xs[n - j]


def verdict(lo: float, hi: float, limit: float) -> str:
    """``"holds"`` when the whole confidence interval is at or under ``limit``, ``"fails"``
    when all of it is above, ``"unresolved"`` when it straddles the limit (the machine's noise
    is larger than the distance to the target: more rounds or a quieter machine decide)."""
    if hi <= limit:
        return "holds"
    if lo > limit:
        return "fails"
    return "unresolved"


def _rounds(
    steps: dict[str, Callable[[], Any]],
    baseline: str,
    names: list[str],
    rounds: int,
    base_every: int,
    rng: random.Random,
    device: torch.device,
    ratios: dict[str, list[float]],
    times: dict[str, list[float]],
) -> None:
    for _ in range(rounds):
        order = names[:]
        rng.shuffle(order)
        gc.collect()  # between rounds, outside any timing
        before = timed(steps[baseline], device)
        times[baseline].append(before)
        pending: list[tuple[str, float]] = []
        for i, n in enumerate(order):
            pending.append((n, timed(steps[n], device)))
            if (i + 1) % base_every == 0 or i == len(order) - 1:
                after = timed(steps[baseline], device)
                times[baseline].append(after)
                ref = 0.5 * (before + after)
                for pn, t in pending:
                    ratios[pn].append(t / ref)
                    times[pn].append(t)
                pending, before = [], after


def interleaved_ratios(
    steps: dict[str, Callable[[], Any]], baseline: str, *, rounds: int, warmup: int, device: torch.device, base_every: int = 3, seed: int = 0
) -> tuple[dict[str, RatioStats], float]:
    """Median over ``rounds`` of ``time(step) / time(baseline)``.

    Every round runs each step once, in a fresh random order, with the baseline re-timed
    before the first step and after every ``base_every`` steps; each step's ratio is taken
    against the mean of the two baseline timings around it, so slow drifts and bursts of load
    from other processes hit numerator and denominator alike. Returns the stats per step and
    the round-to-round noise of the baseline (interquartile range / median of its timings).
    """
    rng = random.Random(seed)
    names = [n for n in steps if n != baseline]
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    ratios: dict[str, list[float]] = {n: [] for n in names}
    times: dict[str, list[float]] = {n: [] for n in steps}
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection would land in whichever step allocated last
    try:
        _rounds(steps, baseline, names, rounds, base_every, rng, device, ratios, times)
    finally:
        if gc_was_enabled:
            gc.enable()
    stats = {}
    for n in names:
        lo, hi = median_ci(ratios[n])
        stats[n] = RatioStats(statistics.median(ratios[n]), 1e3 * statistics.median(times[n]), lo, hi, tuple(ratios[n]))
    bt = times[baseline]
    bq = statistics.quantiles(bt, n=4) if len(bt) > 1 else [bt[0]] * 3
    stats[baseline] = RatioStats(1.0, 1e3 * statistics.median(bt), 1.0, 1.0)
    return stats, (bq[2] - bq[0]) / statistics.median(bt)


# ------------------------------------------------------------------------------ memory


def saved_tensor_bytes(fn: Callable[[], Any], exclude: Sequence[Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward while running ``fn`` (the
    forward), excluding the storages of ``exclude`` (weights, adapter tensors, inputs): the
    activation memory a step adds. Deterministic, so usable on a noisy CPU."""
    skip = {t.untyped_storage().data_ptr() for t in exclude if t.device.type != "meta"}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in skip:
                seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
        except (RuntimeError, NotImplementedError):  # a subclass without storage
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def cuda_peak_bytes(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def geo(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def vm_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (``VmRSS``, ``VmHWM``: Linux only)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def timed_rounds(methods: dict[str, Callable[[], object]], rounds: int, clock: Callable[[], float]) -> dict[str, list[float]]:
    """Seconds of each method per round (every method once per round, in order), after one
    warm-up call each (allocator, lazy init); garbage collection runs between rounds only."""
    for fn in methods.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection would land in whichever method allocated last
    try:
        for _ in range(rounds):
            gc.collect()  # between rounds, outside any timing
            for name, fn in methods.items():
                start = clock()
                fn()
                times[name].append(clock() - start)
    finally:
        if enabled:
            gc.enable()
    return times


def paired_ratio(times: dict[str, list[float]], name: str, reference: str) -> float:
    """The median over rounds of ``name``'s time over ``reference``'s in the same round."""
    return statistics.median(a / b for a, b in zip(times[name], times[reference], strict=True))


def peft_named_adapters(model: nn.Module, adapters: Sequence[Any], r: int, alpha: float, targets: Sequence[str]) -> nn.Module:
    """A peft copy of ``model`` with lora_func LoRA ``adapters`` loaded as "a0", "a1", ... (the
    same weights; "a0" active), for peft's ``adapter_names=`` mixed batches."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)
    peft = get_peft_model(copy.deepcopy(model), config, adapter_name="a0")
    for i in range(1, len(adapters)):
        peft.add_adapter(f"a{i}", config)
    with torch.no_grad():
        for name, module in peft.named_modules():
            if hasattr(module, "lora_A") and len(module.lora_A):
                key = name.removeprefix("base_model.model.")
                for i, adapter in enumerate(adapters):
                    module.lora_A[f"a{i}"].weight.copy_(adapter.params[f"{key}.lora_A"])
                    module.lora_B[f"a{i}"].weight.copy_(adapter.params[f"{key}.lora_B"])
    peft.set_adapter("a0")
    return peft.eval()


def left_padded_batch(size: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(size, length)`` and a left-padded attention mask with per-sequence lengths
    (up to a quarter of ``length`` padded), fixed seed."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (size, length), generator=g)
    pad = torch.randint(0, length // 4, (size,), generator=g)
    mask = (torch.arange(length)[None] >= pad[:, None]).long()
    return ids, mask
