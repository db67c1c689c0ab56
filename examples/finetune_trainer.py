"""Fine-tune a tiny causal LM with the Hugging Face Trainer on neuron: the README's example.

    NEURON_ADAPTIVE_EAGER=1 python examples/finetune_trainer.py [--steps 8]

An unmodified Trainer script: nothing names the device. Trainer finds `neuron` as it
finds TorchNeuron (the `torch_neuronx` compatibility module), moves the model there and
trains. Offline: the model is built from a config (random weights), the data is token
rows made in memory. It then trains the same model on the CPU (`use_cpu=True`), prints
both loss logs and the device's statistics, and exits 1 if the losses differ.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import adaptive_eager  # noqa: E402
from adaptive_eager.report_text import format_stats  # noqa: E402


def train(steps: int, use_cpu: bool):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    rows = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in rows]
    args = transformers.TrainingArguments(output_dir="finetune_out", use_cpu=use_cpu, max_steps=steps,
                                          per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
                                          save_strategy="no", report_to=[], disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # the table below says it once
    trainer.train()
    return args.device, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main() -> int:
    parser = argparse.ArgumentParser(description="Trainer fine-tuning on neuron, against the CPU")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    adaptive_eager.reset_stats()
    device, losses = train(args.steps, use_cpu=False)
    stats = adaptive_eager.stats()
    _, cpu_losses = train(args.steps, use_cpu=True)
    print(f"Trainer picked {device}, mode {stats['mode']}")
    print("step  loss (neuron)  loss (cpu)")
    for step, (a, b) in enumerate(zip(losses, cpu_losses), 1):
        print(f"{step:4d}  {a:13.6f}  {b:10.6f}")
    print()
    print(format_stats(stats))
    same = len(losses) == len(cpu_losses) == args.steps and all(
        abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, cpu_losses))
    print("losses equal the CPU's" if same else "LOSSES DIFFER FROM THE CPU'S")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
