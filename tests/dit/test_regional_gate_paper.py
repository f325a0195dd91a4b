"""The paper's gate (``gate="paper"``, the default): ``Delta`` frozen while a patch is
skipped, weights ``Delta_p / sum_q Delta_q`` that sum to 1, at least one patch per gated
step, forced reactivation after K skips; and the earlier gate still selectable by name."""

from __future__ import annotations

import argparse

import pytest
import torch
from sakura.cloud import render_cli
from sakura.dit.regional import (
    DEFAULT_EPS,
    GATES,
    PARTITIONS,
    ImportanceGate,
    PaperGate,
    RegionalConfig,
    RegionalState,
    run_regional,
)
from sakura.dit.regional_mmdit import regional_generate
from sakura.dit.sampler import schedule

from tests.dit.common import tiny_model, tiny_request
from tests.dit.test_regional import ScriptedBackend


def test_paper_gate_is_the_default_and_the_earlier_gate_stays_by_name():
    cfg = RegionalConfig()
    assert cfg.gate == "paper" and cfg.threshold == DEFAULT_EPS["paper"]
    with pytest.raises(ValueError):
        RegionalConfig(gate="nope").validate(10)
    be = ScriptedBackend()
    for gate, cls in (("paper", PaperGate), ("importance", ImportanceGate)):
        st = RegionalState(RegionalConfig(warmup=2, gate=gate, patches=2), be.coords,
                           schedule(6), torch.zeros(36, 2), be.text_tokens, None, be.cost)
        run_regional(be, st)
        assert isinstance(st.gate, cls)


def _gate_actions(parser: argparse.ArgumentParser, dest: str = "gate"
                  ) -> list[argparse.Action]:
    out = []
    for a in parser._actions:
        if a.dest == dest:
            out.append(a)
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out += _gate_actions(sub, dest)
    return out


def test_the_cli_names_the_registry_gates_and_defaults_to_the_paper_gate():
    """``sakura render serve|replay --gate`` lists its names by hand (the parser stays
    torch-free); they must be config.GATES, defaulting to RegionalConfig's gate."""
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command")
    render_cli.register(commands, commands.add_parser("bench").add_subparsers(dest="bench"))
    actions = _gate_actions(parser)
    assert len(actions) >= 2  # serve and replay
    for a in actions:
        assert tuple(a.choices) == GATES and a.default == RegionalConfig().gate == "paper"
    assert parser.parse_args(["render", "serve", "--gate", "importance"]).gate == "importance"


def test_the_cli_names_the_partitions_and_defaults_to_the_grid():
    """Issue 32 item 6: the grid beat the paper's Otsu split at equal compute, so it is the
    default; ``--partition`` lists config.PARTITIONS by hand, as ``--gate`` does."""
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command")
    render_cli.register(commands, commands.add_parser("bench").add_subparsers(dest="bench"))
    actions = _gate_actions(parser, "partition")
    assert actions
    for a in actions:
        assert tuple(a.choices) == PARTITIONS
        assert a.default == RegionalConfig().partition == "grid"
    assert parser.parse_args(["render", "serve", "--partition", "otsu"]).partition == "otsu"


def test_weights_are_the_frozen_changes_over_their_sum():
    gate = PaperGate(3, eps=0.25, max_skips=5)
    gate.start(torch.tensor([1.0, 1.0, 1.0]))
    # first gated step: every patch ran at the last warm-up step -> every Delta is fresh
    d = gate.decide(torch.tensor([1.5, 1.3, 1.2]))
    assert d.weights.tolist() == pytest.approx([0.5, 0.3, 0.2], abs=1e-6)
    assert float(d.weights.sum()) == pytest.approx(1.0)
    assert d.active.tolist() == [True, True, False]
    # patch 2 is skipped: its Delta (0.2) stays frozen however much its importance moves;
    # patches 0 and 1 ran: their Deltas become |now - last run|
    d = gate.decide(torch.tensor([1.6, 1.3, 9.0]))
    assert gate.delta.tolist() == pytest.approx([0.1, 0.0, 0.2], abs=1e-6)
    # the decision of this step used the Deltas before it: 0.5, 0.3, 0.2 (unchanged)
    assert d.weights.tolist() == pytest.approx([0.5, 0.3, 0.2], abs=1e-6)
    d = gate.decide(torch.tensor([1.6, 1.3, 9.0]))
    assert d.weights.tolist() == pytest.approx([1 / 3, 0.0, 2 / 3], abs=1e-6)
    assert float(d.weights.sum()) == pytest.approx(1.0)
    assert d.active.tolist() == [True, False, True]
    # patch 2 finally ran: its Delta is the change since its last run (the warm-up: 1 -> 9)
    assert float(gate.delta[2]) == pytest.approx(8.0, abs=1e-6)
    assert float(gate.reference[2]) == pytest.approx(9.0)


