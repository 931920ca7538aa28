"""`cpctl config`: the real questionary prompts, driven through prompt_toolkit's pipe input.

Keys: "\r" Enter, "\x15" Ctrl-U (clears a text prompt's pre-filled default), "\x1b[B" arrow
down, "\x03" Ctrl-C; a confirm answers on "y"/"n" alone. The machine is pinned (no GPU unless
a test says otherwise) so the defaults do not depend on the host.
"""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path

import pytest
import yaml
from prompt_toolkit.application import create_app_session
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from cpctl import config as prof
from cpctl.errors import CpctlError
from cpctl.launch.wizard import cross_check, run_config
from launching import REPO
from test_profile import resolve_apart

CPU = prof.Machine(cuda_devices=0)
GPU8 = prof.Machine(cuda_devices=8)
ENTER, DOWN, CLEAR, CTRL_C = "\r", "\x1b[B", "\x15", "\x03"
# script api, device, nnodes, nproc, cp, tp, dp_replicate, dp_shard, strategy, load balance, precision,
# checkpointing, memory options (the yes/no in front of them)
QUESTIONS = 14
# with cp_size 1, the default, strategy and load balance are not asked
QUESTIONS_WITHOUT_CP = QUESTIONS - 2


def typed(text: str) -> str:
    """Replace a text prompt's default with `text` and press Enter."""
    return CLEAR + text + ENTER


def drive(keys: str, *, output: Path, flags: dict[str, str] | None = None,
          machine: prof.Machine = CPU) -> tuple[int, str]:
    console = Console(file=io.StringIO(), width=120)
    with create_pipe_input() as inp, create_app_session(input=inp, output=DummyOutput()):
        inp.send_text(keys)
        inp.close()  # input that runs out ends the wizard (EOFError -> 1) instead of hanging the test
        code = run_config(output=output, assume_yes=False, flags=flags or {}, console=console,
                          interactive=True, machine=machine)
    return code, console.file.getvalue()


def run_yes(*, output: Path, flags: dict[str, str] | None = None, machine: prof.Machine = CPU,
            presets: dict[str, str] | None = None) -> tuple[int, str]:
    console = Console(file=io.StringIO(), width=120)
    code = run_config(output=output, assume_yes=True, flags=flags or {}, console=console, machine=machine,
                      presets=presets)
    return code, console.file.getvalue()


def resolved(path: Path, machine: prof.Machine = CPU) -> prof.Profile:
    """What `cpctl launch --config path` resolves the written file to, away from this host's env."""
    empty = path.parent / "empty"
    empty.mkdir(exist_ok=True)
    return resolve_apart(empty, config=path, machine=machine).profile


def test_defaults_only_write_a_profile_that_resolves(tmp_path):
    out = tmp_path / "cpctl.yaml"
    code, shown = drive(ENTER * QUESTIONS_WITHOUT_CP, output=out)
    assert code == 0
    assert out.read_text().startswith("# cpctl profile written by `cpctl config`")
    got = resolved(out)
    assert (got.launch.device, got.launch.nproc_per_node, got.world_size) == ("cpu", 2, 2)
    # the same default as the profile's everywhere: no CP unless asked for
    assert (got.parallelism.cp_size, got.parallelism.dp_shard_size) == (1, 2)
    # dp_shard_size and nproc_per_node are written as auto, not the 2 they come to here: the profile
    # still fits one process, and takes the GPUs of a machine that has them
    written = yaml.safe_load(out.read_text())
    assert written["parallelism"]["dp_shard_size"] == "auto" and written["launch"]["nproc_per_node"] == "auto"
    assert resolved(out, GPU8).launch.nproc_per_node == 8
    one = resolve_apart(tmp_path / "empty", config=out, machine=CPU, flags={"launch.nproc_per_node": 1}).profile
    assert one.parallelism.dp_shard_size == 1
    assert got.parallelism.cp_comm_strategy == "allgather" and got.parallelism.cp_load_balance
    assert got.fsdp.mixed_precision == "no" and not got.fsdp.activation_checkpointing
    assert "parallelism.cp_size" in shown and f"cpctl launch --config {out} your_script.py" in shown


