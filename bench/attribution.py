"""What attribution costs: lora_func.attribution's features against per_example_grads alone, and
against traker and kronfluence on the same model, weights, examples and loss.

A Llama with random weights (eager attention), LoRA r=8 on q_proj/v_proj, N training examples of
T tokens (left-padded), CPU, at two sizes in one run (default: hidden 128 / 2 layers / 32 x 32
tokens, and hidden 256 / 4 layers / 32 x 64 tokens). Per size:

1. features: ``per_example_grads`` (the reference); ``features(proj_dim=None)`` (flattened rows);
   ``features(proj_dim=k)`` against the per-example gradients followed by the projection's FLOPs
   done with a stored ``(D, k)`` matrix (one GEMM, the matrix drawn beforehand: the cost a
   projection cannot go below), target ``<= 1.2x``; traker's ``TRAKer.featurize`` (its per-sample
   gradients by ``vmap(grad)`` on the adapter as a module, its CPU ``BasicProjector``, normal,
   ``proj_dim=k``) against ``features(proj_dim=k)``;
2. EK-FAC influence of N training examples on Q queries: ``ekfac`` + ``features`` + ``influence``
   against kronfluence's ``fit_all_factors`` + ``compute_pairwise_scores`` on a peft model with
   the same weights (lora_A / lora_B tracked, empirical Fisher, float32, its files in a temporary
   directory), and how far their scores are apart.

Time: interleaved rounds, each ratio the median over rounds of the per-round ratio
(bench/_common.py), this process's CPU time on one thread. Memory: peak bytes allocated on the
CPU during one call (torch profiler memory events), as ratios. Before the timings, the agreement
with kronfluence in float64 on the small size (EK-FAC scores, relative to their largest).

Run: python bench/attribution.py [--rounds 5] [--proj-dim 2048] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c
from functional import build, peak_allocated, perturbed

import lora_func as lf
from lora_func import attribution as at

TARGETS = ["q_proj", "v_proj"]
PROJECTED = "lora_func features(proj_dim=k)"
REFERENCE = "lora_func per_example_grads"
FLOOR = "per_example_grads + stored-matrix GEMM (the FLOP floor)"
OURS_IF = "lora_func ekfac + features + influence"
LIMIT = 1.2


def example_losses(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each example's mean next-token cross-entropy on its real tokens, ``(B,)``."""
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels, reduction="none")
    return per_token.sum(1) / (labels != -100).sum(1)


def loss_of(model, base):
    def loss_fn(adapter, ids, mask):
        return example_losses(lf.adapted_call(model, adapter, ids, attention_mask=mask, base=base).logits, ids, mask).sum()

    return loss_fn


def _quiet() -> warnings.catch_warnings:
    context = warnings.catch_warnings()
    context.__enter__()
    warnings.simplefilter("ignore")
    return context


def traker_featurizer(model, adapter, ids, mask, proj_dim: int, directory: str):
    """traker's featurize of the same examples and loss, the adapter as a module (its parameters
    are the adapter's tensors); ``None`` when traker is not installed."""
    try:
        from trak import TRAKer
        from trak.modelout_functions import AbstractModelOutput
        from trak.projectors import BasicProjector, ProjectionType
    except ImportError:
        return None
    module = lf.as_module(model, adapter.detach())

    class Loss(AbstractModelOutput):
        def __init__(self) -> None:
            pass

        def get_output(self, m, weights, buffers, ids_, mask_):
            logits = functional_call(m, (weights, buffers), (ids_.unsqueeze(0),), {"attention_mask": mask_.unsqueeze(0)}).logits
            return example_losses(logits, ids_.unsqueeze(0), mask_.unsqueeze(0))[0]

        def get_out_to_loss_grad(self, m, weights, buffers, batch):
            return torch.ones(batch[0].shape[0], 1)

    dim = at.feature_dim(adapter)
    projector = BasicProjector(grad_dim=dim, proj_dim=proj_dim, seed=0, proj_type=ProjectionType.normal, device="cpu")
    traker = TRAKer(model=module, task=Loss(), train_set_size=ids.shape[0], save_dir=directory, device="cpu", projector=projector,
                    use_half_precision=False, logging_level=logging.ERROR)
    names = [name for name, _ in module.named_parameters()]
    traker.load_checkpoint({name: adapter.params[key].detach() for name, key in zip(names, adapter.params, strict=True)}, model_id=0,
                           _allow_featurizing_already_registered=True)
    inds = torch.arange(ids.shape[0]).numpy()

    def featurize():
        traker.saver.current_store["is_featurized"][inds] = 0  # featurize again each round
        traker.featurize((ids, mask), inds=inds)

    return featurize