def test_at_least_one_patch_runs_every_gated_step_even_above_every_weight():
    gate = PaperGate(4, eps=0.9, max_skips=100)  # no weight of 4 reaches 0.9 unless alone
    gate.start(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    g = torch.Generator().manual_seed(0)
    imp = torch.tensor([1.0, 2.0, 3.0, 4.0])
    for _ in range(30):
        imp = imp + 0.1 * torch.rand(4, generator=g)
        d = gate.decide(imp)
        assert int(d.active.sum()) >= 1
        assert float(d.weights.sum()) == pytest.approx(1.0, abs=1e-6)
        if int(d.guaranteed.sum()):  # only the heaviest patch, and only when none chose itself
            assert int(d.active.sum()) == 1
            assert int(torch.argmax(d.weights)) == int(torch.nonzero(d.guaranteed))
    # all changes zero: uniform weights, still one runs
    flat = PaperGate(3, eps=0.5)
    flat.start(torch.ones(3))
    d = flat.decide(torch.ones(3))
    assert d.weights.tolist() == pytest.approx([1 / 3] * 3) and int(d.active.sum()) == 1


def test_forced_after_k_skips_and_frozen_delta_keeps_a_still_patch_skipped():
    gate = PaperGate(2, eps=0.2, max_skips=2)
    gate.start(torch.tensor([1.0, 1.0]))
    log = []
    for s in range(1, 8):  # patch 0 keeps changing, patch 1 never does
        d = gate.decide(torch.tensor([1.0 + 0.5 * s, 1.0]))
        log.append((d.active.tolist(), d.forced.tolist()))
    assert all(a[0] for a, _ in log)
    assert [a[1] for a, _ in log] == [False, False, True, False, False, True, False]
    assert [f[1] for _, f in log] == [False, False, True, False, False, True, False]


def test_eps_is_scaled_to_the_patch_count_it_was_set_for():
    """``eps_patches``: the weight a patch needs relative to uniform stays the same when R
    changes (the engine's R search moved to R = 8 where a fixed eps skipped most patches)."""
    imp0, imp1 = torch.ones(8), torch.ones(8) + torch.tensor([8, 8, 6, 6, 4, 4, 2, 2.0])
    paper = PaperGate(8, eps=0.2)
    scaled = PaperGate(8, eps=0.2, eps_patches=4)
    assert paper.threshold == 0.2 and scaled.threshold == pytest.approx(0.1)
    assert PaperGate(4, eps=0.2, eps_patches=4).threshold == pytest.approx(0.2)
    for g in (paper, scaled):
        g.start(imp0)
    # weights 0.2, 0.2, 0.15, 0.15, 0.1, 0.1, 0.05, 0.05
    assert paper.decide(imp1).active.tolist() == [True, True] + [False] * 6
    assert scaled.decide(imp1).active.tolist() == [True] * 6 + [False] * 2
    assert RegionalConfig().eps_patches == 4
    with pytest.raises(ValueError, match="eps_patches"):
        RegionalConfig(eps_patches=0).validate(10)


def test_state_with_the_paper_gate_on_a_scripted_backend():
    be = ScriptedBackend()
    cfg = RegionalConfig(warmup=2, gate="paper", eps=0.3, max_skips=2, patches=2,
                         eps_patches=None)
    st = RegionalState(cfg, be.coords, schedule(10), torch.zeros(36, 2), be.text_tokens,
                       torch.tensor([False, True, False]), be.cost)
    run_regional(be, st)
    s = st.stats
    assert len(s.active_log) == 8 and s.min_active_patches >= 1
    # the salient (left) patch's importance grows every step, the right one's is still
    left = next(i for i, p in enumerate(st.partition.patches) if (be.coords[p, 1] < 3).all())
    assert all(left in a for a in s.active_log)
    assert [1 - left in a for a in s.active_log] == [False, False, True] * 2 + [False, False]
    assert s.forced_patch_steps == 2
    assert s.forced_fraction == pytest.approx(2 / s.executed_patch_steps)
    d = s.to_dict()
    assert d["min_active_patches"] == 1 and d["forced_fraction"] == s.forced_fraction


@pytest.mark.parametrize("eps", [0.2, 0.4, 0.9])
def test_paper_gate_on_a_tiny_seeded_model(eps):
    model = tiny_model()
    req = tiny_request(model)
    _, st = regional_generate(model, req.txt, req.txt_uncond, 32, 3, 8, 2.0,
                              RegionalConfig(warmup=2, gate="paper", patches=4, eps=eps))
    s = st.stats
    assert len(s.active_log) == 6
    assert s.min_active_patches >= 1
    assert s.skipped_patch_steps > 0
    assert s.executed_patch_steps >= len(s.active_log)
    assert 0 <= s.forced_fraction <= 1
    assert s.guaranteed_patch_steps <= len(s.active_log)
    gate = st.gate
    assert float(gate.weights().sum()) == pytest.approx(1.0)
