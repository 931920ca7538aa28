"""A transformers `Trainer` script that knows nothing of cpctl, for context parallelism.

Its `Accelerator` is the Trainer's own; under `cpctl launch --cp-size N` (which finds the Trainer in this source)
it reads the parallel sizes cpctl sets (as under `accelerate launch`), and the Trainer shards each
batch through `accelerator.maybe_context_parallel`, on cpctl's engine. A tiny random Llama and
learnable synthetic rows: nothing is downloaded.

    python scripts/trainer_cp.py                                      # one process, the reference
    cpctl launch --device cpu --nproc-per-node 2 --cp-size 2 \\
        scripts/trainer_cp.py                                         # cp 2, gloo
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments


class CountingRows(torch.utils.data.Dataset):
    """Token rows with a learnable rule (each counts up by its own stride); labels are the tokens."""

    def __init__(self, rows: int, seq_len: int, vocab_size: int):
        generator = torch.Generator().manual_seed(1)
        start = torch.randint(vocab_size, (rows, 1), generator=generator)
        stride = torch.randint(1, 4, (rows, 1), generator=generator)
        self.ids = (start + stride * torch.arange(seq_len)) % vocab_size

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index].clone()}


class KeepLosses(TrainerCallback):
    def __init__(self):
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--losses-out", default=None, help="write the logged per-step losses here as JSON")
    p.add_argument("--evaluate-first", action="store_true", help="evaluate before training as well")
    args = p.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(config)
    kept = KeepLosses()
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2, max_steps=args.steps,
                                     learning_rate=args.lr, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
                                     save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=0)
        trainer = Trainer(model=model, args=training, train_dataset=CountingRows(4 * args.steps, args.seq_len, 128),
                          eval_dataset=CountingRows(4, args.seq_len, 128), callbacks=[kept])
        if args.evaluate_first:
            trainer.evaluate()
        trainer.train()
        evaluated = trainer.evaluate()["eval_loss"]
    if trainer.is_world_process_zero() and args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump({"losses": kept.losses, "eval_loss": evaluated, "world": trainer.args.world_size}, f)


if __name__ == "__main__":
    main()
