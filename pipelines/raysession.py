"""Connect to a Ray cluster, or start a local one with logical GPUs on loopback only."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import Iterator

from soma_cluster.config import CampaignConfig

LOCAL_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",   # every Ray process on 127.0.0.1 (SPEC section 10)
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


@contextmanager
def ray_session(cfg: CampaignConfig, address: str | None = None) -> Iterator[None]:
    """Use an already-initialised Ray as is; else connect to `address`/RAY_ADDRESS; else start a local
    Ray with `resources.local_gpus` logical GPUs, shut down on exit."""
    for key, value in LOCAL_ENV.items():
        if not (address or os.environ.get("RAY_ADDRESS")) or key != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER":
            os.environ.setdefault(key, value)
    import ray

    if ray.is_initialized():
        yield
        return
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level="WARNING")
    else:
        tmp = tempfile.mkdtemp(prefix="soma-ray-", dir="/tmp")
        ray.init(num_gpus=cfg.resources.local_gpus, num_cpus=os.cpu_count() or 1, include_dashboard=False,
                 _temp_dir=tmp, log_to_driver=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()
