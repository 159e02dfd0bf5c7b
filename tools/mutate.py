"""Mutation testing of lora_func's math: small ast mutants, one forked pytest run per mutant.

Each mutant changes one operator, constant, comparison, condition or call (``a + b`` -> ``a - b``,
``2.0`` -> ``4.0``, ``<`` -> ``<=``, ``if c`` -> ``if not c``, ``x.detach()`` -> ``x``, ...) in
one target file; the tests selected for that file run with ``-x`` and the mutant is *killed*
when they fail (or time out), *survived* when they pass.

It never touches the working tree: the tree is copied (without .git, .venv, caches) to
``--copy-to`` and mutated there. The parent process imports torch, transformers, peft and
pytest once, then forks one child per mutant (the child imports the mutated ``lora_func``
afresh), so a mutant costs about a pytest start plus the tests until the first failure.

Usage::

    .venv/bin/python tools/mutate.py --copy-to /tmp/lf/mut --report /tmp/lf/mut-report.md
    .venv/bin/python tools/mutate.py --copy-to /tmp/lf/mut --only lora_func/variants/dora.py --list

Targets and the tests each one runs are in ``TARGETS`` below.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

KILLERS = "tests/test_variant_math_one_layer.py"
PROPERTIES = "tests/test_properties.py"
CONTRACT = "tests/test_contract.py"
RANK_STACK = "tests/test_rank_stack.py"
CATALOGUE = "tests/test_error_catalogue.py"
COMPILE = "tests/test_compile.py"


def _variant_stages(select: str, *files: str) -> list[list[str]]:
    """The fast exact killers and the contract rows of one variant, its own tests, its peft
    storage, then the hypothesis properties (all variants: slowest, last)."""
    return [
        [KILLERS, "-k", select],
        [CONTRACT, "-k", select],
        list(files),
        [RANK_STACK, "-k", select],
        [CATALOGUE, "-k", select],
        # its peft storage (fixed config values, stored shapes, Conv1D refusals)
        ["tests/test_io_peft.py", "-k", select],
        [PROPERTIES],
    ]


_ALL = [[KILLERS], [CONTRACT], ["tests/test_compose.py", "tests/test_rank_stack.py"], [PROPERTIES]]

# file -> (functions to mutate (None: the whole file), test stages). A mutant runs the stages in
# order, each ``pytest -x``, and stops at the first failing one (killed). Functions are
# qualified names (Class.method); nested functions belong to their parent.
TARGETS: dict[str, tuple[tuple[str, ...] | None, list[list[str]]]] = {
    "lora_func/variants/lora.py": (None, _variant_stages("lora and not delora", "tests/test_peft_oracle_lora.py")),
    "lora_func/variants/dora.py": (None, _variant_stages("dora", "tests/test_variant_dora.py")),
    "lora_func/variants/ia3.py": (None, _variant_stages("ia3", "tests/test_variant_ia3.py")),
    "lora_func/variants/delora.py": (None, _variant_stages("delora", "tests/test_variant_delora.py")),
    "lora_func/variants/pissa.py": (None, _variant_stages("pissa", "tests/test_variant_pissa.py")),
    "lora_func/variants/hra.py": (None, _variant_stages("hra", "tests/test_variant_hra.py")),
    "lora_func/variants/antipasto.py": (None, _variant_stages("antipasto", "tests/test_variant_antipasto.py")),
    "lora_func/variants/eva.py": (None, _variant_stages("eva", "tests/test_variant_eva.py")),
    # issue 30 (b): the peft oracle and the variant's own tests first (fast, exact), then the
    # contract rows and the catalogue; no hypothesis stage (it draws every variant: too slow per mutant).
    **{
        f"lora_func/variants/{name}.py": (
            None,
            [
                ["tests/test_variants_structured_b.py", "-k", select],
                *([[f"tests/test_variant_{name}.py"]] if (REPO / f"tests/test_variant_{name}.py").exists() else []),
                [KILLERS, "-k", select],
                [CONTRACT, "-k", select],
                [CATALOGUE, "-k", select],
            ],
        )
        for name, select in (("oft", "oft and not boft"), ("boft", "boft"), ("road", "road"), ("hira", "hira"))
    },
    "lora_func/variants/_orthogonal.py": (
        None,
        [["tests/test_variants_structured_b.py", "-k", "oft or cayley or dropout"], ["tests/test_orthogonal.py", "tests/test_variant_boft.py"], [CONTRACT, "-k", "oft"]],
    ),
    # Issue 30, structured family (first part): the variant's own tests first (float64 peft
    # oracles and its structure), then its contract rows and rank stacks.
    **{
        f"lora_func/variants/{name}.py": (
            None,
            [["tests/test_variants_structured_a.py", "-k", name], [CONTRACT, "-k", name], [RANK_STACK, "-k", name]],
        )
        for name in ("loha", "lokr")
    },
    # + their init, config checks and documented defaults (tests/test_variant_<name>.py, the
    # killers' rows), which the oracles (perturbed tensors) cannot see
    **{
        f"lora_func/variants/{name}.py": (
            None,
            [
                ["tests/test_variants_structured_a.py", "-k", name],
                [f"tests/test_variant_{name}.py", KILLERS, "-k", name],
                [CONTRACT, "-k", name],
                [RANK_STACK, "-k", name],
            ],
        )
        for name in ("gralora", "miss")
    },
    # LoHa / LoKr with their conv kernels (issue 30 leftovers; these replace the entries above):
    # the conv formula first (no peft model: fast), the Linear oracles, the float64 peft oracles
    # on conv kernels, then the contract rows, rank stacks and the catalogue.
    **{
        f"lora_func/variants/{name}.py": (
            None,
            [
                ["tests/test_kinds.py", "-k", f"lycoris and {name}"],
                ["tests/test_variants_structured_a.py", "-k", select],
                ["tests/test_kinds_peft.py", "-k", select],
                # the other dtypes on each activation form, rank dropout on each, config checks
                [f"tests/test_variant_{v}.py" for v in ("loha", "lokr") if v in select],
                [CONTRACT, "-k", select],
                [RANK_STACK, "-k", select],
                [CATALOGUE, "-k", f"lycoris or {name}"],
                # which activation form a call takes changes no value, only the bytes it holds
                ["tests/test_counts.py", "-k", select],
                [KILLERS, "-k", f"documented_defaults and ({select})"],
                # LoHa's traced branch (no custom Function under torch.compile)
                [COMPILE, "-k", select],
            ],
        )
        for name, select in (("loha", "loha"), ("lokr", "lokr"), ("_lycoris", "loha or lokr"))
    },
    # issue 30: the contract rows and the float64 peft oracles first (fast, exact), no properties
    **{
        f"lora_func/variants/{name}.py": (
            None,
            [
                [CONTRACT, "-k", name],
                ["tests/test_variants_structured_c.py", "-k", name],
                *([[f"tests/test_variant_{name}.py"]] if (REPO / f"tests/test_variant_{name}.py").exists() else []),
                [KILLERS, "-k", name],
                *([[RANK_STACK, "-k", name]] if name == "shira" else []),
                [CATALOGUE, "-k", name],
                # C3A's eager FFT Function saves less than autograd through the FFTs: the counts see it
                *([["tests/test_counts.py", "-k", name]] if name == "c3a" else []),
            ],
        )
        for name in ("shira", "fourierft", "c3a")
    },
    "lora_func/variants/_sparse.py": (
        None,
        [[CONTRACT, "-k", "shira or fourierft"], ["tests/test_variants_structured_c.py"], *[[f] for f in ("tests/test_variant_fourierft.py", "tests/test_variant_shira.py") if (REPO / f).exists()]],
    ),
    # Routed LoRA (issue 47): the peft oracle and the contract row.
    "lora_func/variants/poly.py": (None, [["tests/test_routed.py"], [CONTRACT, "-k", "poly"], [CATALOGUE, "-k", "poly or routed"]]),
    "lora_func/variants/arrow.py": (None, [["tests/test_routed.py", "-k", "arrow"], [CONTRACT, "-k", "arrow"], [CATALOGUE, "-k", "arrow"]]),
    "lora_func/routed.py": (None, [["tests/test_routed.py"], ["tests/test_routed_xlora.py"], [CATALOGUE, "-k", "routed or arrow or xlora"]]),
    "lora_func/variants/xlora.py": (None, [["tests/test_routed_xlora.py"], [CONTRACT, "-k", "xlora"], [CATALOGUE, "-k", "xlora"]]),
    "lora_func/variants/waveft.py": (
        None,
        [["tests/test_waveft.py"], [CONTRACT, "-k", "waveft"], [CATALOGUE, "-k", "waveft"], [KILLERS, "-k", "documented_defaults and waveft"]],
    ),
    # the filter table (module level) is compared value for value with peft's by test_waveft.py
    "lora_func/variants/_wavelet.py": (
        ("reduction", "_filters", "idwt2"),
        [["tests/test_waveft.py", "-k", "every_family or peft_checkpoint"], [CONTRACT, "-k", "waveft"]],
    ),
    # The shared-basis variants (issue 31): their own oracle tests instead of the (slow) properties.
    **{
        f"lora_func/variants/{name}.py": (
            None,
            [*_variant_stages(name, f"tests/test_variant_{name}.py")[:-1], ["tests/test_bank_rank_stack.py", "-k", name]],
        )
        for name in ("vera", "vblora", "randlora", "pvera")
    },
    **{
        f"lora_func/variants/{name}.py": (None, [[f"tests/test_variant_{name}.py"], [CONTRACT, "-k", name], [CATALOGUE, "-k", name]])
        for name in ("tinylora", "unilora")
    },
    # Issue 43: their own peft oracle files first (fast, exact), then the contract rows.
    **{
        f"lora_func/variants/{name}.py": (
            None,
            [[f"tests/test_variant_{name}.py"], [CONTRACT, "-k", name], [RANK_STACK, "-k", name], [CATALOGUE, "-k", name], [KILLERS, "-k", f"documented_defaults and {name}"]],
        )
        for name in ("beft", "glora", "osf", "psoft")
    },
    # OSF's traced projection (plain ops under torch.compile, the custom Function in eager code:
    # equal values, so only a fullgraph trace tells the branch apart)
    "lora_func/variants/osf.py": (
        None,
        [["tests/test_variant_osf.py"], [CONTRACT, "-k", "osf"], [RANK_STACK, "-k", "osf"], [CATALOGUE, "-k", "osf"], [KILLERS, "-k", "documented_defaults and osf"], [COMPILE, "-k", "every_variant and osf"]],
    ),
    # Issue 43, session 3: Lily's peft oracle file (tied groups, init draws, per-example mean), then its rows.
    "lora_func/variants/lily.py": (
        None,
        [["tests/test_variant_lily.py"], [CONTRACT, "-k", "lily"], [RANK_STACK, "-k", "lily"], [CATALOGUE, "-k", "lily or group or no-merged"], [KILLERS, "-k", "documented_defaults and lily"]],
    ),
    "lora_func/variants/_bank.py": (None, [[CONTRACT, "-k", "vera or randlora or pvera"], ["tests/test_variant_vera.py", "tests/test_variant_randlora.py"]]),
    "lora_func/variants/_contract.py": (
        ("layer_rank", "layer_alpha", "Slot.peft_key", "Slot.saved", "Variant.rank_axes", "Variant.padded_axes", "Variant.integer_buffers", "Variant.kinds", "Variant.shapes", "Variant.layer_slots", "_mask_rank_axes", "padded_member"),
        [[CONTRACT, "-k", "schema or rank or identity"], ["tests/test_variant_schema.py", "tests/test_peft_problems.py", "tests/test_rank_stack.py", "tests/test_kinds.py"], ["tests/test_io_peft.py"], ["tests/test_mixed_route.py"], _ALL[0]],
    ),
    # issue 42: the option schema (one check for AdapterSpec and peft configs) and its codecs
    "lora_func/variants/_options.py": (
        None,
        [["tests/test_variant_schema.py"], [CATALOGUE, "-k", "spec"], ["tests/test_errors.py", "tests/test_bad_inputs_and_files.py", "tests/test_variants_structured_b.py"], ["tests/test_io_peft.py"]],
    ),
    # Issue 31 (no hypothesis stage: these tests compare against peft step by step).
    "lora_func/variants/adalora.py": (None, [[CONTRACT, "-k", "adalora"], ["tests/test_variant_adalora.py"]]),
    "lora_func/variants/olora.py": (None, [["tests/test_inits.py", "-k", "olora"], [CONTRACT, "-k", "olora"]]),
    "lora_func/variants/corda.py": (None, [["tests/test_inits.py", "-k", "corda"], [CONTRACT, "-k", "corda"]]),
    "lora_func/rank_budget.py": (None, [["tests/test_variant_adalora.py"]]),
    "lora_func/variants/adamss.py": (None, [[CONTRACT, "-k", "adamss"], ["tests/test_variant_adamss.py"], [CATALOGUE, "-k", "adamss"]]),
    "lora_func/subspace_budget.py": (None, [["tests/test_variant_adamss.py"]]),
    "lora_func/optimizers.py": (None, [["tests/test_optimizers.py"]]),
    "lora_func/variants/_kernels.py": (
        ("lora_scale", "add_low_rank", "_fresh_output_in_place", "base_plus_low_rank", "lora_weight_form", "lora_activation_form", "kaiming_uniform"),
        _ALL,
    ),
    "lora_func/_layer_ops.py": (None, [*_ALL[:3], ["tests/test_core.py", "tests/test_compose.py"], [COMPILE, "-k", "overlay_mode or keeps_the_path"], _ALL[3]]),
    "lora_func/_lazy.py": (None, [*_ALL[:3], ["tests/test_core.py"], [COMPILE, "-k", "overlay_mode or keeps_the_path"], _ALL[3]]),
    "lora_func/plan.py": (
        ("_ops", "_program"),
        [*_ALL[:3], ["tests/test_core.py", "tests/test_compose.py", "tests/test_plan.py"], _ALL[3]],
    ),
    # Issue 43 (methods b): the variant's own tests first (float64 peft oracles, init draws, the
    # activation form's shape of work, config checks), then its contract rows, rank stacks, the
    # documented defaults and the catalogue.
    **{
        f"lora_func/variants/{name}.py": (
            None,
            [
                [f"tests/test_variant_{name}.py"],
                [CONTRACT, "-k", name],
                *([[RANK_STACK, "-k", name]] if name != "supertuning" else []),
                [KILLERS, "-k", f"documented_defaults and {name}"],
                [CATALOGUE, "-k", name],
            ],
        )
        for name in ("deft", "peanut", "supertuning")
    },
    # Issue 43 (FRoD): its own peft oracles first, then its contract rows (stacks and per-example
    # gradients there: no rank to pad), the documented defaults, the catalogue and the core's
    # shared_from_weights paths (load(trainable_only=True), the shared-tensor suite).
    "lora_func/variants/frod.py": (
        None,
        [
            ["tests/test_variant_frod.py"],
            [CONTRACT, "-k", "frod"],
            [KILLERS, "-k", "documented_defaults and frod"],
            [CATALOGUE, "-k", "frod"],
            ["tests/test_io_native.py", "tests/test_compose.py", "-k", "frod"],
        ],
    ),
    "lora_func/overlay.py": (
        ("check_adapter_finite", "merge_overlay", "merged_overlay", "overlay", "lazy_overlay", "overlay_mode"),
        [*_ALL[:3], ["tests/test_core.py", "tests/test_adapted_context.py", "tests/test_checks.py"], [COMPILE, "-k", "overlay_mode or keeps_the_path"], _ALL[3]],
    ),
    "lora_func/call.py": (
        ("application", "adapted_call", "adapted"),
        [*_ALL[:3], ["tests/test_core.py", "tests/test_adapted_context.py", "tests/test_plan.py"], [COMPILE, "-k", "overlay_mode or keeps_the_path"], _ALL[3]],
    ),
}

# Issue 43: LoRA's own variants and trainable tokens: the float64 peft oracles first (their own
# files), then the contract rows, the catalogue and the documented defaults.
TARGETS |= {
    f"lora_func/variants/{name}.py": (
        None,
        [
            [f"tests/test_variant_{name}.py"],
            [CONTRACT, "-k", select],
            [CATALOGUE, "-k", select.replace("_", "-")],
            [KILLERS, "-k", f"documented_defaults and ({select})"],
            # its peft storage: the Conv1D refusals (save_peft's and peft_problems')
            ["tests/test_io_peft.py", "-k", select],
            ["tests/test_peft_problems.py", "-k", f"answers_differ or {select}"],
        ],
    )
    for name, select in (
        ("lora_bias", "lora_bias"),
        ("bdlora", "bdlora"),
        ("qalora", "qalora"),
        ("trainable_tokens", "trainable_tokens"),
        ("velora", "velora"),
        ("monteclora", "monteclora"),
        ("alora", "alora and not adalora and not gralora"),
    )
}

# Session 4: the files no run had mutated. Each variant's own float64 peft oracles first, then its
# contract rows, catalogue cases, documented defaults and peft storage.
TARGETS |= {
    f"lora_func/variants/{name}.py": (
        None,
        [
            *own,
            [CONTRACT, "-k", name],
            [CATALOGUE, "-k", f"{name} or {name.replace('_', '-')}"],
            [KILLERS, "-k", f"documented_defaults and {name}"],
            ["tests/test_io_peft.py", "-k", name],
            ["tests/test_peft_problems.py", "-k", f"answers_differ or {name}"],
        ],
    )
    for name, own in (
        ("kasa", [["tests/test_variant_kasa.py"]]),
        ("loftq", [["tests/test_init_loftq.py"]]),
        ("lora_ga", [["tests/test_init_lora_ga.py"]]),
        ("mica", [["tests/test_inits.py", "-k", "mica"], ["tests/test_mixed_route.py", "tests/test_lowrank_function.py", "-k", "mica"]]),
        # the trained copy: peft's LN tuning, modules_to_save and bias training
        ("ln_tuning", [["tests/test_kinds_peft.py", "-k", "ln_tuning"], ["tests/test_modules_to_save.py", "tests/test_peft_bias.py"], ["tests/test_kinds.py", "tests/test_compose.py", "-k", "ln_tuning"]]),
    )
}
# Issue 44 (peft's layer_replication as a view of the base)
TARGETS["lora_func/replication.py"] = (None, [["tests/test_peft_layer_replication.py"], [CATALOGUE, "-k", "replicat or layer-replication"], ["tests/test_io_peft.py", "-k", "replicat"]])
# Issue 44 (peft's modules_to_save and bias="all" | "<method>_only"): the reading and writing
# of the trained copies and biases only (the rest of the io files is the peft oracle tests' business)
_COPY_STAGES = [["tests/test_peft_bias.py", "tests/test_modules_to_save.py"], [CATALOGUE, "-k", "bias or modules-to-save or copy"], ["tests/test_io_peft.py"]]
TARGETS |= {
    "lora_func/io/peft.py": (("_export_leaf", "_one_checkpoint", "_refuse_wider_copies", "_bias_mode"), _COPY_STAGES),
    "lora_func/io/_peft_read.py": (("saved_copies", "_bias_training", "trained_biases", "_drop_wrapper_biases"), _COPY_STAGES),
    "lora_func/io/_peft_keys.py": (("bias_copy_options", "module_copy"), _COPY_STAGES),
}

# Method calls whose removal is a mutant: ``x.detach()`` -> ``x`` (gradient flow), ``.clamp``
# (guards), ``.to`` (dtype policy), ``.T``/transposes (layout), reductions' helpers.
REMOVABLE_METHODS = {"detach", "clamp", "to", "transpose", "abs", "sqrt", "contiguous", "float", "double", "clone", "conj"}
REMOVABLE_ATTRS = {"T", "mT", "mH"}
REMOVABLE_FUNCS = {"reversed", "abs"}
# ``torch.abs(x)`` / ``math.sqrt(x)`` (module functions of one argument) -> ``x``
MODULES = {"torch", "math", "F"}
REMOVABLE_MODULE_FUNCS = {"abs", "sqrt", "tanh", "exp", "diag", "diag_embed"}

BINOP_SWAPS: dict[type, type] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Pow: ast.Mult,
    ast.Mod: ast.FloorDiv,
}
CMP_SWAPS: dict[type, type] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}


@dataclasses.dataclass(frozen=True)
class Mutant:
    file: str
    line: int
    start: int  # byte offsets into the file
    end: int
    original: str
    replacement: str
    kind: str

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.start}:{self.kind}:{self.replacement}"


def _skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes never mutated: docstrings, raise/assert statements, annotations, f-strings."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Raise, ast.Assert, ast.JoinedStr, ast.Import, ast.ImportFrom)):
            mark(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                mark(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mark(node.returns)
            for arg in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs, node.args.vararg, node.args.kwarg]:
                if arg is not None:
                    mark(arg.annotation)
            for decorator in node.decorator_list:
                mark(decorator)
        if isinstance(node, ast.AnnAssign):
            mark(node.annotation)
        # ``if ...: raise`` guards only decide whether an error is raised; they are the error
        # catalogue's business, not the math's.
        if isinstance(node, ast.If) and len(node.body) == 1 and isinstance(node.body[0], ast.Raise) and not node.orelse:
            mark(node.test)
        # __all__ and other module-level string lists
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            mark(node)
    return skip


def _scopes(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """``(qualified name, node)`` for every top-level statement, function and method."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item
                else:
                    yield node.name, item
        else:
            yield "<module>", node


