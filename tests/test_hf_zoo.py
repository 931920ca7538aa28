"""A zoo of tiny Hugging Face causal LMs trains under CP as in one process (tests/workers/hf_zoo.py).

One run per run (cp 2 with each CP strategy; cp 1: one process, attention still through cpctl's
engine), in the session's pool of processes of its size (tests/pool.py, with the profile `cpctl
launch` would give), runs every architecture (six cases each: the README loop,
`model(input_ids=ids, labels=ids).loss` as accelerate users call it, `rt.causal_lm_loss`, and
the three on packed documents; the quick tier runs cp 2 with the worker's QUICK_CASES, half of
them); each (run, architecture, case) is then its own test: two SGD
steps' losses and the first step's full gradients within 1e-5 of a one-process run of plain
transformers, or, for an entry of REFUSED, an error naming the expected substring.

A rank failing alone can leave the other inside a collective and kill the launch: the
architecture it died in is recorded as that crash (with the errors the ranks printed), and the
architectures not yet run are launched again.

A last test makes deliberate mistakes (local position ids, labels shifted per shard) and checks
that they are refused or caught: the comparison can fail.

`python tests/test_hf_zoo.py [allgather|alltoall|cp1] [ARCH ...]` prints the table without pytest.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launching import REPO, cpctl, launch_once, tiered
from pool import Pools

pytest.importorskip("transformers")

WORKER = REPO / "tests" / "workers" / "hf_zoo.py"
# (cp size, strategy): cpctl.attention.Strategy's values, spelled out (no torch at collection)
RUNS = {"cp2-allgather": (2, "allgather"), "cp2-alltoall": (2, "alltoall"), "cp1": (1, "allgather")}
TOLERANCE = 1e-5  # fp32
SEQ = 64  # the worker's sequence length
LAUNCH_TIMEOUT = 900  # seconds for one launch over the whole zoo (about a minute when all goes well)

# Architecture ("llama") or architecture/case ("llama/hf_loss") -> a substring of the error cpctl
# is expected to raise instead of training it (REFUSED_SHARDED: only when cp > 1). The more
# specific key wins, and under CP a REFUSED_SHARDED one.
REFUSED: dict[str, str] = {
    "bart": "its forward takes no position_ids",
    # its LM head transforms the hidden states (dense, GELU, layer norm) before the output embedding
    "roberta/chunked_loss": "computes its logits in a way cpctl's chunked loss does not reproduce",
    "roberta/packed_chunked_loss": "computes its logits in a way cpctl's chunked loss does not reproduce",
    # Falcon builds the mask it hands SDPA itself; transformers 5.24's reads documents, 5.17's does not
    "falcon/packed_chunked_loss": "builds its attention mask itself",
}
REFUSED_SHARDED: dict[str, str] = {
    # without position ids RoBERTa numbers its tokens from its padding token, which no shard can
    "roberta/hf_loss": "numbers its tokens from its padding token",
    "roberta/chunked_loss": "numbers its tokens from its padding token",
}
# Architecture/case -> why transformers in one process is not this case's reference: the case must
# run, its numbers are not compared. OPT and RoBERTa build their masks without position ids, so in
# one process attention crosses the packed documents that `documents=` asks cpctl to separate (at
# every cp size); without `documents=` they train as in one process (packed_loss_nocache,
# packed_chunked_loss).
UNLIKE_ONE_PROCESS: dict[str, str] = {
    "opt/packed": "its mask reads no documents from position ids",
    "roberta/packed": "its mask reads no documents from position ids",
    "falcon/packed": "transformers 5.17's Falcon builds its mask without position ids",
}
# Releases of transformers before remap_positions_for_packed_sequence (5.17) place a packed row's
# attention chunks by the row's positions; cpctl places them in each document, as 5.24 does.
CHUNKS_BY_ROW_REFUSED = {"llama4/packed_chunked_loss": "places a packed row's attention chunks by the row's positions"}
CHUNKS_BY_ROW_UNLIKE = {"llama4/packed"}


def chunks_by_row() -> bool:
    from transformers import masking_utils

    return not hasattr(masking_utils, "remap_positions_for_packed_sequence")


def _worker_constant(name: str) -> ast.expr:
    """The value the worker assigns to `name`, read without importing it (no torch at collection)."""
    for node in ast.parse(WORKER.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(getattr(target, "id", None) == name for target in targets):
            return node.value
    raise AssertionError(f"no {name} in {WORKER}")


ARCHS = [key.value for key in _worker_constant("ARCHS").keys]
CASES = ast.literal_eval(_worker_constant("CASES"))
QUICK_CASES = ast.literal_eval(_worker_constant("QUICK_CASES"))
_ERROR_LINE = re.compile(r"zoo-error rank(\d+) ([\w.-]+)/(\w+): (.*)")


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """launching.finish with a longer limit; returns (exit code, stdout + stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # cpctl stops its workers
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"cpctl launch did not finish in {timeout}s:\n{out}\n{err}")
    return proc.returncode, out + err


