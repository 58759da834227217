"""Attention backends x variants on GPU: forward+backward time, TFLOP/s, peak memory, ratio to SDPA flash (p=1).

    python benchmarks/attention_gpu.py                       # L = 1K..64K, head_dim 64 and 128, bf16, CUDA
    python benchmarks/attention_gpu.py --device cpu --lengths 256,512 --dtype float32   # CPU smoke run

``lengthgen bench attention`` with the same options (`lengthgen.cli.bench`): prints a table and writes JSON
(default runs/bench/attention_<device>.json; an existing file needs --overwrite).
"""

from __future__ import annotations

import sys

from lengthgen.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "attention", *sys.argv[1:]]))
