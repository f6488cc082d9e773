"""A job is done only while its last checkpoint verifies.

If the checkpoint a job's `latest.json` points at is truncated, corrupt or gone, the job's work since its
newest checkpoint that still verifies is lost, whatever events.jsonl says: `latest.json` is pointed back
at that checkpoint (or removed, when none verifies) and a `reopened` event makes the job pending again,
so the next `soma seed` / `soma launch` / `soma resume` retrains the lost updates. A resumed run is bitwise
the run that never stopped (docs/scheduling.md), so the result is the one the lost checkpoint held.

`--retry-failed` reopens jobs that ended failed_permanently, once their cause is fixed (c-BTM retrains chosen
clusters; Ray Tune restarts errored trials): from their newest checkpoint that verifies, with their retries
given back. Their failed attempts stay as they were settled (their lost work stays `wasted`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pipelines.common import console
from soma_cluster.checkpoint import CheckpointCheck, check_checkpoints, checkpoint_steps, fall_back
from soma_cluster.errors import SomaError
from soma_cluster.events import RETRAIN, RETRY_FAILED, emit, history
from soma_cluster.failures import expert_names, select_failed
from soma_cluster.jobs import ENDED_WITH_CHECKPOINT, Event, Job, JobState
from soma_cluster.storage import Store

PARALLEL_CHECKS = 8  # checkpoints verified at once (each is a few reads: latest.json, metadata, tensors)


def reopen_unverified(store: Store, jobs: list[Job]) -> dict[str, CheckpointCheck]:
    """For each job that has run: fall back to its newest checkpoint that verifies and, where that changed
    anything, emit `reopened` and say so. Returns the reopened jobs' checks. The driver then settles the
    reopened attempt against that checkpoint: its work after it moves from training to wasted."""
    past = history(store)
    ran = [(job.name, job.model_dir) for job in jobs if job.name in past]
    with ThreadPoolExecutor(PARALLEL_CHECKS) as pool:
        checks = dict(zip((name for name, _ in ran), pool.map(lambda job: fall_back(store, job[1]), ran), strict=True))
    reopened = {}
    for name, c in checks.items():
        h = past[name]
        if c.ok and not (c.valid is None and h.state in ENDED_WITH_CHECKPOINT and h.step > 0):
            continue  # (a finished expert whose checkpoints are all gone is retrained too)
        lost = max(0, h.step - (c.step or 0))
        if h.terminal and c.valid is not None and not lost:  # only the pointer was gone: nothing to retrain
            console.print(f"{name}: latest.json pointed again at {c.valid}, its last checkpoint (which verifies)")
            continue
        reopened[name] = c
        what = (
            "; ".join(f"{n}: {why}" for n, why in c.bad)
            or f"no checkpoint of it is left under {store.url}/{c.directory}"
        )
        emit(
            store,
            Event.REOPENED,
            name,
            step=c.step or 0,
            was=h.last_event,  # the event it was left at, as this field has always held
            checkpoint=c.valid,
            bad=[n for n, _ in c.bad],
            reason=what,
        )
        start = f"from {c.valid} (step {c.step})" if c.valid else "from the start (no checkpoint of it verifies)"
        console.print(
            f"{name}: {what}; it was {h.last_event} at step {h.step}, now resumes {start}: {lost} updates to retrain"
        )
    return reopened


def reopen_failed(store: Store, jobs: list[Job], requested: list[str]) -> list[str]:
    """Reopen the jobs that ended failed_permanently (all of `jobs`' for an empty `requested`, else the named ones,
    each of which must have: SomaError otherwise, before anything is written). Each falls back to its newest
    checkpoint that verifies (a `reopened` event of its own if that lost work) and gets a `reopened` event with
    reason retry_failed: pending again, its failures no longer counted. Returns the reopened jobs' names."""
    past = history(store)
    chosen = select_failed({n: h.state for n, h in past.items()}, [j.name for j in jobs], requested)
    if not chosen:
        console.print("--retry-failed: no job here ended failed_permanently; nothing to reopen")
        return []
    by_name = {j.name: j for j in jobs}
    reopen_unverified(store, [by_name[n] for n in chosen])
    for name in chosen:
        check = check_checkpoints(store, by_name[name].model_dir)
        emit(
            store,
            Event.REOPENED,
            name,
            step=check.step or 0,
            was=JobState.FAILED_PERMANENTLY,
            checkpoint=check.valid,
            bad=[],
            reason=RETRY_FAILED,
            failures=past[name].failures,
        )
        start = f"from {check.valid} (step {check.step})" if check.valid else "from the start (it has no checkpoint)"
        console.print(
            f"{name}: failed permanently ({past[name].last_error}); reopened {start} with its retries given back"
        )
    return chosen


