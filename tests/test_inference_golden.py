"""The inference API's outputs are bitwise the recorded ones: scores and their records, routes, next-byte
distributions, seeded generations, an export's weights, soma eval's numbers and the lm-eval model's answers on the
session's trained micro campaign, against tests/assets/inference_golden.json (tests/support/inference_golden.py says
how each part was recorded and checked against the code before it). Any change to a number is a change of
behaviour."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.inference_golden import api_outputs, eval_outputs, export_outputs, lmeval_outputs, weights_digest

from soma_cluster.inference.lm import RoutedLM

GOLDEN = Path(__file__).parent / "assets" / "inference_golden.json"


@pytest.fixture(scope="module")
def golden(trained_campaign) -> dict:
    want = json.loads(GOLDEN.read_text())
    got = weights_digest(trained_campaign)
    if got != want["weights_digest"]:
        pytest.skip(
            f"the trained fixture's weights (digest {got[:12]}) are not those the goldens were recorded on "
            f"({want['weights_digest'][:12]}): training or this machine's arithmetic differs, so its outputs may too; "
            "tests/support/inference_golden.py records them again (from code known to be right)"
        )
    return want


def differences(want, got, path: str = "") -> list[str]:
    if isinstance(want, dict) and isinstance(got, dict):
        return [d for k in sorted(set(want) | set(got)) for d in differences(want.get(k), got.get(k), f"{path}/{k}")]
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (a, b) in enumerate(zip(want, got, strict=True)) for d in differences(a, b, f"{path}/{i}")]
    return [] if want == got else [f"{path}: {str(want)[:60]} -> {str(got)[:60]}"]


def test_scores_routes_and_generations_are_bitwise_the_recorded_ones(golden, trained_campaign):
    got = api_outputs(RoutedLM.load(trained_campaign, device="cpu"))
    assert not differences({k: golden[k] for k in got}, got)


def test_an_export_writes_the_recorded_weights(golden, trained_campaign):
    assert not differences(golden["export"], export_outputs(str(trained_campaign)))


def test_soma_eval_s_protocol_windows_score_as_recorded(golden, trained_campaign):
    """Each test window routed on its unscored first 256 bytes, as before causal routing: the same numbers."""
    assert not differences(golden["eval"], eval_outputs(trained_campaign))


def test_the_lmeval_model_answers_as_recorded(golden, trained_campaign):
    pytest.importorskip("lm_eval", reason="the lmeval extra is not installed: pip install 'soma-cluster[lmeval]'")
    assert not differences(golden["lmeval"], lmeval_outputs(str(trained_campaign)))
