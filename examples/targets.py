"""Named planning targets, `name -> (step, args)` with abstract args, shared by the partitioner's
golden tests and benchmarks so every figure and golden file names the same model."""

from __future__ import annotations


def gpt(d, heads, ff, vocab, seq, layers, batch, scan=False):
    from examples.gpt.model import GPTConfig, make_program
    from orchestrator import check_program

    program = make_program(
        GPTConfig(
            vocab=vocab, seq_len=seq, d_model=d, n_heads=heads, n_layers=layers, d_ff=ff, dropout=0.0, scan_layers=scan
        )
    )
    return program.step, check_program(program, batch)


def mlp(d, f, layers, tokens):
    from examples.residual_mlp import residual_mlp

    step, state, x = residual_mlp(d, f, layers, tokens)
    return step, (state, x)


def llama():
    from examples.llama import llama as build

    return build()  # d 4096, 32 heads, 8 key/value heads, SwiGLU 14336, vocab 32000, 2 layers, batch 8 x 1024


def moe(**kw):
    from examples.moe import moe as build

    return build(**kw)  # d 2048, 16 heads, 8 experts of 2048 x 8192, vocab 32000, 2 layers, batch 8 x 1024


TARGETS = {
    "mlp-small-weights": lambda: mlp(256, 1024, 2, 65536),
    "mlp-1k": lambda: mlp(1024, 4096, 2, 4096),
    "mlp-4k": lambda: mlp(4096, 16384, 4, 8192),
    "mlp-8k": lambda: mlp(8192, 32768, 2, 8192),
    "gpt-example": lambda: gpt(128, 4, 512, 256, 64, 2, 24),
    "gpt-d8192": lambda: gpt(8192, 64, 32768, 32768, 1024, 2, 8),
    "llama-gqa-swiglu": llama,
    "gpt-d4096-scan": lambda: gpt(4096, 32, 16384, 32768, 1024, 4, 8, scan=True),
    "moe-8x": moe,
    "moe-64x": lambda: moe(d=1024, heads=8, experts=64, ff=4096, vocab=32000, layers=2, batch=8, seq=1024),
}
