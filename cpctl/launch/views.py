"""How cpctl shows its plans: the launch plan of `--dry-run` and the memory plan of `cpctl plan`.

Presentation only (rich tables on stdout); the plans themselves come from cpctl.launch.launcher and
cpctl.planner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cpctl.config.layers import PROFILE_ENV_VAR
from cpctl.config.schema import FIT
from cpctl.strategy import Strategy
from cpctl.launch.accelerate_env import accelerate_env

if TYPE_CHECKING:
    from cpctl.launch.launcher import LaunchPlan

MESH_HEAD_ROWS, MESH_TAIL_ROWS = 16, 4  # larger worlds print the first and last ranks only
PLAN_WIDE_COLUMNS = 120  # narrower terminals get `cpctl plan`'s "counted as" below its table


ENGINES = {
    "cpctl": "cpctl's engine behind accelerate's maybe_context_parallel (cpu and cuda; windows, documents, checks)",
    "native": "accelerate's own path, PyTorch's context_parallel, unchanged (cuda only)",
}


def _stdout() -> Console:
    return Console(highlight=False)


def print_memory_plan(result: Any, resolved: Any) -> None:
    """`cpctl plan`'s tables: the terms at each moment, the advice, the longest sequences."""
    from cpctl import planner

    out = _stdout()
    model, estimate = result.model, result.estimate
    setup = estimate.setup
    gib = planner.GiB
    seq = planner.format_tokens(estimate.seq_len)
    batch = f", {setup.batch} sequences per step" if setup.batch > 1 else ""
    family = "; ".join([model.family, *model.features()]) if model.family != "llama" or model.features() else ""
    out.print(f"[bold]cpctl plan[/]: {escape(model.name)} ({model.params / 1e9:.2f}B parameters, vocab "
              f"{model.vocab_size}, {model.n_layers} layers, dim {model.dim}{escape('; ' + family) if family else ''}) "
              f"at {seq} tokens{batch}")
    out.print(f"{escape(setup.describe())}; {estimate.local_tokens:,} tokens per GPU")
    out.print(f"[dim]profile as on {escape(resolved.target)}{'; ' + escape(resolved.note) if resolved.note else ''}[/]")
    for note in model.notes:
        out.print(f"[yellow]note:[/] {escape(note)}")
    if setup.lora is not None:
        out.print(escape(lora_line(model, estimate)))

    peak, block = estimate.peak_moment, estimate.block_moment
    block_titles = {"mlp_backward": "block bwd: MLP", "attention_backward": "block bwd: attention",
                    "last_block_backward": "last block bwd"}
    columns = [("loss", "loss"), (block, block_titles[block]), ("optimizer_step", "opt. step")]
    # On a narrow terminal "counted as" gets a table of its own below, instead of a column
    # squeezed into one word per line.
    beside = out.width >= PLAN_WIDE_COLUMNS
    table = Table(show_edge=False, title="memory per GPU, GiB", title_justify="left")
    table.add_column("term", no_wrap=True)
    for moment, title in columns:
        shown_peak = moment == peak
        table.add_column(f"[bold]{title} (peak)[/]" if shown_peak else title, justify="right")
    if beside:
        table.add_column("counted as", overflow="fold")

    def cell(value: float) -> str:
        return f"{value / gib:.1f}" if value >= 0.05 * gib else "-"

    def row(name: str, cells: list[str], how: str) -> None:
        table.add_row(name, *cells, *([how] if beside else []))

    hows = [(term.name, escape(term.how)) for term in estimate.terms] + [("peak allocated", "torch.cuda.max_memory_allocated")]
    for term in estimate.terms:
        row(term.name, [cell(term.at[moment]) for moment, _ in columns], escape(term.how))
    table.add_section()
    at_peak = {moment: moment == peak for moment, _ in columns}
    row("[bold]peak allocated[/]", [f"[bold]{cell(estimate.total(m))}[/]" if at_peak[m] else cell(estimate.total(m))
                                    for m, _ in columns], "torch.cuda.max_memory_allocated")
    extra = [("+ allocator headroom", estimate.headroom, f"{planner.ALLOCATOR_HEADROOM:.1%} of the peak: allocator fragments"),
             ("+ CUDA/NCCL overhead", estimate.overhead, "CUDA context, workspaces, NCCL")]
    for name, value, how in extra:
        row(name, [cell(value) if at_peak[m] else "" for m, _ in columns], how)
        hows.append((name, how))
    verdict = "[green]fits[/]" if estimate.fits_gpu else "[bold red]does not fit[/]"
    row("[bold]needed[/]", [f"[bold]{cell(estimate.needed)}[/]" if at_peak[m] else "" for m, _ in columns],
        f"of {estimate.gpu_memory_gib:g} GiB: {verdict}")
    out.print(table)
    if not beside:
        out.print(f"needed {cell(estimate.needed)} GiB of {estimate.gpu_memory_gib:g} GiB per GPU: {verdict}")
        legend = Table(show_edge=False, show_header=False, box=None, padding=(0, 1), title="counted as",
                       title_justify="left")
        legend.add_column(no_wrap=True, style="dim")
        legend.add_column(overflow="fold")
        for name, how in hows:
            legend.add_row(name, how)
        out.print(legend)
    if estimate.host_bytes:
        per_machine = setup.workers_per_node
        gpus = f"{per_machine} GPU{'s' if per_machine > 1 else ''} x " if per_machine > 1 else ""
        line = (f"host memory per machine: {gpus}({estimate.host_bytes / gib:.1f} GiB offloaded at its exact size + "
                f"~{planner.WORKER_HOST_GIB:g} GiB a worker) = {estimate.host_needed / gib:.1f} GiB")
        if estimate.host_memory_gib is not None:
            verdict = "[green]fits[/]" if estimate.fits_host else "[bold red]does not fit: host memory[/]"
            line += f" of {estimate.host_memory_gib:.1f} GiB: {verdict}"
        else:
            line += " needed; not checked: the host's size is not known (--host-memory GIB)"
        out.print(line, soft_wrap=True)

    print_step_time(result)

    if result.suggestions:
        out.print()
        memory = "GPU and host memory" if not estimate.fits_host else "GiB needed per GPU"
        out.print(f"[bold]To fit {seq} tokens[/] ({memory}):")
        advice = Table(show_edge=False, show_header=False, box=None, padding=(0, 2))
        advice.add_column()
        advice.add_column(justify="right")
        advice.add_column(justify="right")
        advice.add_column()
        for item in result.suggestions:
            found = item.estimate
            host = f"host {found.host_needed / gib:.1f} GiB" if not estimate.fits_host else ""
            verdict = "[green]fits[/]" if found.fits else "[red]does not fit[/]" if found.fits_host else \
                "[red]does not fit: host memory[/]"
            advice.add_row(escape(item.what), f"{found.needed / gib:.1f} GiB", host, verdict)
        out.print(advice)

    out.print()
    scan = Table(show_edge=False, title=f"longest sequence that fits, all GPUs splitting it, {estimate.gpu_memory_gib:g} GiB each",
                 title_justify="left")
    scan.add_column("GPUs")
    for gpus, _, _ in result.longest:
        scan.add_column(str(gpus), justify="right")
    scan.add_row("these options", *[planner.format_tokens(n) if n else "-" for _, n, _ in result.longest])
    better = ", ".join(planner.option_names(result.all_options))
    if result.all_options:
        scan.add_row(f"+ {escape(better)}", *[planner.format_tokens(n) if n else "-" for _, _, n in result.longest])
    if result.longest_sp:
        by_gpus = {gpus: (layout, n) for gpus, layout, n in result.longest_sp}
        scan.add_row("Ulysses: sp x cp", *[f"{by_gpus[g][0].sp}x{by_gpus[g][0].cp}" if g in by_gpus else "-"
                                           for g, _, _ in result.longest])
        scan.add_row("  these options", *[planner.format_tokens(by_gpus[g][1]) if g in by_gpus and by_gpus[g][1]
                                         else "-" for g, _, _ in result.longest])
    out.print(scan)
    layout, ranks = result.layout, setup.seq_ranks
    if resolved.split is not None:
        out.print(f"Split of the {ranks} sequence GPUs by sp_size auto: sp {setup.sp} x cp {setup.cp} "
                  f"({escape(resolved.split)}).", soft_wrap=True)
    elif layout is not None and (layout.sp, layout.cp) != (setup.sp, setup.cp):
        out.print(f"Split for {ranks} sequence GPUs: --sp-size {layout.sp} --cp-size {layout.cp}, or --sp-size auto "
                  f"--cp-size {ranks} ({escape(layout.reason)}).", soft_wrap=True)

    def needs(found) -> str:
        return "more than 4096 GPUs" if found is None else f"{found.setup.gpus} GPU{'s' if found.setup.gpus > 1 else ''}"

    line = f"{seq} tokens need {needs(result.needed)} with these options"
    split = result.needed_sp
    if split is not None and (result.needed is None or split.setup.gpus < result.needed.setup.gpus):
        line = f"{seq} tokens need {needs(split)} with these options (sp {split.setup.sp} x cp {split.setup.cp})"
    if result.all_options:
        line += f", {needs(result.needed_all)} with + {better}"
    out.print(escape(line) + ".")