def _mutations(node: ast.AST) -> Iterator[tuple[str, str]]:
    """``(kind, replacement source)`` for one node."""
    if isinstance(node, ast.BinOp) and type(node.op) in BINOP_SWAPS:
        new = copy.deepcopy(node)
        new.op = BINOP_SWAPS[type(node.op)]()
        yield "binop", f"({ast.unparse(new)})"
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        # a @ b -> a.mT @ b only makes sense for square operands; drop the product instead
        yield "matmul-left", f"({ast.unparse(node.left)})"
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
        yield "unary-drop", f"({ast.unparse(node.operand)})"
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in CMP_SWAPS:
                new = copy.deepcopy(node)
                new.ops[i] = CMP_SWAPS[type(op)]()
                yield "compare", f"({ast.unparse(new)})"
    elif isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield "boolop", f"({ast.unparse(new)})"
    elif isinstance(node, ast.Constant) and not isinstance(node.value, str):
        value = node.value
        if isinstance(value, bool):
            yield "const", repr(not value)
        elif isinstance(value, int):
            yield "const", repr(value + 1)
        elif isinstance(value, float):
            yield "const", repr(value * 2 if value != 0 else 1.0)
    elif isinstance(node, ast.Call):
        func = node.func
        is_module_func = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in MODULES
        if is_module_func and func.attr in REMOVABLE_MODULE_FUNCS and len(node.args) == 1:  # type: ignore[union-attr]
            yield f"drop-{ast.unparse(func)}()", f"({ast.unparse(node.args[0])})"
        elif isinstance(func, ast.Attribute) and not is_module_func and func.attr in REMOVABLE_METHODS:
            yield f"drop-.{func.attr}()", f"({ast.unparse(func.value)})"
        elif isinstance(func, ast.Name) and func.id in REMOVABLE_FUNCS and len(node.args) == 1:
            yield f"drop-{func.id}()", f"({ast.unparse(node.args[0])})"
    elif isinstance(node, ast.Attribute) and node.attr in REMOVABLE_ATTRS and isinstance(node.ctx, ast.Load):
        yield f"drop-.{node.attr}", f"({ast.unparse(node.value)})"


