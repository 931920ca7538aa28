"""Train a tiny Llama two steps on one route, save it as a user of that route would, and write
the trained model's logits on fixed tokens (rank 0: OUT/logits.pt) for the test to compare
with the saved files reloaded in plain transformers.

    cpctl launch --device cpu --nproc-per-node 2 --cp-size 2 --script-api cpctl \\
        tests/workers/save_routes.py runtime OUT
    cpctl launch ... --script-api accelerate tests/workers/save_routes.py {accelerate|trainer} OUT

Routes and what each saves (directories under OUT):
  runtime      cpctl.init + rt.prepare_model; model.save_pretrained(model/, max_shard_size=...)
               (`--into DIR` elsewhere; `--main-only` on rank 0 only, the mistake a save must name)
  accelerate   accelerator.save_model(model, model/) and
               unwrap_model(model).save_pretrained(unwrapped/, state_dict=accelerator.get_state_dict(model));
               the same state dict saved under `if accelerator.is_main_process:` (main-only/);
               accelerator.save_state(state/) after step 2; `--steps 4 --resume` load_state(state/), steps 3-4
  trainer      a Trainer with a periodic checkpoint (OUT/run/checkpoint-2); trainer.save_model(model/);
               `--steps 4 --resume` trains on from that checkpoint to step 4
(TRL's trainers save through the same Trainer.save_model: tests/test_trl.py reloads what its sft script saved.)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEQ, VOCAB, STEPS = 32, 64, 2
PROBE = torch.arange(24).reshape(1, 24) % VOCAB  # the tokens whose logits are compared


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def rows(count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    start = torch.randint(VOCAB, (count, 1), generator=generator)
    return (start + torch.arange(SEQ)) % VOCAB


def write_logits(model: torch.nn.Module, out: Path, *, device: torch.device, main: bool) -> None:
    """Every rank calls the (sharded) model outside any CP step; rank 0 keeps the logits."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=PROBE.to(device)).logits.float().cpu()
    if main:
        torch.save(logits, out / "logits.pt")


def runtime_route(out: Path, *, into: Path | None, main_only: bool) -> None:
    import cpctl

    rt = cpctl.init()
    model = rt.prepare_model(tiny_llama())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for ids in rows(STEPS).to(rt.device).split(1):
        labels, pos = cpctl.shift_labels(ids), cpctl.position_ids_like(ids)
        with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                       no_restore_buffers={ids, labels, pos}):
            logits = model(input_ids=ids, position_ids=pos).logits
            loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
            rt.token_mean(loss_sum, labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    if rt.is_main or not main_only:
        model.save_pretrained(into or out / "model", max_shard_size="40KB")
    write_logits(model, out, device=rt.device, main=rt.is_main)


def accelerate_route(out: Path, *, steps: int, resume: bool) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator()
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    if resume:
        accelerator.load_state(out / "state")
    for step, ids in enumerate(rows(steps).split(1), start=1):
        if resume and step <= STEPS:
            continue  # trained before the state was saved
        ids = ids.to(accelerator.device)
        labels, pos = ids.clone(), torch.arange(SEQ, device=ids.device)[None]
        shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        with accelerator.maybe_context_parallel(buffers=[ids, shift, pos], buffer_seq_dims=[1, 1, 1],
                                                no_restore_buffers={ids, shift, pos}):
            loss = model(input_ids=ids, position_ids=pos, shift_labels=shift, labels=shift).loss
            accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == STEPS and not resume:
            accelerator.save_state(out / "state")
    accelerator.save_model(model, out / "model")
    accelerator.unwrap_model(model).save_pretrained(out / "unwrapped", is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save,
                                                    state_dict=accelerator.get_state_dict(model))
    state = accelerator.get_state_dict(model)  # gathered on every rank, saved by the main process alone
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(out / "main-only", state_dict=state)
    accelerator.wait_for_everyone()
    write_logits(model, out, device=accelerator.device, main=accelerator.is_main_process)


class Rows(torch.utils.data.Dataset):
    def __init__(self, count: int):
        self.ids = rows(count)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index].clone()}


def trainer_route(out: Path, *, steps: int, resume: bool) -> None:
    from transformers import Trainer, TrainingArguments

    common = dict(output_dir=str(out / "run"), per_device_train_batch_size=1, max_steps=steps, learning_rate=1e-2,
                  lr_scheduler_type="constant", logging_steps=1, save_strategy="steps", save_steps=STEPS,
                  report_to=[], use_cpu=not torch.cuda.is_available(), seed=0)
    trainer = Trainer(model=tiny_llama(), args=TrainingArguments(**common), train_dataset=Rows(2 * STEPS))
    trainer.train(resume_from_checkpoint=str(out / "run" / f"checkpoint-{STEPS}") if resume else None)
    trainer.save_model(str(out / "model"))
    write_logits(trainer.model, out, device=trainer.args.device, main=trainer.is_world_process_zero())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("route", choices=["runtime", "accelerate", "trainer"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=STEPS, help="trainer, accelerate: steps in all (a checkpoint at 2)")
    parser.add_argument("--resume", action="store_true", help="trainer, accelerate: train on from the step-2 checkpoint")
    parser.add_argument("--into", type=Path, default=None, help="runtime: save here instead of OUT/model")
    parser.add_argument("--main-only", action="store_true", help="runtime: save under `if rt.is_main:` (a mistake)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.route == "runtime":
        runtime_route(args.out, into=args.into, main_only=args.main_only)
    elif args.route == "accelerate":
        accelerate_route(args.out, steps=args.steps, resume=args.resume)
    else:
        trainer_route(args.out, steps=args.steps, resume=args.resume)
    print(f"saved on rank {os.environ.get('RANK', '0')}")


if __name__ == "__main__":
    main()
