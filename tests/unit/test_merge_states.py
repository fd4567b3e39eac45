"""The optimizer state a rank loads when a run resumes at another number of ranks: the modes'
``merge_state_dicts`` of every old rank's state (no MPI: the methods need no open mode)."""

import torch

from hsgd import GossipSGD, HierarchicalDiLoCo, HierarchicalSGD
from hsgd._engine.optimizer import mean_of_states


def adam_state(value, steps=7):
    return {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((2,), value),
                          "exp_avg_sq": torch.full((2,), value ** 2)}},
            "param_groups": [{"lr": 0.1, "params": [0]}], "hsgd_steps": steps}


def test_floating_tensors_and_numbers_are_averaged_and_the_rest_is_rank_0s():
    merged = mean_of_states([adam_state(1.0), adam_state(3.0, steps=8)])
    state = merged["state"][0]
    assert torch.equal(state["exp_avg"], torch.full((2,), 2.0))
    assert torch.equal(state["exp_avg_sq"], torch.full((2,), 5.0))
    assert state["step"].item() == 3.0 and merged["hsgd_steps"] == 7 and merged["param_groups"][0]["lr"] == 0.1
    scalers = [{"scale": 1024.0, "growth": 2}, {"scale": 512.0, "growth": 3}]
    assert mean_of_states(scalers) == {"scale": 768.0, "growth": 2}
    half = mean_of_states([{"w": torch.ones(2, dtype=torch.float16)}, {"w": torch.zeros(2, dtype=torch.float16)}])
    assert half["w"].dtype == torch.float16 and torch.equal(half["w"], torch.full((2,), 0.5, dtype=torch.float16))


def test_diloco_sends_a_fragment_in_flight_again_as_the_old_ranks_mean():
    def rank(contribution):
        state = adam_state(contribution)
        state["hsgd_outer"] = {"anchor": [torch.ones(2)], "outer": [{}], "world_size": 6,
                               "in_flight": {1: (23, [torch.full((2,), contribution)])}}
        return state
    mode = object.__new__(HierarchicalDiLoCo)
    merged = HierarchicalDiLoCo.merge_state_dicts(mode, [rank(1.0), rank(2.0), rank(6.0)], 4)
    start, (sent,) = merged["hsgd_outer"]["in_flight"][1]
    assert start == 23 and torch.equal(sent, torch.full((2,), 3.0))  # every new rank: the old mean
    assert merged["hsgd_outer"]["world_size"] == 4  # so the new ranks send it again


def test_gossip_starts_every_rank_from_the_consensus_with_weight_one():
    states = [{**adam_state(v), "hsgd_gossip": {"weight": w, "sent": torch.zeros(2)}}
              for v, w in ((1.0, 0.5), (2.0, 1.5))]
    merged = GossipSGD.merge_state_dicts(object.__new__(GossipSGD), states, 1)
    assert "hsgd_gossip" not in merged and torch.equal(merged["state"][0]["exp_avg"], torch.full((2,), 1.5))
    assert HierarchicalSGD.merge_state_dicts(object.__new__(HierarchicalSGD), states, 1)["hsgd_gossip"]["weight"] == 1.0
