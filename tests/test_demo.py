"""The demo: the shipped model and tokenizer, the task and its metric, `lora-func demo` end to end,
and `--model DIR` on another architecture."""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

import lora_func as lf
from lora_func.cli import main
from lora_func.demo.corpus import (
    pretraining_corpus,
    task_examples,
    task_split,
    vocabulary,
    worked_sum_examples,
    worked_sum_split,
)
from lora_func.demo.defaults import DEFAULTS, DEMO_R, DEMO_TASK_TOKENS, FALLBACK, NOT_TRAINED, method_defaults
from lora_func.demo.fitting import SIZE_OPTIONS, fit_and_init, respec
from lora_func.demo.model import ASSETS, build_tokenizer, default_targets, load_model
from lora_func.demo.run import (
    DEFAULT_LR,
    DemoConfig,
    batch_sampler,
    correct_answers,
    cpu_threads,
    encode_examples,
    generate,
    held_out_accuracy,
    results_markdown,
    run_demo,
    run_variant,
    settings_text,
)
from lora_func.train import IGNORE_INDEX, TrainState, fit, make_optimizer
from tests.tolerance import FP32_REL

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shipped():
    return load_model()


def test_shipped_model_knows_the_sums_but_not_the_question_form(shipped):
    model, tokenizer = shipped
    assert isinstance(model, LlamaForCausalLM) and 1_000_000 < sum(p.numel() for p in model.parameters()) < 3_000_000
    examples = task_examples()
    with torch.no_grad():
        for form, at_least, at_most in ((lambda e: f"{e.a} + {e.b} =", 1.0, 1.0), (lambda e: e.prompt, 0.0, 0.05)):
            ids = torch.tensor([tokenizer(form(e))["input_ids"] for e in examples])
            predicted = tokenizer.convert_ids_to_tokens(model(ids).logits[:, -1].argmax(-1).tolist())
            accuracy = sum(p == e.answer for p, e in zip(predicted, examples, strict=True)) / len(examples)
            assert at_least <= accuracy <= at_most, (form(examples[0]), accuracy)


def test_tokenizer_covers_the_corpus_and_round_trips(shipped):
    _, tokenizer = shipped
    text = " ".join(pretraining_corpus(300, seed=5))
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.get_vocab() == build_tokenizer().get_vocab()  # the shipped file is what the script builds
    assert tokenizer.convert_ids_to_tokens(list(range(4 + len(vocabulary())))) == ["<pad>", "<unk>", "<bos>", "<eos>", *vocabulary()]


def test_task_split_is_a_fixed_partition_of_all_100_questions():
    train, held_out = task_split(0)
    assert len(train) == 70 and len(held_out) == 30
    assert {(e.a, e.b) for e in train}.isdisjoint({(e.a, e.b) for e in held_out})
    assert {(e.a, e.b) for e in train + held_out} == {(a, b) for a in range(10) for b in range(10)}
    assert task_split(0) == (train, held_out) and task_split(1) != (train, held_out)
    assert all(int(e.answer) == e.a + e.b and e.prompt == f"what is {e.a} plus {e.b} ?" for e in train)


def test_encoding_puts_labels_on_the_answer_and_full_stop_only(shipped):
    _, tokenizer = shipped
    data = encode_examples(tokenizer, task_examples()[34:36])  # what is 3 plus 4 ? 7 . / what is 3 plus 5 ? 8 .
    words = tokenizer.convert_ids_to_tokens(data.input_ids[0].tolist())
    assert words == ["<bos>", "what", "is", "3", "plus", "4", "?", "7", "."]
    assert data.labels[0].tolist() == [IGNORE_INDEX] * 7 + tokenizer.convert_tokens_to_ids(["7", "."])
    assert data.answer_mask[0].tolist() == [False] * 6 + [True, False, False]  # "?" predicts the answer


