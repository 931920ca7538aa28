"""Scripts written for accelerate run unmodified under `cpctl launch --script-api accelerate`.

scripts/accelerate_cp.py is the loop of accelerate's context-parallelism guide (an Accelerator
that reads its sizes from the environment, FSDP2 through `prepare`, the script's own
`shift_labels`, each step inside `accelerator.maybe_context_parallel`). Launched with cp 2 on
cpctl's engine (CPU, gloo) its per-step losses must be the one-process losses; a run with lr 0
shows those losses move far more than the tolerance, so a wrong gradient could not match. The
layouts run in the session's pools (tests/pool.py: accelerate's variables and cpctl's shim as the
launcher gives them); accelerate's own command line, and the docs' loop, are real launches.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from launching import (REPO, TIMEOUT, cpctl, finish, launch_env, launch_once, plain_losses, probed, probed_env,
                       start_plain, start_python, started, tiered)
from pool import Pools

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = REPO / "scripts" / "accelerate_cp.py"
TRAINER = REPO / "scripts" / "trainer_cp.py"
ARGS = ("--steps", "4", "--seq-len", "64", "--batch", "2")
TOLERANCE = 1e-4
CP2 = ("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", "--script-api", "accelerate")

LAYOUTS = {
    "cp2": (CP2, ()),
    # cpctl's checkpointing at the selective level, under accelerate's prepare; the other strategy
    "cp2-alltoall-checkpointing": ((*CP2, "--cp-comm-strategy", "alltoall", "--activation-checkpointing", "true",
                                    "--checkpoint-level", "selective"), ()),
    # a sliding window (24 tokens, shards of 32): accelerate's own path refuses such a model
    "cp2-window": (CP2, ("--sliding-window", "24")),
    # accelerate launch's command line, with only the launcher's name changed: no --script-api
    # (the source builds an Accelerator), accelerate's flags with their meaning
    "accelerate-flags": (("--cpu", "--num_processes", "2", "--parallelism_config_cp_size", "2", "--use_fsdp",
                          "--fsdp_version", "2", "--mixed_precision", "no"), ()),
    # Ulysses on 2 processes: each holds half the heads of the whole sequence in attention
    "sp2": (("--device", "cpu", "--nproc-per-node", "2", "--sp-size", "2", "--script-api", "accelerate"), ()),
    # Ulysses x ring on 4 processes: the profile's sizes reach an unmodified ParallelismConfig() ...
    "sp2-cp2": (("--device", "cpu", "--nproc-per-node", "4", "--cp-size", "2", "--sp-size", "2",
                 "--script-api", "accelerate"), ()),
    # ... and a script that asks accelerate for sp itself (DeepSpeed's, in accelerate) runs on cpctl's
    "sp2-dp2-script": (("--device", "cpu", "--nproc-per-node", "4", "--sp-size", "2", "--script-api", "accelerate"),
                       (), ("--sp-size", "2")),
}
# processes, and tokens per process of the 64-token rows: each sequence split over cp x sp ranks
SPLIT = {"sp2": (2, 32), "sp2-cp2": (4, 16), "sp2-dp2-script": (4, 32)}


def plain_run(tmp: Path, *extra: str) -> list[float]:
    return plain_losses(SCRIPT, *ARGS, *extra, tmp_path=tmp)["losses"]


def launch_layout(tmp: Path, layout: str, *, references: Callable[..., Callable[[], dict]], pools: Pools) -> dict:
    """The layout's run: in the session's pool of its process count (tests/pool.py: the profile and
    the route `cpctl launch` would give it), or, for accelerate's own command line, a real launch."""
    flags, script_args, *launched_only = LAYOUTS[layout]  # launched_only: not for the one-process reference
    reference = references(*script_args)  # started beside the first layout that needs it
    out = tmp / "losses.json"
    args = (*ARGS, *script_args, *(launched_only or [()])[0], "--losses-out", str(out))
    if "--script-api" in flags:
        pools.run(SCRIPT, *args, flags=flags, cwd=tmp)
    else:
        code, stdout, stderr = finish(cpctl(*flags, str(SCRIPT), *args, tmp_path=tmp))
        if code != 0 or not out.exists():
            pytest.fail(f"cpctl launch {layout} exited {code}:\n{stdout}\n{stderr}")
    return {"run": json.loads(out.read_text()), "reference": reference()["losses"]}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, pools: Pools):
    # one one-process reference per script arguments: most layouts are compared with the same run
    references = launch_once(tmp_path_factory, "reference",
                             lambda tmp, *args: functools.cache(start_plain(SCRIPT, *ARGS, *args, tmp_path=tmp)))
    return launch_once(tmp_path_factory, "accelerate",
                       functools.partial(launch_layout, references=references, pools=pools))


