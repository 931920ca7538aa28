"""Writes a tiny local "hub" for tests of unmodified ecosystem scripts: nothing is downloaded.

    python tests/workers/tiny_hub.py DIR

DIR/model: a 2-layer Llama (hidden 32, vocab 64, fp32) with a word-level tokenizer (`<pad>`,
`<eos>`, words w0..w59), loadable by `from_pretrained(DIR/model)` and TRL's `model_name_or_path`.
DIR/sft/{train,test}.jsonl: "text" rows of 20-60 words that count up by a stride (learnable),
for `load_dataset(DIR/sft)`. DIR/clm/{train,validation}.txt: the same texts, one per line, for
run_clm's `--train_file`.
"""

import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(60)]


def texts(count: int, rng: random.Random) -> list[str]:
    rows = []
    for _ in range(count):
        length, start, stride = rng.randint(20, 60), rng.randrange(len(WORDS)), rng.randint(1, 3)
        rows.append(" ".join(WORDS[(start + stride * i) % len(WORDS)] for i in range(length)))
    return rows


def main(out: Path) -> None:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(out / "model")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1,
                         bos_token_id=1, use_cache=False, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out / "model")
    rng = random.Random(0)
    for folder, splits in (("sft", {"train": "jsonl", "test": "jsonl"}), ("clm", {"train": "txt", "validation": "txt"})):
        (out / folder).mkdir(parents=True, exist_ok=True)
        for split, kind in splits.items():
            rows = texts(24 if split == "train" else 8, rng)
            lines = [json.dumps({"text": row}) for row in rows] if kind == "jsonl" else rows
            (out / folder / f"{split}.{kind}").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
