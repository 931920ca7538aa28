"""Resolving a profile: the layers overlaid, `auto` filled against the machine, the rules checked.

Highest first: `cpctl launch` flags > CPCTL_* variables > SLURM > --config/--profile >
./cpctl.yaml > the user default profile > built-in defaults. Inside a worker, torchrun's
actual world and `cpctl.init(**overrides)` are layers of the same kind.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cpctl.config.layers as L
from cpctl.config.rules import AutoChoice, Machine, detect_machine, fill_auto, first_problem, target_machine
from cpctl.config.schema import AUTO, DEFAULTS, KEYS, Flat, Profile
from cpctl.errors import CpctlError

if TYPE_CHECKING:
    from cpctl.launch.script_api import ScriptUse


@dataclass(frozen=True)
class Resolved:
    """A validated profile with every `auto` filled in and the source of every value."""

    profile: Profile
    sources: dict[str, str]
    files: tuple[Path, ...] = ()

    def rows(self) -> list[tuple[str, Any, str]]:
        return [(path, self.profile.get(path), self.sources.get(path, "default")) for path in KEYS]

    def auto_reason(self, path: str) -> str | None:
        """Why `auto` chose the value at `path`; None when it was not auto's choice."""
        source = self.sources.get(path)
        return source.reason if isinstance(source, AutoChoice) else None


def user_layers(*, config: str | Path | None = None, profile_name: str | None = None,
                environ: Mapping[str, str], cwd: Path) -> tuple[list[L.Layer], tuple[Path, ...]]:
    """The user default profile, ./cpctl.yaml, --config or --profile, SLURM and CPCTL_*: lowest first."""
    if config is not None and profile_name is not None:
        raise CpctlError("--config and --profile both given; pass one of them")
    found: list[tuple[Path, str]] = []
    user_default = L.user_config_dir(environ) / L.USER_PROFILE_NAME
    if user_default.is_file():
        found.append((user_default, f"user default {user_default}"))
    if (cwd / L.LOCAL_PROFILE).is_file():
        found.append((cwd / L.LOCAL_PROFILE, f"./{L.LOCAL_PROFILE}"))
    if config is not None:
        found.append((cwd / Path(config).expanduser(), f"--config {config}"))  # an absolute path stays as is
    if profile_name is not None:
        path = L.find_profile(profile_name, cwd=cwd, environ=environ)
        found.append((path, f"--profile {profile_name} ({path})"))
    layers = [L.file_layer(path, source) for path, source in found]
    return [*layers, L.slurm_layer(environ), L.env_layer(environ)], tuple(path for path, _ in found)


def overlay(layers: Sequence[L.Layer], *, defaults: bool = True) -> L.Layer:
    """The layers overlaid, later ones winning, with each value's source; built-in defaults under all."""
    values, sources = dict(DEFAULTS) if defaults else {}, {}
    for layer in layers:
        values.update(layer.values)
        sources.update(layer.sources)
    return L.Layer(values, sources)


def complete(layer: L.Layer, *, machine: Machine, files: tuple[Path, ...] = (),
             script: ScriptUse | None = None) -> Resolved:
    """`auto` filled on `machine` (and `launch.script_api` from `script`), every rule checked,
    the typed Profile built."""
    values, why = fill_auto(layer.values, machine=machine, script=script, sources=layer.sources)
    problem = first_problem(values, machine=machine)
    if problem is not None:
        raise CpctlError(problem)
    left = [path for path, value in values.items() if value == AUTO]
    if left:  # every rule passed, so nothing should be left; say which if something is
        raise CpctlError(f"{left[0]}: auto could not be resolved on this machine; set it explicitly")
    return Resolved(profile=Profile.from_flat(values), sources={**layer.sources, **why}, files=files)


def merge_layers(*, flags: Mapping[str, Any] | None = None, config: str | Path | None = None,
                 profile_name: str | None = None, environ: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None) -> tuple[Flat, dict[str, str], tuple[Path, ...]]:
    """The values the layers set (no defaults), before `auto` is filled: what a profile asks
    of its machine."""
    environ = os.environ if environ is None else environ
    cwd = Path.cwd() if cwd is None else Path(cwd)
    found, files = user_layers(config=config, profile_name=profile_name, environ=environ, cwd=cwd)
    merged = overlay([*found, L.flag_layer(flags or {})], defaults=False)
    return merged.values, merged.sources, files


