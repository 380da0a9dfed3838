"""The example GPT trained from a token file, as a user's job names it: the file's path comes from
REMESH_TEST_TOKENS (the tests write it)."""

import os

from examples.gpt.model import GPTConfig, make_token_program

program = make_token_program([os.environ["REMESH_TEST_TOKENS"]], GPTConfig(), seed=7)