def print_step_time(result: Any) -> None:
    """The step's predicted time by component, and the layouts that fit ranked by their time."""
    from cpctl import planner

    out = _stdout()
    time, figures = result.time, result.figures
    if time is None:
        return
    fits = "" if result.estimate.fits else " (if it fitted)"
    parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in sorted(time.seconds.items(), key=lambda kv: -kv[1])
                      if seconds >= 0.005)
    out.print()
    out.print(f"[bold]step time[/]{fits}: {time.total:.2f} s, {time.tokens_per_s:,.0f} tokens/s "
              f"({time.tokens_per_s / time.gpus:,.0f} a GPU); seconds: {escape(parts)}")
    out.print(f"[dim]predicted over {escape(figures.name)}'s throughputs ({escape(figures.source)})[/]")
    if not result.ranked:
        return
    table = Table(show_edge=False, title="layouts that fit, fastest first (predicted)", title_justify="left")
    for title in ("layout", "step s", "tokens/s", "peak GiB"):
        table.add_column(title, justify="left" if title == "layout" else "right")
    current = result.estimate.setup
    for entry in result.ranked[:8]:
        chosen = entry.setup
        same = (chosen.sp, chosen.cp, chosen.strategy, chosen.activation_checkpointing, chosen.checkpoint_level) == (
            current.sp, current.cp, current.strategy, current.activation_checkpointing, current.checkpoint_level)
        label = escape(entry.label()) + (" [dim](this profile's)[/]" if same else "")
        table.add_row(label, f"{entry.time.total:.2f}", f"{entry.time.tokens_per_s:,.0f}",
                      f"{entry.estimate.peak / planner.GiB:.1f}")
    out.print(table)
    if len(result.ranked) > 8:
        out.print(f"[dim]and {len(result.ranked) - 8} slower (--json lists them all)[/]")