def test_custom_answers_are_written(tmp_path):
    out = tmp_path / "p.yaml"
    keys = (ENTER + ENTER + ENTER + typed("4")  # the script's API read at launch, device auto, 1 machine, 4 processes
            + typed("2") + ENTER * 3            # cp 2, sp 1, tp 1, dp_replicate 1
            + ENTER                             # dp_shard: auto, 4 / (1 * 2 * 1) = 2
            + DOWN + ENTER                      # alltoall
            + "n" + DOWN + ENTER + "y"          # no load balance, bf16, checkpointing
            + DOWN + ENTER                      # the selective level
            + "y" + typed("2048") + typed("16") + typed("32"))  # memory options: loss chunks of 2048, MLP tiles of 16, norm tiles of 32
    code, _ = drive(keys, output=out)
    assert code == 0
    written = yaml.safe_load(out.read_text())
    assert resolved(out).parallelism.dp_shard_size == 2
    assert written["parallelism"] == {"dp_replicate_size": 1, "dp_shard_size": "auto", "cp_size": 2, "sp_size": 1,
                                      "tp_size": 1,
                                      "cp_comm_strategy": "alltoall", "cp_load_balance": False}
    assert written["fsdp"] == {"mixed_precision": "bf16", "activation_checkpointing": True}
    assert written["memory"] == {"checkpoint_level": "selective", "loss_chunk_tokens": 2048, "tiled_mlp_tokens": 16,
                                 "tiled_norm_tokens": 32}
    assert written["launch"] == {"device": "auto", "nnodes": 1, "nproc_per_node": 4, "script_api": "auto"}
    got = resolved(out)
    assert got.world_size == 4 and got.parallelism.dp_shard_size == 2


def test_memory_options_on_a_gpu_machine(tmp_path):
    out = tmp_path / "p.yaml"
    keys = (ENTER * 9                                # script api auto, device auto, 1 machine, 8 GPUs, cp/sp/tp/dp defaults
            + ENTER + "y" + ENTER                    # precision, checkpointing, the full level
            + "y" + ENTER + typed("8192") + typed("8192") + "y" + ENTER)  # memory: default chunks, MLP and norm tiles, offload, no cpu_offload
    code, shown = drive(keys, output=out, machine=GPU8)
    assert code == 0, shown
    written = yaml.safe_load(out.read_text())
    assert written["memory"] == {"checkpoint_level": "full", "loss_chunk_tokens": 4096, "tiled_mlp_tokens": 8192,
                                 "tiled_norm_tokens": 8192, "offload_activations": True, "cpu_offload": False}
    assert resolved(out, machine=GPU8).memory.offload_activations


def test_an_accelerate_script_is_asked_for_its_engine(tmp_path):
    out = tmp_path / "p.yaml"
    keys = (DOWN + DOWN + ENTER + ENTER + ENTER + ENTER    # accelerate, device auto, 1 machine, 2 processes
            + typed("2") + ENTER * 4                # cp 2, sp 1, tp 1, dp_replicate 1, dp_shard 1
            + ENTER + ENTER + ENTER                 # allgather, load balance, cpctl's engine
            + ENTER + ENTER + ENTER)                # precision, no checkpointing, no memory options
    code, shown = drive(keys, output=out)
    assert code == 0, shown
    written = yaml.safe_load(out.read_text())
    assert written["launch"]["script_api"] == "accelerate" and written["parallelism"]["cp_engine"] == "cpctl"
    got = resolved(out)
    assert (got.launch.script_api, got.parallelism.cp_engine, got.parallelism.cp_size) == ("accelerate", "cpctl", 2)


