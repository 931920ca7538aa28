"""The one registry of cpctl's changes to other libraries (cpctl/integrations/patches.py): every
patch is applied through it, version-gated, and `remove()` puts every original back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cpctl.errors import CpctlError
from cpctl.integrations.patches import Patches, require_known


class Library:
    @property
    def enabled(self) -> bool:
        return True

    def method(self) -> str:
        return "original"


class Subclass(Library):
    pass


def test_patches_are_undone_as_one_newest_first() -> None:
    patches = Patches()
    originals = dict(Library.__dict__)
    patches.replace(Library, "method", lambda original: lambda self: f"patched {original(self)}", why="a")
    patches.replace(Library, "method", lambda original: lambda self: f"again {original(self)}", why="b")
    patches.replace(Library, "enabled", lambda original: property(lambda self: not original.fget(self)), why="c")
    patches.replace(Subclass, "method", lambda original: lambda self: "own", why="d")  # inherited: none of its own
    assert Library().method() == "again patched original" and Library().enabled is False
    assert Subclass().method() == "own" and patches.is_patched(Library, "enabled")
    assert patches.applied()[0] == "Library.method: a"
    patches.remove()
    assert dict(Library.__dict__) == originals and "method" not in Subclass.__dict__
    assert Library().method() == "original" and Library().enabled is True and patches.applied() == []


class Registry:
    """As transformers' GeneralInterface: implementations by name in a class-wide dict."""

    _global_mapping = {"sdpa": "transformers' own"}

    @classmethod
    def register(cls, key: str, value: str) -> None:
        cls._global_mapping.update({key: value})


def test_an_entry_of_a_registry_is_undone_with_the_patches() -> None:
    patches = Patches()
    patches.register(Registry, "cpctl", "ours", why="a")
    patches.register(Registry, "sdpa", "replaced", why="b")
    assert Registry._global_mapping == {"sdpa": "replaced", "cpctl": "ours"}
    assert patches.is_patched(Registry, "cpctl") and not patches.is_patched(Registry, "eager")
    assert patches.applied() == ["Registry['cpctl']: a", "Registry['sdpa']: b"]
    patches.remove()
    assert Registry._global_mapping == {"sdpa": "transformers' own"} and not patches.is_patched(Registry, "cpctl")
    with pytest.raises(CpctlError, match="Library is not the registry cpctl knows"):
        patches.register(Library, "cpctl", "ours", why="c")


def test_a_release_cpctl_has_not_checked_is_one_line() -> None:
    assert require_known("pytest", (".".join(pytest.__version__.split(".")[:2]),), what="x")
    with pytest.raises(CpctlError, match=r"pytest \S+ is not a release cpctl knows for tests \(0.1\).*pytest==0.1"):
        require_known("pytest", ("0.1",), what="tests")


def test_trl_and_the_trainer_are_patched_through_the_registry_and_restored() -> None:
    pytest.importorskip("trl")
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import Trainer, TrainingArguments
    from trl.trainer.sft_trainer import SFTTrainer

    from cpctl.integrations import trainer, trl
    from cpctl.integrations.patches import PATCHES

    before = {(owner, name): owner.__dict__[name] for owner, name in (
        (Trainer, "compute_loss"), (Trainer, "prediction_step"), (Trainer, "__init__"),
        (TrainingArguments, "__post_init__"), (SFTTrainer, "prediction_step"), (ParallelismConfig, "cp_enabled"))}
    profile = SimpleNamespace(fsdp=SimpleNamespace(mixed_precision="no"), launch=SimpleNamespace(device="cpu"))
    runtime = SimpleNamespace(cp_size=2, seq_size=2, config=profile)
    try:
        trainer.install(runtime)
        trl.install(runtime)
        trl.install(runtime)  # once per process
        assert all(owner.__dict__[name] is not original for (owner, name), original in before.items())
        assert sum("SFTTrainer.prediction_step" in line for line in PATCHES.applied()) == 1
        assert ParallelismConfig(cp_size=2).cp_enabled is True  # read from anywhere but TRL's check: unchanged
    finally:
        PATCHES.remove()
    assert all(owner.__dict__[name] is original for (owner, name), original in before.items())