def print_throughputs(figures: Any) -> None:
    """What `cpctl plan --calibrate` measured."""
    out = _stdout()
    out.print(f"[bold]{escape(figures.name)}[/]: {escape(figures.source)}")
    table = Table(show_edge=False, show_header=False, box=None, padding=(0, 2))
    table.add_column(style="dim")
    table.add_column(justify="right")
    rows = [("bf16 matmuls", f"{figures.matmul_tflops:g} TFLOP/s")]
    rows += [(f"attention, head dim {dim}", f"forward {figures.attention_forward_tflops[dim]:g}, backward "
              f"{figures.attention_backward_tflops[dim]:g} TFLOP/s") for dim in sorted(figures.attention_forward_tflops)]
    rows += [("windows and documents", f"{figures.masked_attention_share:.0%} of the dense kernel's rate"),
             ("elementwise over HBM", f"{figures.hbm_gbps:g} GB/s"), ("pinned copies over PCIe", f"{figures.pcie_gbps:g} GB/s"),
             ("AdamW on the host", f"{figures.host_adam_params_per_s / 1e9:.2f} G parameters/s")]
    for name, value in rows:
        table.add_row(name, value)
    out.print(table)


def lora_line(model: Any, estimate: Any) -> str:
    """What LoRA trains and what it freezes, and where the frozen base's dtype came from, in one line."""
    from cpctl import planner

    lora, sizes = estimate.setup.lora, planner.Sizes(model, estimate.setup, estimate.seq_len)
    if lora.base_dtype is not None:
        source = "--base-dtype"
    elif model.weights_dtype is not None:
        source = "the model's config.json"
    else:
        source = "the model names no dtype, as from_config builds it; --base-dtype bf16 for a bf16 checkpoint"
    adapted = len(lora.targeted(model.projections))
    return (f"LoRA: {sizes.adapter_params / 1e6:.1f}M adapter parameters trained in fp32 "
            f"({sizes.adapter_params / model.params:.2%} of the model), rank {lora.rank} on {adapted} "
            f"projections x {model.n_layers} blocks; the base frozen in {sizes.base_dtype} ({source})")


