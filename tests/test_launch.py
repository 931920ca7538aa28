"""Real `cpctl launch` runs: the CLI in a subprocess, torchrun's agent, CPU workers.

Each launch costs an `import torch` (seconds on a small box), so there are few of them and the
worker (tests/workers/launch_probe.py) imports no torch: it writes one JSON file per rank with
what the launcher gave it (RANK, WORLD_SIZE, LOCAL_RANK, CPCTL_RESOLVED_PROFILE, its argv).
What a failure looks like is tested with tests/workers/failing_worker.py, which starts the
runtime (and so imports torch) before one rank fails.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from launching import REPO, TIMEOUT, cpctl, finish, launch_env

from cpctl.errors import CpctlError
from cpctl.launch import rendezvous
from cpctl.launch.launcher import check_cuda_devices

PROBE = REPO / "tests" / "workers" / "launch_probe.py"


def records(out_dir: Path) -> dict[int, dict]:
    return {int(path.stem.removeprefix("rank")): json.loads(path.read_text()) for path in out_dir.glob("rank*.json")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SCRIPT_ARGS = ["--extra", "7", "--nnodes", "3", "--log", "x"]  # `--log`: an abbreviation of torchrun's --log-dir


def test_two_cpu_workers_get_their_ranks_and_the_profile(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    # the probe reads the profile itself, without cpctl.init(): its API is named, or cp 2 would be refused
    code, out, err = finish(cpctl(
        "--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", "--cp-comm-strategy", "alltoall",
        "--script-api", "cpctl", str(PROBE), "--out", str(out_dir), *SCRIPT_ARGS, tmp_path=tmp_path,
    ))
    assert code == 0, out + err
    # before any worker's line: what the workers train in, and from where (on a CPU: no mixed precision)
    lines = err.splitlines()
    said = lines.index("cpctl: training in fp32 compute (fsdp.mixed_precision no, from auto (cpu)); "
                       "fp32 master weights and optimizer state")
    assert not any(line.startswith("[rank") for line in lines[:said]), err
    ranks = records(out_dir)
    assert sorted(ranks) == [0, 1]
    for rank, record in ranks.items():
        assert (record["world_size"], record["local_rank"]) == (2, rank)
        assert record["extra_args"] == SCRIPT_ARGS  # script args pass through untouched, torchrun's names too
        par = record["profile"]["parallelism"]
        assert (par["cp_size"], par["dp_shard_size"], par["cp_comm_strategy"]) == (2, 1, "alltoall")
        expected = {"device": "cpu", "nnodes": 1, "nproc_per_node": 2, "node_rank": 0, "rdzv_endpoint": None,
                    "max_restarts": 0}
        assert {key: record["profile"]["launch"].get(key) for key in expected} == expected
    # every line a worker prints is prefixed with its global rank
    assert "[rank0]: probe says hello (world 2)" in out and "[rank1]: probe says hello (world 2)" in out


def test_a_failing_worker_is_reported_and_its_code_passed_through(tmp_path: Path) -> None:
    # also the -m MODULE form: the probe run as a module from its own directory
    out_dir = tmp_path / "out"
    code, out, err = finish(cpctl(
        "--device", "cpu", "--nproc-per-node", "2", "-m", "launch_probe",
        "--out", str(out_dir), "--fail-rank", "1", "--fail-code", "3", tmp_path=tmp_path, cwd=PROBE.parent,
    ))
    assert code == 3, out + err
    assert sorted(records(out_dir)) == [0, 1]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: worker rank 1 (local rank 1, pid ") and "exited with code 3" in last
    assert "[rank1]: probe fails on purpose" in err
    assert "Traceback" not in out + err


@pytest.mark.full
def test_two_nodes_on_loopback(tmp_path: Path) -> None:
    # Node rank 1 starts first: c10d alone would make it global rank 0 (on one host it sorts the
    # machines by the launcher's pid). Each launch's workers write to a directory of their own.
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = {
        node_rank: cpctl("--nnodes", "2", "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint,
                         "--nproc-per-node", "2", "--device", "cpu", str(PROBE),
                         "--out", str(tmp_path / f"node{node_rank}"), tmp_path=tmp_path)
        for node_rank in (1, 0)
    }
    for node in nodes.values():
        code, out, err = finish(node)
        assert code == 0, out + err
    # global rank 0, which writes checkpoints and logs, runs on the launch given node rank 0
    ranks = {node_rank: records(tmp_path / f"node{node_rank}") for node_rank in nodes}
    assert {node_rank: sorted(ranks[node_rank]) for node_rank in nodes} == {0: [0, 1], 1: [2, 3]}
    every = [record for node in ranks.values() for record in node.values()]
    assert {record["world_size"] for record in every} == {4}
    assert all(record["local_rank"] == record["rank"] % 2 for record in every)
    assert {record["profile"]["launch"]["rdzv_endpoint"] for record in every} == {endpoint}


def test_machines_take_the_places_of_their_node_ranks() -> None:
    # machines in c10d's order; one given no node rank takes the lowest free place
    assert rendezvous.places([1, 0]) == [1, 0]
    assert rendezvous.places([None, 0, None]) == [1, 0, 2]
    assert rendezvous.places([None, None]) == [0, 1]  # none given: c10d's own order
    with pytest.raises(CpctlError, match=r"^a machine was given node rank 2, but 2 machines joined; give each "
                                         r"machine its own --node-rank, 0 to 1$"):
        rendezvous.places([2, 0])


def test_two_machines_given_one_node_rank_fail_the_rendezvous_in_one_line(tmp_path: Path) -> None:
    # cpctl's c10d rendezvous as the agents run it: two handlers joining on loopback, both given node rank 1
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    assert rendezvous.register()
    endpoint = f"127.0.0.1:{free_port()}"

    def join(is_host: str) -> BaseException | None:
        params = RendezvousParameters(rendezvous.BACKEND, endpoint, "same-node-rank", 2, 2, is_host=is_host,
                                      node_rank="1", join_timeout="60")
        handler = rendezvous_handler_registry.create_handler(params)
        try:
            handler.next_rendezvous()
        except RendezvousError as exc:
            return exc
        finally:
            handler.shutdown()
        return None

    with ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(join, ["true", "false"]))
    for error in errors:
        assert error is not None
        assert str(rendezvous.failed(error, watch=None)) == (
            "rendezvous failed: node rank 1 was given to 2 machines; give each machine its own --node-rank, 0 to 1")


def test_ctrl_c_stops_every_worker_and_exits_130(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    proc = cpctl("--device", "cpu", "--nproc-per-node", "2", str(PROBE), "--out", str(out_dir), "--sleep", "300",
                 tmp_path=tmp_path)
    deadline = time.monotonic() + TIMEOUT
    while len(records(out_dir)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "workers did not start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the launcher
    code, out, err = finish(proc)
    assert code == 130, out + err
    assert err.strip().splitlines()[-1] == "error: interrupted by SIGINT; workers stopped"
    assert "death signal" not in err, err  # torch's own line about it, before cpctl's: one line, not two
    time.sleep(0.5)
    for record in records(out_dir).values():
        assert not Path(f"/proc/{record['pid']}").exists() or _is_zombie(record["pid"]), f"worker {record['pid']} still runs"


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


# ----------------------------------------------------------------------------- when a worker fails

FAILING = REPO / "tests" / "workers" / "failing_worker.py"


def error_report(err: str) -> tuple[str, Path, str]:
    """(the `error:` line, the traceback file it names, the last line) of a failed launch's stderr."""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("note:")]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, err
    traceback_lines = [line for line in lines if line.startswith("  traceback: ")]
    assert len(traceback_lines) == 1, err
    return errors[0], Path(traceback_lines[0].removeprefix("  traceback: ")), lines[-1]