# the guide's loop in both tiers with Ulysses under accelerate's prepare on 2 processes (the docs
# loop runs accelerate at cp 2; 2D on 4 processes in the full tier); its flags are read in
# test_accelerate_flags' dry runs
@pytest.mark.parametrize("layout", tiered(LAYOUTS, quick={"sp2"}))
def test_the_guide_loop_under_cp_gives_the_one_process_losses(launched, layout: str) -> None:
    result = launched(layout)
    run, reference = result["run"], result["reference"]
    # each process with its part of the sequence: CP, not copies of a one-process job (same losses)
    assert (run["world"], run["local_tokens"]) == SPLIT.get(layout, (2, 32)) and len(run["losses"]) == len(reference) == 4
    for step, (got, want) in enumerate(zip(run["losses"], reference)):
        assert abs(got - want) <= TOLERANCE, f"step {step}: {got} vs {want} (all: {run['losses']})"


@pytest.mark.full
def test_the_reference_trains(launched, tmp_path: Path) -> None:
    trained, frozen = launched("cp2")["reference"], plain_run(tmp_path, "--lr", "0")
    assert trained[0] == frozen[0]
    assert all(abs(a - b) > 100 * TOLERANCE for a, b in zip(trained[1:], frozen[1:]))


@pytest.mark.full  # run_clm's Trainer runs in the quick tier (test_trainer.py)
def test_a_trainer_under_cp_gives_the_one_process_losses(tmp_path: Path, pools: Pools) -> None:
    """The transformers Trainer shards through accelerator.maybe_context_parallel (cpctl's engine
    here) and normalizes the loss by its own global token count, which cpctl checks."""
    plain = tmp_path / "plain"
    plain.mkdir()
    reference = start_plain(TRAINER, tmp_path=plain)
    out = tmp_path / "cp.json"
    pools.run(TRAINER, "--losses-out", str(out), flags=CP2, cwd=tmp_path)
    run = json.loads(out.read_text())
    one_process = reference()
    reference = one_process["losses"]
    assert abs(run["eval_loss"] - one_process["eval_loss"]) <= TOLERANCE
    assert run["world"] == 2 and len(run["losses"]) == len(reference) == 4
    assert len(set(reference)) == 4  # it trains
    for step, (got, want) in enumerate(zip(run["losses"], reference)):
        assert abs(got - want) <= TOLERANCE, f"step {step}: {got} vs {want}"


@pytest.mark.full
def test_evaluating_before_training_is_accelerates_one_line_as_on_gpus(tmp_path: Path, pools: Pools) -> None:
    """On the CPU the model is FSDP2's, as on GPUs, and transformers' evaluate() before train()
    then meets accelerate's own FSDP2 rule on every rank (which the launcher shows as one line,
    test_launch.py), the same on a laptop and on GPUs."""
    outcome = pools[2].attempt(TRAINER, "--evaluate-first", flags=CP2, cwd=tmp_path)
    last_lines = [(failure or "").strip().splitlines()[-1:] for failure in outcome.failures]
    assert all(line and line[0].startswith("ValueError: When using FSDP2, a model and optimizer must be passed together")
               for line in last_lines), outcome.report() or "the job did not fail"


