"""The admission and session rules every shell calls (tandem.core.admission), on hand-built cases."""
from __future__ import annotations

import pytest

from tandem.core.admission import (ContextError, ContextFault, SessionBusyError, check_deployment, check_one_round,
                                   check_worker_counts, continues, generation_budget)
from tandem.core.deploy import DeploymentError, parse_deploy
from tandem.policy.presets import get_policy


def test_policy_runs_on_its_deployment_kind():
    check_deployment(get_policy("ampd"), parse_deploy("P:tp4x1,D:tp4x1", 8))
    check_deployment(get_policy("vllm"), parse_deploy("C:tp4x2", 8))
    with pytest.raises(DeploymentError, match="needs prefill and decode workers"):
        check_deployment(get_policy("ampd"), parse_deploy("C:tp4x2", 8))
    with pytest.raises(DeploymentError, match="serves co-located workers"):
        check_deployment(get_policy("vllm"), parse_deploy("P:tp4x1,D:tp4x1", 8))


def test_live_worker_counts_follow_the_policy():
    check_worker_counts(get_policy("ampd"), 1, 1, 0)
    check_worker_counts(get_policy("vllm"), 0, 0, 2)
    with pytest.raises(DeploymentError, match="--prefill-workers >= 1"):
        check_worker_counts(get_policy("ampd"), 1, 1, 2)
    with pytest.raises(DeploymentError, match="--colocated N"):
        check_worker_counts(get_policy("continuum"), 1, 1, 0)


def test_generation_budget_clamps_or_refuses():
    assert generation_budget(100, None, 128) == 28
    assert generation_budget(100, 10, 128) == 10
    assert generation_budget(100, 50, 128) == 28                       # the engine clamps
    with pytest.raises(ContextError) as e:
        generation_budget(100, 50, 128, clamp=False)                   # the HTTP API refuses, as vLLM
    assert e.value.fault is ContextFault.REQUEST_EXCEEDS
    with pytest.raises(ContextError) as e:
        generation_budget(128, None, 128)
    assert e.value.fault is ContextFault.PROMPT_FILLS
    assert "leaves no room to generate" in str(e.value)


def test_diffusion_canvas_holds_whole_blocks():
    assert generation_budget(10, 20, 128, canvas_block=8) == 20          # 20 fits: its 3 blocks of 8 fit
    assert generation_budget(115, 20, 128, canvas_block=8) == 8           # one whole block is all that fits
    with pytest.raises(ContextError) as e:
        generation_budget(125, 20, 128, canvas_block=8)                   # not one block fits after 125 tokens
    assert e.value.fault is ContextFault.CANVAS


def test_a_round_continues_only_a_strict_extension():
    assert continues([1, 2, 3], [1, 2, 3, 4])
    assert not continues([1, 2, 3], [1, 2, 3])          # nothing new: the session starts afresh
    assert not continues([1, 2, 3], [1, 9, 3, 4])       # edited history
    assert not continues([1, 2, 3], [1, 2])             # truncated
    assert not continues(None, [1, 2])                  # no history known


def test_one_round_per_session():
    check_one_round("s", None)
    with pytest.raises(SessionBusyError, match="'s' already has a request running \\('r1'\\)"):
        check_one_round("s", "r1")
