"""What :class:`gradreg.integrations.engine_penalty.EnginePenalty` refuses, in one line, when it is
built: an engine stated as DeepSpeed's states itself (no DeepSpeed needed); its steps on DeepSpeed's
engine over 2 ranks are tested in tests/test_engine_penalty_deepspeed.py (slow)."""

from __future__ import annotations

import pytest
from torch import nn

from gradreg import GradientError
from gradreg.integrations.engine_penalty import EnginePenalty
from gradreg.penalties import asam, param_grad_norm, r1, sam


class Engine:
    """The part of DeepSpeed's engine that EnginePenalty reads when it is built."""

    def __init__(self, stage: int) -> None:
        self.module, self.stage = nn.Linear(2, 1), stage

    def zero_optimization_stage(self) -> int:
        return self.stage


@pytest.mark.parametrize(("penalty", "match"), [
    (param_grad_norm(0.1), r"differentiates the parameters twice, which DeepSpeed ZeRO-3 "
                              r"cannot .*: use method='finite_difference'"),
    (asam(0.5), r"is adaptive .*: use sam or gr, or ZeRO-2, or FSDP2 with "
                   r"gradreg\.sharding\.penalty_step")],
    ids=["exact", "adaptive"])
def test_what_zero3_does_not_take_is_refused_naming_what_does(penalty, match: str) -> None:
    with pytest.raises(GradientError, match=match):
        EnginePenalty(Engine(3), penalty)


def test_a_penalty_at_other_points_is_refused() -> None:
    with pytest.raises(GradientError, match=r"points='parameters' .* got points='real': .*; "
                                            "train with DDP or FSDP2"):
        EnginePenalty(Engine(2), r1(10.0))


def test_zero2_takes_the_module_s_trainable_parameters() -> None:
    engine = Engine(2)
    penalty = EnginePenalty(engine, sam(0.05))
    assert list(penalty.accumulation.params) == list(engine.module.parameters())
