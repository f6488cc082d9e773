"""MLflow as a tracking sink: one parent run per campaign (named after its directory), one child run per job
(`<dir>/expert-0003`), found again by their tags (soma.campaign, soma.role, soma.job), so a resumed driver or
`soma track` continues the same runs. A run's status follows the campaign's (RUNNING, FINISHED, FAILED, KILLED;
RUNNING again on resume). Points go out through MlflowClient.log_batch from the sink's thread
(pipelines/tracking.py); mlflow is imported here only, when a campaign asks for it (the `tracking` extra)."""

from __future__ import annotations

import os
import tempfile
import time

from soma_cluster.trackpoints import PARENT, TAG, Artifact, Marks, Metric, Params, Point, RunState, Status, Tag

MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100  # log_batch's limits per call
FORK_RUN = TAG + "forked_from_run"  # a fork's parent run id, found by the parent campaign's key


class MlflowSink:
    name = "mlflow"

    def __init__(
        self,
        uri: str,
        experiment: str,
        key: str,
        label: str,
        timeout_s: float,
        full: bool = False,
        fork_key: str | None = None,
    ):
        """`label`: the runs' names (the campaign directory's name); `fork_key`: a fork's parent campaign's key."""
        self.uri, self.experiment, self.key, self.label, self.full = uri, experiment, key, label, full
        self.fork_key = fork_key
        # the client's own retries (7, with backoff: minutes) are replaced by the sink's bounded ones
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, int(timeout_s))))
        # stdout holds a command's data only: no "View run ... at" line from the client when a run ends
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        self.client = None
        self.exp_id: str | None = None
        self.runs: dict[str, str] = {}  # run name (PARENT or a job) -> MLflow run id

    def load(self) -> None:
        import mlflow.entities  # noqa: F401
        import mlflow.tracking  # noqa: F401

    def open(self) -> Marks:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        self.exp_id = self._experiment()
        marks = Marks(known={} if self.full else None)
        self.runs = {}
        for run in self._search():
            name = PARENT if run.data.tags.get(TAG + "role") == "campaign" else run.data.tags.get(TAG + "job")
            if name is None or name in self.runs:
                continue
            self.runs[name] = run.info.run_id
            for m in run.data._metric_objs:  # the latest point of each key: its step is the high water
                marks.high[(name, m.key)] = max(marks.high.get((name, m.key), -1), m.step)
                if self.full:
                    hist = self.client.get_metric_history(run.info.run_id, m.key)
                    marks.known[(name, m.key)] = {h.step for h in hist}
                    marks.high[(name, m.key)] = max(h.step for h in hist)
            marks.tags |= {(name, k): v for k, v in run.data.tags.items() if k.startswith(TAG)}
            marks.tags[(name, "")] = run.info.status  # its status, as Marks keeps it
            marks.params |= {(name, k) for k in run.data.params}
            if name == PARENT:
                art = TAG + "artifact."
                marks.artifacts |= {k[len(art) :]: v for k, v in run.data.tags.items() if k.startswith(art)}
        if PARENT not in self.runs:
            self.runs[PARENT] = self._create(PARENT, {TAG + "role": "campaign"}, self.label)
            marks.tags[(PARENT, "")] = Status.RUNNING
        if self.fork_key and (PARENT, FORK_RUN) not in marks.tags:
            self._link_fork(marks)
        return marks

    def _link_fork(self, marks: Marks) -> None:
        """A fork's run names its parent's run (`soma.forked_from_run`, the id MLflow's search and URLs use), found by
        the parent campaign's key in any experiment of this server; a parent never tracked here is not linked."""
        exps = [e.experiment_id for e in self.client.search_experiments(max_results=1000)]
        found = self.client.search_runs(
            exps[:100],  # search_runs takes at most 100 experiments a call
            filter_string=f"tags.`{TAG}campaign` = '{self.fork_key}' and tags.`{TAG}role` = 'campaign'",
            max_results=1,
        )
        if found:
            self.client.set_tag(self.runs[PARENT], FORK_RUN, found[0].info.run_id)
            marks.tags[(PARENT, FORK_RUN)] = found[0].info.run_id

    def _experiment(self) -> str:
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(self.experiment)
        except Exception:  # made meanwhile by another campaign's driver
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                raise
            return exp.experiment_id

    def _search(self) -> list:
        out, token = [], None
        while True:
            page = self.client.search_runs(
                [self.exp_id], filter_string=f"tags.`{TAG}campaign` = '{self.key}'", max_results=1000, page_token=token
            )
            out += list(page)
            token = page.token
            if not token:
                return out

    def _create(self, name: str, tags: dict[str, str], run_name: str) -> str:
        tags = {TAG + "campaign": self.key, **tags}
        if name != PARENT:
            tags["mlflow.parentRunId"] = self.runs[PARENT]
        return self.client.create_run(self.exp_id, tags=tags, run_name=run_name).info.run_id

    def _run(self, name: str) -> str:
        if name not in self.runs:
            self.runs[name] = self._create(name, {TAG + "role": "job", TAG + "job": name}, f"{self.label}/{name}")
        return self.runs[name]

    def write(self, points: list[Point]) -> None:
        from mlflow.entities import Metric as MlMetric
        from mlflow.entities import Param, RunTag

        metrics: dict[str, list] = {}
        params: dict[str, list] = {}
        tags: dict[str, dict] = {}
        later: list[Point] = []
        for p in points:
            if isinstance(p, Metric):
                metrics.setdefault(p.run, []).append(MlMetric(p.key, p.value, int(p.t * 1000), p.step))
            elif isinstance(p, Tag):  # the last value of a key wins (one batch may hold a job's two states)
                tags.setdefault(p.run, {})[p.key] = RunTag(p.key, p.value[:5000])
            elif isinstance(p, Params):
                params.setdefault(p.run, []).extend(Param(k, v[:6000]) for k, v in p.values.items())
            else:
                later.append(p)
        for run in dict.fromkeys([*metrics, *tags]):
            rid = self._run(run)
            ms, ts = metrics.get(run, []), list(tags.get(run, {}).values())
            for i in range(max(-(-len(ms) // MAX_METRICS), -(-len(ts) // MAX_TAGS))):
                self.client.log_batch(
                    rid, metrics=ms[i * MAX_METRICS : (i + 1) * MAX_METRICS], tags=ts[i * MAX_TAGS : (i + 1) * MAX_TAGS]
                )
        for run, ps in params.items():
            for i in range(0, len(ps), MAX_PARAMS):
                self.client.log_batch(self._run(run), params=ps[i : i + MAX_PARAMS])
        for p in later:
            self._other(p)

    def _other(self, p: Point) -> None:
        if isinstance(p, RunState):
            if p.status in (Status.RUNNING, Status.SCHEDULED):  # reopened: a resumed campaign, a job started again
                self.client.update_run(self._run(p.run), status=p.status)
            else:
                self.client.set_terminated(self._run(p.run), status=p.status, end_time=int(time.time() * 1000))
        elif isinstance(p, Artifact):
            with tempfile.TemporaryDirectory(prefix="soma-artifact-") as tmp:
                path = os.path.join(tmp, os.path.basename(p.name))
                with open(path, "wb") as fh:
                    fh.write(p.data)
                self.client.log_artifact(self.runs[PARENT], path)
            self.client.set_tag(self.runs[PARENT], f"{TAG}artifact.{p.name}", p.sha)

    def finish(self) -> list[str]:
        return []  # every batch was logged by write()

    def close(self) -> None:
        pass
