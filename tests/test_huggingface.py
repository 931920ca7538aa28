"""A Hugging Face model with attn_implementation="sdpa" trains under CP unmodified (docs/huggingface.md).

transformers builds the model from a tiny config: nothing is downloaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launching import REPO, TIMEOUT, cpctl, finish, launch_env, started, tiered

from cpctl.errors import CpctlError

pytest.importorskip("transformers")


WORKER = REPO / "tests" / "workers" / "hf_cases.py"
LAYOUTS = {
    # cp 1: nothing sharded, attention through cpctl's engine all the same
    "cp1": (("--nproc-per-node", "1", "--cp-size", "1"), 1, 1),
    "cp2": (("--nproc-per-node", "2", "--cp-size", "2"), 2, 1),
    # the model's own gradient checkpointing (cpctl's replaces it), backward after the context
    "cp2-checkpointing": (("--nproc-per-node", "2", "--cp-size", "2"), 2, 1),
    # the same at the selective level: attention's outputs kept, not recomputed
    "cp2-selective-checkpointing": (("--nproc-per-node", "2", "--cp-size", "2", "--activation-checkpointing", "true",
                                     "--checkpoint-level", "selective"), 2, 1),
    # the decoder layers' MLPs in tiles of 8 tokens and their two norms in tiles of 12 (a shard holds 32)
    "cp2-tiled": (("--nproc-per-node", "2", "--cp-size", "2", "--tiled-mlp-tokens", "8", "--tiled-norm-tokens", "12"), 2, 1),
    # tp: the model's own base_model_tp_plan ("colwise"/"rowwise") is the default plan
    "tp2": (("--nproc-per-node", "2", "--cp-size", "1", "--tp-size", "2"), 1, 2),
}


@pytest.mark.parametrize("layout", tiered(LAYOUTS, quick={"cp1", "cp2"}))
def test_hf_llama_logits_and_gradients_equal_a_plain_step(tmp_path: Path, pools, layout: str) -> None:
    flags, cp, tp = LAYOUTS[layout]
    out = tmp_path / "hf.json"
    pools.run(WORKER, str(out), *(["checkpointing"] if layout.endswith("checkpointing") else []), flags=flags,
              cwd=tmp_path)  # in the session's processes (tests/pool.py)
    result = json.loads(out.read_text())
    assert (result["cp"], result["tp"]) == (cp, tp) and result["n_params"] > 0
    assert result["checkpointed"] == layout.endswith("checkpointing")
    # engine calls in the step, at every cp size: one per layer and pass (forward; a full checkpoint's recompute)
    assert result["attention_calls"] == (4 if layout == "cp2-checkpointing" else 2)
    assert result["tiled_mlps"] == (2 if layout.endswith("tiled") else 0)  # both layers' MLPs, or none
    assert result["tiled_norms"] == (5 if layout.endswith("tiled") else 0)  # their input and post-attention norms, the final one
    assert result["logits"] <= 1e-5
    assert result["grads"] <= 1e-5
    refusals = result["refusals"]
    for name, fragments in REFUSALS.items():
        if tp > 1 and name.startswith("falcon"):  # Falcon has no TP plan to prepare it with
            assert name not in refusals
            continue
        if cp == 1 and name in FINE_AT_CP_1:
            assert refusals[name] is None, f"{name} was refused at cp 1: {refusals[name]}"
            continue
        assert refusals[name] is not None, f"{name} was not refused"
        for fragment in fragments:
            assert fragment in refusals[name], refusals[name]


REFUSALS = {
    "checkpointing_after_prepare": ["gradient_checkpointing_enable() after rt.prepare_model", "before prepare_model"],
    "mask_4d": ["a 4-D attention_mask", "pass the 2-D padding mask"],
    "unprepared_model": ["LlamaForCausalLM runs inside maybe_context_parallel", "cpctl did not prepare it",
                         "rt.prepare_model first"],
    "use_cache": ["use_cache=False"],
    "num_items_in_batch": ["num_items_in_batch under context parallelism", "leave it out"],
    "labels_not_in_buffers": ["labels has the full sequence length 64", "add it to buffers"],
    "attention_dropout": ["attention_dropout=0.1", "set it to 0.0"],
    "falcon_alibi": ["FalconForCausalLM cannot run under context parallelism", "alibi=True", "alibi=False"],
    "falcon_output_attentions": ["output_attentions=True", "leave it out"],
}
# With nothing sharded, labels of full length are the shard's, a caller's token count is right, and
# a model cpctl did not prepare sees the whole sequence.
FINE_AT_CP_1 = {"labels_not_in_buffers", "num_items_in_batch", "unprepared_model"}


def test_config_problems_name_the_setting() -> None:
    from types import SimpleNamespace

    from cpctl.integrations.huggingface import _config_problems

    assert list(_config_problems(SimpleNamespace(layer_types=["full_attention", "sliding_attention"]))) == []
    hybrid = list(_config_problems(SimpleNamespace(layer_types=["full_attention", "linear_attention"])))
    assert len(hybrid) == 1 and "'linear_attention'" in hybrid[0] and "cannot be sharded" in hybrid[0]
    capped = list(_config_problems(SimpleNamespace(attn_logit_softcapping=50.0)))
    assert len(capped) == 1 and "attn_logit_softcapping=50.0" in capped[0] and "set it to None" in capped[0]


def test_a_model_that_calls_sdpa_itself_is_routed_unless_its_mask_holds_more_than_causality() -> None:
    from transformers import FalconConfig, FalconForCausalLM

    from cpctl.integrations.huggingface import _sdpa_call_problem, _takes_attention_interface

    def falcon(**overrides):
        return FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
                                              **{"attn_implementation": "sdpa", **overrides}))

    rotary = falcon()
    assert not _takes_attention_interface(rotary)  # what transformers itself says of Falcon
    assert _sdpa_call_problem(rotary) is None
    assert "alibi=True" in _sdpa_call_problem(falcon(alibi=True))
    eager = _sdpa_call_problem(falcon(attn_implementation="eager"))
    assert "'eager'" in eager and 'attn_implementation="sdpa"' in eager
    # a class transformers offers no SDPA for is not told to ask for it
    from transformers import XGLMConfig, XGLMForCausalLM

    eager_only = _sdpa_call_problem(XGLMForCausalLM(XGLMConfig(vocab_size=64, d_model=16, num_layers=1,
                                                               attention_heads=2, ffn_dim=32)))
    assert "(transformers has no SDPA for it)" in eager_only and "cp_size 1" in eager_only


def tiny(family: str, **overrides):
    """A tiny transformers causal LM of `family` ("llama", "bart", "whisper", "roberta"), SDPA."""
    import transformers as hf

    common = dict(vocab_size=64, attn_implementation="sdpa", **overrides)
    if family == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(**common, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=4, num_key_value_heads=2))
    if family == "roberta":
        return hf.RobertaForCausalLM(hf.RobertaConfig(**common, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=4, is_decoder=True))
    decoder = dict(d_model=32, decoder_layers=1, encoder_layers=1, decoder_attention_heads=4, encoder_attention_heads=4,
                   decoder_ffn_dim=64, encoder_ffn_dim=64, is_decoder=True, is_encoder_decoder=False, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    config = {"bart": hf.BartConfig, "whisper": hf.WhisperConfig}[family](**common, **decoder)
    return {"bart": hf.BartForCausalLM, "whisper": hf.WhisperForCausalLM}[family](config)


def test_what_a_model_does_with_positions_and_its_loss_is_read_from_the_model() -> None:
    """Positions: a forward without position_ids would number each shard from 0 (refused); RoBERTa's
    default positions count from its padding token. The loss: transformers answers ForCausalLMLoss
    for every model without a loss_type, so only the forward's code shows BART's and Whisper's own
    unshifted CrossEntropyLoss."""
    from cpctl.integrations.huggingface import _computes_loss_function, _counts_positions_from_padding, _position_problems

    llama, roberta, bart, whisper = (tiny(family) for family in ("llama", "roberta", "bart", "whisper"))
    assert list(_position_problems(llama)) == list(_position_problems(roberta)) == []
    for model in (bart, whisper):
        (problem,) = _position_problems(model)
        assert "its forward takes no position_ids" in problem and "cp_size 1" in problem
    assert [_counts_positions_from_padding(m) for m in (llama, roberta, bart)] == [False, True, False]
    assert [_computes_loss_function(m) for m in (llama, roberta, bart, whisper)] == [True, True, False, False]


def test_a_chunked_loss_needs_a_plain_linear_head_and_the_models_exact_logits() -> None:
    import torch

    from cpctl.integrations.huggingface import _check_logits, causal_lm_loss_sum

    model = tiny("llama")

    class ScaledHead(torch.nn.Linear):  # a learned logit scale, as Dory's head has
        def forward(self, hidden):
            return super().forward(hidden) * 1.5

    head = ScaledHead(32, 64, bias=False)
    model.set_output_embeddings(head)
    ids = torch.randint(64, (1, 8))
    with pytest.raises(CpctlError, match="output head ScaledHead is not a plain linear layer"):
        causal_lm_loss_sum(model, None, input_ids=ids, labels=ids, chunk_tokens=4)
    # a scale close to 1 (HyperCLOVAX's logits_scaling multiplies where Granite's divides) is no rounding in fp32
    hidden = torch.randn(2, 32)
    plain = torch.nn.Linear(32, 64)
    _check_logits(plain(hidden), hidden, plain, None, model)
    with pytest.raises(CpctlError, match="computes its logits in a way cpctl's chunked loss does not reproduce"):
        _check_logits(plain(hidden) * 1.0005, hidden, plain, None, model)


def test_a_forward_under_cp_without_one_attention_call_through_cpctl_is_one_line() -> None:
    """Whatever mixes a shard's tokens outside cpctl's attention (here the model switched to eager
    after prepare_model; a recurrence would do the same) never sees the other shards'."""
    import torch

    from cpctl.integrations import huggingface
    from cpctl.integrations.patches import PATCHES

    model = tiny("llama")
    runtime = CountingRuntime()
    try:
        huggingface.prepare(model, runtime)
        ids = torch.randint(64, (1, 8))
        with runtime.routing():
            model(input_ids=ids)
            assert runtime.attention_calls == 1
            model.config._attn_implementation = "eager"
            with pytest.raises(CpctlError, match="without one attention call through cpctl"):
                model(input_ids=ids)
    finally:
        PATCHES.remove()