# ----------------------------------------------------------------------------- dry run


def note_without_cp(profile) -> None:
    """Several ranks of which none splits a sequence: said first, since CP is what cpctl is for. One
    process has nothing to split with (its attention still runs on cpctl's engine): nothing to say."""
    world = profile.launch.nnodes * profile.launch.nproc_per_node
    if profile.parallelism.cp_size == 1 and profile.parallelism.sp_size == 1 and world > 1:
        _stdout().print(f"[yellow]note:[/] cp_size 1: the {world} ranks split batches, not sequences (each holds "
                        "whole sequences); pass --cp-size N to split each sequence over N ranks", soft_wrap=True)


def note_more_processes_than_cores(profile, *, cores: int | None) -> None:
    """CPU workers beyond this machine's cores each get a slice of one, and a run that looks hung
    is only slow: said before they start."""
    launch = profile.launch
    if launch.device == "cpu" and cores and launch.nproc_per_node > cores:
        _stdout().print(f"[yellow]note:[/] {launch.nproc_per_node} CPU processes on {cores} cores: each gets "
                        f"{cores / launch.nproc_per_node:.2g} of a core, so every step is that much slower; "
                        f"--nproc-per-node {cores} or fewer runs at full speed", soft_wrap=True)


def auto_split(resolved) -> str | None:
    """The split sp_size auto chose, and why, in one line (None when sp_size was not auto)."""
    reason = resolved.auto_reason("parallelism.sp_size")
    if reason is None:
        return None
    par = resolved.profile.parallelism
    return f"sp_size auto: sp {par.sp_size} x cp {par.cp_size}, for {reason}"


def ulysses_note(profile) -> str | None:
    """What sp_size does in this layout, and what it asks of the model, in one line (None without it)."""
    par, nproc = profile.parallelism, profile.launch.nproc_per_node
    if par.sp_size == 1:
        return None
    span = par.sp_size * par.tp_size
    where = ("inside one node" if nproc % span == 0 else
             f"across nodes (sp x tp = {span} > {nproc} processes per node: its all-to-all leaves NVLink)")
    ring = f", the {par.cp_comm_strategy} ring over cp {par.cp_size} outside it" if par.cp_size > 1 else ""
    return (f"Ulysses: sp {par.sp_size} on consecutive ranks, {where}{ring}; each sequence is split over "
            f"cp x sp = {par.cp_size * par.sp_size} ranks. The model's attention heads (per tp rank) must divide by "
            f"{par.sp_size} (checked at prepare_model); K/V heads fewer than {par.sp_size} are repeated, exactly.")


