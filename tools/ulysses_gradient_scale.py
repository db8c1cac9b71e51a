"""The Ulysses training script tests/test_ulysses.py runs (tools/ulysses_script.py: TinyLM with ALST's
loss; here SGD with momentum, 4 steps, sp 2 on 2 gloo ranks) under real DeepSpeed or under zerotron,
against one process on the full sequences: the largest weight and relative loss differences.
DeepSpeed 0.19.8 sums gradients over the sequence ranks at ZeRO 0-2 and averages at ZeRO 3, so only
its stage 3 matches; zerotron averages at every stage (docs/long-context.md).

    torchrun --standalone --nproc_per_node 2 tools/ulysses_gradient_scale.py ds|zt STAGE
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main(which: str, stage: int):
    if which == "ds":
        import deepspeed
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import zerotron as deepspeed
        from zerotron.long_context import DistributedAttention
        from zerotron.long_context import mpu as parallel_state_sp

        deepspeed.init_distributed()
    from tools import ulysses_script as script

    sp = 2
    parallel_state_sp.initialize_sequence_parallel(sp)
    group = parallel_state_sp.get_sequence_parallel_group()
    rank = dist.get_rank(group)
    model = script.TinyLM(group, DistributedAttention)
    config = {
        "train_batch_size": 4,
        "gradient_clipping": 0.0,
        "sequence_parallel_size": sp,
        "zero_optimization": {"stage": stage},
        "optimizer": script.optimizer_config("sgd"),
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(
        model=model, config=config, mpu=parallel_state_sp, model_parameters=model.parameters()
    )
    mine = slice(rank * script.SEQ // sp, (rank + 1) * script.SEQ // sp)
    losses = []
    for ids, labels in script.batches(4, 4):
        ids, labels = ids[:, mine], labels[:, mine]
        loss = engine(ids, torch.arange(script.SEQ)[mine].expand_as(ids), labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    want_losses, want = script.reference(4, 4, "sgd")
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=stage == 3):
        state = {n: p.detach().clone() for n, p in params}
    result = {
        "system": which,
        "stage": stage,
        "max_weight_diff": max((state[k] - want[k]).abs().max().item() for k in state),
        "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)),
    }
    if dist.get_rank() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
