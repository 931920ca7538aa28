"""Worker: the example Llama, checkpointed, with a backward run twice (retain_graph).

Each recompute must route attention (and, at the selective level, replay it) again. The
gradients are compared with a plain single-process model that does the same two backwards;
rank 0 writes the max abs difference to argv[1] as JSON.
"""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import cpctl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from llama import PRESETS, Llama  # noqa: E402


def main() -> None:
    rt = cpctl.init()
    torch.manual_seed(0)
    reference = Llama(PRESETS["tiny"])
    model = rt.prepare_model(copy.deepcopy(reference))
    ids = torch.randint(PRESETS["tiny"].vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    labels, pos = cpctl.shift_labels(ids), cpctl.position_ids_like(ids)

    ref_loss = F.cross_entropy(reference(ids, position_ids=pos).flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()

    with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                   no_restore_buffers={ids, labels, pos}):
        logits = model(ids, position_ids=pos)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        loss = rt.token_mean(loss_sum, labels)
    loss.backward(retain_graph=True)  # after the context: the recompute routes attention by itself
    loss.backward()

    grads = dict(reference.named_parameters())
    error = max((param.grad.full_tensor() - grads[name.replace("._checkpoint_wrapped_module", "")].grad).abs().max().item()
                for name, param in model.named_parameters())
    if rt.is_main:
        with open(sys.argv[1], "w") as f:
            json.dump({"grads": error, "cp": rt.cp_size, "level": rt.config.memory.checkpoint_level}, f)


if __name__ == "__main__":
    main()