def node_order(plan: LaunchPlan) -> str:
    """What the mesh table's node column means for this launch: which machine runs which ranks."""
    nproc, node_rank = plan.resolved.profile.launch.nproc_per_node, plan.node_rank
    writer = "global rank 0 (it writes checkpoints, saved models and logs)"
    if node_rank is not None:
        first = node_rank * nproc
        these = f"rank {first}" if nproc == 1 else f"ranks {first}-{first + nproc - 1}"
        where = "here" if node_rank == 0 else "on node rank 0"
        return (f"node = node rank: each machine runs the ranks of the node rank it is given; this one, node rank "
                f"{node_rank}, runs {these}; {writer} runs {where}.")
    source = plan.resolved.sources.get("launch.node_rank", "default")
    shared = "" if source == "default" else f"; launch.node_rank from {source} is every machine's"
    return (f"node = a place in the rendezvous: this machine was given no node rank of its own (--node-rank, "
            f"CPCTL_NODE_RANK, SLURM{shared}), so it takes a place no machine was given, in c10d's order (by host "
            f"name); give each machine its own --node-rank to decide which one runs {writer}.")


SCRIPT_APIS = {
    "cpctl": "a cpctl script: its cpctl.init() reads the profile",
    "accelerate": "an accelerate script: the profile becomes accelerate's environment, the worker starts in "
                  "cpctl.integrations.accelerate_shim",
}


def precision(resolved) -> str:
    """What the workers train in and where that came from, in one line (a --config file's
    mixed_precision: bf16 would otherwise train a script that never asked for it in bf16, unsaid)."""
    fsdp = resolved.profile.fsdp
    where = resolved.sources.get("fsdp.mixed_precision", "default")
    if fsdp.mixed_precision == "no":
        compute = "fp32 compute (fsdp.mixed_precision no"
    else:
        compute = f"{fsdp.mixed_precision} compute, fp32 gradient reduction (fsdp.mixed_precision {fsdp.mixed_precision}"
    weights = ("fp32 master weights and optimizer state" if fsdp.master_weights == "fp32"
               else "weights and optimizer state in the dtype they arrive in (fsdp.master_weights keep)")
    return f"{compute}, from {where}); {weights}"