class CountingRuntime:
    """A RuntimeView of one process (cp 1), enough for a model's forward: its engine is SDPA over
    the whole sequence, counted; `routing()` is its maybe_context_parallel."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.config = SimpleNamespace(parallelism=SimpleNamespace(tp_size=1))
        self.sp_size = self.seq_size = 1
        self.cp_active = False
        self.attention_calls = 0

    def routing(self):
        import contextlib

        @contextlib.contextmanager
        def active():
            self.cp_active = True
            try:
                yield
            finally:
                self.cp_active = False

        return active()

    def step_attention(self, q, k, v, *, is_causal, scale, enable_gqa, window, chunk):
        import torch.nn.functional as F

        assert window is None and chunk is None
        self.attention_calls += 1
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    def shard(self, tensor, seq_dim):
        return tensor

    def appended_in_shard(self, local_len, *, device=None):
        return None

    def hide_keys(self, rows) -> None:
        assert rows is None

    def require_sharded(self, tensor, *, name, seq_dim) -> None:
        pass


def test_two_models_prepared_in_one_process_each_compute_with_their_own_runtime() -> None:
    """A policy and a PEFT-wrapped reference, prepared with two runtimes: each model's attention goes
    to its own runtime's engine when that runtime routes, transformers' SDPA when it does not,
    whichever was prepared last; so do a copy of a prepared model and a checkpointed block's
    recompute (in backward, after its model's forward returned). The registrations with
    transformers are undone with the other patches."""
    import copy

    import torch
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import AttentionMaskInterface

    from cpctl.integrations import huggingface
    from cpctl.integrations.patches import PATCHES

    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attn_implementation="sdpa")
    plain = LlamaForCausalLM(config)
    policy = copy.deepcopy(plain)
    reference = peft.get_peft_model(copy.deepcopy(plain), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    ids = torch.randint(config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = plain(input_ids=ids).logits
    first, second = CountingRuntime(), CountingRuntime()
    try:
        huggingface.prepare(policy, first)
        huggingface.prepare(huggingface.huggingface_model_in(reference), second)  # prepared last
        assert AttentionInterface._global_mapping[huggingface.IMPLEMENTATION] is huggingface.attention

        with first.routing():
            got = policy(input_ids=ids).logits
        assert (first.attention_calls, second.attention_calls) == (2, 0)  # one per layer, on its own runtime
        assert (got - expected).abs().max().item() <= 1e-5
        with first.routing():
            reference(input_ids=ids)  # its runtime does not route: transformers' SDPA
        assert (first.attention_calls, second.attention_calls) == (2, 0)
        with second.routing():
            got = reference(input_ids=ids).logits
            policy(input_ids=ids)
        assert (first.attention_calls, second.attention_calls) == (2, 2)
        assert (got - reference(input_ids=ids).logits).abs().max().item() <= 1e-5
        with first.routing():  # a copy of a prepared model (TRL's reference models) keeps its runtime
            copy.deepcopy(policy)(input_ids=ids)
        assert (first.attention_calls, second.attention_calls) == (4, 2)

        # The policy's blocks checkpointed: their recompute in backward is routed by the layer's own model.
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        layers = policy.model.layers
        for index, layer in enumerate(layers):
            layers[index] = checkpoint_wrapper(layer)
        with first.routing():
            loss = policy(input_ids=ids).logits.sum()
            policy(input_ids=ids)  # another forward ended before the backward
            loss.backward()
        assert (first.attention_calls, second.attention_calls) == (4 + 2 + 2 + 2, 2)
    finally:
        PATCHES.remove()
    assert huggingface.IMPLEMENTATION not in AttentionInterface._global_mapping
    assert huggingface.IMPLEMENTATION not in AttentionMaskInterface._global_mapping
    assert huggingface._RUNNING == []


SINKS = """
import json, sys, torch, cpctl
from transformers import GptOssConfig, GptOssForCausalLM
def gpt_oss():  # learned attention sinks; transformers runs it with eager attention only
    torch.manual_seed(0)
    return GptOssForCausalLM(GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=12,
        layer_types=["sliding_attention", "full_attention"], initializer_range=0.1, attn_implementation="eager"))
