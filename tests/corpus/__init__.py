"""Training steps written the way public codebases write them (each module's docstring names
which), with the plans an experienced engineer writes for 8 devices (`EXPERTS`). The partitioner
is checked against them by what XLA compiles (`tests/partitioner/fake_devices/test_corpus.py`,
`benchmarks/corpus.py`).

Each module has `build(layers=..., **options) -> (step, (state, batch))`, abstract arguments, and
`EXPERTS`; `CORPUS` names each entry, with its options."""

CORPUS = {
    "llama-maxtext": ("llama_maxtext", {}),
    "llama-maxtext-remat": ("llama_maxtext", {"remat": True}),
    "llama-gqa-repeat": ("llama_gqa", {"form": "repeat"}),
    "llama-gqa-tile": ("llama_gqa", {"form": "tile"}),
    "llama-gqa-broadcast": ("llama_gqa", {"form": "broadcast"}),
    "llama-gqa-grouped": ("llama_gqa", {"form": "grouped"}),
    "nnx-llama": ("nnx_llama", {}),
    "linen-scan-gpt": ("linen_scan", {}),
    "maxtext-scan": ("maxtext_scan", {}),
    "moe-top2-shared": ("moe", {}),
    "t5": ("t5", {}),
    "vit": ("vit", {}),
    "resnet": ("convnet", {}),
    "equinox-gpt": ("equinox_gpt", {}),
    "custom-vjp-gpt": ("custom_vjp_gpt", {}),
    "gemma": ("gemma", {}),
    "hf-gpt2": ("hf_gpt2", {}),
    "nnx-scan-llama": ("nnx_scan", {}),
    "equinox-scan-llama": ("equinox_scan", {}),
    "mamba2-ssd": ("mamba2", {}),
    "unet-diffusion": ("unet", {}),
    "roberta-mlm": ("roberta_mlm", {}),
    "deepseek-mla-sort": ("deepseek", {"form": "sort"}),
    "deepseek-mla-ragged": ("deepseek", {"form": "ragged"}),
    "whisper": ("whisper", {}),
}

# Written as a Python loop over layers (the folding check of plan time against depth applies).
LOOPED = (
    "llama-maxtext",
    "llama-maxtext-remat",
    "llama-gqa-repeat",
    "nnx-llama",
    "moe-top2-shared",
    "t5",
    "vit",
    "equinox-gpt",
    "custom-vjp-gpt",
    "gemma",
    "hf-gpt2",
    "mamba2-ssd",
    "deepseek-mla-sort",
    "deepseek-mla-ragged",
)
SCANNED = ("linen-scan-gpt", "maxtext-scan", "nnx-scan-llama", "equinox-scan-llama")


def load(name: str):
    """(module, options) of a corpus entry."""
    import importlib

    module, options = CORPUS[name]
    return importlib.import_module(f"tests.corpus.{module}"), dict(options)