def test_bad_answers_are_asked_again(tmp_path):
    out = tmp_path / "p.yaml"
    keys = (ENTER + ENTER + ENTER + typed("4")
            + typed("3") + typed("0") + typed("two") + typed("2")   # cp 3 does not divide 4; 0, "two" are no sizes
            + ENTER + ENTER + ENTER                                 # sp 1, tp 1, dp_replicate 1
            + typed("1") + typed("2")                               # dp_shard 1: 1 * 1 * 2 * 1 != 4
            + ENTER * 5)
    code, _ = drive(keys, output=out)
    assert code == 0
    got = resolved(out)
    assert (got.parallelism.cp_size, got.parallelism.dp_shard_size, got.world_size) == (2, 2, 4)


def test_several_machines_ask_the_endpoint_and_leave_the_node_rank_to_each_launch(tmp_path):
    out = tmp_path / "p.yaml"
    keys = (ENTER + ENTER + typed("2")
            + ENTER + typed("node0:29500")              # an endpoint is required
            + ENTER + typed("2") + ENTER * (QUESTIONS - 4))  # 2 processes per machine, cp 2, the rest defaults
    code, shown = drive(keys, output=out)
    assert code == 0, shown
    where = ("on each of the 2 machines, R its node rank (0 on the one at node0:29500: it hosts the rendezvous and "
             "runs global rank 0)")
    assert (f"Launch {where}: cpctl launch --config {out} --node-rank R your_script.py") in " ".join(shown.split())
    assert f"# Launch {where}: cpctl launch --config {out} --node-rank R your_script.py" in out.read_text()
    # every machine launches this file: a node rank in it would be every machine's
    assert "node_rank" not in yaml.safe_load(out.read_text())["launch"]
    got = resolved(out)
    assert (got.launch.nnodes, got.launch.rdzv_endpoint) == (2, "node0:29500")
    assert (got.parallelism.cp_size, got.parallelism.dp_shard_size, got.world_size) == (2, 2, 4)


def test_flags_are_not_asked(tmp_path):
    out = tmp_path / "p.yaml"
    flags = {"launch.nproc_per_node": "4", "parallelism.cp_size": "4", "parallelism.cp_comm_strategy": "alltoall"}
    code, shown = drive(ENTER * (QUESTIONS - 3), output=out, flags=flags)
    assert code == 0 and "From flags" in shown
    got = resolved(out)
    assert (got.parallelism.cp_size, got.parallelism.dp_shard_size, got.parallelism.cp_comm_strategy) == (4, 1, "alltoall")


def test_device_choices_leave_out_what_the_flags_rule_out(tmp_path):
    out = tmp_path / "p.yaml"
    # 16 processes per machine but 8 GPUs: only cpu is offered, and Enter takes it.
    code, _ = drive(ENTER * (QUESTIONS_WITHOUT_CP - 1), output=out, flags={"launch.nproc_per_node": "16"}, machine=GPU8)
    assert code == 0
    assert resolved(out, GPU8).launch.device == "cpu"


def test_declined_overwrite_keeps_the_file(tmp_path):
    out = tmp_path / "cpctl.yaml"
    out.write_text("# mine\n")
    code, shown = drive(ENTER, output=out)   # the default is No
    assert code == 1 and out.read_text() == "# mine\n" and "nothing written" in shown


def test_accepted_overwrite_replaces_the_file(tmp_path):
    out = tmp_path / "cpctl.yaml"
    out.write_text("# mine\n")
    code, _ = drive("y" + ENTER * QUESTIONS_WITHOUT_CP, output=out)
    assert code == 0 and resolved(out).parallelism.cp_size == 1


def test_ctrl_c_exits_130_and_writes_nothing(tmp_path):
    out = tmp_path / "p.yaml"
    code, shown = drive(ENTER + ENTER + CTRL_C, output=out)
    assert code == 130 and not out.exists()
    assert shown.strip().splitlines() == ["Answers are checked as you go; Enter keeps the shown default.",
                                          "Interrupted; nothing written."]


def test_yes_takes_defaults_and_flags(tmp_path):
    out = tmp_path / "sub" / "p.yaml"
    code, shown = run_yes(output=out, flags={"parallelism.cp_size": "4", "fsdp.activation_checkpointing": "true"})
    assert code == 0 and "your_script.py" in shown
    got = resolved(out)
    # 2 processes cannot hold cp 4 on cpu: the default processes per machine grows to 4.
    assert (got.launch.nproc_per_node, got.parallelism.cp_size, got.parallelism.dp_shard_size) == (4, 4, 1)
    assert got.fsdp.activation_checkpointing