def test_teacher_forced_score_agrees_with_generate_question_by_question(shipped):
    """Oracle: model.generate under lora_func.adapted, one question at a time."""
    model, tokenizer = shipped
    train_examples, held_out_examples = task_split(0)
    train = encode_examples(tokenizer, train_examples)
    adapter = lf.init_adapter(model, lf.AdapterSpec("ia3", targets=default_targets(model)), generator=torch.Generator().manual_seed(0))
    with cpu_threads(1):  # as the demo trains the shipped model (see DemoConfig.threads_for_run)
        fit(model, TrainState(adapter, make_optimizer(adapter, 0.1)), batch_sampler(train, 16, 0), 25, progress=False)
    questions = held_out_examples[:12]
    accuracy, logits = held_out_accuracy(model, adapter, encode_examples(tokenizer, questions))
    scored = correct_answers(logits, encode_examples(tokenizer, questions)).tolist()
    generated = [generate(model, tokenizer, e.prompt, adapter, max_new_tokens=2).split(" ")[0] == e.answer for e in questions]
    assert scored == generated and any(scored) and not all(scored), scored  # partly trained: both outcomes occur
    assert accuracy == pytest.approx(sum(scored) / len(scored))


def test_lora_r8_on_attention_trains_under_3_percent_of_the_parameters(shipped):
    model, _ = shipped
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=default_targets(model), r=8))
    expected = sum(8 * (m.in_features + m.out_features) for n, m in model.named_modules() if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")))
    total = sum(p.numel() for p in model.parameters())
    assert adapter.num_parameters() == expected and expected / total < 0.03


def test_cli_demo_writes_plot_tables_adapters_and_improves(tmp_path, capsys):
    """The six variants the README command's default (lora, dora, ia3; tests/test_docs.py) does
    not run, so that every variant is checked to learn the task: held-out accuracy up by at
    least 30 points after 60 steps (an adapter that training or the metric ignores stays at 0;
    PiSSA's default rate, 1e-3, needs more than 30)."""
    out = tmp_path / "demo"
    variants = ["eva", "antipasto", "pissa", "delora", "hra", "ia3_ff"]
    assert main(["demo", "--variants", ",".join(variants), "--steps", "60", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "| variant | lr | settings | trainable params |" in printed and "% of the model" in printed
    assert "peft format" in printed and "lora_func format (antipasto.safetensors; antipasto has no peft equivalent" in printed
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads((out / "results.json").read_text())
    assert [r["variant"] for r in rows] == variants and (out / "results.md").read_text().count("\n") == 2 + len(variants)
    for row in rows:
        assert row["acc_before"] == 0.0 and row["acc_after"] >= 0.3, (row["variant"], row["acc_after"])
        if row["variant"] == "pissa":  # peft stores PiSSA as a rank-2r LoRA on the base: float rounding
            assert not row["reload_identical"] and 0 < row["reload_max_abs_diff"] < 1e-4, row["reload_max_abs_diff"]
            assert "rank-16 LoRA on the untouched base" in row["saved_as"]
        else:
            assert row["reload_identical"], row["variant"]
        assert len(row["losses"]) == 60 and row["samples"][0]["prompt"].startswith("what is")
    for variant in variants[:-1]:
        assert (out / "adapters" / (f"{variant}.safetensors" if variant == "antipasto" else f"{variant}/adapter_config.json")).is_file()


def test_training_runs_on_one_thread_for_the_shipped_model_and_restores_the_setting(tmp_path):
    """A second thread makes the tiny model's steps 10-20x slower when the cores are shared
    (DemoConfig.threads_for_run); the process's own setting comes back afterwards."""
    assert DemoConfig().threads_for_run() == 1
    assert DemoConfig(threads=3).threads_for_run() == 3
    assert DemoConfig(model_dir="some/model").threads_for_run() is None  # a real model: torch's default
    model, tokenizer = load_model()
    train_examples, held_out_examples = task_split(0)
    train, held_out = encode_examples(tokenizer, train_examples), encode_examples(tokenizer, held_out_examples[:4])
    before = torch.get_num_threads()
    seen = []
    for threads in (None, 2):
        config = DemoConfig(steps=2, progress=False, samples=0, threads=threads)
        run_variant(model, tokenizer, "ia3", config, train, held_out, tmp_path / str(threads), on_step=lambda _: seen.append(torch.get_num_threads()))
        assert torch.get_num_threads() == before
    assert seen == [1, 1, 2, 2]


def test_the_wheel_ships_the_demo_model(tmp_path):
    """A non-editable install has the model and tokenizer: they are package data of a built
    wheel (an editable install would hide a missing package-data entry)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "lora_func", src / "lora_func", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = (tmp_path / "dist").glob("lora_func-*.whl")
    shipped = {f"lora_func/demo/assets/{p.name}" for p in ASSETS.iterdir()}
    assert {"lora_func/demo/assets/model.safetensors", "lora_func/demo/assets/tokenizer.json"} <= shipped
    assert shipped <= set(zipfile.ZipFile(wheel).namelist())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16+GradScaler"])
def test_demo_on_a_half_precision_base_keeps_fp32_adapters_and_learns(dtype, tmp_path):
    (row,) = run_demo(DemoConfig(variants=["ia3"], steps=20, dtype=dtype, progress=False, samples=0, out=tmp_path), emit=lambda _: None)
    assert row["acc_after"] > row["acc_before"] and row["reload_identical"]
    assert all(torch.isfinite(torch.tensor(row["losses"]))) and row["losses"][-1] < 0.5 * row["losses"][0]
    if dtype == torch.bfloat16:
        assert row["skipped_steps"] == 0  # bf16 has fp32's range: no scaler, nothing skipped
    else:
        assert row["skipped_steps"] <= 5  # the scaler's first scale (2**16) may overflow once or twice
    saved = load_file(tmp_path / "adapters" / "ia3" / "adapter_model.safetensors")
    assert saved and all(t.dtype == torch.float32 for t in saved.values())


def test_model_flag_takes_any_local_causal_lm_directory(tmp_path):
    """A GPT-2 (Conv1D layers, fused c_attn) saved with save_pretrained: the same demo runs."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=32, bos_token_id=2, eos_token_id=3))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    lines = []
    (row,) = run_demo(DemoConfig(variants=["lora"], steps=3, model_dir=str(tmp_path), progress=False, samples=1), emit=lines.append)
    assert str(tmp_path) in lines[0] and row["reload_identical"] and len(row["losses"]) == 3
    loaded, _ = load_model(tmp_path)
    assert default_targets(loaded) == ["c_attn"]
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        load_model(tmp_path / "nope")


def test_scripts_run(tmp_path, monkeypatch, capsys):
    """Smoke runs of the scripts (their full runs take minutes): the pretraining script writes a
    loadable model directory. In this process, as its ``__main__`` (as tests/test_docs.py runs
    the examples): a new interpreter would import torch and transformers again for two steps."""
    script = ROOT / "scripts" / "pretrain_tiny_lm.py"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "--steps", "2", "--lines", "300", "--out", str(tmp_path / "model")])
    with torch.random.fork_rng():  # it seeds the global generator
        runpy.run_path(str(script), run_name="__main__")
    printed = capsys.readouterr().out
    assert "accuracy on 'a + b =' (pretraining notation)" in printed
    model, tokenizer = load_model(tmp_path / "model")
    assert isinstance(model, LlamaForCausalLM) and tokenizer.get_vocab() == build_tokenizer().get_vocab()


def test_lr_sweep_runs_resumes_and_reports(tmp_path, capsys, monkeypatch):
    """scripts/lr_sweep.py in this process (its full grids take hours): each run is a JSON line,
    VB-LoRA's vector_length is fitted to the model, a rerun resumes without training again, and
    the report prints the tables and draws the curves."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lr_sweep", ROOT / "scripts" / "lr_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "lr_sweep", sweep)  # its dataclasses look their module up there
    spec.loader.exec_module(sweep)
    out = tmp_path / "sweep.jsonl"
    args = ["--variants", "ia3,vblora", "--lrs", "0.1,0.3", "--steps", "2", "--seeds", "0", "--out", str(out)]
    before = torch.get_num_threads()
    try:
        assert sweep.main(args) == 0
    finally:
        torch.set_num_threads(before)
    table = capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 8 and {r["task"] for r in records} == {"sums", "worked_sums"}  # 2 methods x 2 rates x 2 tasks
    assert all(r["fitted"] == ({"vector_length": 64} if r["variant"] == "vblora" else {}) for r in records)  # fitted, not failed
    lines = table.splitlines()
    assert lines[:3] == ["### sums", "", "| method | settings | lr 0.1 | lr 0.3 |"] and "### chosen" in lines, table
    assert sweep.main(["--report", str(out), "--plot", str(tmp_path / "sweep.png")]) == 0 and capsys.readouterr().out == table
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sweep.grid_points("lrs", ["ia3"], [0.1], ["sums"], [0]) == [sweep.Point("ia3", "sums", 0, 0.1, ())]
    done = {sweep.record_key(r) for r in records}  # what a rerun skips: every point of the same grid
    assert {p.key() for p in sweep.grid_points("lrs", ["ia3", "vblora"], [0.1, 0.3], list(sweep.TASKS), [0])} == done
    # The fine grid: the best coarse settings (ties to the lower held-out loss) and the method's own
    # defaults, each at its best coarse rate and that rate's neighbours.
    coarse = [{"variant": "vera", "settings": s, "lr": lr, "acc": acc, "held_out_loss": loss}
              for s, lr, acc, loss in [({}, 0.1, 0.5, 1.0), ({}, 1.0, 0.5, 2.0), ({"r": 64}, 0.01, 0.9, 1.0), ({"r": 64}, 0.03, 0.9, 0.5)]]
    coarse.append({"variant": "ia3", "settings": {}, "lr": 1e-4, "acc": 0.9, "held_out_loss": 0.1})
    grid = sweep.fine_grid(coarse)
    assert grid == {"vera": [({"r": 64}, (0.01, 0.03, 0.1)), ({}, (0.03, 0.1, 0.3))], "ia3": [({}, (0.0001, 0.0003))]}
    fine = sweep.grid_points("fine", ["ia3"], None, ["sums"], [0, 1], grid)
    assert [(p.lr, p.seed) for p in fine] == [(1e-4, 0), (1e-4, 1), (3e-4, 0), (3e-4, 1)]
    # The default: within 10 points of the best demo mean, the best on the worked sums.
    cells = {("m", "sums", "a", 0.1): [0.9, 0.9], ("m", "worked_sums", "a", 0.1): [0.1],
             ("m", "sums", "b", 0.3): [0.85], ("m", "worked_sums", "b", 0.3): [0.5],
             ("m", "sums", "c", 1.0): [0.5], ("m", "worked_sums", "c", 1.0): [0.9]}
    assert sweep.choose(cells, "m") == ("b", 0.3) and sweep.choose(cells, "other") is None
    cells[("m", "sums", "a", 0.1)], cells[("m", "sums", "b", 0.3)] = [0.65], [0.56]  # b: within 10 points, under 60 %
    assert sweep.choose(cells, "m") == ("a", 0.1)


def test_gradient_checkpointing_flag_trains_exactly_as_without_and_restores_the_model(tmp_path, monkeypatch):
    """``--gradient-checkpointing`` recomputes each decoder layer in backward (a recompute must
    happen) and trains to the same losses and adapter; the model comes back in eval mode with
    checkpointing off."""
    import lora_func._application as application

    recomputed = []
    rebound = application._rebound

    def spy(function, reentrant, args):
        wrapped = rebound(function, reentrant, args)
        return wrapped if wrapped is function else lambda *a, **k: (recomputed.append(torch._C._current_graph_task_id() != -1), wrapped(*a, **k))[1]

    monkeypatch.setattr(application, "_rebound", spy)
    model, tokenizer = load_model()
    train_examples, held_out_examples = task_split(0)
    train, held_out = encode_examples(tokenizer, train_examples), encode_examples(tokenizer, held_out_examples[:4])
    rows = []
    for on in (False, True):
        config = DemoConfig(steps=3, progress=False, samples=0, gradient_checkpointing=on)
        rows.append(run_variant(model, tokenizer, "dora", config, train, held_out, tmp_path / str(on)))
        assert not model.training and not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        assert getattr(model, "_require_grads_hook", None) is None
    assert any(recomputed) and rows[0]["losses"] == pytest.approx(rows[1]["losses"], rel=FP32_REL)
    assert main(["demo", "--variants", "ia3", "--steps", "2", "--gradient-checkpointing", "--out", str(tmp_path / "cli"), "--no-progress"]) == 0


def test_worked_sums_are_a_fixed_partition_of_550_questions_in_the_models_vocabulary():
    """The sweep's second task: three single digits with a + b <= 9, answered with both sums written
    out in the pretraining notation (so every step is a sum the base knows)."""
    examples = worked_sum_examples()
    assert len(examples) == len({e.terms for e in examples}) == 550
    for e in examples:
        a, b, c = e.terms
        assert a + b <= 9 and e.prompt == f"what is {a} plus {b} plus {c} ?"
        assert e.answer == f"{a} + {b} = {a + b} , {a + b} + {c} = {a + b + c}"
    words = set(vocabulary())
    assert all(w in words for e in examples for w in f"{e.prompt} {e.answer}".split())
    train, held_out = worked_sum_split(0)
    assert (len(train), len(held_out)) == (450, 100) and {e.terms for e in train}.isdisjoint(e.terms for e in held_out)
    assert worked_sum_split(0) == (train, held_out) and worked_sum_split(1) != (train, held_out)


def test_every_registered_method_has_one_row_of_demo_defaults_read_by_the_demo():
    """One table: the demo's learning rate, rank and options per method come from
    lora_func.demo.defaults (the dashboard and the docs read it too: tests/test_dashboard.py,
    tests/test_docs.py); a method the demo does not train is declared in NOT_TRAINED with its
    reason instead, never in both and never in neither."""
    assert sorted([*DEFAULTS, *NOT_TRAINED]) == lf.list_variants() and not set(DEFAULTS) & set(NOT_TRAINED)
    assert sorted(NOT_TRAINED) == ["arrow", "lily", "lora_bias", "xlora"]
    assert dict(DEFAULT_LR) == {name: row.lr for name, row in DEFAULTS.items()}
    assert method_defaults("not-registered") is FALLBACK
    targets = ["q_proj"]
    for name, row in DEFAULTS.items():
        spec = DemoConfig().spec_for(name, targets)
        assert (spec.r, DemoConfig().lr_for(name)) == (row.rank(), row.lr), name
        assert all(spec.option(k) == v for k, v in row.options.items()), name
        if row.alpha is not None:
            assert spec.alpha == row.alpha, name
        # a row's own targets (trainable tokens: the embedding) replace the demo's, not --targets
        assert list(spec.targets) == list(row.targets or targets), name
        assert spec.tied == (row.tied or "error"), name
        assert list(DemoConfig(targets=("v_proj",)).spec_for(name, ["v_proj"]).targets) == ["v_proj"], name
        assert DemoConfig(r=3).spec_for(name, targets).r == 3 and DemoConfig(lr=0.5).lr_for(name) == 0.5
    assert [name for name, row in DEFAULTS.items() if row.targets is not None] == ["trainable_tokens"]
    assert DEMO_R == 8


def test_trainable_tokens_retrains_the_words_of_the_demo_tasks(shipped):
    """The demo gives trainable tokens (which has no default tokens) the ids of every word of its
    two tasks, on the shipped model's tied embedding table."""
    model, tokenizer = shipped
    words = set()
    for train, held_out in (task_split(0), worked_sum_split(0)):
        data = encode_examples(tokenizer, train + held_out)
        words |= set(data.input_ids[data.attention_mask.bool()].tolist())
    assert tuple(sorted(words - set(tokenizer.all_special_ids))) == DEMO_TASK_TOKENS
    row = DEFAULTS["trainable_tokens"]
    assert row.options["token_indices"] == DEMO_TASK_TOKENS and (row.targets, row.tied) == (("embed_tokens",), "both")
    adapter = lf.init_adapter(model, DemoConfig().spec_for("trainable_tokens", default_targets(model)))
    assert adapter.num_parameters() == len(DEMO_TASK_TOKENS) * model.config.hidden_size
    assert "token_indices" in row.note


def test_a_method_the_demo_does_not_train_is_reported_with_its_reason(shipped, tmp_path):
    """arrow (training-free routing among trained LoRAs) and lora_bias (needs biased targets; the
    shipped model has none) get their results row, status "skipped", with the declared reason,
    before any work; the results table shows it."""
    model, tokenizer = shipped
    train, held_out = (encode_examples(tokenizer, part) for part in task_split(0))
    before = {k: v.clone() for k, v in lf.base_params(model).items()}
    rows = [run_variant(model, tokenizer, name, DemoConfig(steps=1), train, held_out, tmp_path) for name in sorted(NOT_TRAINED)]
    assert [(r["variant"], r["status"], r["reason"]) for r in rows] == [
        (name, "skipped", f"not trained by the demo: {NOT_TRAINED[name]}") for name in sorted(NOT_TRAINED)
    ]
    assert "routed.arrow" in NOT_TRAINED["arrow"] and "bias" in NOT_TRAINED["lora_bias"]
    assert not any(tmp_path.iterdir()) and all(torch.equal(v, lf.base_params(model)[k]) for k, v in before.items())
    table = results_markdown(rows)
    assert all(f"| {name} |" in table and "skipped: not trained by the demo" in table for name in NOT_TRAINED)
    # the reason is true: lora_bias cannot be built on the shipped model's bias-free layers
    with pytest.raises(ValueError, match="no bias"):
        lf.init_adapter(model, lf.AdapterSpec("lora_bias", default_targets(model), r=8))


def test_every_method_builds_on_the_shipped_model_with_its_demo_defaults(shipped):
    """What `lora-func demo --variants all` starts from: every registered method's demo spec builds
    on the shipped model, some after lowering a size option (VB-LoRA's vector_length=256 on 128-
    and 64-wide layers), never by failing."""
    model, tokenizer = shipped
    train = encode_examples(tokenizer, task_split(0)[0])
    config = DemoConfig()
    changed = {}
    calibration = [{"input_ids": train.input_ids[:16], "attention_mask": train.attention_mask[:16]}]
    assert sorted([*DEFAULTS, *NOT_TRAINED]) == lf.list_variants()
    for name in sorted(DEFAULTS):
        spec = config.spec_for(name, default_targets(model))
        fitted = fit_and_init(model, spec, lambda s: lf.init_adapter(model, s, calibration=calibration if lf.get_variant(s.variant).calibration else None))
        assert fitted.adapter.spec == fitted.spec and fitted.adapter.num_parameters() > 0, name
        # no trained tensor shares memory with a frozen one: the optimizer steps in place (OSF's
        # osf_S once was its frozen osf_S0, so training moved both and its reload differed)
        frozen = {b.untyped_storage().data_ptr() for b in fitted.adapter.buffers.values() if b.numel()}
        assert not [k for k, p in fitted.adapter.params.items() if p.numel() and p.untyped_storage().data_ptr() in frozen], name
        changed.update({name: [(c.option, c.asked, c.used) for c in fitted.changes]} if fitted.changes else {})
    assert changed == {"vblora": [("vector_length", 256, 64)]}, changed


def test_fitting_lowers_a_size_option_to_the_largest_value_that_builds_and_says_why(shipped):
    model, _ = shipped
    targets = default_targets(model)  # q/o 128x128, k/v 128 -> 64

    def init(spec):
        return lf.init_adapter(model, spec)

    vblora = fit_and_init(model, lf.AdapterSpec("vblora", targets, r=4), init)
    (change,) = vblora.changes
    assert (change.option, change.asked, change.used) == ("vector_length", 256, 64) and vblora.spec.option("vector_length") == 64
    assert "vector_length=256 must divide" in change.reason and "largest value below it" in change.describe()
    assert vblora.adapter.spec.option("vector_length") == 64
    # r itself: C3A's block size must divide the widths (12 -> 8), HRA's paired init needs an even r (3 -> 2),
    # and PiSSA's r above the narrowest width (64) comes down to it (it takes r directions of each
    # weight; LoRA takes any r, as peft does).
    for variant, asked, used in (("c3a", 12, 8), ("hra", 3, 2), ("pissa", 100, 64)):
        fitted = fit_and_init(model, lf.AdapterSpec(variant, targets, r=asked), init)
        assert [(c.option, c.asked, c.used) for c in fitted.changes] == [("r", asked, used)], variant
        assert fitted.adapter.spec.r == used
    # A spec that builds is left alone; one that no candidate fixes raises the first error.
    assert fit_and_init(model, lf.AdapterSpec("lora", targets, r=8), init).changes == ()
    assert fit_and_init(model, lf.AdapterSpec("lora", targets, r=100), init).changes == ()
    with pytest.raises(ValueError, match="gralora_k"):
        fit_and_init(model, lf.AdapterSpec("gralora", targets, r=4), lambda spec: (_ for _ in ()).throw(ValueError(f"gralora_k={spec.option('gralora_k')}")))
    assert set(SIZE_OPTIONS) <= set(lf.list_variants())
    assert respec(lf.AdapterSpec("lora", targets, r=4, alpha=2.0, dropout=0.1), r=2).option("dropout") == 0.1


def test_settings_text_names_the_rank_and_what_differs_from_the_variants_defaults():
    targets = ["q_proj"]
    assert settings_text(lf.AdapterSpec("lora", targets, r=8)) == "r=8"
    assert settings_text(lf.AdapterSpec("fourierft", targets, r=1000, scaling=300.0)) == "r=1000, scaling=300"
    assert settings_text(lf.AdapterSpec("vblora", targets, r=4, vector_length=64), fitted=["vector_length"]) == "r=4, vector_length=64*"
    assert settings_text(lf.AdapterSpec("lora", targets, r=3, alpha=16.0), fitted=["r"]) == "r=3*, alpha=16"


def test_a_method_that_cannot_run_or_fails_is_reported_and_the_others_are_written(tmp_path, capsys, monkeypatch):
    """One method cannot start (adamss without scikit-learn, its optional dependency, as in a
    fresh `pip install -e .`), one fails while training: both are rows of results.md with their
    reason, the others train, the plot and the tables are written, and only the failure makes the
    exit status 1."""
    import lora_func.demo.run as run

    real_fit = run.fit

    def fit(model, state, *args, **kwargs):
        if state.adapter.spec.variant == "ia3_ff":
            raise RuntimeError("a bug in ia3_ff's training")
        return real_fit(model, state, *args, **kwargs)

    monkeypatch.setattr(run, "fit", fit)
    monkeypatch.setitem(sys.modules, "sklearn", None)  # `import sklearn.cluster` raises ImportError
    monkeypatch.setitem(sys.modules, "sklearn.cluster", None)
    out = tmp_path / "demo"
    args = ["demo", "--variants", "ia3,adamss,ia3_ff", "--steps", "2", "--out", str(out), "--no-progress"]
    code = main(args)
    captured = capsys.readouterr()
    rows = {r["variant"]: r for r in json.loads((out / "results.json").read_text())}
    assert code == 1 and [r["status"] for r in rows.values()] == ["trained", "skipped", "failed"], rows
    assert rows["adamss"]["reason"].startswith("cannot run on this model: ") and "scikit-learn" in rows["adamss"]["reason"]
    assert rows["ia3_ff"]["reason"] == "RuntimeError: a bug in ia3_ff's training"
    table = (out / "results.md").read_text()
    (line,) = [line for line in table.splitlines() if line.startswith("| adamss | ")]
    assert f"| adamss | {DEFAULT_LR['adamss']:g} | r=" in line and "| — | — |" in line and "skipped: cannot run on this model" in line
    assert "failed: RuntimeError: a bug in ia3_ff" in table
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and len(rows["ia3"]["losses"]) == 2
    assert "note: adamss skipped: cannot run on this model" in captured.err and "scikit-learn" in captured.err
    assert "lora-func demo: ia3_ff failed: RuntimeError: a bug in ia3_ff's training" in captured.err
    # Without the failure, a method that cannot run does not change the exit status.
    assert main(["demo", "--variants", "ia3,adamss", "--steps", "2", "--out", str(out), "--no-progress"]) == 0


def test_results_markdown_rows_for_trained_fitted_and_unrunnable_methods():
    trained = {
        "variant": "vblora", "status": "trained", "lr": 0.01, "settings": "r=8, vector_length=64*", "reason": None,
        "fitted": [{"option": "vector_length", "asked": 256, "used": 64, "why": "..."}], "trainable": 1000, "trainable_pct": 0.1,
        "acc_before": 0.0, "acc_after": 0.7, "final_loss": 0.5, "ms_per_step": 30.0, "reload_identical": True, "reload_max_abs_diff": 0.0,
    }
    skipped = {"variant": "adamss", "status": "skipped", "lr": 0.01, "settings": "r=8", "fitted": [],
               "reason": "cannot run on this model: needs scikit-learn | pip install"}
    lines = results_markdown([trained, skipped]).splitlines()
    assert lines[0].count("|") == lines[2].count("|") == lines[3].count("|") == 11
    assert lines[2] == ("| vblora | 0.01 | r=8, vector_length=64* | 1,000 (0.10 %) | 0% | 70% | 0.500 | 30 | identical | "
                        "vector_length lowered from 256 to fit |")
    assert lines[3] == "| adamss | 0.01 | r=8 | — | — | — | — | — | — | skipped: cannot run on this model: needs scikit-learn / pip install |"
