"""accelerate's examples/torch_native_parallelism/nd_parallel_trainer.py, run on the tiny local hub.

As the example writes it: `ParallelismConfig()` read from the environment (what `accelerate launch
--config_file configs/cp.yaml` sets, and cpctl launch too), the packed dataset, TrainingArguments
with `bf16=True`, a Trainer, `save_model`. Changed: the dataset (utils.py), `max_steps` (a few
steps, not an epoch) and `report_to="none"` (offline); and what transformers 5 removed, which the
example still uses: `transformers.infer_device` (the device type is read from torch here) and the
Trainer's `tokenizer=` (now `processing_class=`).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
from utils import get_dataset

from accelerate.utils import ParallelismConfig


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--checkpoint-frequency", type=int, default=100)
    parser.add_argument("--model-name", type=str, required=True)
    parser.add_argument("--save-dir", type=str, default="./accelerate-nd-parallel")
    parser.add_argument("--device-type", type=str, default="auto")
    parser.add_argument("--max-steps", type=int, default=-1)
    return parser.parse_args()


def main():
    pc = ParallelismConfig()
    args = parse_args()
    if args.device_type == "auto":
        args.device_type = "cuda" if torch.cuda.is_available() else "cpu"
    model_kwargs = {}
    if pc.tp_enabled:
        model_kwargs["tp_plan"] = "auto"
        model_kwargs["device_mesh"] = pc.build_device_mesh(args.device_type)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModelForCausalLM.from_pretrained(args.model_name, use_cache=False, **model_kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    packed_dataset = get_dataset(tokenizer, args.sequence_length, model_name=args.model_name)
    training_args = TrainingArguments(
        output_dir=args.save_dir,
        parallelism_config=pc,
        num_train_epochs=1,
        max_steps=args.max_steps,
        per_device_train_batch_size=1,
        logging_steps=1,
        save_steps=args.checkpoint_frequency,
        learning_rate=5e-5,
        remove_unused_columns=False,
        bf16=True,
        report_to="none",
    )
    trainer = Trainer(model=model, args=training_args, processing_class=tokenizer, train_dataset=packed_dataset)
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
