"""zerotron's MoE layer against DeepSpeed 0.19.8's `deepspeed.moe.layer.MoE` (ep_size 1, one gloo process):
the same weights (DeepSpeed's state dict loads into zerotron's: the same keys), the same input and random
stream; outputs, l_aux, exp_counts and every parameter's and the input's gradient, for top-1 and top-2,
dropping and dropless, random token selection and Gumbel noise, residual MoE, train and eval. Run with
DeepSpeed's interpreter:

    PYTHONPATH=. python tools/moe_layer_compare.py
"""

import os

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(
    MASTER_ADDR="127.0.0.1",
    MASTER_PORT=os.environ.get("MASTER_PORT", "29571"),
    RANK="0",
    LOCAL_RANK="0",
    WORLD_SIZE="1",
)

CASES = [
    dict(k=1, use_rts=False),
    dict(k=1, use_rts=True, noisy_gate_policy="RSample"),
    dict(k=1, drop_tokens=False, use_rts=False),
    dict(k=1, noisy_gate_policy="Jitter", use_rts=False),
    dict(k=2, top2_2nd_expert_sampling=False),
    dict(k=2, top2_2nd_expert_sampling=True, capacity_factor=0.5),
    dict(k=2, drop_tokens=False, top2_2nd_expert_sampling=False, use_residual=True),
]


def expert():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))


def run(cls, case, state, x, train):
    torch.manual_seed(1)
    layer = cls(hidden_size=16, expert=expert(), num_experts=4, min_capacity=2, **case)
    if state is not None:
        layer.load_state_dict(state)
    if hasattr(layer, "set_deepspeed_parallelism"):
        layer.set_deepspeed_parallelism()
    layer.train(train)
    x = x.clone().requires_grad_()
    torch.manual_seed(2)
    out, l_aux, counts = layer(x)
    (out.square().sum() + l_aux).backward()
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    return layer.state_dict(), out.detach(), l_aux.detach(), counts, grads, x.grad


def main():
    import deepspeed
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from zerotron.moe import MoE

    deepspeed.init_distributed(dist_backend="gloo")
    x = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(0))
    worst = 0.0
    for case in CASES:
        for train in (True, False):
            state, *want = run(DeepSpeedMoE, case, None, x, train)
            _, *got = run(MoE, case, state, x, train)
            out, l_aux = (want[0] - got[0]).abs().max().item(), (want[1] - got[1]).abs().item()
            counts = torch.equal(want[2].long(), got[2].long())
            names = sorted(want[3]) == sorted(got[3])
            grads = max((want[3][n] - got[3][n]).abs().max().item() for n in want[3]) if names else float("inf")
            dx = (want[4] - got[4]).abs().max().item()
            worst = max(worst, out, l_aux, grads, dx)
            print(f"{case} train={train}: output {out:.1e}, l_aux {l_aux:.1e}, counts {counts}, "
                  f"param grads {grads:.1e} (same set {names}), input grad {dx:.1e}")  # fmt: skip
    print(f"largest difference {worst:.1e}")


if __name__ == "__main__":
    main()
