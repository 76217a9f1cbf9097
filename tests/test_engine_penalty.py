"""What :class:`gradreg.engine_penalty.EnginePenalty` refuses, in one line, when it is built:
an engine stated as DeepSpeed's states itself (no DeepSpeed needed); its steps on DeepSpeed's
engine over 2 ranks are tested in tests/test_engine_penalty_deepspeed.py (slow)."""

from __future__ import annotations

import pytest
from torch import nn

from gradreg import GradientError
from gradreg.engine_penalty import EnginePenalty
from gradreg.penalties import r1, sam


class Engine:
    """The part of DeepSpeed's engine that EnginePenalty reads when it is built."""

    def __init__(self, stage: int) -> None:
        self.module, self.stage = nn.Linear(2, 1), stage

    def zero_optimization_stage(self) -> int:
        return self.stage


def test_zero3_is_refused_naming_what_takes_the_penalty() -> None:
    with pytest.raises(GradientError, match=r"does not take DeepSpeed ZeRO-3, .*: use ZeRO-2, or "
                                            r"FSDP2 with gradreg\.sharding\.penalty_step"):
        EnginePenalty(Engine(3), sam(0.05))


def test_a_penalty_at_other_points_is_refused() -> None:
    with pytest.raises(GradientError, match=r"points='parameters' .* got points='real': .*; "
                                            "train with DDP or FSDP2"):
        EnginePenalty(Engine(2), r1(10.0))


def test_zero2_takes_the_module_s_trainable_parameters() -> None:
    engine = Engine(2)
    penalty = EnginePenalty(engine, sam(0.05))
    assert list(penalty.accumulation.params) == list(engine.module.parameters())