def run_zoo(tmp_path: Path, run: str, *worker_args: str, archs: list[str] | None = None,
            cases: tuple[str, ...] = CASES, pools: Pools | None = None) -> dict:
    """{arch: {case: record}} for every architecture asked for (all by default), relaunching past
    crashes; in the session's pool of the run's process count (tests/pool.py), else launched."""
    cp, strategy = RUNS[run]
    flags = ("--nproc-per-node", str(cp), "--cp-size", str(cp), "--cp-comm-strategy", strategy)
    results: dict = {}
    pending = list(archs or [])  # empty: the worker's own full list
    for attempt in range(len(ARCHS) + 1):
        out = tmp_path / f"zoo-{run}-{attempt}.json"
        if pools is not None:
            outcome = pools[cp].attempt(WORKER, str(out), *worker_args, *pending, flags=flags, cwd=tmp_path,
                                        timeout=LAUNCH_TIMEOUT)
            code, output = (0 if outcome.ok else 1), "\n".join(outcome.outputs) + outcome.report()
        else:
            proc = cpctl("--device", "cpu", *flags, str(WORKER), str(out), *worker_args, *pending, tmp_path=tmp_path)
            code, output = _wait(proc, LAUNCH_TIMEOUT)
        part = json.loads(out.read_text()) if out.exists() else {}
        assert part, f"the zoo worker died before its first architecture (exit {code}):\n{output[-6000:]}"
        results |= {name: record for name, record in part.items() if record}
        left = [name for name, record in part.items() if not record]
        if not left:
            assert code == 0, f"the zoo worker finished every architecture but exited {code}:\n{output[-6000:]}"
            return results
        crashed, pending = left[0], left[1:]
        printed: dict[str, list[str]] = {case: [] for case in cases}
        for match in _ERROR_LINE.finditer(output):
            rank, name, case, error = match.groups()
            if name == crashed and case in printed:
                printed[case].append(f"rank {rank}: {error.strip()}")
        tail = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
        died_in = next((case for case in cases if printed[case]), None)  # the first case a rank failed in
        results[crashed] = {}
        for case in cases:
            if died_in is not None and cases.index(case) > cases.index(died_in):
                error = f"not run: the launch died (exit {code}) in case {died_in}"
            else:
                error = (f"launch died (exit {code}) in this case; "
                         + ("; ".join(printed[case]) or f"last output: {tail}"))
            results[crashed][case] = {"error": error}
        if not pending:
            return results
    raise AssertionError("the zoo kept crashing")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory, pools, request: pytest.FixtureRequest):
    """One run per run, on first use, shared by that run's tests (a failure too); the quick tier's
    runs the worker's QUICK_CASES."""
    if request.config.getoption("--full"):
        return launch_once(tmp_path_factory, "zoo", lambda tmp, run: run_zoo(tmp, run, pools=pools))
    return launch_once(tmp_path_factory, "zoo",
                       lambda tmp, run: run_zoo(tmp, run, "--quick", cases=QUICK_CASES, pools=pools))