@pytest.mark.full
def test_a_model_prepared_twice_is_adopted_once(tmp_path: Path, pools: Pools) -> None:
    """prepare(model, optimizer), then prepare_model(model) again: cpctl prepares it once."""
    script = tmp_path / "twice.py"
    script.write_text(
        "import copy, sys, torch\n"
        "from accelerate import Accelerator\nfrom accelerate.utils import ParallelismConfig\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "torch.manual_seed(0)\n"
        "config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
        "                     num_attention_heads=4, num_key_value_heads=2, attn_implementation='sdpa', use_cache=False)\n"
        "model = LlamaForCausalLM(config)\n"
        "ids = torch.randint(128, (2, 64), generator=torch.Generator().manual_seed(1))\n"
        "want = copy.deepcopy(model)(input_ids=ids, labels=ids).loss.item()\n"
        "accelerator = Accelerator(parallelism_config=ParallelismConfig())\n"
        "model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "model = accelerator.prepare_model(model)\n"  # as the Trainer does to evaluate (prepare(model) alone: accelerate's FSDP2 refuses)
        "labels = ids.clone()\n"
        "with accelerator.maybe_context_parallel(buffers=[ids, labels], buffer_seq_dims=[1, 1],\n"
        "                                        no_restore_buffers={ids, labels}):\n"
        "    got = model(input_ids=ids, labels=labels).loss\n"
        "    accelerator.backward(got)\n"
        "assert abs(got.item() - want) < 1e-5, (got.item(), want)\n"
        "accelerator.print('same loss', got.item())\n")
    printed = pools.run(script, flags=CP2, cwd=tmp_path)
    assert "same loss" in printed[0]


TRAINER_MISTAKES = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, index):
        ids = (torch.arange(32) + index) % 64
        return {"input_ids": ids, "labels": ids.clone()}
class OwnLoss(Trainer):  # a loss written for whole sequences: shifted here, averaged here
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return (loss, logits) if return_outputs else loss
mistake = sys.argv[1]
args = TrainingArguments(output_dir="run", max_steps=1, per_device_train_batch_size=1, report_to=[], use_cpu=True,
                         label_smoothing_factor=0.1 if mistake == "label_smoothing" else 0.0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, use_cache=False)).eval()
# .eval(): as from_pretrained returns it; the Trainer switches it to training inside the first step
(OwnLoss if mistake == "own_loss" else Trainer)(model=model, args=args, train_dataset=Rows()).train()
"""
TRAINER_REFUSALS = {
    "label_smoothing": ["label_smoothing_factor 0.1 under context parallelism", "set label_smoothing_factor=0"],
    "own_loss": ["OwnLoss.compute_loss computed the training loss without Trainer.compute_loss",
                 "return super().compute_loss("],
}


@pytest.mark.parametrize("mistake", TRAINER_REFUSALS)
def test_a_trainer_loss_that_would_be_one_shards_is_refused(tmp_path: Path, pools: Pools, mistake: str) -> None:
    """Label smoothing (the Trainer's smoother shifts and averages each shard's labels itself) and a
    compute_loss override that computes its own loss from a shard: both were silently not one
    process's losses; each is refused on every rank before the first update."""
    script = tmp_path / "mistake.py"
    script.write_text(TRAINER_MISTAKES)
    for line in pools[2].attempt(script, mistake, flags=CP2, cwd=tmp_path).refusals():
        assert all(fragment in line for fragment in TRAINER_REFUSALS[mistake]), line


SCHEDULED = """
import json, sys, torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, use_cache=False))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / 4))  # to 0 in 4 steps
accelerator = Accelerator()
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
rates, losses = [], []
generator = torch.Generator().manual_seed(1)
for _ in range(3):
    ids = torch.randint(64, (1, 32), generator=generator).to(accelerator.device)
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    with accelerator.maybe_context_parallel(buffers=[ids, labels], buffer_seq_dims=[1, 1], no_restore_buffers={ids, labels}):
        loss = model(input_ids=ids, labels=labels, shift_labels=labels).loss
        accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    rates.append(scheduler.get_last_lr()[0])
    losses.append(loss.item())
if accelerator.is_main_process:
    json.dump({"rates": rates, "losses": losses}, open(sys.argv[1], "w"))
"""


def test_a_prepared_scheduler_follows_one_process_schedule(tmp_path: Path, pools: Pools) -> None:
    """accelerate steps a prepared scheduler once per process (each its own batch); the CP ranks of
    a group share theirs, so under CP it stepped twice as fast as one process: now once per batch."""
    script = tmp_path / "scheduled.py"
    script.write_text(SCHEDULED)
    one_process = start_python(str(script), str(tmp_path / "one.json"), cwd=tmp_path)
    pools.run(script, str(tmp_path / "cp.json"), flags=CP2, cwd=tmp_path)
    one_process()
    one, cp = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "cp"))
    assert one["rates"] == pytest.approx([0.0075, 0.005, 0.0025]) and cp["rates"] == pytest.approx(one["rates"]), (cp, one)
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(cp["losses"], one["losses"])), (cp, one)