ids = torch.randint(64, (1, 32), generator=torch.Generator().manual_seed(1))
rt = cpctl.init()
model = rt.prepare_model(gpt_oss())  # refused here under CP
plain = gpt_oss()
plain(input_ids=ids, labels=ids).loss.backward()
loss = model(input_ids=ids, labels=ids).loss  # outside maybe_context_parallel: transformers' own attention
loss.backward()
sinks = model.model.layers[0].self_attn.sinks.grad.full_tensor()
try:
    with rt.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1]):
        model(input_ids=ids)
    refusal = None
except cpctl.CpctlError as error:
    refusal = str(error)
json.dump({"loss": abs(loss.item() - plain(input_ids=ids, labels=ids).loss.item()),
           "sinks_grad": (sinks - plain.model.layers[0].self_attn.sinks.grad).abs().max().item(),
           "refusal": refusal}, open(sys.argv[1], "w"))
"""


def test_a_model_with_attention_sinks_is_its_own_outside_the_context_and_refused_under_cp(tmp_path: Path,
                                                                                           pools) -> None:
    """gpt-oss adds learned sinks to each softmax, which neither cpctl's engine nor SDPA computes:
    refused at prepare_model under CP; at cp 1 the model keeps transformers' attention (it once ran
    SDPA outside the context, silently without its sinks) and is refused inside the context."""
    pytest.importorskip("transformers.models.gpt_oss")
    script, out = tmp_path / "sinks.py", tmp_path / "cp1.json"
    script.write_text(SINKS)
    pools[1].run(script, str(out), cwd=tmp_path)
    result = json.loads(out.read_text())
    assert result["loss"] <= 1e-6 and result["sinks_grad"] <= 1e-6, result
    assert "adds learned sinks (model.layers.0.self_attn.sinks)" in result["refusal"], result
    for line in pools[2].attempt(script, str(tmp_path / "cp2.json"), flags=("--cp-size", "2"), cwd=tmp_path).refusals():
        assert "GptOssForCausalLM cannot run under context parallelism: its attention adds learned sinks" in line, line
        assert "at cp_size 1" in line, line


COMPILED_FIRST = """
import torch, cpctl
from transformers import LlamaConfig, LlamaForCausalLM
rt = cpctl.init()
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, attn_implementation="sdpa")
rt.prepare_model(torch.compile(LlamaForCausalLM(config)))
"""


@pytest.mark.full
def test_a_model_compiled_before_prepare_model_is_one_line_naming_the_order(tmp_path: Path) -> None:
    """Its compiled graph would keep transformers' attention (a mask under CP): refused before any step."""
    proc = subprocess.run([sys.executable, "-c", COMPILED_FIRST], cwd=tmp_path, env=launch_env(tmp_path),
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "compiled (torch.compile) before rt.prepare_model" in last and "torch.compile(rt.prepare_model(model))" in last


@pytest.mark.full
def test_a_model_compiled_after_prepare_model_trains_as_uncompiled_without_dynamo_warnings(tmp_path: Path,
                                                                                          pools) -> None:
    """cpctl's engine and its model hooks run as they are under torch.compile (graph breaks around
    them): dynamo traces neither its cached kernel checks nor its hooks' collectives, and warns of nothing. The
    compiled run is a real launch (its ranks' output is read); the eager one runs in the pool."""
    worker = REPO / "tests" / "workers" / "compiled_case.py"
    compiled_run = started(cpctl("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", str(worker),
                                 str(tmp_path / "compiled.json"), "--compile", tmp_path=tmp_path))
    pools.run(worker, str(tmp_path / "eager.json"), flags=("--nproc-per-node", "2", "--cp-size", "2"), cwd=tmp_path)
    code, stdout, stderr = finish(compiled_run)
    assert code == 0, stdout + stderr
    eager, compiled = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("eager", "compiled"))
    assert len(set(eager)) == 2 and all(abs(a - b) <= 1e-5 for a, b in zip(compiled, eager)), (compiled, eager)
    # no dynamo warning: not its kernel checks' (lru_cache), not a graph break in cpctl's hooks,
    # not the global hook cpctl holds inside the step
    assert not [word for word in ("lru_cache", "Graph break", "global hooks") if word in stderr], stderr