def check(record: dict, arch: str, case: str, *, cp: int) -> None:
    refused = REFUSED.get(f"{arch}/{case}", REFUSED.get(arch))
    if cp > 1:
        refused = REFUSED_SHARDED.get(f"{arch}/{case}", REFUSED_SHARDED.get(arch, refused))
    by_row = chunks_by_row()
    if by_row:
        refused = CHUNKS_BY_ROW_REFUSED.get(f"{arch}/{case}", refused)
    if refused is not None:
        assert record.get("error") and refused in record["error"], (
            f"{arch}/{case}: expected an error containing {refused!r}, got {record}")
        return
    assert record.get("error") is None, f"{arch}/{case}: {record['error']}"
    assert len(record["losses_ref"]) == len(record["losses_cp"]) == 2, record
    if f"{arch}/{case}" in UNLIKE_ONE_PROCESS or (by_row and f"{arch}/{case}" in CHUNKS_BY_ROW_UNLIKE):
        return
    assert record["local_len"] == SEQ // cp, f"{arch}/{case}: the CP model saw {record['local_len']} tokens"
    assert record["engine_calls"] > 0, f"{arch}/{case}: attention did not go through cpctl's engine"
    assert record["loss_diff"] <= TOLERANCE, f"{arch}/{case}: loss differs by {record['loss_diff']:.3g}: {record}"
    assert record["grad_diff"] <= TOLERANCE, f"{arch}/{case}: gradients differ by {record['grad_diff']:.3g}: {record}"


@pytest.mark.parametrize("case", tiered(CASES, quick=QUICK_CASES))
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("run", tiered(RUNS, quick={"cp2-allgather"}))
def test_hf_architecture_trains_under_cp_as_in_one_process(zoo, run: str, arch: str, case: str) -> None:
    results = zoo(run)
    assert set(results) == set(ARCHS), f"architectures missing: {set(ARCHS) - set(results)}"
    check(results[arch][case], arch, case, cp=RUNS[run][0])


@pytest.mark.full
def test_the_comparison_catches_mistakes(tmp_path: Path, pools) -> None:
    """Mistakes in the README loop must show: refused, or gradients far from the one-process ones."""
    results = run_zoo(tmp_path, "cp2-allgather", "--wrong-positions", "--wrong-labels", archs=["llama"],
                      cases=("wrong_positions", "wrong_labels"), pools=pools)["llama"]
    # Local positions arange(local_len) on every rank: refused (they would train silently off).
    positions = results["wrong_positions"]
    assert positions.get("error") and "position_ids made on the shard" in positions["error"], positions
    # Labels shifted per shard: nothing to refuse (they are just token ids), so the numbers must differ.
    labels = results["wrong_labels"]
    assert labels.get("error") is None, labels
    assert labels["local_len"] == SEQ // RUNS["cp2-allgather"][0], labels
    assert labels["grad_diff"] > 1e-4 and labels["loss_diff"] > 1e-4, labels


def _table(results: dict, *, cp: int) -> str:
    rows = []
    for arch, cases in results.items():
        for case, r in cases.items():
            try:
                check(r, arch, case, cp=cp)
                verdict = "ok"
            except AssertionError:
                verdict = "FAIL"
            what = r.get("error") or f"loss {r['loss_diff']:.2e} grad {r['grad_diff']:.2e}"
            rows.append(f"{arch:12} {case:19} {verdict:5} {what}")
    return "\n".join(rows)


if __name__ == "__main__":
    import tempfile

    run = {"allgather": "cp2-allgather", "alltoall": "cp2-alltoall", "cp1": "cp1"}[sys.argv[1] if len(sys.argv) > 1 else "allgather"]
    with tempfile.TemporaryDirectory() as tmp:
        print(_table(run_zoo(Path(tmp), run, archs=sys.argv[2:] or None), cp=RUNS[run][0]))
