"""The `zero3` command: train the built-in GPT on the built-in corpus with ZeRO-3.

`zero3 train` starts N local worker processes with torch's elastic launcher (the
machinery behind torchrun), so a single command shows the engine end to end:
parameters partitioned at construction, sharded optimizer, mixed precision, and
the per-rank model-state bytes set beside ZeRO-3's 16P/N expectation.

The package, one concept a module, each importing only the ones above it in this list:
options (argparse types), config (the train config), job (TrainJob), reporting (what
train prints), estimate, checkpoints (export, import-deepspeed), worker (the training
loop), launch (the elastic launcher), train, parser (build_parser, main).
"""

from __future__ import annotations

from zero3.cli.config import build_config, merge_user_config
from zero3.cli.job import TrainJob
from zero3.cli.launch import Rendezvous
from zero3.cli.options import non_negative_float, non_negative_int, positive_float, positive_int
from zero3.cli.parser import build_parser, main

__all__ = [
    "Rendezvous",
    "TrainJob",
    "build_config",
    "build_parser",
    "main",
    "merge_user_config",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
]
