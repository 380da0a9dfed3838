"""A decoder language model written as a Flax NNX user writes one, trained on their own token files.

The recipe for any NNX model: build the model and its `nnx.Optimizer` in one function, keep
`nnx.state((model, optimizer))` as the train state, and `nnx.merge` them with the graphdef at the
top of the step. The job file names the factory, `program = "examples.nnx_lm.model:make_program"`,
and its `[options]` table says where the tokens are; the factory reads the job's steps for the
learning-rate schedule. Parameters are float32, computed in bfloat16 (`param_dtype`/`dtype`), the
loss in float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from orchestrator import Evaluation, JobSettings, Program, TokenFiles


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 512
    seq_len: int = 64
    d_model: int = 128
    heads: int = 4
    layers: int = 2
    d_ff: int = 512
    learning_rate: float = 3e-3


MIXED = dict(param_dtype=jnp.float32, dtype=jnp.bfloat16)


class Block(nnx.Module):
    def __init__(self, c: LMConfig, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(c.d_model, rngs=rngs, **MIXED), nnx.LayerNorm(c.d_model, rngs=rngs, **MIXED)
        self.attn = nnx.MultiHeadAttention(c.heads, c.d_model, decode=False, rngs=rngs, **MIXED)
        self.up = nnx.Linear(c.d_model, c.d_ff, rngs=rngs, **MIXED)
        self.down = nnx.Linear(c.d_ff, c.d_model, rngs=rngs, **MIXED)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class LM(nnx.Module):
    def __init__(self, c: LMConfig, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c.vocab, c.d_model, rngs=rngs, **MIXED)
        self.blocks = nnx.List([Block(c, rngs) for _ in range(c.layers)])
        self.ln = nnx.LayerNorm(c.d_model, rngs=rngs, **MIXED)

    def __call__(self, tokens):
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.ln(x)).astype(jnp.float32)  # tied embeddings


def make_program(settings: JobSettings, config: LMConfig = LMConfig()) -> Program:
    """The job's program: `settings.options["train_tokens"]` (a path or a list of them) are flat
    uint16 token files; `seq_len` and `learning_rate` there override the config's. With
    `eval_tokens` (held-out token files), the model is evaluated on `eval_batches` batches of them
    (default 2) every `eval_every` steps (default 20)."""
    options = dict(settings.options)
    c = dataclasses.replace(config, **{k: options[k] for k in ("seq_len", "learning_rate") if k in options})
    schedule = optax.warmup_cosine_decay_schedule(0.0, c.learning_rate, max(1, settings.steps // 10), settings.steps)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))

    def build(key):
        model = LM(c, nnx.Rngs(key))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: build(jax.random.key(0))))

    def init(key):
        return nnx.state(build(key))

    def loss_fn(model, batch):
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    def evaluate(state, batch):
        model, _ = nnx.merge(graphdef, state)
        return {"loss": loss_fn(model, batch)}

    data = TokenFiles(_paths(options, "train_tokens", required=True), c.seq_len, seed=settings.seed).dataset()
    evaluation = None
    if held_out := _paths(options, "eval_tokens"):
        held = TokenFiles(held_out, c.seq_len, seed=settings.seed).dataset()
        evaluation = Evaluation(
            evaluate, held, every=options.get("eval_every", 20), batches=options.get("eval_batches", 2)
        )
    return Program(init=init, step=step, data=data, tokens_per_example=c.seq_len, evaluation=evaluation)


def _paths(options, key: str, required: bool = False) -> tuple[str, ...]:
    paths = options.get(key)
    if not paths and required:
        raise ValueError(f'the job file\'s [options] needs {key} = ["path/to/tokens.bin", ...]')
    return (paths,) if isinstance(paths, str) else tuple(paths or ())
