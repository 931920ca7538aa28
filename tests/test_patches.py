"""The one registry of cpctl's changes to other libraries (cpctl/integrations/patches.py): every
patch is applied through it, version-gated, checked against the shape it relies on, and
`remove()` puts every original back (and forgets what was noted about other libraries' objects)."""

from __future__ import annotations

import gc
import types
from types import SimpleNamespace

import pytest

from cpctl.errors import CpctlError
from cpctl.integrations.patches import Patches, require_known
from cpctl.upstream import SUPPORTED, Shape, shape_refusal


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
    runtime = SimpleNamespace(cp_size=2, seq_size=2, config=profile, mesh=SimpleNamespace(seq_enabled=True))
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


def refused(make_patch) -> str:
    """The refusal a patch raises: one line, and the owner left as it was."""
    with pytest.raises(CpctlError) as raised:
        make_patch()
    message = str(raised.value)
    assert "\n" not in message and "is not what cpctl adapts" in message, message
    return message


class Upstream:
    """A release of a library as a patch expects it."""

    __module__ = "accelerate.accelerator"  # so a refusal names the releases cpctl supports of accelerate

    def gather(self, tensor):
        return tensor

    def gather_for_metrics(self, input_data, use_gather_object=False):
        return self.gather(input_data)

    @property
    def cp_enabled(self) -> bool:
        return True


class Changed:
    """The same library, a release later: every name a patch relies on renamed or gone."""

    __module__ = "accelerate.accelerator"

    def gather(self, tensors):
        return tensors

    def gather_for_metrics(self, data):
        return data

    def cp_enabled(self) -> bool:
        return True


def test_a_patch_checks_the_shape_it_relies_on_before_replacing_anything() -> None:
    patches = Patches()
    originals = dict(Changed.__dict__)
    shapes = {"gather": Shape(parameters=("tensor",)), "cp_enabled": Shape(kind=property),
              "gather_for_metrics": Shape(parameters=("input_data", "use_gather_object"), reads=("gather",)),
              "missing": Shape()}
    for name, shape in shapes.items():
        assert name == "missing" or shape_refusal(Upstream, name, shape) is None  # the release it was written for
        message = refused(lambda: patches.replace(Changed, name, lambda original: None, why="x", needs=shape))
        assert message.startswith(f"Changed.{name} of accelerate ")
        assert message.endswith(f"cpctl supports accelerate {SUPPORTED['accelerate']}")
    assert "(no parameter input_data, no parameter use_gather_object, no use of gather)" in shape_refusal(
        Changed, "gather_for_metrics", shapes["gather_for_metrics"])
    assert "(a function, not a property)" in shape_refusal(Changed, "cp_enabled", shapes["cp_enabled"])
    assert "(no attribute missing)" in shape_refusal(Changed, "missing", Shape())
    assert "(no attribute absent)" in shape_refusal(Upstream, "gather", Shape(uses=("absent",)))
    assert dict(Changed.__dict__) == originals and patches.applied() == []


def test_what_cpctl_notes_about_an_object_is_held_weakly_and_forgotten_with_the_patches() -> None:
    patches = Patches()

    class Config:  # a dataclass with eq: unhashable, as accelerate's ParallelismConfig
        __hash__ = None

    config, other = Config(), Config()
    patches.note(config, "requested sizes", {"cp_size": 2})
    assert patches.noted(config, "requested sizes") == {"cp_size": 2}
    assert patches.noted(other, "requested sizes") is None
    assert "requested sizes" not in vars(config)  # nothing set on the object itself
    del config
    gc.collect()
    assert patches._notes == {}  # gone with its object
    patches.note(other, "adopted", True)
    patches.remove()
    assert patches.noted(other, "adopted", False) is False