def retire_after(store: Store, directory: str, keep_to: int | None, tag: str) -> list[str]:
    """Move the checkpoints of `directory` past step `keep_to` (all of them for None) into `directory/tag/`, written
    there before they are removed here: the old attempts' checkpoints stay, out of the way of the new one."""
    moved = []
    for step in checkpoint_steps(store, directory):
        if keep_to is not None and step <= keep_to:
            continue
        for suffix in (".safetensors", ".json"):
            rel = f"step-{step:06d}{suffix}"
            store.write_bytes(f"{directory}/{tag}/{rel}", store.read_bytes(f"{directory}/{rel}"))
            store.remove(f"{directory}/{rel}")
            moved.append(rel)
    if keep_to is None:
        if store.exists(f"{directory}/latest.json"):
            store.remove(f"{directory}/latest.json")
    else:
        store.write_json(f"{directory}/latest.json", {"step": keep_to, "name": f"step-{keep_to:06d}"})
    return moved


def check_retrain(store: Store, jobs: list[Job], requested: list[str], from_step: int | None) -> list[str]:
    """The experts `--retrain` names, each with a checkpoint of `from_step` if given (SomaError naming the first
    without one); reads only, so `soma resume` refuses before it takes the lease."""
    names = expert_names(requested, [j.name for j in jobs])
    by_name = {j.name: j for j in jobs}
    if from_step is not None:
        for name in names:
            steps = checkpoint_steps(store, by_name[name].model_dir)
            if from_step not in steps:
                kept = ", ".join(map(str, steps)) or "none"
                raise SomaError(
                    f"--from-step {from_step}: {name} has no checkpoint of that step (it has {kept}); pass one of "
                    "those, or leave out --from-step to retrain it from the seed"
                )
    return names


def reopen_retrain(store: Store, jobs: list[Job], requested: list[str], from_step: int | None) -> list[str]:
    """`soma resume --retrain EXPERT ...`: train the named experts again, from the seed (`from_step` None) or from
    their checkpoint of `from_step`, which each must have (SomaError before anything is written). Their later
    checkpoints move to `retired-N/` in their directory and their events and ledger records stay as they were (what
    was spent stays spent); a `reopened` event (reason retrain) makes each pending."""
    names = check_retrain(store, jobs, requested, from_step)
    by_name = {j.name: j for j in jobs}
    past = history(store)
    for name in names:
        d = by_name[name].model_dir
        h = past.get(name)
        tag = f"retired-{sum(1 for ev in (h.events if h else []) if ev.get('reason') == RETRAIN) + 1}"
        retire_after(store, d, from_step, tag)
        emit(
            store,
            Event.REOPENED,
            name,
            step=from_step or 0,
            was=h.state if h else JobState.PENDING,
            checkpoint=None if from_step is None else f"step-{from_step:06d}",
            bad=[],
            reason=RETRAIN,
            retired=f"{d}/{tag}",
        )
        start = "from the seed" if from_step is None else f"from its checkpoint of step {from_step}"
        console.print(f"{name}: retrained {start}; its later checkpoints kept under {d}/{tag}/", markup=False)
    return names