def kronfluence_runner(model, adapter, r: int, alpha: float, train, queries, directory: str, dtype=torch.float32):
    """kronfluence's EK-FAC pairwise scores ``(Q, N)`` on a peft model with the adapter's weights
    (the loss summed over each batch's examples, as kronfluence expects); ``None`` when
    kronfluence (or peft) is not installed."""
    try:
        from kronfluence.analyzer import Analyzer, prepare_model
        from kronfluence.arguments import FactorArguments, ScoreArguments
        from kronfluence.task import Task
    except ImportError:
        return None
    context = _quiet()
    try:
        peft = c.peft_named_adapters(model, [adapter], r, alpha, TARGETS).to(dtype)
    finally:
        context.__exit__(None, None, None)
    tracked = [n for n, m in peft.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 2)[-2] in ("lora_A", "lora_B")]

    class Loss(Task):
        def compute_train_loss(self, batch, model, sample=False):
            ids, mask = batch
            return example_losses(model(ids, attention_mask=mask).logits, ids, mask).sum()

        def compute_measurement(self, batch, model):
            return self.compute_train_loss(batch, model)

        def get_influence_tracked_modules(self):
            return tracked

        def get_attention_mask(self, batch):
            return batch[1]

    class Rows(torch.utils.data.Dataset):
        def __init__(self, ids, mask):
            self.ids, self.mask = ids, mask

        def __len__(self):
            return self.ids.shape[0]

        def __getitem__(self, i):
            return self.ids[i], self.mask[i]

    task = Loss()
    peft = prepare_model(peft, task)
    analyzer = Analyzer("bench", peft, task, cpu=True, disable_tqdm=True, output_dir=directory, log_level=logging.ERROR)
    factor_args = FactorArguments(strategy="ekfac", use_empirical_fisher=True, activation_covariance_dtype=dtype, gradient_covariance_dtype=dtype,
                                  per_sample_gradient_dtype=dtype, lambda_dtype=dtype)
    score_args = ScoreArguments(damping_factor=1e-3, per_sample_gradient_dtype=dtype, precondition_dtype=dtype, score_dtype=dtype)
    train_rows, query_rows = Rows(*train), Rows(*queries)

    def run() -> torch.Tensor:
        context = _quiet()  # kronfluence's deprecated GradScaler calls warn every time
        try:
            analyzer.fit_all_factors("f", train_rows, per_device_batch_size=len(train_rows), factor_args=factor_args, overwrite_output_dir=True)
            analyzer.compute_pairwise_scores("s", "f", query_rows, train_rows, per_device_query_batch_size=len(query_rows),
                                             per_device_train_batch_size=len(train_rows), score_args=score_args, overwrite_output_dir=True)
            run.last = analyzer.load_pairwise_scores("s")["all_modules"]  # type: ignore[attr-defined]
            return run.last  # type: ignore[attr-defined]
        finally:
            context.__exit__(None, None, None)

    return run


def ours_influence(model, adapter, train, queries):
    loss_fn = loss_of(model, lf.base_params(model))

    def run() -> torch.Tensor:
        curvature = at.ekfac(loss_fn, adapter, [train], token_mask=lambda ids, mask: mask)
        run.last = at.influence(curvature, at.features(loss_fn, adapter, *train), at.features(loss_fn, adapter, *queries), damping=1e-3)  # type: ignore[attr-defined]
        return run.last  # type: ignore[attr-defined]

    return run


