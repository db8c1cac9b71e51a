"""zerotron's MoE gating (zerotron/moe/gating.py) against DeepSpeed 0.19.8's (deepspeed.moe.sharded_moe) on
the same router logits and the same random stream: top-1 (with and without random token selection and
Gumbel noise), top-2 (with and without second-expert sampling), top-3 (both drop policies), dropping and
dropless, min_capacity binding or not. Prints one line per case: the largest |difference| of l_aux and
combine_weights, and whether dispatch_mask and exp_counts are equal. Run with DeepSpeed's interpreter:

    PYTHONPATH=. python tools/moe_gating_compare.py
"""

import os

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
from deepspeed.moe import sharded_moe as ds  # noqa: E402

from zerotron.moe import gating as zt  # noqa: E402

CASES = [  # (name, DeepSpeed's call, zerotron's call) on logits [tokens, experts]
    ("top1 drop", lambda f, x: f.top1gating(x, 1.0, 4, use_rts=False)),
    ("top1 drop rts", lambda f, x: f.top1gating(x, 1.0, 4, use_rts=True)),
    ("top1 drop rsample", lambda f, x: f.top1gating(x, 1.0, 4, noisy_gate_policy="RSample", use_rts=False)),
    ("top1 dropless", lambda f, x: f.top1gating(x, 1.0, 4, drop_tokens=False, use_rts=False)),
    ("top1 min_capacity binds", lambda f, x: f.top1gating(x, 0.25, 16, use_rts=False)),
    ("top2 drop", lambda f, x: f.top2gating(x, 1.0, 4, top2_2nd_expert_sampling=False)),
    ("top2 drop sampling", lambda f, x: f.top2gating(x, 1.0, 4, top2_2nd_expert_sampling=True)),
    ("top2 tight", lambda f, x: f.top2gating(x, 0.5, 1, top2_2nd_expert_sampling=False)),
    ("top2 dropless", lambda f, x: f.top2gating(x, 1.0, 4, drop_tokens=False, top2_2nd_expert_sampling=False)),
    ("top3 probs", lambda f, x: f.topkgating(x, 3, 0.5, 1)),
    ("top3 position", lambda f, x: f.topkgating(x, 3, 0.5, 1, drop_policy="position")),
    ("top3 dropless", lambda f, x: f.topkgating(x, 3, 1.0, 4, drop_tokens=False)),
]


def main():
    worst = 0.0
    for name, call in CASES:
        for tokens, experts in ((64, 8), (37, 4)):
            logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens))
            torch.manual_seed(0)
            want = call(ds, logits.clone())
            torch.manual_seed(0)
            got = call(zt, logits.clone())
            l_aux = (want[0] - got[0]).abs().item()
            shape = tuple(want[1].shape) == tuple(got[1].shape)
            combine = (want[1] - got[1]).abs().max().item() if shape else float("inf")
            same = shape and torch.equal(want[2], got[2]) and torch.equal(want[3].long(), got[3].long())
            worst = max(worst, l_aux, combine)
            print(f"{name:26s} {tokens}x{experts}: l_aux {l_aux:.1e}, combine {combine:.1e}, dispatch+counts {same}")
    print(f"largest difference {worst:.1e}")


if __name__ == "__main__":
    main()
