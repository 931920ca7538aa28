"""A LoRA fine-tune of a tiny Llama (peft's get_peft_model, before rt.prepare_model) for two steps:
its losses, its adapters' gradients, the trained model's logits, and its adapters saved with
`save_pretrained` (rank 0 writes OUT/result.json and OUT/adapters/).

    python tests/workers/peft_cases.py OUT --plain          # one plain process with peft: the reference
    python tests/workers/peft_cases.py OUT [--bf16-base] [--dropout P]   # cpctl's runtime, one process
    python tests/workers/peft_cases.py OUT --trainer         # a transformers Trainer (also under cpctl launch
                                                             # --script-api accelerate): losses, saved adapters
    cpctl launch --device cpu --nproc-per-node 2 --cp-size 2 tests/workers/peft_cases.py OUT
    (any layout and checkpointing level the launch sets: the adapters sit on every linear projection,
    the tiled MLPs' too)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

SEQ, VOCAB = 32, 64
PROBE = torch.arange(24).reshape(1, 24) % VOCAB  # the tokens whose logits are compared


def base_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config)


def lora(model: LlamaForCausalLM, *, dropout: float = 0.0):
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=dropout))


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(VOCAB, (1, SEQ), generator=generator) for _ in range(2)]


def full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().float().cpu()


def train(model, *, step_context, token_mean, device) -> tuple[list[float], list[dict[str, list]], int]:
    """Two steps: the losses, the adapters' gradients, and how many frozen parameters got a gradient."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, gradients, frozen_with_grads = [], [], 0
    torch.manual_seed(3)  # dropout's masks: the same in every run of one layout
    for ids in batches():
        ids = ids.to(device)
        labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
        pos = torch.arange(SEQ, device=device)[None]
        with step_context([ids, labels, pos]):
            logits = model(input_ids=ids, position_ids=pos).logits
            loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
            loss = token_mean(loss_sum, labels)
            loss.backward()
        frozen_with_grads += sum(p.grad is not None for p in model.parameters() if not p.requires_grad)
        gradients.append({name.replace("._checkpoint_wrapped_module", ""): full(p.grad).tolist()
                          for name, p in model.named_parameters() if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, gradients, frozen_with_grads


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.cat(batches())

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index].clone()}


def trainer_way(out: Path, *, steps: int = 2, checkpointing: bool = False, stop_at: int | None = None,
                resume: bool = False) -> None:
    """The Trainer with a PEFT model: its logged losses and its save_model (the adapters). With
    `stop_at`, a checkpoint every `stop_at` steps and training stopped at the first (an interrupted
    run); `resume` trains on from the latest checkpoint in the same `out`."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    losses: list[float] = []

    class KeepLosses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

        def on_step_end(self, args, state, control, **kwargs):
            if stop_at is not None and not resume and state.global_step == stop_at:
                control.should_save, control.should_training_stop = True, True

    saving = {"save_strategy": "steps", "save_steps": stop_at} if stop_at else {"save_strategy": "no"}
    args = TrainingArguments(output_dir=str(out / "run"), per_device_train_batch_size=1, max_steps=steps,
                             learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, report_to=[],
                             use_cpu=not torch.cuda.is_available(), seed=0, gradient_checkpointing=checkpointing,
                             **saving)
    trainer = Trainer(model=lora(base_model()), args=args, train_dataset=Rows(), callbacks=[KeepLosses()])
    trainer.train(resume_from_checkpoint=resume or None)
    trainer.save_model(str(out / "adapters"))
    if trainer.is_world_process_zero():
        (out / "result.json").write_text(json.dumps({"losses": losses}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--bf16-base", action="store_true", help="the frozen base in bf16, as released checkpoints are")
    parser.add_argument("--peft-after-prepare", action="store_true", help="get_peft_model after prepare_model (refused)")
    parser.add_argument("--trainer", action="store_true", help="through a transformers Trainer")
    parser.add_argument("--dropout", type=float, default=0.0, help="peft's lora_dropout")
    parser.add_argument("--steps", type=int, default=2, help="--trainer: steps in all")
    parser.add_argument("--checkpointing", action="store_true", help="--trainer: gradient_checkpointing=True")
    parser.add_argument("--stop-at", type=int, default=None, help="--trainer: save at and stop after this step")
    parser.add_argument("--resume", action="store_true", help="--trainer: train on from the latest checkpoint")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.trainer:
        return trainer_way(args.out, steps=args.steps, checkpointing=args.checkpointing, stop_at=args.stop_at,
                           resume=args.resume)
    import contextlib

    if args.plain:
        model = lora(base_model(), dropout=args.dropout)
        losses, gradients, frozen_with_grads = train(model, step_context=lambda buffers: contextlib.nullcontext(),
                                  token_mean=lambda s, labels: s / (labels != -100).sum(), device="cpu")
        main_rank, device = True, torch.device("cpu")
    else:
        import cpctl

        rt = cpctl.init()
        base = base_model().to(torch.bfloat16) if args.bf16_base else base_model()
        model = (lora(rt.prepare_model(base), dropout=args.dropout) if args.peft_after_prepare
                 else rt.prepare_model(lora(base, dropout=args.dropout)))
        context = lambda buffers: rt.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),  # noqa: E731
                                                            no_restore_buffers=set(buffers))
        losses, gradients, frozen_with_grads = train(model, step_context=context, token_mean=rt.token_mean, device=rt.device)
        main_rank, device = rt.is_main, rt.device
    frozen = {str(p.dtype) for p in model.parameters() if not p.requires_grad}
    trainable = {str(p.dtype) for p in model.parameters() if p.requires_grad}
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=PROBE.to(device)).logits.float().cpu()
    model.save_pretrained(args.out / "adapters")
    if main_rank:
        torch.save(logits, args.out / "logits.pt")
        (args.out / "result.json").write_text(json.dumps({"losses": losses, "gradients": gradients,
                                                           "frozen_dtypes": sorted(frozen),
                                                           "frozen_with_grads": frozen_with_grads,
                                                           "trainable_dtypes": sorted(trainable)}))


if __name__ == "__main__":
    main()
