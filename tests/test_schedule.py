"""The learning-rate schedule of cp-train (cp_handler/training/schedule.py), one process.

Values at the points that define Megatron-LM's schedule (the warm-up's ends, the decay's middle and end,
after it), computed by hand here; the LambdaLR's state survives a JSON round trip (the checkpoint keeps it)
and continues the same sequence. Exact comparisons: the same float operations on both sides, except the
cosine's middle (``cos(pi / 2)`` is 6e-17, not 0: ``approx`` at 1e-12).
"""

import json

import pytest
import torch

from cp_handler.training.schedule import LRSchedule


def test_warmup_then_decay_at_the_defining_points():
    cosine = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=4, decay_style="cosine", decay_steps=12)
    assert [cosine(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # step s has taken s + 1 steps
    assert cosine(7) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-12)  # n = 8: half-way from 4 to 12
    assert cosine(11) == pytest.approx(0.1, rel=1e-12) and cosine(50) == pytest.approx(0.1, rel=1e-12)
    linear = LRSchedule(lr=2.0, min_lr=0.0, warmup_steps=0, decay_style="linear", decay_steps=10)
    assert [linear(s) for s in (0, 4, 9, 20)] == [0.9, 0.5, 0.0, 0.0]
    constant = LRSchedule(lr=1.0, warmup_steps=2)
    assert [constant(s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert all(LRSchedule()(s) == 1.0 for s in range(5))  # the default: no schedule at all


def test_scheduler_state_survives_json_and_continues_the_sequence():
    schedule = LRSchedule(lr=3e-3, min_lr=3e-4, warmup_steps=2, decay_style="cosine", decay_steps=8)

    def optimizer():
        return torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=3e-3)

    optim = optimizer()
    scheduler = schedule.scheduler(optim)
    seen = []
    for _ in range(8):
        seen.append(optim.param_groups[0]["lr"])
        optim.step()
        scheduler.step()
        if len(seen) == 3:
            saved_optim, saved = optim.state_dict(), json.loads(json.dumps(scheduler.state_dict()))
    assert seen == [3e-3 * schedule(s) for s in range(8)]
    resumed = optimizer()
    again = schedule.scheduler(resumed)  # built before the state is loaded, as cp-train does
    resumed.load_state_dict(saved_optim)
    again.load_state_dict(saved)
    continued = []
    for _ in range(5):
        continued.append(resumed.param_groups[0]["lr"])
        resumed.step()
        again.step()
    assert continued == seen[3:]