def test_yes_defaults_on_a_gpu_machine_use_every_gpu(tmp_path):
    out = tmp_path / "p.yaml"
    assert run_yes(output=out, machine=GPU8)[0] == 0
    got = resolved(out, GPU8)
    assert (got.launch.device, got.launch.nproc_per_node, got.parallelism.cp_size) == ("cuda", 8, 1)
    assert got.fsdp.mixed_precision == "bf16"


@pytest.mark.parametrize(("flags", "message"), [
    ({"parallelism.cp_size": "x"}, "flag --cp-size: 'x' is not allowed for parallelism.cp_size"),
    ({"parallelism.cp_comm_strategy": "ring"}, "expected allgather or alltoall"),
    ({"fsdp.version": "1", "parallelism.cp_size": "2"}, "fsdp.version: 1 with cp_size 2; context parallelism needs fsdp.version: 2"),
    ({"launch.nproc_per_node": "4", "parallelism.cp_size": "3"}, "cp(3) * tp(1) = 3 does not divide world size 4"),
    ({"launch.nnodes": "2"}, "2 machines need a rendezvous; pass --rdzv-endpoint HOST:PORT"),
    ({"launch.device": "cuda"}, "pass --nproc-per-node"),
])
def test_yes_with_bad_flags_raises_and_writes_nothing(tmp_path, flags, message):
    out = tmp_path / "p.yaml"
    with pytest.raises(CpctlError) as info:
        run_yes(output=out, flags=flags)
    assert message in str(info.value)
    assert not out.exists()


def test_a_node_rank_is_given_at_launch_not_written(tmp_path):
    out = tmp_path / "p.yaml"
    flags = {"launch.nnodes": "2", "launch.node_rank": "1", "launch.rdzv_endpoint": "node0:29500"}
    with pytest.raises(CpctlError) as info:
        run_yes(output=out, flags=flags)
    assert str(info.value) == ("--node-rank: a profile is shared by every machine, and each machine has its own node "
                               f"rank; give it at launch: cpctl launch --config {out} --node-rank R your_script.py")
    assert not out.exists()
    # accelerate's config file is one machine's: its machine_rank stays out of the profile every machine shares
    code, _ = run_yes(output=out, flags={}, presets={"launch.nnodes": "2", "launch.node_rank": "1",
                                                    "launch.rdzv_endpoint": "node0:29500"})
    assert code == 0 and "node_rank" not in yaml.safe_load(out.read_text())["launch"]


def test_a_mistake_reads_the_same_from_config_and_launch(tmp_path):
    # one list of rules: `config --yes` and `launch`/`check` say the same, and blame what was set
    flags = {"launch.nproc_per_node": "2", "parallelism.cp_size": "3"}
    with pytest.raises(CpctlError) as from_config:
        run_yes(output=tmp_path / "p.yaml", flags=flags)
    with pytest.raises(CpctlError) as from_launch:
        resolve_apart(tmp_path, flags=flags)
    expected = "dp_replicate(1) * cp(3) * tp(1) = 3 does not divide world size 2 (nnodes 1 x nproc_per_node 2)"
    assert expected in str(from_config.value) and expected in str(from_launch.value)
    assert "launch.nnodes" not in str(from_config.value)  # never set by the user: not blamed


def test_yes_never_overwrites(tmp_path):
    out = tmp_path / "cpctl.yaml"
    out.write_text("# mine\n")
    with pytest.raises(CpctlError, match="already exists; pass a new --output or delete the file"):
        run_yes(output=out)
    assert out.read_text() == "# mine\n"


def test_yes_never_replaces_a_link_even_one_to_nothing(tmp_path):
    out = tmp_path / "cpctl.yaml"
    out.symlink_to(tmp_path / "elsewhere.yaml")  # dangling: exists() says False
    with pytest.raises(CpctlError, match="already exists"):
        run_yes(output=out)
    assert out.is_symlink() and not (tmp_path / "elsewhere.yaml").exists()


