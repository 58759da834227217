"""Experiments: recipes composed from the layers below (train, eval, report), owning nothing those layers
should own. `compare` (the main job), `retrofit` (seed 000's AVNorm on a trained model), `theory` (seed 004's
extreme-value results) and `bench` (attention backends against SDPA)."""
