"""Run by `accelerate launch` from test_train.py: train a head for the tiny Llama target of conftest on
the feature cache given as argv[1], into argv[2], with seqs_per_step argv[3]."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import tiny_target  # noqa: E402
from dart_lab.config import TrainConfig  # noqa: E402
from dart_lab.train import train_head  # noqa: E402

cfg = TrainConfig(max_steps=6, draft_length=3, draft_vocab_size=64, anchors_per_seq=10_000, warmup_steps=1,
                  val_examples=2, val_every=3, autocast=False, seqs_per_step=int(sys.argv[3]))
train_head(tiny_target("llama"), sys.argv[1], sys.argv[2], cfg, progress=False, log=lambda *a: None)