def test_a_profile_for_a_gpu_machine_can_be_written_where_none_is_visible(tmp_path):
    out = tmp_path / "p.yaml"
    flags = {"launch.device": "cuda", "launch.nproc_per_node": "8", "parallelism.cp_size": "8"}
    assert run_yes(output=out, flags=flags, machine=CPU)[0] == 0
    assert resolved(out, GPU8).parallelism.cp_size == 8


def test_cross_check_names_every_factor():
    answers = {"launch.device": "cpu", "launch.nnodes": 1, "launch.nproc_per_node": 8,
               "parallelism.dp_replicate_size": 1, "parallelism.dp_shard_size": 2,
               "parallelism.cp_size": 2, "parallelism.tp_size": 1}
    assert cross_check(answers, machine=CPU) == (
        "dp_replicate(1) * dp_shard(2) * cp(2) * tp(1) = 4 != world size 8 (nnodes 1 x nproc_per_node 8); "
        "set dp_shard_size: 4 (or auto)")
    assert cross_check({**answers, "parallelism.dp_shard_size": 4}, machine=CPU) is None
    assert cross_check({**answers, "parallelism.dp_shard_size": "auto"}, machine=CPU) is None


def spawn_in_terminal(output: Path, *, columns: int = 120):
    """run_config in a child process on a real pseudo-terminal (stdin is a TTY: it asks)."""
    pexpect = pytest.importorskip("pexpect")
    driver = ("import sys; from pathlib import Path; from rich.console import Console; "
              "from cpctl.launch.wizard import run_config; "
              "sys.exit(run_config(output=Path(sys.argv[1]), assume_yes=False, flags={}, console=Console()))")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm"}
    return pexpect, pexpect.spawn(sys.executable, ["-c", driver, str(output)], cwd=str(REPO), env=env,
                                  encoding="utf-8", timeout=15, dimensions=(40, columns))


def test_enter_through_a_real_terminal(tmp_path):
    out = tmp_path / "cpctl.yaml"
    pexpect, child = spawn_in_terminal(out)
    try:
        for prompt, answer in (("The training script uses", ENTER), ("Device", ENTER), ("Machines", ENTER), ("Processes per machine", ENTER),
                               ("CP size", typed("2")), ("SP size", ENTER), ("TP size", ENTER), ("DP replicate", ENTER), ("DP shard", ENTER),
                               ("CP comm strategy", ENTER), ("Load balance", ENTER), ("Mixed precision", ENTER),
                               ("Activation checkpointing", ENTER), ("Long sequences", ENTER)):
            child.expect_exact(prompt)
            child.send(answer)
        child.expect_exact("Wrote")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    got = resolved(out)
    assert (got.parallelism.cp_size, got.world_size) == (2, 2)


def test_yes_says_where_a_value_it_chose_came_from(tmp_path):
    # --cp-size 4 on a 2-process default: the processes per machine grow, and the summary says why
    code, shown = run_yes(output=tmp_path / "p.yaml", flags={"parallelism.cp_size": "4"})
    assert code == 0
    assert "flag --cp-size" in shown and "auto if it fits the sizes" in shown


def test_input_that_ends_early_writes_nothing(tmp_path):
    out = tmp_path / "p.yaml"
    code, shown = drive(ENTER * 3, output=out)
    assert code == 1 and not out.exists() and "Input ended; nothing written." in shown


