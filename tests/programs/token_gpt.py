"""The example GPT trained from a token file, as a user's job names it: the file's path comes from
REMESH_TEST_TOKENS (the tests write it); `evaluated` also evaluates on REMESH_TEST_EVAL_TOKENS."""

import os

from examples.gpt.model import GPTConfig, make_token_program

program = make_token_program([os.environ["REMESH_TEST_TOKENS"]], GPTConfig(), seed=7)

evaluated = make_token_program(
    [os.environ["REMESH_TEST_TOKENS"]],
    GPTConfig(),
    seed=7,
    held_out=[os.environ["REMESH_TEST_EVAL_TOKENS"]] if "REMESH_TEST_EVAL_TOKENS" in os.environ else [],
    eval_every=5,
)


def make(settings):
    """A factory, as a job names one: its `[options]` train_tokens name the token files."""
    return make_token_program(settings.options["train_tokens"], GPTConfig(), seed=7)