def test_the_dry_run_shows_what_accelerate_is_told(tmp_path: Path) -> None:
    code, out, err = finish(cpctl(*CP2, "--dry-run", str(SCRIPT), tmp_path=tmp_path))
    assert code == 0, out + err
    assert "What accelerate is told" in out
    for line in ("PARALLELISM_CONFIG_CP_SIZE", "FSDP_VERSION", "ACCELERATE_USE_PARALLELISM_CONFIG"):
        assert line in out
    assert "cpctl's engine behind accelerate's maybe_context_parallel" in out
    assert "--module -- cpctl.integrations.accelerate_shim" in out


SET_TWICE = {
    "sizes": ("ParallelismConfig(dp_shard_size=2, cp_size=1)",
              "the script's ParallelismConfig sets dp_shard_size 2 (profile: 1), cp_size 1 (profile: 2)"),
    # on the CPU this used to be preempted by accelerate's "covers 1 processes"
    "cp_size": ("ParallelismConfig(cp_size=1)", "the script's ParallelismConfig sets cp_size 1 (profile: 2)"),
    "strategy": ("ParallelismConfig(cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy='alltoall'))",
                 "the script's ParallelismConfig sets cp_comm_strategy alltoall (profile: allgather)"),
    "precision": ("ParallelismConfig(), mixed_precision='bf16'",
                  "the script's Accelerator sets mixed_precision='bf16' (profile: fsdp.mixed_precision no)"),
}


@pytest.mark.full
@pytest.mark.parametrize("case", SET_TWICE)
def test_what_the_script_and_the_launch_both_set_must_agree(tmp_path: Path, pools: Pools, case: str) -> None:
    built, message = SET_TWICE[case]
    script = tmp_path / "own_sizes.py"
    script.write_text("from accelerate import Accelerator\n"
                      "from accelerate.utils import ParallelismConfig, TorchContextParallelConfig\n"
                      f"Accelerator(parallelism_config={built})\n")
    for line in pools[2].attempt(script, flags=CP2, cwd=tmp_path).refusals():
        assert message in line and "in one place" in line.split(message)[1], line


@pytest.mark.full
def test_sp_asked_in_the_script_only_is_said_before_accelerate_builds_its_mesh(tmp_path: Path) -> None:
    """A mesh of 4 on 2 processes, which accelerate would fail to build in its own words."""
    script = tmp_path / "own_sp.py"
    script.write_text("from accelerate import Accelerator\nfrom accelerate.utils import ParallelismConfig\n"
                      "Accelerator(parallelism_config=ParallelismConfig(sp_size=2))\n")
    code, out, err = finish(cpctl(*CP2, str(script), tmp_path=tmp_path))
    assert code == 1 and "the script's ParallelismConfig sets sp_size 2 (profile: 1)" in err, out + err
    assert "Traceback" not in err


@pytest.mark.parametrize(("flags", "fragment"), [
    (("--cp-engine", "native"), "needs CUDA; set cp_engine: cpctl to run on cpu"),
    (("--cp-engine", "native", "--device", "cuda", "--nproc-per-node", "2", "--script-api", "cpctl"),
     "a cpctl script always runs on cpctl's engine"),
    (("--nproc-per-node", "4", "--tp-size", "2"), "tp_size 2 with launch.script_api: accelerate"),
    (("--cp-engine", "native", "--device", "cuda", "--nproc-per-node", "4", "--sp-size", "2"),
     "sp_size 2 with cp_engine: native: PyTorch's context_parallel has no Ulysses"),
    (("--nproc-per-node", "4", "--dp-replicate-size", "2"), "accelerate's ParallelismConfig refuses this layout"),
])
def test_what_accelerate_cannot_run_is_one_line_before_any_worker(tmp_path: Path, flags, fragment) -> None:
    code, out, err = finish(cpctl(*CP2, *flags, "--dry-run", str(SCRIPT), tmp_path=tmp_path))
    assert code == 2, out + err
    assert fragment in err and len(err.strip().splitlines()) == 1, err


