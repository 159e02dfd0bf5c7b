"""QLoRA: fine-tune a LoRA adapter on a 4-bit (nf4) base, the quantized model untouched.

The shipped demo model is loaded with bitsandbytes' nf4 quantization (it runs on the CPU), an
adapter trains on it with lora_func.train (backward + AdamW, gradient checkpointing on), and
its held-out accuracy on the demo task goes up. The adapter reloads onto the float model too.

Run: python examples/qlora.py          (needs bitsandbytes: pip install bitsandbytes)
"""

import tempfile
import warnings

import torch

import lora_func as lf
from lora_func.demo.corpus import task_split
from lora_func.demo.model import default_targets, load_model
from lora_func.demo.run import batch_sampler, cpu_threads, encode_examples, held_out_accuracy
from lora_func.train import TrainState, fit, make_optimizer

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # bitsandbytes' notices about its CPU kernels
    model, tokenizer = load_model(quantize="nf4")
print(f"base: {type(model.model.layers[0].self_attn.q_proj).__name__} layers, weights {model.model.layers[0].self_attn.q_proj.weight.dtype}")

train_examples, held_out_examples = task_split(0)
train, held_out = encode_examples(tokenizer, train_examples), encode_examples(tokenizer, held_out_examples)
adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=default_targets(model), r=8), generator=torch.Generator().manual_seed(0))
before, _ = held_out_accuracy(model, adapter, held_out)

model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
model.train()  # HF checkpoints in training mode; the model has no dropout
state = TrainState(adapter, make_optimizer(adapter, lr=3e-3))
with cpu_threads(1):  # the tiny model's matmuls are too small to split
    history = fit(model, state, batch_sampler(train, 16, seed=0), 100, progress=False)
model.activation_checkpointing_disable()
model.eval()

after, _ = held_out_accuracy(model, adapter, held_out)
print(f"held-out accuracy {before:.0%} -> {after:.0%}; loss {history[0].loss:.3f} -> {history[-1].loss:.3f}")
assert after > before, "QLoRA training should improve the held-out accuracy"

# The adapter file is the same as on a float base: it loads onto the float model as well.
with tempfile.TemporaryDirectory() as directory:
    path = lf.save(adapter, f"{directory}/qlora.safetensors")
    float_model, _ = load_model()
    on_float = lf.load(path, model=float_model)
    float_after, _ = held_out_accuracy(float_model, on_float, held_out)
print(f"the same adapter on the float model: {float_after:.0%} (the difference: nf4 round-off of the base)")
