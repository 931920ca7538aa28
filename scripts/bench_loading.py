"""Host memory and time to load a pretrained checkpoint into FSDP2, per machine, side by side:
`rt.from_pretrained` (meta build; each rank reads its shards' slices) against the way before it
(`from_pretrained` on every rank, then `rt.prepare_model`) and an accelerate script's way
(`from_pretrained` on every rank, then `accelerator.prepare`), at 1, 2 and 4 CPU processes.

    python scripts/bench_loading.py --write-checkpoint /tmp/llama-1b      # a bf16 Llama-3.2-1B shape, random
    python scripts/bench_loading.py --checkpoint /tmp/llama-1b --procs 1 2 4 --out docs/benchmarks/loading_cpu.jsonl

For each (way, processes) one `cpctl launch --device cpu --cp-size N` runs this file as its
worker; this process samples the resident memory of the whole process tree every 20 ms until
rank 0 says the model is loaded (a marker file), so the peak is the machine's, not a sum of
per-process peaks. The workers then check their shards bit for bit against the safetensors
files (each rank its own slices). The rows: peak host bytes, the same less the runtime's
own (each process's resident bytes after `cpctl.init()`, before loading), both also without
the file pages the processes map (RssAnon: the page cache of the safetensors files, which the
kernel reclaims), as multiples of one bf16 copy (the checkpoint's size), and load seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GiB = 1 << 30
WAYS = ("from_pretrained_then_prepare", "rt.from_pretrained", "accelerator.prepare")


def write_checkpoint(path: Path, *, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 q / 8 K/V heads, vocabulary 128256, tied head
    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         tie_word_embeddings=True, rope_theta=500000.0, dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)  # transformers' default shard size: several files past 5 GB, one here


def resident_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident bytes: all of them (VmRSS), or its own memory without the file pages
    it maps (RssAnon: the safetensors files' page cache, which the kernel reclaims, left out)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))
    except (OSError, StopIteration):
        return 0


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            children = []
        found += children
        frontier += children
    return found


def measure(checkpoint: Path, *, way: str, procs: int, master_weights: str, device: str, scratch: Path) -> dict:
    marker, report = scratch / "loaded", scratch / "report.json"
    for path in (marker, report):
        path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "cpctl.launch.cli", "launch", "--device", device, "--nproc-per-node", str(procs),
               "--cp-size", str(procs), "--master-weights", master_weights, "--script-api",
               "accelerate" if way == "accelerator.prepare" else "cpctl", __file__,
               "--worker", way, "--checkpoint", str(checkpoint), "--marker", str(marker), "--report", str(report)]
    started = time.monotonic()
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = peak_anonymous = 0
    while launcher.poll() is None and not marker.exists():
        tree = descendants(launcher.pid)
        peak = max(peak, sum(resident_bytes(p) for p in tree))
        peak_anonymous = max(peak_anonymous, sum(resident_bytes(p, "RssAnon") for p in tree))
        time.sleep(0.02)
    output = launcher.communicate()[0]
    if launcher.returncode != 0:
        raise SystemExit(f"{way} at {procs} processes failed:\n{output[-3000:]}")
    ranks = json.loads(report.read_text())
    runtime_bytes = sum(rank["resident_after_init"] for rank in ranks)
    runtime_anonymous = sum(rank["anonymous_after_init"] for rank in ranks)
    return {"way": way, "device": device, "processes": procs, "master_weights": master_weights,
            "checkpoint_bytes": sum(p.stat().st_size for p in checkpoint.glob("*.safetensors")),
            "peak_host_bytes": peak, "runtime_bytes": runtime_bytes, "peak_less_runtime_bytes": peak - runtime_bytes,
            "peak_anonymous_bytes": peak_anonymous, "peak_anonymous_less_runtime_bytes": peak_anonymous - runtime_anonymous,
            "load_s": max(rank["load_s"] for rank in ranks), "launch_to_loaded_s": time.monotonic() - started,
            "gpu_peak_bytes": max(rank["gpu_peak_bytes"] for rank in ranks),
            "bit_equal": all(rank["bit_equal"] for rank in ranks)}


def worker(way: str, checkpoint: Path, marker: Path, report: Path) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import cpctl

    rt = cpctl.init()
    resident, anonymous = resident_bytes(os.getpid()), resident_bytes(os.getpid(), "RssAnon")
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    started = time.monotonic()
    if way == "rt.from_pretrained":
        model = rt.from_pretrained(AutoModelForCausalLM, checkpoint)
    elif way == "accelerator.prepare":
        from accelerate import Accelerator

        model = AutoModelForCausalLM.from_pretrained(checkpoint)
        model, _ = Accelerator().prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    else:
        model = rt.prepare_model(AutoModelForCausalLM.from_pretrained(checkpoint))
    dist.barrier()
    load_s = time.monotonic() - started
    if rt.is_main:
        marker.touch()
    time.sleep(0.2)  # the sampler's last look at the loaded model
    bit_equal = shards_equal_the_files(model, checkpoint)
    rows = [None] * rt.world_size
    dist.all_gather_object(rows, {"rank": rt.rank, "resident_after_init": resident,
                                  "anonymous_after_init": anonymous,
                                  "gpu_peak_bytes": torch.cuda.max_memory_allocated() if rt.device.type == "cuda" else 0,
                                  "load_s": load_s,
                                  "bit_equal": bit_equal})
    if rt.is_main:
        report.write_text(json.dumps(rows))


def shards_equal_the_files(model, checkpoint: Path) -> bool:
    """Each local shard equals its slice of the stored tensor (in the parameter's dtype), bit for bit."""
    import json as _json

    import torch
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    index = checkpoint / "model.safetensors.index.json"
    where = (_json.loads(index.read_text())["weight_map"] if index.exists()
             else {name: "model.safetensors" for name in safe_open(checkpoint / "model.safetensors", "pt").keys()})
    for name, tensor in get_model_state_dict(model).items():
        if name not in where:
            continue  # a tied copy: the checkpoint stores the other name
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel() == 0:
            continue
        offsets = (tensor.__create_chunk_list__()[0].offsets if isinstance(tensor, DTensor) else (0,) * tensor.dim())
        with safe_open(checkpoint / where[name], "pt") as f:
            stored = f.get_slice(name)[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))]
        if not torch.equal(stored.to(local.dtype), local.detach().cpu()):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-checkpoint", type=Path, help="write a bf16 Llama-3.2-1B-shaped checkpoint here")
    parser.add_argument("--layers", type=int, default=16, help="with --write-checkpoint: fewer layers, a smaller model")
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--master-weights", nargs="+", default=["fp32", "keep"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per process")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--out", type=Path, help="append the rows here as JSON lines")
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--marker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.checkpoint, args.marker, args.report)
    if args.write_checkpoint:
        return write_checkpoint(args.write_checkpoint, layers=args.layers)
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-loading-{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"{'way':30} {'master':>6} {'procs':>5} {'peak GiB':>9} {'less runtime':>12} {'x bf16 copy':>11} "
          f"{'anon x copy':>11} {'GPU x copy':>10} {'load s':>7} {'bit-equal':>9}")
    for master_weights in args.master_weights:
        for procs in args.procs:
            for way in args.ways:
                if way == "accelerator.prepare" and master_weights == "keep" and args.device == "cuda":
                    continue  # refused: accelerate upcasts under mixed precision (bf16, cuda's default) anyway
                row = measure(args.checkpoint, way=way, procs=procs, master_weights=master_weights,
                              device=args.device, scratch=scratch)
                row["date"] = time.strftime("%Y-%m-%d")
                print(f"{way:30} {master_weights:>6} {procs:>5} {row['peak_host_bytes'] / GiB:9.2f} "
                      f"{row['peak_less_runtime_bytes'] / GiB:12.2f} "
                      f"{row['peak_less_runtime_bytes'] / row['checkpoint_bytes']:11.2f} "
                      f"{row['peak_anonymous_less_runtime_bytes'] / row['checkpoint_bytes']:11.2f} "
                      f"{row['gpu_peak_bytes'] / row['checkpoint_bytes']:10.2f} {row['load_s']:7.1f} "
                      f"{str(row['bit_equal']):>9}", flush=True)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