def test_cli_config_yes(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cpctl.launch.cli import app

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "x.yaml"
    result = CliRunner().invoke(app, ["config", "--yes", "--cp-size", "2", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "cpctl launch --config" in result.output
    assert resolved(out).parallelism.cp_size == 2


def test_cli_config_without_a_tty_takes_defaults_and_refuses_bad_flags(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cpctl.launch.cli import app

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "x.yaml"
    runner = CliRunner()
    # CliRunner's stdin is no terminal: no question is asked, as under --yes.
    assert runner.invoke(app, ["config", "--output", str(out)]).exit_code == 0
    assert resolved(out).world_size == 2
    again = runner.invoke(app, ["config", "--output", str(out)])
    assert again.exit_code == 2 and "already exists" in again.output
    bad = runner.invoke(app, ["config", "--cp-size", "3", "--nproc-per-node", "4", "--output", str(tmp_path / "y.yaml")])
    assert bad.exit_code == 2 and "cp(3) * tp(1) = 3 does not divide world size 4" in bad.output
    assert "Traceback" not in bad.output and not (tmp_path / "y.yaml").exists()


def answer_cp_size_with_defaults_before(child, answer: str) -> None:
    """Enter through the questions before the CP size, then type `answer` to it."""
    for prompt in ("The training script uses", "Device", "Machines", "Processes per machine"):
        child.expect_exact(prompt)
        child.send(ENTER)
    child.expect_exact("CP size")
    child.send(typed(answer))


def test_a_real_terminal_shows_why_an_answer_is_refused_and_ctrl_c_exits_130(tmp_path):
    out = tmp_path / "cpctl.yaml"
    pexpect, child = spawn_in_terminal(out)
    try:
        answer_cp_size_with_defaults_before(child, "3")
        child.expect_exact("cp(3) = 3 does not divide world size 2 (nnodes 1 x nproc_per_node 2)")
        child.send(CTRL_C)
        child.expect_exact("Interrupted; nothing written.")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 130 and not out.exists()


def on_screen(raw: str) -> str:
    """What a terminal shows of `raw`, run together: escape sequences and line breaks gone, each
    run of spaces one space (a line broken at a space and one cut there read apart)."""
    return " ".join(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x08", " ", raw).split())


def test_a_refusal_longer_than_the_terminal_is_wrapped_not_cut(tmp_path):
    # 60 columns: the reason is 138 characters, and its end is the fix
    reason = ("cp(3) = 3 does not divide world size 2 (nnodes 1 x nproc_per_node 2); choose sizes whose "
              "product divides 2 or change --nproc-per-node/--nnodes")
    pexpect, child = spawn_in_terminal(tmp_path / "cpctl.yaml", columns=60)
    try:
        answer_cp_size_with_defaults_before(child, "3")
        child.expect_exact("cp(3) = 3 does not divide")
        child.expect_exact("--nproc-per-node/--nnodes", timeout=5)  # cut at the width, it never comes
        shown = child.before + child.after
        child.send(CTRL_C)
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert on_screen("cp(3) = 3 does not divide" + shown).endswith(reason)
    # wrapped between words, each line within the terminal
    lines = [on_screen(line) for line in shown.split("\r\n")]
    assert len(lines) >= 3 and all(len(line) <= 60 for line in lines)
    assert "--nproc-per-node/--nnodes" in lines[-1]


def test_an_unwritable_output_is_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cpctl.launch.cli import app

    (tmp_path / "file").write_text("")  # a file where a directory should be
    result = CliRunner().invoke(app, ["config", "--yes", "--output", str(tmp_path / "file" / "cpctl.yaml")])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: --output ")
    assert "cannot write it" in result.stderr and "Traceback" not in result.output


def test_a_file_created_while_the_wizard_is_open_is_not_replaced(tmp_path, monkeypatch):
    out = tmp_path / "p.yaml"
    import cpctl.launch.wizard as wizard

    ask_all = wizard._ask_all

    def someone_writes_meanwhile(ask):
        ask_all(ask)
        out.write_text("# written by someone else meanwhile\n")

    monkeypatch.setattr(wizard, "_ask_all", someone_writes_meanwhile)
    with pytest.raises(CpctlError, match="appeared while the wizard was open; nothing written"):
        run_yes(output=out)
    assert out.read_text() == "# written by someone else meanwhile\n"


def test_a_partial_file_left_by_a_killed_run_is_cleaned_up(tmp_path):
    out = tmp_path / "p.yaml"
    stale = tmp_path / ".p.yaml.cpctl-partial.abc123"
    stale.write_text("half")
    assert run_yes(output=out)[0] == 0
    assert out.is_file() and not stale.exists()
