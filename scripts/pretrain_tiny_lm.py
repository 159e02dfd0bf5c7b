"""Pretrain the demo's tiny Llama on the generated corpus and write it to lora_func/demo/assets/.

    python scripts/pretrain_tiny_lm.py            # about 3 min of CPU time (one thread)

On one thread (the default, ``--threads 1``) it rewrites the shipped files bit for bit.

Everything is made here: the corpus (lora_func.demo.corpus), a word-level tokenizer over its
vocabulary, a 1.2 M-parameter Llama (lora_func.demo.model.tiny_config), plain next-token
training with AdamW. The weights are saved in bf16 (2.4 MB). At the end it prints the accuracy
on all 100 sums in the pretraining notation (should be 100 %) and on the fine-tuning question
form (should be about 0 %: that is the demo's job).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from lora_func.demo.corpus import pretraining_corpus, task_examples
from lora_func.demo.model import ASSETS, build_tokenizer, tiny_config


def token_stream(tokenizer, lines: list[str]) -> torch.Tensor:
    """All lines as one 1-D id tensor, without ``<bos>`` (added per training window)."""
    ids = tokenizer(" ".join(lines), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids)


def windows(stream: torch.Tensor, bos: int, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``(batch, length)`` random windows of the stream, each after a ``<bos>``."""
    starts = torch.randint(0, len(stream) - length, (batch,), generator=generator)
    body = torch.stack([stream[s : s + length - 1] for s in starts.tolist()])
    return torch.cat([torch.full((batch, 1), bos), body], dim=1)


@torch.no_grad()
def answer_accuracy(model, tokenizer, prompts: list[str], answers: list[str]) -> float:
    """Fraction of prompts whose greedy next token is the (one-token) answer."""
    ids = torch.tensor([tokenizer(p)["input_ids"] for p in prompts])
    predicted = model(ids).logits[:, -1].argmax(-1)
    expected = torch.tensor([tokenizer.convert_tokens_to_ids(a) for a in answers])
    return (predicted == expected).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ASSETS)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 reproduces the shipped files bit for bit)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer()
    stream = token_stream(tokenizer, pretraining_corpus(args.lines, seed=args.seed))
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(tiny_config(len(tokenizer)))
    model.config._attn_implementation = "eager"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"corpus: {len(stream):,} tokens, vocabulary {len(tokenizer)}; model: {n_params:,} parameters")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 20)

    def lr_factor(step: int) -> float:  # linear warm-up, cosine decay to 10 %
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    generator = torch.Generator().manual_seed(args.seed)
    model.train()
    start = time.perf_counter()
    progress = tqdm(range(args.steps), desc="pretraining", unit="step")
    for _ in progress:
        ids = windows(stream, tokenizer.bos_token_id, args.batch, args.length, generator)
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        progress.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    print(f"trained in {time.perf_counter() - start:.0f} s, final loss {loss.item():.3f}")

    examples = task_examples()
    sums = answer_accuracy(model, tokenizer, [f"{e.a} + {e.b} =" for e in examples], [e.answer for e in examples])
    questions = answer_accuracy(model, tokenizer, [e.prompt for e in examples], [e.answer for e in examples])
    print(f"accuracy on 'a + b =' (pretraining notation): {sums:.0%}; on 'what is a plus b ?': {questions:.0%}")

    args.out.mkdir(parents=True, exist_ok=True)
    model.config._attn_implementation = None
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    # The generic class name, so that transformers 4.x's AutoTokenizer reads it too (5.x writes
    # its own backend's name).
    config_path = args.out / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"}
    config_path.write_text(json.dumps(config, indent=2))
    print(f"wrote {sorted(p.name for p in args.out.iterdir())} to {args.out}")


if __name__ == "__main__":
    main()
