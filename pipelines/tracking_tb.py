"""TensorBoard as a tracking sink: one run directory per campaign (<logdir>/<name>-<campaign key>), one scalar
namespace per job (`expert-0003/train_loss`, `campaign/gpu_hours/wasted`), the config as a text summary. What
the directory already holds is read back with TensorBoard's own event reader when the sink opens, so a resumed
driver appends only later steps. Written with torch.utils.tensorboard (torch is a base dependency; it needs the
tensorboard package, the `tracking` extra)."""

from __future__ import annotations

import os

from soma_cluster.tracking import Marks, Metric, Params, Point

CONFIG_TEXT = "campaign/config"


def read_scalars(path: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in a run directory -> its (step, value) points, in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, logdir: str, key: str, campaign: str, full: bool = False):
        self.path = os.path.join(logdir, f"{campaign}-{key}")
        self.full, self.writer, self.has_config = full, None, False

    def load(self) -> None:
        import tensorboard.backend.event_processing.event_accumulator  # noqa: F401
        import torch.utils.tensorboard  # noqa: F401

    def open(self) -> Marks:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from torch.utils.tensorboard import SummaryWriter

        marks = Marks(known={} if self.full else None, kinds=(Metric, Params))  # no tags or artifacts here
        if os.path.isdir(self.path):
            acc = EventAccumulator(self.path, size_guidance={"scalars": 0, "tensors": 0})
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                run, key = tag.split("/", 1)
                steps = {e.step for e in acc.Scalars(tag)}
                marks.high[(run, key)] = max(steps)
                if self.full:
                    marks.known[(run, key)] = steps
            self.has_config = f"{CONFIG_TEXT}/text_summary" in acc.Tags()["tensors"]  # written once, as one text
        marks.params_whole = self.has_config
        if self.writer is None:
            self.writer = SummaryWriter(log_dir=self.path, flush_secs=30)
        return marks

    def write(self, points: list[Point]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # one event per (run, step, time): a heartbeat's five scalars cost one event, not five
        events: dict[tuple[int, float], list] = {}
        for p in points:
            if isinstance(p, Metric):
                value = Summary.Value(tag=f"{p.run}/{p.key}", simple_value=p.value)
                events.setdefault((p.step, p.t), []).append(value)
            elif isinstance(p, Params) and p.values and not self.has_config:
                self.has_config = True
                rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(p.values.items()))
                self.writer.add_text(CONFIG_TEXT, f"| parameter | value |\n|---|---|\n{rows}")
        for (step, t), values in events.items():
            self.writer.file_writer.add_summary(Summary(value=values), step, t)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
