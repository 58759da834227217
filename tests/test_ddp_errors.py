"""Errors under torchrun (2 gloo ranks): an error every rank has alike is printed once, by rank 0; an error of
one rank's own is printed by that rank.

The test launches this file with ``torchrun --standalone --nproc_per_node=2``; run as a script, each rank calls
``lengthgen train`` with a bad ``--set`` key (found before the ranks join the process group), then into a folder
holding something else (rank 0's check, handed to the other rank), or (``own``) with each rank failing its own way
after joining, or (``differ``) rank 1 with another learning rate and seed, or other text; it writes the exit codes.
Another launch (``late``) runs the command line as the ``lengthgen`` script does, rank 0 starting after the other
rank has left its error to it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from helpers import DISTRIBUTED_RUN as BASE
from helpers import torchrun_two


def test_an_error_of_every_rank_is_printed_once(tmp_path):
    stderr = torchrun_two(__file__, tmp_path, "shared").stderr + torchrun_two(__file__, tmp_path, "own").stderr
    pieces = ["train.bogus is not a valid key", f"{tmp_path / 'taken'} already holds notes.txt",
              "rank 0 failed its own way", "rank 1 failed its own way"]   # (two ranks' lines may interleave)
    assert [stderr.count(piece) for piece in pieces] == [1] * 4, stderr
    assert stderr.count("lengthgen train: error: ") == 4, stderr
    codes = [json.loads((tmp_path / f"{name}-{rank}.json").read_text()) for name in ("shared", "own") for rank in "01"]
    assert codes == [[2, 2], [2, 2], [2], [2]]


def test_ranks_with_different_configs_are_refused(tmp_path):
    """Ranks launched with another learning rate, seed or text trained apart without a word (before: exit 0, each
    rank its own updates and data, rank 0's config saved); now every rank stops before the folder, rank 0 naming
    each key that differs. The same text read from another folder (a DATA_LOCATION key) is no difference."""
    for name, text in (("a", "one two three\n\n" * 20), ("copy", "one two three\n\n" * 20), ("other", "four\n\n" * 40)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "corpus.txt").write_text(text)
    stderr = torchrun_two(__file__, tmp_path, "differ").stderr
    assert stderr.count("lengthgen train: error: the ranks differ: data digest: rank 0 '") == 1, stderr
    assert "; train.lr: rank 0 0.01, rank 1 0.02; train.seed: rank 0 0, rank 1 1; launch every rank with the same " \
           "command" in stderr and "data.text.corpus" not in stderr, stderr
    assert [json.loads((tmp_path / f"differ-{rank}.json").read_text()) for rank in "01"] == [[0, 2]] * 2
    assert (tmp_path / "differ-copy" / "latest.json").is_file() and not (tmp_path / "differ").exists()


def test_the_reporting_rank_is_not_stopped_before_its_line(tmp_path):
    """Torchrun stops every rank once one has exited: the rank that leaves its error to rank 0 waits to be
    stopped, so rank 0, later than it, still prints the line (before, the run failed without a word of why)."""
    proc = torchrun_two(__file__, tmp_path, "late", check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("lengthgen train: error: train.bogus is not a valid key") == 1, proc.stderr


def _late(out: Path, rank: str) -> None:
    """``lengthgen train`` with a bad key through `lengthgen.__main__.main`; rank 0 starts 3 s after rank 1 has
    returned from the command (without lingering, rank 1 exits and torchrun stops rank 0 in that time)."""
    import time

    import lengthgen.cli
    from lengthgen.__main__ import main

    marker = out / "rank1-returned"
    if rank == "0":
        while not marker.exists():
            time.sleep(0.05)
        time.sleep(3)
    else:
        run = lengthgen.cli.main
        lengthgen.cli.main = lambda: [run(), marker.touch()][0]
    sys.argv = ["lengthgen", "train", "--set", "train.bogus=1", "--out", str(out / "late")]
    sys.exit(main())


def _worker(out: Path, scenario: str) -> None:
    import lengthgen.train.trainer as trainer
    from lengthgen.cli import main
    from lengthgen.config import ConfigError

    rank = os.environ["RANK"]
    run = ["train", *(a for o in BASE for a in ("--set", o)), "--no-progress", "--out"]
    if scenario == "shared":
        if rank == "0":
            (out / "taken").mkdir()
            (out / "taken" / "notes.txt").write_text("not a run")
        codes = [main(["train", "--set", "train.bogus=1", "--out", str(out / "bogus")]),
                 main([*run, str(out / "taken")])]
    elif scenario == "differ":     # the same text from another folder (Python API: main leaves the process group)
        from lengthgen.train import train
        from lengthgen.train.config import RunConfig

        text = lambda name: ["data.kind=text", "data.task_kwargs={}", "train.eval_batches=0",  # noqa: E731
                             f'data.text={{corpus = "{out / (name if rank == "1" else "a")}", tokenizer = "byte"}}']
        train(RunConfig().override(*BASE, *text("copy")), out / "differ-copy", progress=False)
        differ = (["train.lr=0.02", "train.seed=1"] if rank == "1" else []) + text("other")
        differ = [o for o in BASE if not o.startswith("data.task=")] + differ       # text reads no data.task
        codes = [0, main(["train", *(a for o in differ for a in ("--set", o)), "--no-progress", "--out",
                          str(out / "differ")])]
    else:
        def fail(self, stop_at=None):
            raise ConfigError(f"rank {self.rank} failed its own way")

        trainer.Trainer.fit = fail
        codes = [main([*run, str(out / "own")])]
    (out / f"{scenario}-{rank}.json").write_text(json.dumps(codes))


if __name__ == "__main__":
    if sys.argv[2] == "late":
        _late(Path(sys.argv[1]), os.environ["RANK"])
    _worker(Path(sys.argv[1]), sys.argv[2])
