"""Training: `train(config, out_dir)` -> `TrainResult`, `load_run(path)` -> (config, model), and the pieces
(schedules, BEMA, optimizers with Muon and QK-clip, atomic checkpoints, the run folder's lock and resume rules,
per-step data seeding)."""

from lengthgen.train.bema import BEMA, bema_coefficients
from lengthgen.train.optim import attention_max_logits, build_optimizers, muon_param_names, qk_clip_
from lengthgen.train.schedule import cosine_multiplier, lr_multiplier, wsd_multiplier
from lengthgen.train.trainer import NonFiniteLossError, Trainer, TrainResult, train
from lengthgen.train.weights import load_run

__all__ = ["BEMA", "NonFiniteLossError", "TrainResult", "Trainer", "attention_max_logits", "bema_coefficients",
           "build_optimizers", "cosine_multiplier", "load_run", "lr_multiplier", "muon_param_names", "qk_clip_",
           "train", "wsd_multiplier"]