def assert_quiet(out: str, err: str) -> None:
    """No traceback, no doubled rank prefix, no peer's gloo error, no torchelastic log line."""
    text = out + err
    for noise in ("Traceback", "[rank0]: [rank0]:", "[rank1]: [rank1]:", "Connection closed by peer",
                  "torch/distributed/elastic", "closing signal"):
        assert noise not in text, text


def test_a_cpctl_error_in_a_worker_is_one_line_naming_its_rank(tmp_path: Path) -> None:
    # rank 1 shards 7 tokens over 2 CP ranks (a CpctlError); rank 0 then loses its peer in a barrier
    code, out, err = finish(cpctl("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", str(FAILING),
                                  "--rank", "1", tmp_path=tmp_path))
    assert code == 1, out + err
    assert "[rank0]: worker ready" in out and "[rank1]: worker ready" in out  # the script's own output stays
    error, traceback_file, last = error_report(err)
    assert error == ("error: rank 1: sequence length 7 is not divisible by 2 * cp_size (4) with cp_load_balance; "
                     "pad the sequence to 8 tokens or choose another cp_size")
    assert last.startswith("  worker rank 1 (local rank 1, pid ") and " exited with code 1" in last, err
    assert_quiet(out, err)
    try:
        text = traceback_file.read_text()
        assert text.startswith("Traceback (most recent call last):") and "failing_worker.py" in text
        assert text.rstrip().endswith("cpctl.errors.CpctlError: " + error.removeprefix("error: rank 1: "))
        assert traceback_file.name == "rank1-traceback.txt"
    finally:
        shutil.rmtree(traceback_file.parent, ignore_errors=True)


