"""Attention backends x variants on GPU: forward+backward time, TFLOP/s, peak memory, ratio to SDPA flash (p=1).

    python benchmarks/attention_gpu.py                       # L = 1K..64K, head_dim 64 and 128, bf16, CUDA
    python benchmarks/attention_gpu.py --device cpu --lengths 256,512 --dtype float32   # CPU smoke run

Prints a table and writes JSON (default runs/bench/attention_<device>.json; an existing file needs --overwrite).
See `lengthgen.experiments.bench`.
"""

from __future__ import annotations

import argparse

from lengthgen.config import ConfigError
from lengthgen.experiments.bench import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    try:
        main(add_arguments(parser).parse_args())
    except ConfigError as err:
        parser.exit(2, f"error: {err}\n")
