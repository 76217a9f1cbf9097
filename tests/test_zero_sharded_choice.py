"""Which ZeRO-3 steps of :class:`gradreg.integrations.engine_penalty.EnginePenalty` run on each
rank's partitions (:func:`gradreg.integrations.zero_sharded.takes_sharded`): the finite
differences of the 2-norm in float32 with the optimizer's states on the device; the others
(fp16's loss scaling, bf16, an offloaded optimizer, another norm) with the parameters gathered
whole. No DeepSpeed needed: an engine stating its configuration."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gradreg.integrations.zero_sharded import takes_sharded
from gradreg.penalties import gr, param_grad_norm, sam


@dataclass
class Engine:
    """What takes_sharded reads of DeepSpeed's engine."""

    fp16: bool = False
    bf16: bool = False
    offload: bool = False

    def fp16_enabled(self) -> bool:
        return self.fp16

    def bfloat16_enabled(self) -> bool:
        return self.bf16

    def zero_use_cpu_optimizer(self) -> bool:
        return self.offload


@pytest.mark.parametrize("penalty", [sam(0.05), gr(0.5),
                                     param_grad_norm(0.5, method="finite_difference")],
                         ids=["sam", "gr", "param_grad_norm"])
def test_the_finite_differences_of_the_2_norm_in_float32_run_on_the_partitions(penalty) -> None:
    assert takes_sharded(Engine(), penalty)


@pytest.mark.parametrize(("engine", "penalty"), [
    (Engine(fp16=True), sam(0.05)), (Engine(bf16=True), sam(0.05)),
    (Engine(offload=True), sam(0.05)),
    (Engine(), param_grad_norm(0.5, method="finite_difference", p=1))],
    ids=["fp16", "bf16", "offload", "p=1"])
def test_the_others_gather_the_parameters_whole(engine: Engine, penalty) -> None:
    assert not takes_sharded(engine, penalty)
