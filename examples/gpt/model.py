"""A GPT-style decoder written as plain single-device JAX + optax: no sharding code anywhere.

Data is generated from the step index alone (no downloads): token sequences from a fixed sparse
Markov chain, so the loss has real structure to learn and falls from log(vocab) towards the chain's
entropy. `make_token_program` trains the same model on token files instead (nanoGPT's `train.bin`,
each host reading only its rows); `write_tokens` writes such a file from the same chain. Dropout
draws from a PRNG key carried in the state, so it is checkpointed with it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from orchestrator import Evaluation, Program, TokenFiles


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 512
    dropout: float = 0.1
    learning_rate: float = 3e-3
    successors: int = 4  # each token has this many likely next tokens in the synthetic language
    scan_layers: bool = False  # layers stacked ([n_layers, ...] leaves) and run by jax.lax.scan


def init_params(key, cfg: GPTConfig):
    keys = iter(jax.random.split(key, 2 + 6 * cfg.n_layers))
    normal = lambda shape, scale=0.02: scale * jax.random.normal(next(keys), shape, jnp.float32)
    d, f = cfg.d_model, cfg.d_ff

    def layer():
        return {
            "ln1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
            "attn": {
                "wq": normal((d, d)),
                "wk": normal((d, d)),
                "wv": normal((d, d)),
                "wo": normal((d, d), 0.02 / np.sqrt(2 * cfg.n_layers)),
            },
            "ln2": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
            "mlp": {
                "w1": normal((d, f)),
                "b1": jnp.zeros(f),
                "w2": normal((f, d), 0.02 / np.sqrt(2 * cfg.n_layers)),
                "b2": jnp.zeros(d),
            },
        }

    layers = [layer() for _ in range(cfg.n_layers)]
    return {
        "wte": normal((cfg.vocab, d)),
        "wpe": normal((cfg.seq_len, d)),
        "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers) if cfg.scan_layers else layers,
        "ln_f": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
    }


def layer_norm(x, p, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def dropout(x, rate, key):
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def attention(x, p, cfg: GPTConfig):
    b, s, d = x.shape
    h = cfg.n_heads
    split = lambda t: t.reshape(b, s, h, d // h)
    q, k, v = split(x @ p["wq"]), split(x @ p["wk"]), split(x @ p["wv"])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // h)
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(b, s, d) @ p["wo"]


def block(x, lp, cfg: GPTConfig, keys=(None, None)):
    x = x + dropout(attention(layer_norm(x, lp["ln1"]), lp["attn"], cfg), cfg.dropout, keys[0])
    hidden = jax.nn.gelu(layer_norm(x, lp["ln2"]) @ lp["mlp"]["w1"] + lp["mlp"]["b1"])
    return x + dropout(hidden @ lp["mlp"]["w2"] + lp["mlp"]["b2"], cfg.dropout, keys[1])


def forward(params, tokens, cfg: GPTConfig, key=None):
    x = params["wte"][tokens] + params["wpe"][: tokens.shape[1]]
    if cfg.scan_layers:
        if key is None or cfg.dropout == 0.0:
            x, _ = jax.lax.scan(lambda h, lp: (block(h, lp, cfg), None), x, params["layers"])
        else:
            keys = jax.random.split(key, 2 * cfg.n_layers).reshape(cfg.n_layers, 2)
            x, _ = jax.lax.scan(
                lambda h, xs: (block(h, xs[0], cfg, (xs[1][0], xs[1][1])), None), x, (params["layers"], keys)
            )
    else:
        keys = list(jax.random.split(key, 2 * cfg.n_layers)) if key is not None else [None] * (2 * cfg.n_layers)
        for i, lp in enumerate(params["layers"]):
            x = block(x, lp, cfg, (keys[2 * i], keys[2 * i + 1]))
    return layer_norm(x, params["ln_f"]) @ params["wte"].T  # tied embeddings


def loss_fn(params, batch, cfg: GPTConfig, key=None):
    logits = forward(params, batch["inputs"], cfg, key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def make_program(cfg: GPTConfig = GPTConfig()) -> Program:
    optimizer = optax.adamw(cfg.learning_rate, weight_decay=0.01)
    table = _markov_table(cfg)

    def init(key):
        pkey, dkey = jax.random.split(key)
        params = init_params(pkey, cfg)
        return {"params": params, "opt": optimizer.init(params), "rng": jax.random.key_data(dkey)}

    def step(state, batch):
        key, sub = jax.random.split(jax.random.wrap_key_data(state["rng"]))
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch, cfg, sub)
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new = {"params": params, "opt": opt, "rng": jax.random.key_data(key)}
        return new, {"loss": loss, "grad_norm": optax.global_norm(grads)}

    def batch(step: int, size: int):
        rng = np.random.default_rng([0x5EED, step])
        tokens = np.empty((size, cfg.seq_len + 1), np.int32)
        tokens[:, 0] = rng.integers(0, cfg.vocab, size)
        choice = rng.integers(0, cfg.successors, (size, cfg.seq_len))
        for t in range(cfg.seq_len):
            tokens[:, t + 1] = table[tokens[:, t], choice[:, t]]
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    return Program(init=init, step=step, batch=batch, tokens_per_example=cfg.seq_len)


def make_token_program(
    paths, cfg: GPTConfig = GPTConfig(), seed: int = 0, dtype: str = "uint16", held_out=(), eval_every: int = 0
) -> Program:
    """The same model trained on flat token files (ids below `cfg.vocab`), shuffled by `seed`;
    with `held_out` token files, evaluated on two batches of them every `eval_every` steps."""
    data = TokenFiles(tuple(paths), cfg.seq_len, dtype=dtype, seed=seed).dataset()
    evaluation = None
    if held_out:
        held = TokenFiles(tuple(held_out), cfg.seq_len, dtype=dtype, seed=seed).dataset()
        evaluation = Evaluation(
            lambda state, batch: {"loss": loss_fn(state["params"], batch, cfg)}, held, eval_every, 2
        )
    return dataclasses.replace(make_program(cfg), batch=None, data=data, evaluation=evaluation)


def write_tokens(path: str, tokens: int, cfg: GPTConfig = GPTConfig(), seed: int = 0) -> None:
    """A uint16 token file of `tokens` ids, as nanoGPT's prepare scripts write one: documents of
    the Markov chain's language, concatenated."""
    rng = np.random.default_rng(seed)
    table = _markov_table(cfg)
    out = np.empty(tokens, np.uint16)
    out[0] = rng.integers(0, cfg.vocab)
    choice = rng.integers(0, cfg.successors, tokens)
    for t in range(1, tokens):
        out[t] = table[out[t - 1], choice[t]]
    out.tofile(path)


