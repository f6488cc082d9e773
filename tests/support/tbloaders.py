"""What TensorBoard itself shows of a log directory, through both of its loaders: the data server (a Rust binary,
TensorBoard's default with `--load_fast=auto`) over gRPC, and the Python multiplexer (`--load_fast=false`),
each read through the data provider the TensorBoard server hands its scalars plugin. Every point of every run
and scalar tag (no downsampling)."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

Shown = dict[str, dict[str, list[tuple[int, float]]]]  # run -> tag -> [(step, value)] in the order returned
ALL = 10**9  # downsample to at most this many points: every point


def _points(scalars) -> Shown:
    return {
        run: {tag: [(d.step, d.value) for d in data] for tag, data in tags.items()} for run, tags in scalars.items()
    }


def python_loader(logdir: str) -> Shown:
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.backend.event_processing.data_ingester import DEFAULT_SIZE_GUIDANCE

    mux = plugin_event_multiplexer.EventMultiplexer(
        size_guidance=DEFAULT_SIZE_GUIDANCE, tensor_size_guidance={"scalars": 0}, purge_orphaned_data=True
    )
    mux.AddRunsFromDirectory(logdir)
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, logdir)
    ctx = context.RequestContext()
    return _points(provider.read_scalars(ctx, experiment_id="", plugin_name="scalars", downsample=ALL))


def data_server(logdir: str, timeout_s: float = 30.0) -> Shown:
    """One load cycle of the data server on `logdir`, then every scalar it holds."""
    import grpc
    import tensorboard_data_server
    from tensorboard import context
    from tensorboard.data import grpc_provider
    from tensorboard.data.proto import data_provider_pb2_grpc

    with tempfile.TemporaryDirectory(prefix="soma-tbserver-") as tmp:
        port_file, log = Path(tmp) / "port", Path(tmp) / "log"
        args = [tensorboard_data_server.server_binary(), f"--logdir={logdir}", "--reload=once", "--port=0"]
        args += [f"--port-file={port_file}", "--samples-per-plugin=scalars=all", "--verbose", "--die-after-stdin"]
        with open(log, "wb") as err:
            proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + timeout_s
            while b"Finished load cycle" not in log.read_bytes():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
            addr = f"localhost:{int(port_file.read_text())}"
            with grpc.insecure_channel(addr) as channel:
                provider = grpc_provider.GrpcDataProvider(
                    addr, data_provider_pb2_grpc.TensorBoardDataProviderStub(channel)
                )
                got = provider.read_scalars(
                    context.RequestContext(), experiment_id="", plugin_name="scalars", downsample=ALL
                )
                return _points(got)
        finally:
            proc.stdin.close()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def shown(logdir: str) -> dict[str, Shown]:
    """{loader: what it shows}: "data_server" (TensorBoard's default) where its binary exists for this platform,
    and "python"."""
    import tensorboard_data_server

    out = {"data_server": data_server(logdir)} if tensorboard_data_server.server_binary() else {}
    return out | {"python": python_loader(logdir)}
