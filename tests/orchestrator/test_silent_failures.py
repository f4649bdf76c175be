"""The follower's alerts for the silent failures of drafter training: real τ near 1 while the accuracy rises
(a train/serve mismatch, named with the run's own values), and real τ falling between evaluations."""

from __future__ import annotations

import pytest

from orchestrator.monitor import SilentFailure, TauDrop, build_monitors

FACTS = {"kind": "facts", "target_layer_ids": [1, 2, 3], "num_target_layers": 6, "mask_token_id": 4,
         "rope_theta_target": 10000.0, "rope_theta_drafter": 10000.0,
         "chat_template_kwargs": {"enable_thinking": True}, "target_ranks": 0, "drafter_ranks": 0}


def _train(step, acc):
    return {"kind": "train", "step": step, "acc": acc}


def _eval(step, tau, when="during"):
    return {"kind": "eval", "step": step, "when": when, "tau": tau}


def feed(detector, records):
    alerts = []
    for r in records:
        alerts += detector.feed(r)
    return alerts


def test_tau_near_one_with_rising_accuracy_fires_once_naming_every_cause_with_the_runs_values():
    d = SilentFailure()
    alerts = feed(d, [FACTS, _eval(0, 1.0, "before"), _train(25, 0.12), _train(50, 0.45), _eval(50, 1.05),
                      _train(75, 0.6), _eval(75, 1.02)])
    assert [a.kind for a in alerts] == ["tau-near-1"]
    msg = alerts[0].message
    assert "real τ 1.05 at step 50" in msg and "0.12 -> 0.45" in msg
    for text in ("target layers [1, 2, 3] of the target's 6", "mask token id 4", "target 10000.0, drafter 10000.0",
                 'chat template arguments {"enable_thinking": true} at training and in its evaluation'):
        assert text in msg, text
    assert alerts[0].detail["facts"]["mask_token_id"] == 4


def test_tau_near_one_stays_quiet_when_tau_rises_the_accuracy_does_not_or_only_before_training():
    quiet_runs = [
        [FACTS, _eval(0, 1.0, "before"), _train(25, 0.12), _train(50, 0.5), _eval(50, 2.4)],  # healthy
        [FACTS, _train(25, 0.05), _train(50, 0.08), _eval(50, 1.01)],  # nothing learned yet: not this failure
        [FACTS, _train(25, 0.12), _train(50, 0.6), _eval(0, 1.0, "before")],  # the untrained drafter's τ
    ]
    for records in quiet_runs:
        assert feed(SilentFailure(), records) == []


def test_tau_near_one_without_facts_says_not_recorded_and_rearms_after_tau_recovers():
    d = SilentFailure()
    first = feed(d, [_train(1, 0.1), _train(2, 0.5), _eval(2, 1.0)])
    assert "not recorded" in first[0].message
    assert feed(d, [_eval(3, 1.0)]) == []  # fired once
    assert feed(d, [_eval(4, 2.0)]) == []  # cleared
    assert [a.kind for a in feed(d, [_eval(5, 1.1)])] == ["tau-near-1"]


def test_tau_drop_fires_on_a_fall_beyond_the_fraction_of_the_best_not_on_noise():
    d = TauDrop(fraction=0.2)
    assert feed(d, [_eval(0, 1.0, "before"), _eval(100, 2.5), _eval(200, 3.0), _eval(300, 2.6)]) == []
    alerts = feed(d, [_eval(400, 2.3)])
    assert len(alerts) == 1 and alerts[0].kind == "tau-drop"
    assert "fell to 2.30 at step 400 from 3.00 at step 200" in alerts[0].message
    assert feed(d, [_eval(500, 2.2)]) == []  # once per fall
    assert feed(d, [_eval(600, 2.9), _eval(700, 2.0)])[0].detail["best_tau"] == 3.0


def test_tau_drop_refuses_a_fraction_outside_0_1():
    with pytest.raises(ValueError, match="fraction"):
        TauDrop(fraction=1.5)


def test_the_followers_monitors_include_both_with_the_inventorys_thresholds():
    mons = build_monitors({"tau_near_one": 1.4, "tau_drop_fraction": 0.5})
    silent = next(m for m in mons if isinstance(m, SilentFailure))
    drop = next(m for m in mons if isinstance(m, TauDrop))
    assert (silent.near_one, drop.fraction) == (1.4, 0.5)
    # a τ of 1.3 is "near 1" only under the inventory's 1.4
    assert feed(silent, [_train(1, 0.1), _train(2, 0.5), _eval(2, 1.3)])[0].kind == "tau-near-1"


def _step(step, acc, sim_tau):
    return {"kind": "train", "step": step, "acc": acc, "sim_tau": sim_tau}


def test_real_tau_far_below_the_trainings_simulated_tau_is_a_train_serve_gap_naming_the_context_mask():
    d = SilentFailure()
    records = [FACTS, _eval(0, 1.0, "before"), _step(25, 0.31, 2.36), _step(50, 0.54, 3.35), _eval(50, 1.88),
               _step(100, 0.79, 4.99), _eval(100, 1.82), _step(150, 0.84, 5.5), _eval(150, 1.82)]
    alerts = feed(d, records)
    # step 50: 1.88 is 0.56 of 3.35, not yet a gap; step 100: 0.36 of 4.99 fires, once
    assert [a.kind for a in alerts] == ["train-serve-gap"]
    msg = alerts[0].message
    assert "real τ 1.82 at step 100 is 0.36 of the 4.99 training simulates (below 0.5)" in msg, msg
    assert "the token accuracy rose 0.31 -> 0.79" in msg
    assert "context mask" in msg and "mask token id 4" in msg
    assert alerts[0].detail["sim_tau"] == 4.99


def test_a_healthy_runs_real_tau_near_its_simulated_tau_stays_quiet_and_the_inventorys_ratio_applies():
    healthy = [FACTS, _step(25, 0.24, 2.07), _step(50, 0.36, 2.76), _eval(50, 2.22), _step(100, 0.42, 3.05),
               _eval(100, 2.31)]
    assert feed(SilentFailure(), healthy) == []
    unlearned = [_step(25, 0.05, 4.0), _step(50, 0.08, 4.0), _eval(50, 1.5)]  # accuracy never rose
    assert feed(SilentFailure(), unlearned) == []
    gap = [_step(25, 0.31, 2.36), _step(100, 0.79, 4.99), _eval(100, 1.82)]
    strict = next(m for m in build_monitors({"tau_sim_ratio": 0.3}) if isinstance(m, SilentFailure))
    assert feed(strict, gap) == []  # 0.36 of the simulated τ is not below 0.3
    assert [a.kind for a in feed(SilentFailure(sim_ratio=0.4), gap)] == ["train-serve-gap"]
    with pytest.raises(ValueError, match="sim_ratio"):
        SilentFailure(sim_ratio=1.0)
