"""What a directory given to a command is, and the command that would make it what the command needs.

Every command takes a campaign directory (or an experiment directory, for `soma report`). Given the wrong one (a
missing path, an empty directory, another command's directory, a campaign at an earlier stage) it says what it
found and names the command that makes the right one. Nothing here needs Ray."""

from __future__ import annotations

from enum import StrEnum

from soma_cluster.errors import SomaError

CAMPAIGN_FILE = "campaign.yaml"  # soma prepare (read back by soma_cluster/campaignfile.py, as CONFIG_FILE)
EXPERIMENT_FILE = "experiment.json"  # soma experiment (pipelines/experiment.py's MARKER)
RESULTS_FILE = "results.json"  # soma experiment, when every arm is evaluated

# the command that writes each top-level name of a campaign or an experiment directory
MAKERS = {
    CAMPAIGN_FILE: "soma prepare",
    "router": "soma prepare",
    "shards": "soma prepare",
    "test": "soma prepare",
    "seed": "soma seed",
    "experts": "soma launch",
    "status.json": "soma launch",
    "eval": "soma eval",
    "plan": "soma plan",
    "fork.json": "soma fork",
    EXPERIMENT_FILE: "soma experiment",
    RESULTS_FILE: "soma experiment",
}


class Found(StrEnum):
    MISSING = "missing"  # nothing at the path (or an empty directory)
    CAMPAIGN = "campaign"
    EXPERIMENT = "experiment"
    OTHER = "other"  # a directory of files no soma command wrote


def found(names: list[str]) -> Found:
    """What a directory holding these top-level names (lease files left out) is."""
    if CAMPAIGN_FILE in names:
        return Found.CAMPAIGN
    if EXPERIMENT_FILE in names:
        return Found.EXPERIMENT
    return Found.OTHER if names else Found.MISSING


def maker(rel: str) -> str | None:
    """The command that writes `rel` (a path inside a campaign or experiment directory)."""
    return MAKERS.get(rel.strip("/").split("/", 1)[0])


def missing_file(url: str, rel: str) -> str:
    """'URL/REL is missing; ...' naming the command that writes it."""
    command = maker(rel)
    fix = f"run {command} {url} (it writes {rel})" if command else "re-run the stage that writes it"
    return f"{url}/{rel} is missing; {fix}"


def not_a_campaign(url: str, names: list[str]) -> SomaError:
    """A command that needs a campaign was given something else."""
    kind = found(names)
    if "soma-export.json" in names:
        return SomaError(
            f"{url} is an export of a trained ensemble (soma export made it), not a campaign: soma score and soma "
            "sample read it; the other commands take the campaign it came from"
        )
    if kind is Found.EXPERIMENT:
        arms = sorted(n for n in names if n.startswith("s") and n[1:].isdigit())
        where = f"{url}/{arms[0]}/ARM" if arms else f"{url}/sSEED/ARM"
        return SomaError(
            f"{url} is an experiment directory (soma experiment wrote it), not a campaign; pass one of its campaigns "
            f"({where}), or make a campaign with soma prepare NEW_DIR"
        )
    if kind is Found.OTHER:
        return SomaError(
            f"{url} holds no {CAMPAIGN_FILE}, and its files were not written by soma; pass a campaign directory, or "
            f"make one in a new directory with soma prepare NEW_DIR"
        )
    return SomaError(f"{url} holds no {CAMPAIGN_FILE}; run soma prepare {url} first")


def not_an_experiment(url: str, names: list[str], experiment: str | None = None) -> SomaError:
    """`soma report` was given something other than a finished experiment's directory."""
    kind = found(names)
    if kind is Found.CAMPAIGN:
        return SomaError(
            f"{url} is a campaign, not an experiment directory: soma eval {url} writes its report "
            f"({url}/eval/report.md); soma report re-renders experiments made by soma experiment NAME DIR"
        )
    if kind is Found.EXPERIMENT:
        return SomaError(
            f"{url}/{RESULTS_FILE} is missing: the experiment has not finished; run soma experiment "
            f"{experiment or 'NAME'} {url} again to finish it"
        )
    return SomaError(
        f"{url} holds no {RESULTS_FILE}: it is not an experiment directory; soma experiment NAME {url} makes one "
        "(soma presets lists the experiments)"
    )


def occupied(url: str, names: list[str], needs: str) -> SomaError:
    """A command that makes a new campaign (or experiment) was pointed at a directory already holding other things."""
    what = {
        Found.EXPERIMENT: "an experiment directory (soma experiment wrote it)",
        Found.CAMPAIGN: "a campaign (soma prepare wrote it)",
    }.get(found(names), "not empty")
    command = MAKERS.get(needs, "soma prepare")
    return SomaError(f"{url} is {what} and holds no {needs}; choose an empty or new directory for {command}")
