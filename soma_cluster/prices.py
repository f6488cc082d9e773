"""What compute costs in US dollars (the `prices` config section): the price in force for the device a ledger
record's GPU-seconds ran on. Each record keeps the price it was written with (`usd_per_hour`), so a price changed
later (soma set prices.*) never rewrites the past; records written without a price stay unpriced."""

from __future__ import annotations

from soma_cluster.config import PricesConfig


def usd_per_hour(prices: PricesConfig, device: str | None) -> float | None:
    """USD per GPU-hour for GPU-seconds on `device`: "cuda" at the accelerator's price (spot or on demand), "cpu" (a
    logical GPU share held on a CPU) at prices.cpu_hour; None (not known yet: an actor before its first report) at
    the accelerator's price, else the CPU's. None: no price applies."""
    gpu = prices.gpu[prices.accelerator] if prices.accelerator is not None else None
    gpu_price = None if gpu is None else (gpu.spot if prices.spot else gpu.on_demand)
    if device == "cpu":
        return prices.cpu_hour
    if device == "cuda":
        return gpu_price
    return gpu_price if gpu_price is not None else prices.cpu_hour
