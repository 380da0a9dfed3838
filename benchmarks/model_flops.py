"""Model FLOPs per step as remesh counts them (XLA's cost analysis of the step's program before
partitioning, what MFU divides by) against 6 x parameters x tokens plus attention, for the example
GPT at three sizes; and what one device's partitioned program executes on 8 devices.

    .venv/bin/python benchmarks/model_flops.py
"""

from _harness import ROOT, fake_devices

fake_devices(8)  # before jax is imported, below

import sys  # noqa: E402

sys.path.insert(0, ROOT)

import jax  # noqa: E402

import partitioner  # noqa: E402
from examples.gpt.model import GPTConfig, make_program  # noqa: E402
from orchestrator import check_program  # noqa: E402
from orchestrator.worker.compile import step_flops  # noqa: E402

SIZES = {
    "example (demo job)": GPTConfig(),
    "d512 x 4 layers, seq 256": GPTConfig(d_model=512, n_heads=8, d_ff=2048, n_layers=4, seq_len=256, vocab=1024),
    "d1024 x 8 layers, seq 512": GPTConfig(d_model=1024, n_heads=16, d_ff=4096, n_layers=8, seq_len=512, vocab=8192),
}
BATCH = 24


def formula(cfg):
    d, f, L, V, s = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab, cfg.seq_len
    params = L * (4 * d * d + 2 * d * f) + V * d  # matmul weights; the tied embedding as the output projection
    tokens = BATCH * s
    return 6 * params * tokens, 12 * L * s * d * tokens


def main():
    print(
        "| model | 6 N T | attention | formula GFLOP | XLA-counted GFLOP | counted / formula | plan on 8 | one device's GFLOP x 8 / counted |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, cfg in SIZES.items():
        program = make_program(cfg)
        state, batch = check_program(program, BATCH)
        plan = partitioner.plan(program.step, state, batch, devices=8, hardware="cpu")
        mesh = plan.bind(jax.devices()[:8])
        sh = (plan.shardings(mesh, state, argnum=0), plan.shardings(mesh, batch, argnum=1))
        compiled = jax.jit(program.step, in_shardings=sh).lower(state, batch).compile()
        f = step_flops(program.step, (state, batch), compiled)
        dense, attention = formula(cfg)
        total = dense + attention
        print(
            f"| {name} | {dense / 1e9:.2f} | {attention / 1e9:.2f} | {total / 1e9:.2f} | {f['model_flops'] / 1e9:.2f} | "
            f"**{f['model_flops'] / total:.3f}** | {plan.describe()} | {8 * f['device_flops'] / f['model_flops']:.2f} |"
        )


if __name__ == "__main__":
    main()