def test_accelerates_gather_keeps_one_cp_rank_per_group_only_inside_gather_for_metrics() -> None:
    """The swap of `gather` inside gather_for_metrics is a class patch in the registry: undone with it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from cpctl.integrations import accelerate_shim
    from cpctl.integrations.patches import PATCHES

    class Accelerator(Upstream):
        def gather(self, tensor):  # 4 ranks (dp 2 x cp 2), each holding its rank's number
            return torch.arange(4).repeat_interleave(tensor.numel())

    from cpctl.layout import MESH_AXES
    from cpctl.runtime.mesh import Axes, ParallelMesh

    originals = {name: Accelerator.__dict__.get(name) for name in ("gather", "gather_for_metrics")}
    sizes = {"dp_shard": 2, "cp": 2}  # the mesh's ranks as torch lays them out: dp_shard 2 x cp 2
    grid = torch.arange(4).view(*(sizes.get(name, 1) for name in MESH_AXES))
    mesh = ParallelMesh(root=SimpleNamespace(mesh=grid, mesh_dim_names=MESH_AXES), axes=Axes({}))
    context = SimpleNamespace(mesh=mesh, cp_active=False, seq_group=None)
    try:
        accelerate_shim._install_once_per_sequence(Accelerator, context)
        accelerator = Accelerator()
        assert accelerator.gather_for_metrics(torch.zeros(1)).tolist() == [0, 2]  # the first cp rank of each dp
        assert accelerator.gather(torch.zeros(1)).tolist() == [0, 1, 2, 3]  # outside: accelerate's own
        assert "gather" not in vars(accelerator)
    finally:
        PATCHES.remove()
    assert {name: Accelerator.__dict__.get(name) for name in originals} == originals


def test_the_accelerate_patches_refuse_a_release_that_changed_what_they_rely_on(monkeypatch) -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.parallelism_config import ParallelismConfig

    from cpctl.integrations import accelerate_shim, accelerate_sp
    from cpctl.integrations.patches import PATCHES

    class Accelerator:  # __init__ without the arguments whose values cpctl checks
        __module__ = "accelerate.accelerator"

        def __init__(self, config=None):
            self.config = config

    class Config:
        __module__ = "accelerate.parallelism_config"

        def __post_init__(self):  # reads no sizes: what cpctl sets before it would go unchecked
            pass

    profile = SimpleNamespace(fsdp=SimpleNamespace(mixed_precision="no"))
    monkeypatch.setattr(accelerate, "Accelerator", Accelerator)
    try:
        message = refused(lambda: accelerate_shim.install(profile, None))
        assert "Accelerator.__init__ of accelerate " in message
        lacks = "no attribute parallelism_config, no parameter parallelism_config, no parameter mixed_precision"
        assert f"({lacks})" in message
    finally:
        PATCHES.remove()
    assert shape_refusal(ParallelismConfig, "__post_init__", accelerate_sp.POST_INIT_SHAPE) is None
    changed = shape_refusal(Config, "__post_init__", accelerate_sp.POST_INIT_SHAPE)
    assert "(no use of cp_size, no use of sp_size)" in changed


def test_the_trl_patches_refuse_a_release_that_changed_what_they_rely_on() -> None:
    pytest.importorskip("trl")
    from trl.trainer.sft_trainer import SFTTrainer

    from cpctl.integrations import trl

    class Trainer:
        __module__ = "trl.trainer.sft_trainer"

        def __init__(self, args, accelerator):  # reads cp_enabled twice: the lift would answer both
            if accelerator.parallelism_config.cp_enabled and args.packing:
                raise ValueError("packing")
            self.sharded = accelerator.parallelism_config.cp_enabled

        def prediction_step(self, model, inputs, prediction_loss_only):
            return None

    assert shape_refusal(SFTTrainer, "__init__", trl.PACKING_REFUSAL) is None
    assert shape_refusal(SFTTrainer, "prediction_step", trl.PREDICTION_STEP) is None
    packing = shape_refusal(Trainer, "__init__", trl.PACKING_REFUSAL)
    assert f"(no use of eval_packing, 2 reads of cp_enabled, not one); cpctl supports trl {SUPPORTED['trl']}" in packing
    prediction = shape_refusal(Trainer, "prediction_step", trl.PREDICTION_STEP)
    assert "Trainer.prediction_step of trl " in prediction and "no attribute _prepare_inputs" in prediction
    assert "no parameter ignore_keys" in prediction


def test_multi_head_attention_is_routed_only_where_torch_calls_sdpa_by_name() -> None:
    pytest.importorskip("torch")
    from cpctl.attention import dispatch

    functional = types.ModuleType("torch.nn.functional")  # a torch whose MHA computes attention itself

    def multi_head_attention_forward(query, key, value, need_weights=True):
        return query

    functional.multi_head_attention_forward = multi_head_attention_forward
    assert dispatch._MHA_REFUSAL is None  # this torch's
    message = shape_refusal(functional, "multi_head_attention_forward", dispatch._MHA_SHAPE)
    assert message.startswith("torch.nn.functional.multi_head_attention_forward of torch ")
    assert f"(no use of scaled_dot_product_attention); cpctl supports torch {SUPPORTED['torch']}" in message


def test_whether_a_models_module_calls_sdpa_is_read_from_its_code_not_its_text() -> None:
    from cpctl.upstream import module_uses

    calls, mentions = types.ModuleType("modeling_calls"), types.ModuleType("modeling_mentions")
    exec("import torch\nclass Attention:\n    @property\n    def out(self):\n"
         "        return lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q)\n", vars(calls))
    exec('"""Unlike scaled_dot_product_attention(q, k, v), this attends by hand."""\n'
         "def attend(q):\n    return q  # not scaled_dot_product_attention(q, q, q)\n", vars(mentions))
    assert module_uses(calls, "scaled_dot_product_attention")  # in a lambda in a property of a class
    assert not module_uses(mentions, "scaled_dot_product_attention") and not module_uses(None, "x")


def test_torch_compiles_wrapper_is_known_without_importing_dynamo_and_gives_the_model_inside() -> None:
    """By type name and `_orig_mod`: were torch to rename its wrapper, a model compiled before
    prepare_model would no longer be refused (its graph keeps the attention it was traced with)."""
    import torch

    from cpctl.upstream import uncompiled

    model = torch.nn.Linear(2, 2)
    assert uncompiled(torch.compile(model)) is model and uncompiled(model) is model