def agreement(hidden: int, layers: int, vocab: int, n: int, seq: int, r: int) -> float | None:
    """max |ours - kronfluence| / max |kronfluence| of EK-FAC scores in float64."""
    model = build(hidden, layers, vocab).double()
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=TARGETS, r=r, alpha=2 * r, dtype=torch.float64), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    adapter = adapter.with_params({k: 0.2 * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in adapter.params.items()})
    ids, mask = c.left_padded_batch(n, seq, vocab)
    mask = mask.flip(1)  # right padding: in float64 this Llama's fully masked (left-padded) rows are NaN
    train, queries = (ids, mask), (ids[: n // 4], mask[: n // 4])
    with tempfile.TemporaryDirectory() as directory:
        theirs = kronfluence_runner(model, adapter, r, 2 * r, train, queries, directory, dtype=torch.float64)
        if theirs is None:
            return None
        want = theirs()
    got = ours_influence(model, adapter, train, queries)()
    return float((got - want).abs().max() / want.abs().max())


def section(args, hidden: int, layers: int, vocab: int, n: int, seq: int, *, kronfluence: bool = True) -> dict[str, float]:
    model = build(hidden, layers, vocab)
    r, k = args.rank, args.proj_dim
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=TARGETS, r=r, alpha=2 * r), generator=torch.Generator().manual_seed(0)), 0)
    ids, mask = c.left_padded_batch(n, seq, vocab)
    loss_fn = loss_of(model, lf.base_params(model))
    dim = at.feature_dim(adapter)
    stored = torch.randn(dim, k)

    def floor():
        grads = lf.per_example_grads(loss_fn, adapter, ids, mask)
        return torch.cat([g.flatten(1) for g in grads.values()], 1) @ stored

    methods = {
        REFERENCE: lambda: lf.per_example_grads(loss_fn, adapter, ids, mask),
        "lora_func features(proj_dim=None)": lambda: at.features(loss_fn, adapter, ids, mask),
        FLOOR: floor,
        PROJECTED: lambda: at.features(loss_fn, adapter, ids, mask, proj_dim=k, generator=torch.Generator().manual_seed(0)),
    }
    references = {"lora_func features(proj_dim=None)": REFERENCE, FLOOR: REFERENCE, PROJECTED: FLOOR}
    with tempfile.TemporaryDirectory() as directory:
        featurize = traker_featurizer(model, adapter, ids, mask, k, directory + "/trak")
        if featurize is None:
            print("traker not installed: no traker row")
        else:
            import trak

            name = f"traker {trak.__version__} featurize (BasicProjector, normal, k)"
            methods[name] = featurize
            references[name] = PROJECTED
        queries = (ids[: args.queries], mask[: args.queries])
        ours = methods[OURS_IF] = ours_influence(model, adapter, (ids, mask), queries)
        theirs = kronfluence_runner(model, adapter, r, 2 * r, (ids, mask), queries, directory + "/kron") if kronfluence else None
        if theirs is None:
            print("kronfluence not installed: no kronfluence row" if kronfluence else "(--quick: no kronfluence timing)")
        else:
            import kronfluence as kf

            name = f"kronfluence {kf.__version__} fit_all_factors + compute_pairwise_scores (ekfac)"
            methods[name] = theirs
            references[name] = OURS_IF
        peaks = {name: peak_allocated(fn) for name, fn in methods.items()}
        times = c.timed_rounds(methods, args.rounds, c.CLOCKS[args.clock])
        if theirs is not None:
            difference = float((ours.last - theirs.last).abs().max() / theirs.last.abs().max())  # type: ignore[attr-defined]
            print(f"\nfloat32 EK-FAC scores, max |lora_func - kronfluence| / max |kronfluence|: {difference:.2e}")
    c.print_paired_table(f"Llama hidden {hidden}, {layers} layers, N = {n} examples x {seq} tokens, LoRA r={r} on {TARGETS} (D = {dim:,}), "
                         f"k = {k}, {args.queries} queries: time (target: features(proj_dim=k) <= {LIMIT}x the FLOP floor)", times, references)
    print("\n| method | peak allocated | ratio | vs |\n|---|---|---|---|")
    for name in methods:
        ref = references.get(name)
        ratio = f"{peaks[name] / peaks[ref]:.2f}" if ref and peaks[ref] else ""
        print(f"| {name} | {c.fmt_bytes(peaks[name])} | {ratio} | {ref or ''} |")
    out = {key: c.paired_ratio(times, name, references[name]) for key, name in (("features", "lora_func features(proj_dim=None)"), ("projected_over_floor", PROJECTED))}
    out["projected_over_per_example_grads"] = c.paired_ratio(times, PROJECTED, REFERENCE)
    for key, prefix in (("traker_over_ours", "traker"), ("kronfluence_over_ours", "kronfluence")):
        name = next((m for m in methods if m.startswith(prefix)), None)
        if name is not None:
            out[key] = c.paired_ratio(times, name, references[name])
            out[key.replace("over_ours", "memory_over_ours")] = peaks[name] / max(1, peaks[references[name]])
    verdict = "HOLDS" if out["projected_over_floor"] <= LIMIT else "FAILS"
    print(f"\nfeatures(proj_dim={k}) / FLOP floor: {out['projected_over_floor']:.3f} (target <= {LIMIT}) -> {verdict}")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_interleaved_args(parser, rounds=5)
    parser.add_argument("--proj-dim", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--queries", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        sizes = [(32, 1, 64, 6, 8), (64, 1, 64, 6, 8)]
        args.rounds, args.proj_dim, args.rank, args.queries = 1, 64, 2, 2
    else:
        sizes = [(128, 2, 512, 32, 32), (256, 4, 2048, 32, 64)]
    print(f"torch {torch.__version__}, {args.threads} thread(s), clock {args.clock}, {args.rounds} interleaved rounds")
    difference = agreement(32, 1, 64, 8, 8, 2)
    print("kronfluence not installed: no agreement check" if difference is None else
          f"float64 EK-FAC scores (Llama hidden 32, 8 examples), max |lora_func - kronfluence| / max |kronfluence|: {difference:.2e}")
    # --quick: kronfluence (seconds of fixed cost per call) in the agreement check only.
    results = {f"{hidden}x{layers}": section(args, hidden, layers, vocab, n, seq, kronfluence=not args.quick) for hidden, layers, vocab, n, seq in sizes}
    if difference is not None:
        results["kronfluence_float64_difference"] = difference
    print(f"\nsummary: {json.dumps({k: v if isinstance(v, float) else {a: round(b, 3) for a, b in v.items()} for k, v in results.items()})}")
    return results


if __name__ == "__main__":
    c.reexec_with_steady_allocator()
    main()
