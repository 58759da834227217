"""A run's metrics log: ``metrics.jsonl`` in the run folder, one JSON *entry* per logged step or evaluation,
mirrored to TensorBoard when it is installed. Only rank 0 writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any



class MetricsLog:
    """Appends entries (dicts with a ``step``) to ``run_dir/metrics.jsonl`` and TensorBoard (``run_dir/tb``);
    does nothing when not ``enabled``. `close` it at the end."""

    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.path, self.enabled = Path(run_dir) / "metrics.jsonl", enabled
        self.writer = _tensorboard(Path(run_dir)) if enabled else None

    def append(self, entry: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        if self.writer is not None:
            for key, value in _flatten(entry).items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, entry["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _tensorboard(run_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard is optional
        return None
    return SummaryWriter(str(run_dir / "tb"))


__all__ = ["MetricsLog"]
