"""What soma serve makes of Serve's status while it deploys (soma_cluster/inference/servestate.py), without Ray: the
messages are Serve 2.60's own, as a replica whose constructor raised left them (recorded from a real deploy of an
export whose weights.safetensors was damaged after soma serve had checked it)."""

from __future__ import annotations

import pytest

from soma_cluster.inference.servestate import AppState, Verdict, notes, raised, verdict

REPLICA_TRACEBACK = """The deployment failed to start 3 times in a row. This may be due to a problem with its \
constructor or initial health check failing. See controller logs for details. Error:
\x1b[36mray::ServeReplica:soma:SomaExperts.initialize_and_get_metadata()\x1b[39m (pid=21075, ip=127.0.0.1, \
actor_id=f4f9, repr=<ray.serve._private.replica.ServeReplica:soma:SomaExperts object at 0x7fe31ce0d290>)
  File "/usr/lib/python3.11/concurrent/futures/_base.py", line 401, in __get_result
    raise self._exception
  File "ray/serve/_private/replica.py", line 1928, in initialize
    raise RuntimeError(traceback.format_exc()) from None
RuntimeError: Traceback (most recent call last):
  File "ray/serve/_private/replica.py", line 1867, in initialize
    await self._user_callable_wrapper.initialize_callable()
  File "pipelines/serve_app.py", line 144, in __init__
    self.lm = RoutedLM.load(
  File "soma_cluster/inference/export.py", line 254, in read_blob
    raise ChecksumError(
soma_cluster.errors.ChecksumError: /data/export/weights.safetensors fails its checksum (truncated or corrupt); \
export again (soma export CAMPAIGN DIR)"""

OTHER_TRACEBACK = REPLICA_TRACEBACK.replace(
    "soma_cluster.errors.ChecksumError: /data/export/weights.safetensors fails its checksum (truncated or corrupt); "
    "export again (soma export CAMPAIGN DIR)",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
)
PENDING = (
    "Deployment 'SomaExperts' in application 'soma' has 1 replicas that have taken more than 30s to be scheduled. "
    'This may be due to waiting for the cluster to auto-scale. Resources required for each replica: {"GPU": 1.0}'
)


def app(status: str, experts: tuple[str, str], app_message: str = "") -> AppState:
    return AppState.of(status, app_message, {"SomaExperts": experts, "SomaRouter": ("HEALTHY", "")})


def test_the_innermost_error_of_a_replica_traceback_is_the_line():
    cls, msg = raised(REPLICA_TRACEBACK)
    assert cls == "soma_cluster.errors.ChecksumError"
    assert msg.startswith("/data/export/weights.safetensors fails its checksum")
    assert raised(PENDING) is None and raised("") is None


def test_a_soma_error_fails_the_deployment_at_the_first_try_naming_the_file():
    state, why = verdict(app("DEPLOYING", ("UPDATING", REPLICA_TRACEBACK)))
    assert state is Verdict.FAILED and "\n" not in why
    assert why.startswith("a SomaExperts replica could not start: /data/export/weights.safetensors fails its checksum")


def test_another_error_is_left_to_serve_s_retries_then_named():
    assert verdict(app("DEPLOYING", ("UPDATING", OTHER_TRACEBACK)))[0] is Verdict.WAITING
    assert notes(app("DEPLOYING", ("UPDATING", OTHER_TRACEBACK))) == [
        "SomaExperts: a replica could not start (OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB); "
        "Serve tries again"
    ]
    failed = app(
        "DEPLOY_FAILED", ("DEPLOY_FAILED", OTHER_TRACEBACK), "Failed to update the deployments ['SomaExperts']."
    )
    state, why = verdict(failed)
    assert state is Verdict.FAILED
    assert (
        why == "a SomaExperts replica could not start: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    )


def test_running_waiting_gone_and_failed_without_a_traceback():
    assert verdict(app("RUNNING", ("HEALTHY", "")))[0] is Verdict.RUNNING
    assert verdict(app("DEPLOYING", ("UPDATING", PENDING))) == (Verdict.WAITING, "")
    assert notes(app("DEPLOYING", ("UPDATING", PENDING))) == [f"SomaExperts: {PENDING}"]
    assert verdict(None)[0] is Verdict.FAILED and notes(None) == []
    state, why = verdict(app("DEPLOY_FAILED", ("DEPLOY_FAILED", ""), "Failed to update the deployments."))
    assert state is Verdict.FAILED and why == "Failed to update the deployments."
    long = app("DEPLOY_FAILED", ("DEPLOY_FAILED", "x " * 2000))
    assert len(verdict(long)[1]) <= 600


def test_soma_serve_waits_for_running_and_stops_at_the_first_soma_error(monkeypatch, capsys):
    """pipelines.serve.wait_deployed on a scripted status: a config Serve has not listed yet is waited for (a REST
    deploy is listed a moment after the PUT), Serve's notes are printed once each, a soma error ends it at once."""
    from pipelines import serve
    from soma_cluster.errors import SomaError

    monkeypatch.setattr(serve, "POLL_DEPLOY_S", 0.0)
    pending = app("DEPLOYING", ("UPDATING", PENDING))
    script = iter([None, None, pending, pending, app("RUNNING", ("HEALTHY", ""))])
    serve.wait_deployed(lambda: next(script))
    assert capsys.readouterr().err.count("taken more than 30s to be scheduled") == 1
    script = iter([pending, app("DEPLOYING", ("UPDATING", REPLICA_TRACEBACK))])
    with pytest.raises(SomaError, match=r"did not deploy: a SomaExperts replica could not start: /data/export/weights"):
        serve.wait_deployed(lambda: next(script))
    script = iter([pending, None])  # listed, then gone: deleted while it deployed
    with pytest.raises(SomaError, match="gone from Serve"):
        serve.wait_deployed(lambda: next(script))
    monkeypatch.setattr(serve, "APPEAR_S", 0.0)
    with pytest.raises(SomaError, match="gone from Serve"):  # never listed within APPEAR_S
        serve.wait_deployed(lambda: None)