def resolve(*, flags: Mapping[str, Any] | None = None, config: str | Path | None = None,
            profile_name: str | None = None, environ: Mapping[str, str] | None = None,
            cwd: str | Path | None = None, machine: Machine | None = None,
            script: ScriptUse | None = None) -> Resolved:
    """The profile `cpctl launch`/`check` runs with (see the module docstring for the order);
    `script`: what the script's source shows, for `launch.script_api: auto`."""
    environ = os.environ if environ is None else environ
    values, sources, files = merge_layers(flags=flags, config=config, profile_name=profile_name,
                                          environ=environ, cwd=cwd)
    machine = detect_machine(environ) if machine is None else machine
    return complete(L.Layer({**DEFAULTS, **values}, sources), machine=machine, files=files, script=script)


@dataclass(frozen=True)
class Preview:
    """A profile resolved as on the machine it is written for, and whether it launches here."""

    resolved: Resolved
    target: str  # that machine, in words
    problem_here: str | None  # why it would not launch on this machine; None if it would


def preview(*, flags: Mapping[str, Any] | None = None, config: str | Path | None = None,
            profile_name: str | None = None, environ: Mapping[str, str] | None = None,
            cwd: str | Path | None = None, machine: Machine | None = None,
            script: ScriptUse | None = None) -> Preview:
    """What `launch --dry-run` and `check --static` show: a cuda profile resolved with the GPUs
    it asks for, even on a laptop or a CPU CI box."""
    environ = os.environ if environ is None else environ
    values, sources, files = merge_layers(flags=flags, config=config, profile_name=profile_name,
                                          environ=environ, cwd=cwd)
    here = detect_machine(environ) if machine is None else machine
    target, described = target_machine(values, detected=here)
    layer = L.Layer({**DEFAULTS, **values}, sources)
    resolved = complete(layer, machine=target, files=files, script=script)
    problem = None
    if target != here:
        try:
            complete(layer, machine=here, script=script)
        except CpctlError as exc:
            problem = str(exc)
    return Preview(resolved, described, problem)


def for_worker(overrides: Mapping[str, Any], *, environ: Mapping[str, str], cuda_devices: int,
               cwd: str | Path | None = None) -> Resolved:
    """The profile inside a worker: the one `cpctl launch` resolved (CPCTL_RESOLVED_PROFILE), or,
    under plain torchrun or python, the user's layers with torchrun's actual world on top; then
    `cpctl.init(**overrides)` above all."""
    passed = environ.get(L.PROFILE_ENV_VAR)
    if passed:
        try:
            tree = json.loads(passed)
        except json.JSONDecodeError as exc:
            raise CpctlError(f"{L.PROFILE_ENV_VAR} is not the JSON `cpctl launch` writes ({exc.msg} at character "
                             f"{exc.pos}); unset it, or start the script with cpctl launch") from None
        layers = [L.tree_layer(tree, L.PROFILE_ENV_VAR)]
        files: tuple[Path, ...] = ()
    else:
        environ = {k: v for k, v in environ.items() if k != L.PROFILE_ENV_VAR}
        layers, files = user_layers(environ=environ, cwd=Path.cwd() if cwd is None else Path(cwd))
        layers.append(L.torchrun_layer(environ))
    layers.append(L.overrides_layer(overrides))
    resolved = complete(overlay(layers), machine=Machine(cuda_devices=cuda_devices), files=files)
    world = int(environ.get("WORLD_SIZE", "1"))
    if resolved.profile.world_size != world:  # e.g. a profile passed on by hand to another launcher
        raise CpctlError(f"the profile is for {resolved.profile.world_size} processes but this job has WORLD_SIZE "
                         f"{world}" + (f"; {L.PROFILE_ENV_VAR} was resolved for another launch: unset it" if passed else ""))
    return resolved
