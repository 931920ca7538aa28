"""accelerate's examples/torch_native_parallelism/nd_parallel.py, run on the tiny local hub.

Kept as the example writes it: the ParallelismConfig from the script's own size options, an
FSDP2 plugin, `accelerator.prepare`, `forward` with its four buffers and the loss averaged over
the dp x cp group, `model.config` (the FLOP count) and `model.save_pretrained` at the end.
Changed: no wandb tracker (offline), the dataset (utils.py), the loss of every step printed in
full, and `--precision` (the example's bf16 by default; fp32 for an exact comparison).
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM
from utils import create_collate_fn, get_dataset, get_model_flops_per_token, setup_tokenizer

from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import FullyShardedDataParallelPlugin, set_seed


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp-replicate-size", type=int, default=1)
    parser.add_argument("--dp-shard-size", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--cp-size", type=int, default=1)
    parser.add_argument("--sequence-length", type=int, default=1024)
    parser.add_argument("--num-steps", type=int, default=1000)
    parser.add_argument("--save-dir", type=str, default="./outputs")
    parser.add_argument("--checkpoint-frequency", type=int, default=100)
    parser.add_argument("--model-name", type=str, required=True)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    return parser.parse_args()


def forward(model, batch, optimizer, accelerator: Accelerator):
    batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1), device=batch["input_ids"].device).unsqueeze(0)
    buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
    ):
        loss_reduce_grp = (
            accelerator.torch_device_mesh["dp_cp"].get_group()
            if accelerator.parallelism_config.dp_cp_dim_names
            else None
        )
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=loss_reduce_grp)
    return loss


def train(args):
    parallelism_config = ParallelismConfig(
        dp_replicate_size=args.dp_replicate_size,
        dp_shard_size=args.dp_shard_size,
        tp_size=args.tp_size,
        cp_size=args.cp_size,
    )
    fsdp2_plugin = None
    if parallelism_config.dp_shard_enabled or parallelism_config.cp_enabled:
        fsdp2_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            state_dict_type="SHARDED_STATE_DICT",
        )
    bf16 = args.precision == "bf16"
    accelerator = Accelerator(mixed_precision="bf16" if bf16 else "no", parallelism_config=parallelism_config,
                              fsdp_plugin=fsdp2_plugin)
    model = AutoModelForCausalLM.from_pretrained(args.model_name, torch_dtype=torch.bfloat16 if bf16 else torch.float32,
                                                 use_cache=False)
    tokenizer = setup_tokenizer(args.model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dataset = get_dataset(tokenizer, args.sequence_length, accelerator, model_name=args.model_name)
    dataloader = DataLoader(dataset, batch_size=1, collate_fn=create_collate_fn())
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    total_num_steps = min(args.num_steps, len(dataloader))
    model_flops_per_token = get_model_flops_per_token(model, args.sequence_length)
    losses = []
    accelerator.print(f"Starting training... ({model_flops_per_token} FLOP per token)")
    for step, batch in enumerate(dataloader):
        if step >= total_num_steps:
            break
        loss = forward(model, batch, optimizer, accelerator)
        losses.append(loss.item())
        accelerator.print(f"Step {step}/{total_num_steps}, Loss: {loss.item():.4f}")
    accelerator.print("Training completed!")
    model.save_pretrained(args.save_dir + "/model")
    accelerator.print(f"Model saved to {args.save_dir}/model")
    if accelerator.is_main_process:
        with open(args.save_dir + "/losses.json", "w") as f:
            json.dump({"losses": losses, "world": accelerator.num_processes}, f)
    accelerator.end_training()


if __name__ == "__main__":
    set_seed(42)
    train(parse_args())