def _condition_mutations(node: ast.AST) -> Iterator[tuple[ast.AST, str, str]]:
    if isinstance(node, (ast.If, ast.IfExp, ast.While)):
        yield node.test, "negate-condition", f"(not ({ast.unparse(node.test)}))"


def mutants_of(file: str, functions: tuple[str, ...] | None, root: Path) -> list[Mutant]:
    source = (root / file).read_bytes()
    tree = ast.parse(source)
    skip = _skipped_nodes(tree)
    line_starts = [0]
    for line in source.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))

    def offsets(node: ast.AST) -> tuple[int, int]:
        return line_starts[node.lineno - 1] + node.col_offset, line_starts[node.end_lineno - 1] + node.end_col_offset  # type: ignore[attr-defined]

    out: dict[str, Mutant] = {}
    for name, scope in _scopes(tree):
        if functions is not None and name not in functions and name.split(".")[0] not in functions:
            continue
        for node in ast.walk(scope):
            if id(node) in skip or not hasattr(node, "end_col_offset"):
                continue
            found = [(node, kind, text) for kind, text in _mutations(node)] + list(_condition_mutations(node))
            for target, kind, text in found:
                if id(target) in skip:
                    continue
                start, end = offsets(target)
                original = source[start:end].decode()
                m = Mutant(file, target.lineno, start, end, original, text, kind)  # type: ignore[attr-defined]
                out.setdefault(m.id, m)
    return sorted(out.values(), key=lambda m: (m.file, m.start, m.kind, m.replacement))


