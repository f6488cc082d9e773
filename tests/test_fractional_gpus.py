"""Fractional GPUs on a real local Ray: 0.5 GPU per expert on 2 logical GPUs runs 4 experts at once and
queues the rest; resources.placement maps to Ray's scheduling strategy."""

import shutil
import tempfile

import pytest
from conftest import micro_config

from pipelines.campaign import Driver, Job, expert_jobs
from pipelines.prepare import prepare
from soma_cluster.errors import SomaError
from soma_cluster.events import history
from soma_cluster.storage import Store
from workers import SCHEDULING

N_EXPERTS, GPUS, SHARE = 6, 2, 0.5
SLOTS = int(GPUS / SHARE)


@pytest.fixture(scope="module")
def ray_two_gpus():
    import ray

    tmp = tempfile.mkdtemp(prefix="soma-ray-s-", dir="/tmp")
    ray.init(
        num_gpus=GPUS, num_cpus=2, include_dashboard=False, _temp_dir=tmp, log_to_driver=False, logging_level="WARNING"
    )
    yield ray
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at one instant (an interval ending at t closes before one starting at t)."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    now = most = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def intervals(hist, names, start_event):
    out = []
    for name in names:
        evs = hist[name].events
        out.append(
            (
                next(e["t"] for e in evs if e["event"] == start_event),
                next(e["t"] for e in evs if e["event"] == "finished"),
            )
        )
    return out


def test_half_gpu_experts_run_four_at_a_time_and_the_rest_queue(ray_two_gpus, tmp_path, text_corpus):
    cfg = micro_config(n_experts=N_EXPERTS, corpus={"source": str(text_corpus)}, resources={"num_gpus": SHARE})
    store = Store(str(tmp_path / "camp"))
    prepare(store, cfg)
    assert Driver(store, cfg, [Job(None)], show_progress=False).run() == {"seed": "finished"}
    outcome = Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False).run()
    assert set(outcome.values()) == {"finished"} and len(outcome) == N_EXPERTS
    hist = history(store)
    names = sorted(outcome)
    held = intervals(hist, names, "launched")  # from asking Ray for the GPU share to the end
    running = intervals(hist, names, "started")
    assert max_overlap(held) == SLOTS  # fractional shares: 4 experts on 2 GPUs at once ...
    assert max_overlap(running) <= SLOTS  # ... never more
    first_end = min(end for _, end in held)
    assert sum(start >= first_end for start, _ in held) == N_EXPERTS - SLOTS  # the extra two waited for a slot
    assert all(e["num_gpus"] == SHARE for n in names for e in hist[n].events if e["event"] == "launched")


def test_placement_maps_to_ray_scheduling_strategy():
    assert SCHEDULING == {"pack": "DEFAULT", "spread": "SPREAD"}
    assert micro_config().resources.placement == "pack"
    assert micro_config(resources={"placement": "spread"}).resources.placement == "spread"
    with pytest.raises(SomaError, match="placement"):
        micro_config(resources={"placement": "scatter"})