def test_check_says_whether_accelerate_and_transformers_are_known(tmp_path: Path) -> None:
    from cpctl.versions import KNOWN_ACCELERATE, is_known
    from cpctl.launch.envinfo import run_checks

    assert is_known("1.15.2", KNOWN_ACCELERATE) and not is_known("1.16.0", KNOWN_ACCELERATE)
    assert not is_known("11.5.0", KNOWN_ACCELERATE)
    flags = {"launch.device": "cpu", "launch.nproc_per_node": "2", "parallelism.cp_size": "2",
             "launch.script_api": "accelerate"}
    _, checks = run_checks(flags=flags, static=True, environ={}, cwd=tmp_path)
    by_name = {check.name: check for check in checks}
    assert by_name["accelerate"].ok and "a release cpctl knows" in by_name["accelerate"].detail
    assert by_name["transformers"].ok


# ------------------------------------------------------------------ accelerate's own examples

ND = REPO / "tests" / "workers" / "nd_parallel"  # nd_parallel.py, nd_parallel_trainer.py, configs/cp.yaml's copy
ON_THIS_CPU = ("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2")


@pytest.mark.full
def test_nd_parallel_with_its_cp_config_gives_the_one_process_losses(tmp_path: Path, tiny_hub: Path) -> None:
    """accelerate's nd_parallel.py under `cpctl launch --config configs/cp.yaml` (its sizes and
    precision overridden for this 2-core CPU): FSDP2 on the CPU as on GPUs, so `model.config`
    and `model.save_pretrained` work; 63-token rows padded to 64; the one-process losses."""
    script_args = ("--model-name", str(tiny_hub / "model"), "--sequence-length", "63", "--num-steps", "3",
                   "--precision", "fp32")
    # the script all-reduces its loss, so its one-process run needs a process group: a launch of one,
    # started beside the launch at cp 2 (both spend seconds importing)
    one_process = started(cpctl("--device", "cpu", "--nproc-per-node", "1", "--script-api", "accelerate",
                                str(ND / "nd_parallel.py"), *script_args, "--save-dir", str(tmp_path / "one"),
                                tmp_path=tmp_path))
    code, out, err = finish(cpctl("--config", str(ND / "cp.yaml"), *ON_THIS_CPU, "--mixed-precision", "no",
                                  str(ND / "nd_parallel.py"), "--cp-size", "2", *script_args,
                                  "--save-dir", str(tmp_path / "cp"), tmp_path=tmp_path, env=probed_env(tmp_path)))
    assert code == 0, out + err
    code, out, err = finish(one_process)
    assert code == 0, out + err
    one, cp = (json.loads((tmp_path / run / "losses.json").read_text()) for run in ("one", "cp"))
    assert cp["world"] == 2 and len(cp["losses"]) == len(one["losses"]) == 3 and len(set(one["losses"])) == 3
    assert max(abs(a - b) for a, b in zip(cp["losses"], one["losses"])) <= 1e-5, (cp, one)
    saved = tmp_path / "cp" / "model"
    assert (saved / "config.json").exists() and (saved / "model.safetensors").exists()
    from safetensors.torch import load_file

    weights = load_file(saved / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape == (64, 32)  # whole, not a shard; names without wrappers
    for rank in probed(tmp_path):
        assert rank["cp_size"] == 2 and {(s["length"], s["padded"], s["local"]) for s in rank["steps"]} == {(63, 64, 32)}


@pytest.mark.full
def test_nd_parallel_trainer_and_its_bf16(tmp_path: Path, tiny_hub: Path) -> None:
    """nd_parallel_trainer.py hard-codes bf16=True in its TrainingArguments. configs/cp.yaml says
    bf16 too, so it trains in bf16 on the CPU (under CP); a launch in fp32 names both in one line."""
    script_args = (str(ND / "nd_parallel_trainer.py"), "--model-name", str(tiny_hub / "model"), "--sequence-length",
                   "63", "--max-steps", "2", "--save-dir", str(tmp_path / "out"))
    code, out, err = finish(cpctl(*CP2, *script_args, tmp_path=tmp_path))
    assert code == 1, out + err
    assert "the script's TrainingArguments set bf16=True (profile: fsdp.mixed_precision no)" in err
    assert "--mixed-precision bf16" in err and "Traceback" not in err
    code, out, err = finish(cpctl("--config", str(ND / "cp.yaml"), *ON_THIS_CPU, *script_args, tmp_path=tmp_path,
                                  env=probed_env(tmp_path)))
    assert code == 0, out + err
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1, 2]
    for rank in probed(tmp_path):
        assert rank["cp_size"] == 2 and len(rank["steps"]) == 2 and set(rank["attention_q_lens"]) == {32}