def _markov_table(cfg: GPTConfig) -> np.ndarray:
    """Each token's `successors` possible next tokens, fixed for the language."""
    return np.random.default_rng(1234).integers(0, cfg.vocab, (cfg.vocab, cfg.successors)).astype(np.int32)


program = make_program()


def scanned_program(settings) -> Program:
    """The demo GPT with its layers stacked and applied by `jax.lax.scan` (as MaxText writes
    them), which the planner can pipeline: `[options] layers = 4` (default 4), `dropout = 0.0`
    (default: none, so that every mesh and microbatch count draws the same losses)."""
    options = settings.options
    cfg = GPTConfig(
        n_layers=int(options.get("layers", 4)), dropout=float(options.get("dropout", 0.0)), scan_layers=True
    )
    return make_program(cfg)


def plan_target():
    """For `remesh plan examples.gpt.model:plan_target --devices 8`: the step and abstract args."""
    from orchestrator import check_program

    state, batch = check_program(program, 24)
    return program.step, (state, batch)


def plan_target_large():
    """The same decoder at d_model 8192 (64 heads, d_ff 32768, vocab 32768, sequence 1024, batch
    8): large enough that moving activations is cheaper than moving weights, where Megatron wins.
    `remesh plan examples.gpt.model:plan_target_large --devices 8 --verify`."""
    from orchestrator import check_program

    cfg = GPTConfig(vocab=32768, seq_len=1024, d_model=8192, n_heads=64, n_layers=2, d_ff=32768, dropout=0.0)
    large = make_program(cfg)
    state, batch = check_program(large, 8)
    return large.step, (state, batch)
