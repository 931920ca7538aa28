"""Which API a script is written with, read from its source (`launch.script_api: auto`), in plain
Python: nothing here imports or runs the scripts it reads."""

from __future__ import annotations

from pathlib import Path

import pytest
from launching import REPO
from test_profile import resolve_apart, source_of

from cpctl import config as P
from cpctl.errors import CpctlError
from cpctl.launch.script_api import detect, disagreement


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def route(tmp_path: Path, source: str, *, cp_size: int = 2, name: str = "train.py") -> tuple[str, str]:
    write(tmp_path / name, source)
    use = detect(name, module=False, cwd=tmp_path)
    assert use is not None
    return use.route(cp_size=cp_size)


@pytest.mark.parametrize(("script", "api", "line", "why"), [
    ("scripts/accelerate_cp.py", "accelerate", "accelerator = Accelerator(", "builds an Accelerator"),
    ("scripts/trainer_cp.py", "accelerate", "trainer = Trainer(", "uses transformers' Trainer"),
    ("scripts/train_llama.py", "cpctl", "rt = cpctl.init()", "calls cpctl.init()"),
])
def test_the_shipped_scripts(script: str, api: str, line: str, why: str) -> None:
    number = next(n for n, text in enumerate((REPO / script).read_text().splitlines(), 1) if line in text)
    use = detect(script, module=False, cwd=REPO)
    assert use is not None and use.route(cp_size=2) == (api, f"{script}:{number} {why}")


@pytest.mark.parametrize(("source", "api", "what"), [
    ("import accelerate as acc\nacc.Accelerator()\n", "accelerate", "train.py:2 builds an Accelerator"),
    ("from accelerate import Accelerator\nclass Mine(Accelerator): pass\n", "accelerate", "builds an Accelerator"),
    ("from transformers import Seq2SeqTrainer as T\nT(model=None)\n", "accelerate", "uses transformers' Seq2SeqTrainer"),
    ("from trl import SFTTrainer\nclass Mine(SFTTrainer): pass\n", "accelerate", "uses TRL's SFTTrainer"),
    ("import trl\ntrl.GRPOTrainer(model=None)\n", "accelerate", "uses TRL's GRPOTrainer"),
    ("import transformers\ntransformers.trainer.Trainer(model=None)\n", "accelerate", "uses transformers' Trainer"),
    ("from cpctl import init as start\nrt = start()\n", "cpctl", "calls cpctl.init()"),
    ("import cpctl as cp\nrt = cp.init(cp_size=2)\n", "cpctl", "calls cpctl.init()"),
], ids=["alias", "subclass", "seq2seq", "trl-subclass", "trl-attribute", "submodule", "from-import", "module-alias"])
def test_each_way_of_writing_it(tmp_path: Path, source: str, api: str, what: str) -> None:
    got, why = route(tmp_path, source)
    assert got == api and why.endswith(what), why


@pytest.mark.parametrize("source", [
    "from accelerate import Accelerator\n",  # imported, never used
    "from transformers import TrainingArguments, TrainerCallback\nTrainingArguments(output_dir='x')\n",
    "import torch.distributed as dist\ndist.init_process_group('gloo')\n",
    "def f(cpctl):\n    return cpctl.init()\n",  # a parameter named cpctl is not the package
])
def test_what_is_not_a_use(tmp_path: Path, source: str) -> None:
    assert route(tmp_path, source, cp_size=1)[0] == "cpctl"  # neither: safe without CP ...
    with pytest.raises(CpctlError, match="neither cpctl.init"):  # ... refused with it
        route(tmp_path, source, cp_size=2)


def test_the_loop_in_a_local_module_counts(tmp_path: Path) -> None:
    write(tmp_path / "lib" / "loop.py", "import cpctl\n\n\ndef main():\n    return cpctl.init()\n")
    write(tmp_path / "lib" / "__init__.py", "raise SystemExit('read, never imported')\n")
    assert route(tmp_path, "from lib.loop import main\nmain()\n") == ("cpctl", "lib/loop.py:5 calls cpctl.init()")


def test_a_module_and_its_relative_imports(tmp_path: Path) -> None:
    write(tmp_path / "pkg" / "__init__.py", "")
    write(tmp_path / "pkg" / "__main__.py", "from .train import run\nrun()\n")
    write(tmp_path / "pkg" / "train.py", "from accelerate import Accelerator\n\n\ndef run():\n    Accelerator()\n")
    use = detect("pkg", module=True, cwd=tmp_path)
    assert use is not None and use.route(cp_size=2) == ("accelerate", "pkg/train.py:5 builds an Accelerator")
    assert [path.name for path in use.files] == ["__main__.py", "train.py"]