def print_launch_plan(plan: LaunchPlan, *, target: str, problem_here: str | None, notes: Sequence[str] = ()) -> None:
    from cpctl.launch.envinfo import describe
    from cpctl.layout import MESH_AXES, mesh_table

    out = _stdout()
    resolved = plan.resolved
    note_without_cp(resolved.profile)
    out.print(f"[bold]Resolved profile[/] as on {escape(target)} "
              "(highest source wins: flag > env > SLURM > --config/--profile > ./cpctl.yaml > user default > default)",
              soft_wrap=True)
    profile_table = Table(show_edge=False)
    for column in ("key", "value", "source"):
        profile_table.add_column(column, overflow="fold")
    for path, value, source in resolved.rows():
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        profile_table.add_row(path, escape(shown), escape(source))
    out.print(profile_table)
    for note in notes:
        out.print(f"[dim]{escape(note)}[/]", soft_wrap=True)
    api, source = resolved.profile.launch.script_api, resolved.sources.get("launch.script_api", "default")
    reason = resolved.auto_reason("launch.script_api")
    why = source if reason is None else f"auto: {reason}"
    out.print(f"[bold]Script[/]: {SCRIPT_APIS[api]} (launch.script_api {api}; {escape(why)})", soft_wrap=True)
    out.print(f"[bold]Precision[/]: {escape(precision(resolved))}", soft_wrap=True)
    memory = resolved.profile.memory
    if resolved.profile.fsdp.activation_checkpointing and memory.checkpoint_level == "mixed":
        if memory.selective_blocks == FIT:
            chosen = ("as many blocks as fit, chosen at the first step from cpctl plan's memory model for this GPU "
                      "and the step's length (`cpctl plan --model M --seq-len S --checkpoint-level mixed` shows the "
                      "count; --selective-blocks N pins it)")
        else:
            chosen = f"the last {memory.selective_blocks} blocks"
        out.print(f"Checkpointing: selective for {escape(chosen)}, full for the rest.", soft_wrap=True)

    profile = resolved.profile
    world, nproc = profile.world_size, profile.launch.nproc_per_node
    out.print()
    out.print(f"[bold]Mesh layout[/]: {escape(describe(resolved))}", soft_wrap=True)
    if profile.parallelism.cp_size > 1:
        strategy = Strategy.parse(profile.parallelism.cp_comm_strategy)
        out.print(f"K/V across cp: {strategy.what} (cp_comm_strategy {strategy.value})", soft_wrap=True)
    if profile.parallelism.sp_size > 1:
        out.print(f"Heads across sp: Ulysses, an all-to-all of q, k, v over the {profile.parallelism.sp_size} sp ranks "
                  "before attention, and of its output after", soft_wrap=True)
    mesh = Table(show_edge=False)
    for column in ("rank", "node", "local rank", *MESH_AXES):
        mesh.add_column(column, justify="right")
    coordinates = mesh_table(profile.parallelism, world)
    shown_rows = coordinates
    if world > MESH_HEAD_ROWS + MESH_TAIL_ROWS:
        shown_rows = coordinates[:MESH_HEAD_ROWS] + [None] + coordinates[-MESH_TAIL_ROWS:]
    for coord in shown_rows:
        if coord is None:
            mesh.add_row("…", *[""] * (2 + len(MESH_AXES)))
            continue
        axes = [str(getattr(coord, axis)) for axis in MESH_AXES]
        mesh.add_row(str(coord.rank), str(coord.rank // nproc), str(coord.rank % nproc), *axes)
    out.print(mesh)
    if world > MESH_HEAD_ROWS + MESH_TAIL_ROWS:
        out.print(f"[dim]{world - MESH_HEAD_ROWS - MESH_TAIL_ROWS} ranks not shown[/]")
    split = auto_split(resolved)
    if split:
        out.print(escape(split), soft_wrap=True)
    ulysses = ulysses_note(profile)
    if ulysses:
        out.print(escape(ulysses), soft_wrap=True)
    if profile.launch.nnodes > 1:
        out.print(f"[dim]{escape(node_order(plan))}[/]", soft_wrap=True)

    told = accelerate_env(profile)
    if told:
        engine = profile.parallelism.cp_engine
        out.print()
        out.print("[bold]What accelerate is told[/] (the variables `accelerate launch` would set; the script's "
                  "Accelerator reads them):", soft_wrap=True)
        variables = Table(show_edge=False)
        variables.add_column("variable")
        variables.add_column("value")
        for name, value in told.items():
            variables.add_row(name, value)
        out.print(variables)
        out.print(f"Attention under CP: [bold]{ENGINES[engine]}[/] (parallelism.cp_engine: {engine})", soft_wrap=True)
        par = profile.parallelism
        if par.sp_size > 1:
            out.print(f"sp_size {par.sp_size}: cpctl's Ulysses, not DeepSpeed's: the script's Accelerator sees the "
                      f"{par.cp_size * par.sp_size} ranks of each sequence as its cp axis (FSDP, the batch and the loss "
                      "treat them alike), and cpctl's engine splits them into Ulysses and the ring", soft_wrap=True)

    out.print()
    out.print("[bold]Worker command[/] (what cpctl launch runs, as a shell line):")
    out.print(plan.command_line(), markup=False, highlight=False, soft_wrap=True)
    if "--standalone" in plan.torchrun_args:
        out.print("[dim]cpctl launch binds the rendezvous stores of --standalone to 127.0.0.1 only; plain torchrun "
                  "listens on every interface.[/]", soft_wrap=True)
    if "--rdzv-backend=c10d" in plan.torchrun_args:
        out.print("[dim]cpctl launch runs this c10d rendezvous with each machine placed by its node rank; plain "
                  "torchrun's c10d ignores --node-rank and sorts the machines by host name.[/]", soft_wrap=True)
    out.print(
        f"[dim]The resolved profile reaches every worker as JSON in {PROFILE_ENV_VAR}; "
        "torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.[/]",
        soft_wrap=True,
    )
    if problem_here is not None:
        out.print(f"[yellow]Here it would not launch:[/] {escape(problem_here)}", soft_wrap=True)
