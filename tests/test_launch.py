"""Real `cpctl launch` runs: the CLI in a subprocess, torchrun's agent, CPU workers.

Each launch costs an `import torch` (seconds on a small box), so there are few of them and the
worker (tests/workers/launch_probe.py) imports no torch: it writes one JSON file per rank with
what the launcher gave it (RANK, WORLD_SIZE, LOCAL_RANK, CPCTL_RESOLVED_PROFILE, its argv).
"""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

from launching import REPO, TIMEOUT, cpctl, finish

PROBE = REPO / "tests" / "workers" / "launch_probe.py"


def records(out_dir: Path) -> dict[int, dict]:
    return {int(path.stem.removeprefix("rank")): json.loads(path.read_text()) for path in out_dir.glob("rank*.json")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_cpu_workers_get_their_ranks_and_the_profile(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    code, out, err = finish(cpctl(
        "--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", "--cp-comm-strategy", "alltoall",
        str(PROBE), "--out", str(out_dir), "--extra", "7", tmp_path=tmp_path,
    ))
    assert code == 0, out + err
    ranks = records(out_dir)
    assert sorted(ranks) == [0, 1]
    for rank, record in ranks.items():
        assert (record["world_size"], record["local_rank"]) == (2, rank)
        assert record["extra_args"] == ["--extra", "7"]  # script args pass through untouched
        par = record["profile"]["parallelism"]
        assert (par["cp_size"], par["dp_shard_size"], par["cp_comm_strategy"]) == (2, 1, "alltoall")
        assert record["profile"]["launch"] | {} == {"device": "cpu", "nnodes": 1, "nproc_per_node": 2, "node_rank": 0,
                                                     "rdzv_endpoint": None, "max_restarts": 0}
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


def test_two_nodes_on_loopback(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        cpctl("--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--nproc-per-node", "1",
              "--device", "cpu", str(PROBE), "--out", str(out_dir), tmp_path=tmp_path)
        for rank in (0, 1)
    ]
    results = [finish(node) for node in nodes]
    for code, out, err in results:
        assert code == 0, out + err
    ranks = records(out_dir)
    assert sorted(ranks) == [0, 1]
    assert {record["world_size"] for record in ranks.values()} == {2}
    assert {record["local_rank"] for record in ranks.values()} == {0}
    assert {record["profile"]["launch"]["rdzv_endpoint"] for record in ranks.values()} == {endpoint}


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
    time.sleep(0.5)
    for record in records(out_dir).values():
        assert not Path(f"/proc/{record['pid']}").exists() or _is_zombie(record["pid"]), f"worker {record['pid']} still runs"


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
