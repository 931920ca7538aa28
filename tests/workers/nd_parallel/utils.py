"""accelerate's examples/torch_native_parallelism/utils.py, the parts nd_parallel*.py use, reading
the tiny local hub's texts (tests/workers/tiny_hub.py: MODEL/../clm/train.txt) where the example
downloads TinyStories. The packing is the example's: rows of seq_len tokens with their next-token
labels (`shift_labels` = `labels`) and positions 0..seq_len-1."""

from contextlib import nullcontext
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoTokenizer


def get_dataset(tokenizer, seq_len, accelerator=None, *, model_name):
    processing_ctx = accelerator.main_process_first if accelerator else nullcontext
    raw_dataset = load_dataset("text", data_files=str(Path(model_name).parent / "clm" / "train.txt"), split="train")

    def tokenize_function(examples):
        tokenized_batch = tokenizer(examples["text"], padding=False, truncation=True, max_length=seq_len,
                                    return_tensors=None)
        tokenized_batch["labels"] = tokenized_batch["input_ids"].copy()
        return tokenized_batch

    with processing_ctx():
        tokenized_dataset = raw_dataset.map(tokenize_function, batched=True, remove_columns=["text"])

    def create_packed_sequences(examples):
        all_tokens = []
        for input_ids in examples["input_ids"]:
            all_tokens.extend(input_ids)
        num_sequences = len(all_tokens) // (seq_len + 1)
        packed_input_ids, packed_labels, packed_position_ids = [], [], []
        for i in range(num_sequences):
            start_idx = i * (seq_len + 1)
            full_sequence = all_tokens[start_idx:start_idx + seq_len + 1]
            packed_input_ids.append(full_sequence[:-1])
            packed_labels.append(full_sequence[1:])
            packed_position_ids.append(torch.arange(0, seq_len))
        return {"input_ids": packed_input_ids, "shift_labels": packed_labels, "position_ids": packed_position_ids,
                "labels": packed_labels}

    with processing_ctx():
        packed_dataset = tokenized_dataset.map(create_packed_sequences, batched=True,
                                               remove_columns=tokenized_dataset.column_names, batch_size=1000)
    return packed_dataset.shuffle(seed=42)


def get_model_flops_per_token(model, seq_len):
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    mlp_flops = 18 * cfg.hidden_size * cfg.intermediate_size
    attn_flops = 12 * head_dim * (cfg.num_attention_heads + cfg.num_key_value_heads)
    attn_dotproduct_flops = 12 * cfg.num_attention_heads * head_dim * seq_len
    return (mlp_flops + attn_flops + attn_dotproduct_flops) * cfg.num_hidden_layers


def create_collate_fn():
    def collate_fn(batch):
        input_ids = torch.tensor([item["input_ids"] for item in batch], dtype=torch.long)
        shift_labels = torch.tensor([item["shift_labels"] for item in batch], dtype=torch.long)
        return {"input_ids": input_ids, "shift_labels": shift_labels, "labels": shift_labels}

    return collate_fn


def setup_tokenizer(model_id):
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
