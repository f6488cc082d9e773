"""campaign.yaml: the file that makes a directory a campaign, and the config read back from it.

soma prepare (and soma fork, for a child) writes the resolved config there once (config.to_yaml_text); every
later command and every worker reads it back here, refused if it was edited since. The config in force adds the
revisions written since (soma set; soma_cluster/revisions.py). Its name is soma_cluster/targets.py's, below the
store, whose messages name the command that writes each file. No Ray.
"""

from __future__ import annotations

from soma_cluster.config import CampaignConfig, from_yaml_text
from soma_cluster.errors import SomaError
from soma_cluster.lease import LEASE_FILES
from soma_cluster.storage import Store
from soma_cluster.targets import CAMPAIGN_FILE as CONFIG_FILE
from soma_cluster.targets import not_a_campaign


def load_campaign_config(store: Store) -> CampaignConfig:
    """The resolved config a campaign directory was bound to, refused if campaign.yaml was edited since it was
    written."""
    if not store.exists(CONFIG_FILE):
        raise not_a_campaign(store.url, [n for n in store.listdir("") if n not in LEASE_FILES])
    raw = store.read_bytes(CONFIG_FILE)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SomaError(
            f"{store.url}/{CONFIG_FILE} is not UTF-8 text (damaged); restore it from a backup or start a new campaign"
        ) from None
    return from_yaml_text(text, f"{store.url}/{CONFIG_FILE}")