def test_a_scripts_own_exception_shows_its_type_and_message(tmp_path: Path) -> None:
    code, out, err = finish(cpctl("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", str(FAILING),
                                  "--rank", "0", "--error", "value", tmp_path=tmp_path))
    assert code == 1, out + err
    error, traceback_file, last = error_report(err)
    assert error == "error: rank 0: ValueError: batch 3 has no labels"
    assert last.startswith("  worker rank 0 (local rank 0, pid ") and " exited with code 1" in last, err
    assert_quiet(out, err)
    try:
        assert traceback_file.read_text().rstrip().endswith("ValueError: batch 3 has no labels")
    finally:
        shutil.rmtree(traceback_file.parent, ignore_errors=True)


def test_a_process_alone_that_fails_ends_as_python_ends_it(tmp_path: Path) -> None:
    # plain `python script.py`, a world of 1: no peer can be mid-collective, so nothing cuts the
    # exit short: the script's atexit handlers run and its open files are flushed
    leave = tmp_path / "left"
    leave.mkdir()
    proc = subprocess.run([sys.executable, str(FAILING), "--rank", "0", "--error", "value", "--leave", str(leave)],
                          cwd=tmp_path, env=launch_env(tmp_path), check=False, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.rstrip().endswith("ValueError: batch 3 has no labels"), proc.stderr  # Python's own traceback
    assert (leave / "buffered.txt").read_text() == "written before the failure", proc.stderr
    assert (leave / "atexit.txt").read_text() == "ran at exit", proc.stderr


@pytest.mark.full
def test_with_restarts_each_failed_attempt_is_one_line(tmp_path: Path) -> None:
    code, out, err = finish(cpctl("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", "--max-restarts", "1",
                                  str(FAILING), "--rank", "1", "--error", "value", tmp_path=tmp_path))
    assert code == 1, out + err
    [restart] = [line for line in err.splitlines() if "torchrun restarts" in line]
    assert restart.startswith("[rank1]: failed: ValueError: batch 3 has no labels (traceback: ")
    assert restart.endswith("rank1-attempt0-traceback.txt); torchrun restarts the workers (1 restart left)")
    error, traceback_file, _ = error_report(err)
    assert error == "error: rank 1: ValueError: batch 3 has no labels"
    assert traceback_file.name == "rank1-attempt1-traceback.txt"
    assert_quiet(out, err)
    shutil.rmtree(traceback_file.parent, ignore_errors=True)


def test_a_script_exiting_2_is_told_apart_from_a_cpctl_usage_error(tmp_path: Path) -> None:
    # argparse in the script exits 2 (no --out): cpctl passes the 2 on, and says a worker exited with it
    code, out, err = finish(cpctl("--device", "cpu", "--nproc-per-node", "2", str(PROBE), tmp_path=tmp_path))
    assert code == 2, out + err
    assert "[rank0]: launch_probe.py: error: the following arguments are required: --out" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: worker rank ") and "exited with code 2" in last and "its output is above" in last
    # cpctl's own usage error, for comparison: exit 2 too, but no worker named and nothing started
    code, out, err = finish(cpctl("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "3", str(PROBE),
                                  tmp_path=tmp_path))
    assert code == 2 and "worker rank" not in err and "[rank" not in out + err, out + err


PLAIN_SCRIPT = """\
import sys
import torch.distributed as dist

print("argv", sys.argv[1:], flush=True)
dist.init_process_group("gloo")  # not through cpctl.init(): torch prefixes its traceback lines itself
if dist.get_rank() == 1:
    raise ValueError("plain script fails")
"""


def test_a_plain_torch_script_failing_prints_each_line_once_and_leaves_no_temp_dir(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    temp = tmp_path / "tmp"
    temp.mkdir()
    after = ["--log", "x", "--nnodes", "3", "--", "--cp-size", "2"]  # the script's, all of it
    code, out, err = finish(cpctl("--device", "cpu", "--nproc-per-node", "2", str(script), *after,
                                  tmp_path=tmp_path, extra_env={"TMPDIR": str(temp)}))
    assert code == 1, out + err
    assert f"[rank0]: argv {after}" in out and f"[rank1]: argv {after}" in out
    assert "[rank1]: Traceback (most recent call last):" in err
    assert "[rank1]: ValueError: plain script fails" in err
    assert "[rank1]: [rank1]:" not in err and "[rank0]: [rank0]:" not in err
    assert err.strip().splitlines()[-1].startswith("error: worker rank 1 (local rank 1, pid ")
    assert list(temp.iterdir()) == []  # no traceback file of cpctl's to keep: nothing left behind


def test_a_node_waiting_for_the_others_says_so(tmp_path: Path) -> None:
    endpoint = f"localhost:{free_port()}"
    profile = tmp_path / "two-nodes.yaml"
    profile.write_text(f"version: 1\nlaunch:\n  device: cpu\n  nnodes: 2\n  nproc_per_node: 1\n  node_rank: 0\n"
                       f"  rdzv_endpoint: {endpoint}\n")
    proc = cpctl("--config", str(profile), str(PROBE), "--out", str(tmp_path / "out"), tmp_path=tmp_path)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    deadline = time.monotonic() + TIMEOUT
    while not any("still waiting" in line for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=TIMEOUT)
    reader.join(timeout=10)
    err = "".join(lines)
    assert code == 130, err
    assert f"cpctl: rendezvous at {endpoint}: waiting for 2 nodes (this one included; gives up after 600 s)" in err
    assert f"cpctl: still waiting at {endpoint}: 1 of 2 nodes joined after 5 s (gives up after 600 s;" in err
    assert err.strip().splitlines()[-1] == ("error: interrupted while waiting at the rendezvous (1 of 2 nodes joined); "
                                            "no worker was started")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("count", "visible", "fragments"),
    [
        (3, "0,1,2,7", ["CUDA_VISIBLE_DEVICES=0,1,2,7 names 4 GPUs but torch sees 3 GPUs (nproc_per_node 4)",
                        "`nvidia-smi -L`", "--nproc-per-node 3"]),
        (0, "4,5,6,7", ["CUDA_VISIBLE_DEVICES=4,5,6,7 names 4 GPUs but torch sees no GPU", "--device cpu"]),
        (2, None, ["torch sees 2 GPUs but nproc_per_node is 4", "--nproc-per-node 2"]),
    ],
)
def test_gpus_torch_cannot_see_are_refused_before_spawning(count: int, visible: str | None,
                                                           fragments: list[str]) -> None:
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    with pytest.raises(CpctlError) as caught:
        check_cuda_devices(4, device_count=count, environ=environ)
    for fragment in fragments:
        assert fragment in str(caught.value)
    check_cuda_devices(4, device_count=4, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})  # enough: no error