def test_libraries_are_never_read(tmp_path: Path) -> None:
    # a local folder named like a library (or the library itself) uses the APIs in its own code
    write(tmp_path / "accelerate" / "__init__.py", "from accelerate.accelerator import Accelerator\nAccelerator()\n")
    with pytest.raises(CpctlError, match=r"neither cpctl.init\(\) nor an Accelerator or Trainer found \(read 1 file\)"):
        route(tmp_path, "import accelerate\nprint(accelerate)\n")


def test_both_apis_is_refused_with_the_flag_to_pass(tmp_path: Path) -> None:
    source = "import cpctl\nfrom accelerate import Accelerator\nrt = cpctl.init()\naccelerator = Accelerator()\n"
    for cp_size in (1, 2):
        with pytest.raises(CpctlError) as caught:
            route(tmp_path, source, cp_size=cp_size)
        assert str(caught.value) == ("train.py: train.py:3 calls cpctl.init() and train.py:4 builds an Accelerator; "
                                     "cannot tell which of the two starts the processes: pass --script-api cpctl or "
                                     "--script-api accelerate")


def test_neither_says_what_was_read(tmp_path: Path) -> None:
    write(tmp_path / "helpers.py", "X = 1\n")
    with pytest.raises(CpctlError) as caught:
        route(tmp_path, "import argparse\nimport helpers\n", cp_size=4)
    assert str(caught.value) == (
        "train.py: neither cpctl.init() nor an Accelerator or Trainer found (read 2 files); with cp_size 4 its "
        "processes would run without context parallelism: call cpctl.init() in it, or pass --script-api cpctl "
        "(it reaches cpctl.init() another way) or --script-api accelerate (an accelerate or Trainer script)")
    with pytest.raises(CpctlError, match=r"\(cannot read it: SyntaxError at line 1\)"):
        route(tmp_path, "def (:\n", cp_size=2)


def test_a_missing_script_is_left_to_the_launch(tmp_path: Path) -> None:
    assert detect("nothing.py", module=False, cwd=tmp_path) is None
    assert detect("no_such_module_xyz", module=True, cwd=tmp_path) is None


def test_an_installed_module_is_read_as_python_m_finds_it(tmp_path: Path) -> None:
    # `-m json.tool`: found on sys.path as `python -m` would; it calls no cpctl.init()
    use = detect("json.tool", module=True, cwd=tmp_path)
    assert use is not None and use.files[0].name == "tool.py" and use.files[0].parent.name == "json"
    with pytest.raises(CpctlError, match="json.tool: neither"):
        use.route(cp_size=2)


def test_options_the_script_mentions(tmp_path: Path) -> None:
    write(tmp_path / "train.py", "import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr')\n"
                                 "p.add_argument('--cp-size=', '-n')\n")
    use = detect("train.py", module=False, cwd=tmp_path)
    assert use is not None and {"--lr", "--cp-size", "-n"} <= use.options


def test_auto_is_resolved_from_the_script_and_says_where(tmp_path: Path) -> None:
    write(tmp_path / "train.py", "from accelerate import Accelerator\nAccelerator()\n")
    use = detect("train.py", module=False, cwd=tmp_path)
    resolved = resolve_apart(tmp_path, flags={"parallelism.cp_size": "2"}, script=use)
    assert resolved.profile.launch.script_api == "accelerate"
    assert source_of(resolved, "launch.script_api") == "auto (train.py:2 builds an Accelerator)"
    # set by hand, the source is not read; without a script (check, plan) auto means cpctl
    resolved = resolve_apart(tmp_path, flags={"launch.script_api": "cpctl"}, script=use)
    assert source_of(resolved, "launch.script_api") == "flag --script-api"
    assert source_of(resolve_apart(tmp_path), "launch.script_api") == "auto (no script to read)"
    native = resolve_apart(tmp_path, flags={"parallelism.cp_engine": "native", "launch.device": "cuda"},
                           machine=P.Machine(cuda_devices=1))
    assert native.profile.launch.script_api == "accelerate"  # the native engine is accelerate's only


def test_an_api_set_by_hand_against_the_source_is_noted(tmp_path: Path) -> None:
    write(tmp_path / "train.py", "from transformers import Trainer\nTrainer(model=None).train()\n")
    use = detect("train.py", module=False, cwd=tmp_path)
    assert use is not None
    note = disagreement(use, api="cpctl", cp_size=2)
    assert note == ("train.py starts as a cpctl script (launch.script_api cpctl), but train.py:2 uses transformers' "
                    "Trainer and its source shows no cpctl.init(): if so, its processes run without context "
                    "parallelism (launch.script_api auto reads it from the source)")
    assert disagreement(use, api="accelerate", cp_size=2) is None and disagreement(use, api="cpctl", cp_size=1) is None
