"""`accelerate launch`'s flags on `cpctl launch`: a command line written for accelerate works with
only the launcher's name changed.

Each flag of accelerate that sets something cpctl has a key for is declared once in ALIASES,
with accelerate's meaning: `--num-processes` is the total over all machines (cpctl's
`nproc_per_node` is per machine), `--main-process-ip`/`--main-process-port` are the rendezvous
endpoint. The values go through the profile key's own validation, and `--dry-run` shows them
with the flag they came from. accelerate's other flags are refused, one line each
(CANNOT_HONOUR), rather than ignored.

accelerate spells every flag with underscores or dashes (`--num_processes`, `--num-processes`);
cpctl's command line reads `_` in an option's name as `-` (cpctl.launch.cli). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cpctl.config import KEYS
from cpctl.config.accelerate_file import PARALLELISM
from cpctl.config.layers import FlagText
from cpctl.errors import CpctlError

ACCELERATE_DEFAULT_PORT = 29500  # accelerate's --main_process_port when none is given
ACCELERATE_LOCAL_HOST = "127.0.0.1"  # its MASTER_ADDR on one machine


@dataclass(frozen=True)
class Alias:
    """One flag of `accelerate launch` that cpctl honours."""

    name: str  # accelerate's name, with dashes
    path: str | None  # the profile key it sets; None: nothing to set (what it asks is what cpctl does)
    switch: str | None = None  # for a flag without a value: the value it stands for
    allowed: tuple[str, ...] = ()  # for a flag with nothing to set: the values that ask for what cpctl does
    meaning: str = ""  # for --help, where the key alone does not say it

    @property
    def help(self) -> str:
        if self.meaning or self.path is None:  # an alias that sets nothing says in `meaning` what it asks for
            return self.meaning
        key = KEYS[self.path]
        return f"sets {key.path} to {self.switch}" if self.switch else f"sets {key.path}, as {key.flag} does"

    @property
    def param(self) -> str:
        return "accelerate_" + self.name[2:].replace("-", "_")


NUM_PROCESSES, MAIN_PROCESS_IP, MAIN_PROCESS_PORT = "--num-processes", "--main-process-ip", "--main-process-port"

ALIASES: tuple[Alias, ...] = (
    *(Alias(f"--parallelism-config-{setting.name.replace('_', '-')}", setting.path, allowed=setting.allowed,
            meaning=setting.meaning) for setting in PARALLELISM),  # the same settings as in accelerate's config file
    Alias(NUM_PROCESSES, "launch.nproc_per_node", meaning="the processes of all machines together: "
          "nproc_per_node = N / machines"),
    Alias("--num-machines", "launch.nnodes"),
    Alias("--machine-rank", "launch.node_rank"),
    Alias(MAIN_PROCESS_IP, "launch.rdzv_endpoint", meaning="the machine-rank-0 host: rdzv_endpoint = "
          f"HOST:PORT (port {ACCELERATE_DEFAULT_PORT} unless --main-process-port)"),
    Alias(MAIN_PROCESS_PORT, "launch.rdzv_endpoint", meaning="the rendezvous port (0: a free one, on one "
          "machine)"),
    Alias("--max-restarts", "launch.max_restarts"),
    Alias("--cpu", "launch.device", switch="cpu"),
    Alias("--multi-gpu", "launch.device", switch="cuda"),
    Alias("--mixed-precision", "fsdp.mixed_precision"),
    Alias("--fsdp-version", "fsdp.version"),
    Alias("--fsdp-reshard-after-forward", "fsdp.reshard_after_forward"),
    Alias("--fsdp-activation-checkpointing", "fsdp.activation_checkpointing"),
    Alias("--fsdp-offload-params", "memory.cpu_offload"),
    # what cpctl always does: accepted, nothing to set
    Alias("--use-fsdp", None, switch="true", meaning="what cpctl always does (FSDP2, fsdp.version)"),
    Alias("--use-parallelism-config", None, switch="true",
          meaning="what cpctl always does (the profile's sizes are accelerate's ParallelismConfig)"),
)
BY_NAME: dict[str, Alias] = {alias.name: alias for alias in ALIASES}

# accelerate's flags that cpctl cannot honour, by name or by a prefix ending in "-": why, and what to do.
_DEEPSPEED = "cpctl shards with FSDP2, not DeepSpeed; drop the DeepSpeed flags"
_FSDP = ("cpctl wraps every transformer block with FSDP2 itself (accelerate's TRANSFORMER_BASED_WRAP); "
         "drop it; FSDP2's options cpctl has: --fsdp-reshard-after-forward, --fsdp-activation-checkpointing, "
         "--fsdp-offload-params")
CANNOT_HONOUR: dict[str, str] = {
    "--config-file": "cpctl reads the file accelerate config writes as --config FILE (its keys become the "
                     "profile's): pass it that way",
    "--use-deepspeed": _DEEPSPEED, "--deepspeed-": _DEEPSPEED, "--zero-stage": _DEEPSPEED,
    "--offload-optimizer-": _DEEPSPEED, "--offload-param-": _DEEPSPEED, "--gradient-clipping": _DEEPSPEED,
    "--gradient-accumulation-steps": "set it in the script: Accelerator(gradient_accumulation_steps=N), or the "
                                     "Trainer's TrainingArguments",
    "--use-megatron-lm": "cpctl does not run Megatron-LM; drop it", "--megatron-lm-": "cpctl does not run Megatron-LM; drop it",
    "--fsdp-": _FSDP,
    "--dynamo-": "cpctl does not compile the model; call torch.compile in the script",
    "--gpu-ids": "choose the GPUs with CUDA_VISIBLE_DEVICES (CUDA_VISIBLE_DEVICES=0,1 cpctl launch ...)",
    "--num-cpu-threads-per-process": "set OMP_NUM_THREADS (cpctl sets 1 per worker when it is unset)",
    "--enable-cpu-affinity": "cpctl does not pin workers to cores; drop it",
    "--same-network": "cpctl's machines meet at a c10d rendezvous (--main-process-ip/--rdzv-endpoint); drop it",
    "--rdzv-backend": "cpctl chooses the rendezvous: standalone on one machine, c10d at --rdzv-endpoint across machines",
    "--rdzv-conf": "cpctl chooses the rendezvous settings; drop it",
    "--monitor-interval": "torchrun's default is used; drop it",
    "--role": "drop it",
    "--tee": "cpctl shows every worker's output, each line prefixed with its rank; drop it",
    "--log-dir": "cpctl keeps torchrun's logs itself and names a failed worker's traceback file; drop it",
    "--quiet": "drop it", "--debug": "drop it",
    "--no-python": "cpctl launches Python scripts and modules only",
    "--tpu": "cpctl runs on NVIDIA GPUs and CPUs", "--tpu-": "cpctl runs on NVIDIA GPUs and CPUs",
    "--no-tpu-cluster": "cpctl runs on NVIDIA GPUs and CPUs", "--main-training-function": "a TPU option; drop it",
    "--vm": "a TPU option; drop it", "--env": "set the variables in the shell that runs cpctl launch",
    "--mpirun-hostfile": "cpctl starts workers with torchrun, not mpirun; run cpctl launch on each machine",
    "--fp8-": "cpctl's mixed precision is bf16, fp16 or no", "--downcast-bf16": "drop it",
}


def nothing_to_set(given: Mapping[str, str]) -> list[str]:
    """The flags among `given` that ask for what cpctl does anyway, each with what that is."""
    return [f"{name}: {BY_NAME[name].meaning}" for name in given if BY_NAME[name].path is None]


def normalized(flag: str) -> str:
    """`--num_processes=4` -> `--num-processes`: accelerate accepts both spellings."""
    name = flag.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def refusal(flag: str) -> str | None:
    """The one line for an accelerate flag cpctl cannot honour; None when `flag` is not one."""
    name = normalized(flag)
    why = CANNOT_HONOUR.get(name)
    if why is None and name not in BY_NAME:
        why = next((text for prefix, text in CANNOT_HONOUR.items() if prefix.endswith("-") and name.startswith(prefix)),
                   None)
    return None if why is None else f"{flag.split('=', 1)[0]}: accelerate launch's flag, which cpctl cannot honour: {why}"


def profile_flags(given: Mapping[str, str], *, flags: Mapping[str, str],
                  nnodes_of: Callable[[Mapping[str, str]], int]) -> dict[str, str]:
    """cpctl's flags (key path -> text) with accelerate's `given` ones (name -> text) added, each
    naming its flag as its source. A key set by both must get the same value.

    `nnodes_of(flags)`: the machines the profile has with these flags (for --num-processes,
    accelerate's total over all of them).
    """
    merged: dict[str, str] = dict(flags)
    shown = {path: f"{KEYS[path].flag} {text}" for path, text in flags.items()}  # who set each key, for a conflict

    def put(path: str, text: str, *, flag: str, source: str) -> None:
        if path in merged:
            mine, theirs = (KEYS[path].parse(str(value), source=source) for value in (merged[path], text))
            if mine != theirs:
                raise CpctlError(f"{shown[path]} and {flag} both set {path}; pass one of them")
            return
        merged[path] = FlagText(text, source=source)
        shown[path] = flag

    for name, text in given.items():
        alias = BY_NAME[name]
        if alias.path is None:
            if alias.allowed and text not in alias.allowed:
                raise CpctlError(f"flag {name}: {text!r} is not allowed; expected {' or '.join(alias.allowed)}")
            continue
        if name in (NUM_PROCESSES, MAIN_PROCESS_IP, MAIN_PROCESS_PORT):
            continue  # they need the machines: below
        put(alias.path, alias.switch or text, flag=name if alias.switch else f"{name} {text}", source=f"flag {name}")
    if not {NUM_PROCESSES, MAIN_PROCESS_IP, MAIN_PROCESS_PORT} & given.keys():
        return merged
    nnodes = nnodes_of(merged)
    if NUM_PROCESSES in given:
        total = f"{NUM_PROCESSES} {given[NUM_PROCESSES]}"
        put("launch.nproc_per_node", _per_machine(given[NUM_PROCESSES], nnodes=nnodes), flag=total,
            source=f"flag {total}" + (f" (the total over {nnodes} machines)" if nnodes > 1 else ""))
    endpoint = _endpoint(given.get(MAIN_PROCESS_IP), given.get(MAIN_PROCESS_PORT), nnodes=nnodes)
    if endpoint is not None:
        named = " ".join(f"{name} {given[name]}" for name in (MAIN_PROCESS_IP, MAIN_PROCESS_PORT) if name in given)
        put("launch.rdzv_endpoint", endpoint, flag=named,
            source="flag " + " ".join(name for name in (MAIN_PROCESS_IP, MAIN_PROCESS_PORT) if name in given))
    return merged


def _per_machine(text: str, *, nnodes: int) -> str:
    try:
        total = int(text)
    except ValueError:
        total = 0
    if total < 1:
        raise CpctlError(f"flag {NUM_PROCESSES}: {text!r} is not allowed; expected an integer >= 1 "
                         "(accelerate's meaning: the processes of all machines together)")
    if total % nnodes:
        raise CpctlError(f"{NUM_PROCESSES} {total} is the total over {nnodes} machines (accelerate's meaning), and "
                         f"{total} is not a multiple of {nnodes}; pass a multiple of {nnodes}, or --nproc-per-node N "
                         "(processes per machine)")
    return str(total // nnodes)


def _endpoint(ip: str | None, port: str | None, *, nnodes: int) -> str | None:
    """accelerate's main process address as cpctl's rendezvous endpoint, host:port."""
    if ip is None and port is None:
        return None
    if port is not None and not (port.strip().isdigit() and int(port) <= 65535):
        raise CpctlError(f"flag {MAIN_PROCESS_PORT}: {port!r} is not allowed; expected a port 0-65535")
    if port is not None and int(port) == 0:  # accelerate: a free port, which only one machine can pick
        if nnodes > 1:
            raise CpctlError(f"{MAIN_PROCESS_PORT} 0 (a free port) works on one machine only; across {nnodes} machines "
                             "pass the port they all reach")
        if ip is None:
            return None  # cpctl's standalone rendezvous takes a free port too
        port = None
    if ip is None and nnodes > 1:
        raise CpctlError(f"{MAIN_PROCESS_PORT} without {MAIN_PROCESS_IP} across {nnodes} machines; pass "
                         f"{MAIN_PROCESS_IP} (the machine-rank-0 host) too")
    return f"{ip or ACCELERATE_LOCAL_HOST}:{port or ACCELERATE_DEFAULT_PORT}"