def test_an_accelerate_config_file_is_read_or_refused_by_name(tmp_path: Path) -> None:
    """`cpctl launch --config` and `cpctl config --from-accelerate` read the file `accelerate config`
    writes; what cpctl cannot honour is named in one line."""
    code, out, err = finish(cpctl("--config", str(ND / "cp.yaml"), "--dry-run", str(SCRIPT), tmp_path=tmp_path))
    assert code == 0, out + err
    rows = {cells[0].strip(): (cells[1].strip(), cells[2].strip()) for cells in
            (line.split("│") for line in out.splitlines()) if len(cells) == 3}
    for key, value in (("parallelism.cp_size", "8"), ("fsdp.mixed_precision", "bf16"), ("launch.nproc_per_node", "8"),
                       ("fsdp.activation_checkpointing", "true"), ("launch.script_api", "accelerate")):
        assert rows[key][0] == value and rows[key][1].startswith("--config"), (key, rows[key])
    written = tmp_path / "profile.yaml"
    proc = subprocess.run([sys.executable, "-m", "cpctl.launch.cli", "config", "--from-accelerate", str(ND / "cp.yaml"),
                           "--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", "--yes", "--output",
                           str(written)], cwd=tmp_path, env=launch_env(tmp_path), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    profile = yaml.safe_load(written.read_text())
    assert profile["parallelism"]["cp_size"] == 2 and profile["fsdp"]["mixed_precision"] == "bf16"
    assert profile["launch"]["script_api"] == "accelerate" and profile["fsdp"]["activation_checkpointing"] is True
    deepspeed = tmp_path / "zero3.yaml"
    deepspeed.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 2\n")
    code, out, err = finish(cpctl("--config", str(deepspeed), "--dry-run", str(SCRIPT), tmp_path=tmp_path))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "distributed_type: DEEPSPEED: cpctl shards with FSDP2" in err


GUIDE_SNIPPET = """\
import torch
from accelerate import Accelerator
from accelerate.utils import ParallelismConfig
from transformers import LlamaConfig, LlamaForCausalLM

accelerator = Accelerator(parallelism_config=ParallelismConfig())
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, use_cache=False))
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(128, (2, 64), generator=torch.Generator().manual_seed(0))
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
with accelerator.maybe_context_parallel(
    buffers=[batch["input_ids"], batch["attention_mask"]],
    buffer_seq_dims=[1, 1],
    no_restore_buffers={batch["input_ids"], batch["labels"]},
):
    outputs = model(**batch)
"""


@pytest.mark.full
def test_the_guides_snippet_is_one_line(tmp_path: Path, pools: Pools) -> None:
    """accelerate's guide names labels in no_restore_buffers without sharding them: refused on
    every rank, naming the fix."""
    snippet = tmp_path / "guide_snippet.py"
    snippet.write_text(GUIDE_SNIPPET)
    for line in pools[2].attempt(snippet, flags=CP2, cwd=tmp_path).refusals():
        assert "no_restore_buffers must be a subset of buffers" in line and "add it to buffers" in line, line


def test_the_docs_loop_runs_as_printed(tmp_path: Path) -> None:
    """docs/accelerate.md's version of the guide's loop, under cpctl launch with accelerate's API."""
    docs = (REPO / "docs" / "accelerate.md").read_text()
    block = docs.split("<!-- guide-loop -->\n```python\n")[1].split("```\n<!-- /guide-loop -->")[0]
    printed = tmp_path / "guide_loop.py"
    printed.write_text(block)
    code, out, err = finish(cpctl(*CP2, str(printed), tmp_path=tmp_path, env=probed_env(tmp_path)))
    assert code == 0, out + err
    assert "[rank0]: step 2: loss" in out
    for rank in probed(tmp_path):
        assert [(s["length"], s["padded"]) for s in rank["steps"]] == [(63, 64)] * 3