def apply(m: Mutant, source: bytes) -> bytes:
    return source[: m.start] + m.replacement.encode() + source[m.end :]


# ------------------------------------------------------------------------------------ running


def copy_tree(dest: Path) -> None:
    dest = dest.resolve()
    if dest == REPO or REPO in dest.parents:
        raise SystemExit(f"--copy-to {dest} is inside the repository; pick a directory outside it")
    if dest.exists():
        shutil.rmtree(dest)
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".hypothesis", ".pytest_cache", "*.egg-info", ".ruff_cache")
    shutil.copytree(REPO, dest, ignore=ignore)


def preload() -> None:
    """Import the heavy dependencies once in the parent, so every forked child starts warm."""
    import einops  # noqa: F401
    import pytest  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch

    torch.set_num_threads(1)
    import transformers  # noqa: F401
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM  # noqa: F401

    try:
        import peft  # noqa: F401
    except ImportError:  # pragma: no cover - a test dependency
        pass


def run_tests(stages: list[list[str]], log: Path, timeout: float) -> tuple[str, float]:
    """Fork; the child runs each stage's pytest on the mutated copy until one fails.
    Returns (status, seconds)."""
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # child
        try:
            fd = os.open(str(log), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.setpgid(0, 0)
            import pytest

            import lora_func

            if not lora_func.__file__.startswith(os.getcwd()):
                raise RuntimeError(f"imported {lora_func.__file__}, not the mutated copy under {os.getcwd()}")
            code = 0
            for args in stages:
                code = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", "--no-header", "--assert=plain", *args]))
                if code == pytest.ExitCode.NO_TESTS_COLLECTED:  # e.g. -k ia3 in a file with no ia3 case
                    code = 0
                if code != 0:
                    break
        except BaseException:  # noqa: BLE001 - any crash of the child counts as a failure
            import traceback

            traceback.print_exc()
            sys.stdout.flush()
            code = 99
        os._exit(int(code))
    deadline = start + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        if time.perf_counter() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return "timeout", time.perf_counter() - start
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    if code == 0:
        return "survived", seconds
    if code == 1:
        return "killed", seconds
    return f"error({code})", seconds  # collection/usage errors: an import-time crash kills too


def first_failure(log: Path) -> str:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0].removeprefix("FAILED ").removeprefix("ERROR ")
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copy-to", type=Path, required=True, help="scratch directory for the mutated copy (outside the repo)")
    parser.add_argument("--only", nargs="*", default=None, help="target files (default: all of TARGETS)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--report", type=Path, default=None, help="write a markdown report here")
    parser.add_argument("--json", type=Path, default=None, help="write the raw results here")
    parser.add_argument("--timeout-factor", type=float, default=4.0, help="a mutant's timeout, in baseline run times")
    parser.add_argument("--no-copy", action="store_true", help="reuse an existing --copy-to tree")
    parser.add_argument("--lines", nargs="*", type=int, default=None, help="only the mutants on these lines (a re-run of a report's survivors)")
    parser.add_argument(
        "--survivors-of",
        type=Path,
        default=None,
        help="only the mutants that survived in this earlier --json, matched by (file, kind, original, replacement), so the line numbers may have moved",
    )
    args = parser.parse_args(argv)

    files = args.only or list(TARGETS)
    unknown = sorted(set(files) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets {unknown}; known: {list(TARGETS)}")
    if not args.no_copy:
        copy_tree(args.copy_to)
    root = args.copy_to.resolve()
    all_mutants = {f: mutants_of(f, TARGETS[f][0], root) for f in files}
    if args.lines is not None:
        all_mutants = {f: [m for m in ms if m.line in args.lines] for f, ms in all_mutants.items()}
    if args.survivors_of is not None:
        earlier = {(r["file"], r["kind"], r["original"], r["replacement"]) for r in json.loads(args.survivors_of.read_text()) if r["status"] == "survived"}
        all_mutants = {f: [m for m in ms if (m.file, m.kind, m.original, m.replacement) in earlier] for f, ms in all_mutants.items()}
    if args.list:
        for f, ms in all_mutants.items():
            for m in ms:
                print(f"{m.file}:{m.line} [{m.kind}] {m.original!r} -> {m.replacement!r}")
        print(f"{sum(map(len, all_mutants.values()))} mutants")
        return 0

    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.environ["PYTHONHASHSEED"] = "0"
    sys.dont_write_bytecode = True
    os.chdir(root)
    sys.path.insert(0, str(root))
    preload()
    logs = root / ".mutation-logs"
    logs.mkdir(exist_ok=True)

    results = []
    started = time.perf_counter()
    for f in files:
        tests = TARGETS[f][1]
        path = root / f
        original = path.read_bytes()
        status, base_seconds = run_tests(tests, logs / "baseline.log", timeout=1800)
        if status != "survived":
            print(f"{f}: the unmutated tests fail ({status}); see {logs / 'baseline.log'}", file=sys.stderr)
            return 2
        timeout = max(60.0, args.timeout_factor * base_seconds)
        print(f"{f}: {len(all_mutants[f])} mutants, baseline {base_seconds:.1f} s", flush=True)
        try:
            for i, m in enumerate(all_mutants[f]):
                path.write_bytes(apply(m, original))
                log = logs / "mutant.log"
                status, seconds = run_tests(tests, log, timeout)
                killer = first_failure(log) if status == "killed" else ""
                results.append(dataclasses.asdict(m) | {"status": status, "seconds": round(seconds, 2), "killer": killer})
                if status == "survived":
                    print(f"  SURVIVED {m.file}:{m.line} [{m.kind}] {m.original!r} -> {m.replacement!r}", flush=True)
                if (i + 1) % 25 == 0:
                    print(f"  {i + 1}/{len(all_mutants[f])} ({time.perf_counter() - started:.0f} s)", flush=True)
        finally:
            path.write_bytes(original)

    killed = sum(r["status"] != "survived" for r in results)
    summary = f"{killed}/{len(results)} mutants killed ({100 * killed / max(len(results), 1):.1f}%) in {time.perf_counter() - started:.0f} s"
    print(summary)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.report:
        lines = [f"# Mutation run\n\n{summary}\n", "| file | killed | survived |", "|---|---|---|"]
        for f in files:
            rs = [r for r in results if r["file"] == f]
            lines.append(f"| {f} | {sum(r['status'] != 'survived' for r in rs)} | {sum(r['status'] == 'survived' for r in rs)} |")
        lines += ["", "## Survivors", "", "| where | kind | original | mutant |", "|---|---|---|---|"]
        for r in results:
            if r["status"] == "survived":
                lines.append(f"| {r['file']}:{r['line']} | {r['kind']} | `{r['original']}` | `{r['replacement']}` |")
        args.report.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
