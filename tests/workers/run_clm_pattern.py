"""transformers' examples/pytorch/language-modeling/run_clm.py, cut to what it does with a local
model and text files (no hub, no `evaluate` download): the same argument dataclasses and parser,
`load_dataset("text", ...)`, tokenize, `group_texts` into blocks, `default_data_collator`, a
Trainer with run_clm's `preprocess_logits_for_metrics` (argmax) and `compute_metrics` (accuracy of
the shifted predictions, computed as `evaluate`'s accuracy does), train, save, evaluate with
perplexity. `--do_predict` also runs `trainer.predict` on the validation blocks and saves the
predictions (argmax per token) as predictions.npy in the output dir.

    python tests/workers/run_clm_pattern.py --model_name_or_path HUB/model --train_file HUB/clm/train.txt \\
        --validation_file HUB/clm/validation.txt --block_size 63 --do_train --do_eval --output_dir OUT
"""

import math
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
from datasets import load_dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a local model directory"})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "a text file, one document per line"})
    validation_file: str = field(metadata={"help": "a text file, one document per line"})
    block_size: int = field(default=64, metadata={"help": "tokens per training row"})


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    raw_datasets = load_dataset("text", data_files={"train": data_args.train_file,
                                                    "validation": data_args.validation_file})
    config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config)

    column_names = list(raw_datasets["train"].features)
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized_datasets = raw_datasets.map(tokenize_function, batched=True, remove_columns=column_names)
    block_size = data_args.block_size

    def group_texts(examples):
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {k: [t[i: i + block_size] for i in range(0, total_length, block_size)]
                  for k, t in concatenated_examples.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        lm_datasets = tokenized_datasets.map(group_texts, batched=True)
    train_dataset, eval_dataset = lm_datasets["train"], lm_datasets["validation"]

    def preprocess_logits_for_metrics(logits, labels):
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        labels = labels[:, 1:].reshape(-1)
        preds = preds[:, :-1].reshape(-1)
        return {"accuracy": float((preds == labels).mean())}  # evaluate.load("accuracy")'s value

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
    )

    if training_args.do_train:
        train_result = trainer.train()
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            perplexity = math.exp(metrics["eval_loss"])
        except OverflowError:
            perplexity = float("inf")
        metrics["perplexity"] = perplexity
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        predicted = trainer.predict(eval_dataset)
        if trainer.is_world_process_zero():
            np.save(f"{training_args.output_dir}/predictions.npy", predicted.predictions)
        trainer.save_metrics("predict", predicted.metrics)


if __name__ == "__main__":
    main()
