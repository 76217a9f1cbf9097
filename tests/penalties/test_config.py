"""The configuration as one validated, immutable value, and the method chosen once from it."""

from __future__ import annotations

import ast
import dataclasses

import pytest
import torch
from torch import Tensor, nn

from gradreg.autograd import GradientError
from gradreg.penalties import GradientPenalty, PenaltyConfig, make_penalty, methods
from gradreg.penalties import config as config_module
from gradreg.penalties.formulas import projections
from gradreg.penalties.kinds import hessian as hessian_penalty_module
from gradreg.penalties.kinds.hessian import hessian_penalty
from tests.penalties.parameter_gradients import value_and_grad


def critic() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0)).double()


def points(batch: int = 6) -> Tensor:
    torch.manual_seed(1)
    return torch.randn(batch, 3, dtype=torch.float64, requires_grad=True)


def test_a_config_and_its_keyword_options_build_the_same_penalty() -> None:
    """R1 on a tanh MLP: the value is gain * weight * mean_i ||grad_x D(x_i)||^2, computed here
    from the input gradient taken separately."""
    model, x = critic(), points()
    config = PenaltyConfig(gain=0.5, points="real")
    by_config = GradientPenalty(config, weight=2.0)
    by_options = GradientPenalty(weight=2.0, gain=0.5, points="real")
    assert by_config.config == by_options.config == make_penalty("r1", weight=2.0).config
    (g,) = torch.autograd.grad(model(x).sum(), x)
    expected = 2.0 * 0.5 * g.square().sum(1).mean()
    torch.testing.assert_close(by_config(model(x), x), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(value_and_grad(by_config, model, model(x), x),
                               value_and_grad(by_options, model, model(x), x), rtol=0, atol=0)


def test_the_config_does_not_change_but_the_weight_does() -> None:
    penalty = make_penalty("wgan_gp", layers=["a", "b"])
    assert penalty.config.layers == ("a", "b")  # a config's list, frozen into a tuple
    with pytest.raises(dataclasses.FrozenInstanceError):
        penalty.config.target = 0.0
    with pytest.raises(AttributeError, match=r"target is part of the penalty's configuration.*"
                                             r"dataclasses.replace\(penalty.config, target="):
        penalty.target = 0.0
    assert penalty.config.target == 1.0 and penalty.config.points == "interpolates"
    penalty.weight = 3.0
    assert penalty.weight == 3.0 and penalty.state_dict()["_extra_state"] == {"weight": 3.0}
    other = GradientPenalty(dataclasses.replace(penalty.config, target=0.0), weight=1.0)
    assert (other.config.target, other.config.points, penalty.config.target) == (
        0.0, "interpolates", 1.0)


@pytest.mark.parametrize("option", [name for name in PenaltyConfig.options() if name != "step"])
def test_an_option_is_read_from_the_config_only(option: str) -> None:
    penalty = make_penalty("r1")
    with pytest.raises(AttributeError, match=rf"^'{option}' is an option of the penalty's "
                                             rf"configuration: read penalty\.config\.{option}$"):
        getattr(penalty, option)
    assert not hasattr(penalty, option)


def test_the_step_attribute_is_the_lazy_counter_and_the_step_size_is_the_configs() -> None:
    penalty = make_penalty("r1", every=2, method="finite_difference", step=0.01)
    penalty.due()
    assert (penalty.step.item(), penalty.config.step) == (1, 0.01)
    assert list(penalty.state_dict()) == ["step", "ema", "_extra_state"]


def test_the_mistakes_in_building_one_are_named() -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['targte'\]; valid: weight, "
                                        r"target, one_sided"):
        GradientPenalty(targte=1.0)
    with pytest.raises(TypeError, match="got a config and options \\['target'\\]"):
        GradientPenalty(PenaltyConfig(), target=1.0)
    with pytest.raises(TypeError, match="takes a PenaltyConfig or keyword options, got a dict"):
        GradientPenalty({"target": 1.0})
    with pytest.raises(ValueError, match=r"power must be > 0, got 0\.$"):
        PenaltyConfig(power=0)
    with pytest.raises(ValueError, match="weight must be a finite number >= 0, got -1"):
        GradientPenalty(weight=-1)


def test_the_removed_compiled_method_is_refused_naming_double_backward() -> None:
    """``method="compiled"`` (compiled torch.func, slower than the eager double backward in every
    case measured) is refused in one line naming the method to pass, never run as another."""
    for build in (lambda: make_penalty("wgan_gp", method="compiled"),
                  lambda: PenaltyConfig(method="compiled")):
        with pytest.raises(GradientError) as refused:
            build()
        message = str(refused.value)
        assert "\n" not in message
        assert message == ("method='compiled' was removed (it was slower than the eager double "
                           "backward in every case measured): use method='double_backward', "
                           "which is exact.")


def test_a_new_method_slots_in_by_its_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method registered in BUILDERS (and its name in config.METHODS) is a valid ``method``,
    built once, and is handed each call with the points subsampled; what it returns is weighted
    as any other."""
    calls: list[methods.PenaltyCall] = []

    def build(config: PenaltyConfig, penalty: methods.PenaltyFunctions) -> methods.Method:
        exact = methods.DoubleBackward(penalty)

        def method(call: methods.PenaltyCall) -> Tensor:
            calls.append(call)
            return exact(call)

        built.append(method)
        return method

    built: list[methods.Method] = []
    monkeypatch.setitem(methods.BUILDERS, "recorded", build)
    monkeypatch.setattr(config_module, "METHODS", (*config_module.METHODS, "recorded"))
    model, x = critic(), points(batch=6)
    penalty = make_penalty("r1", weight=4.0, method="recorded", subsample=0.5)
    assert penalty.needs_callable and len(built) == 1
    value = penalty(model, x)
    penalty(model, x)
    assert len(built) == 1 and len(calls) == 2 and calls[0].inputs[0].shape == (3, 3)
    (g,) = torch.autograd.grad(model(x[:3]).sum(), x)
    torch.testing.assert_close(value, 4.0 * 0.5 * g[:3].square().sum(1).mean(), rtol=1e-12,
                               atol=0)
    with pytest.raises(ValueError, match="method must be one of .*'recorded'.*got 'other'"):
        make_penalty("r1", method="other")


def test_the_names_the_configuration_accepts_are_those_the_methods_build() -> None:
    """The configuration imports nothing of the computation (no circle), only the checks of
    single options below it: its names of methods and projections are its own tuples, held
    equal here to what is built."""
    assert tuple(methods.BUILDERS) == config_module.METHODS
    assert tuple(projections.PROJECTIONS) == config_module.PROJECTION_NAMES
    with open(config_module.__file__) as source:
        tree = ast.parse(source.read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {name for name in imported if name and name.startswith("gradreg.penalties")} == {
        "gradreg.penalties.guards.options"}


DEFAULTS = {field.name: field.default for field in dataclasses.fields(PenaltyConfig)}
HESSIAN = {"kind": "hessian", "points": "latents", "method": "finite_difference",
           "reduction": "max"}


def test_an_option_of_another_kind_may_be_written_at_its_default_only() -> None:
    """iterations (kind='spectral'), and target, one_sided, power and p (not of kind='hessian'),
    compared with the fields' own defaults."""
    assert PenaltyConfig(iterations=DEFAULTS["iterations"]).iterations == 10
    with pytest.raises(ValueError, match="^iterations sets the power iteration of "
                                         "kind='spectral'; pass kind='spectral'.$"):
        PenaltyConfig(iterations=DEFAULTS["iterations"] + 1)
    written = {name: DEFAULTS[name] for name in ("target", "one_sided", "power", "p")}
    assert PenaltyConfig(**HESSIAN, **written) == PenaltyConfig(**HESSIAN)
    for name, other in (("target", 1.0), ("one_sided", True), ("power", 1.0), ("p", 1.0)):
        with pytest.raises(ValueError, match="penalizes a variance, not a norm"):
            PenaltyConfig(**HESSIAN, **{name: other})


@pytest.mark.parametrize(("options", "message"), [
    ({"count": 1}, "count (random directions per sample) must be an int >= 2 or None (its "
                   "default): the Hessian penalty is a variance over the directions, which needs "
                   "two; got 1."),
    ({"step": -0.5}, "step (the estimate's step size) must be a number > 0 or None (its "
                     "default), got -0.5."),
    ({"reduction": "sum"}, "kind='hessian' reduces by 'max' (the authors' default) or 'mean', "
                           "got reduction='sum'."),
    ({"method": "perturbation"}, "kind='hessian' is computed by method 'finite_difference' "
                                 "or 'double_backward', got method='perturbation'.")])
def test_the_hessian_options_are_refused_alike_by_the_config_and_the_function(
        options: dict, message: str) -> None:
    with pytest.raises(ValueError) as by_config:
        PenaltyConfig(**{**HESSIAN, **options})
    with pytest.raises(ValueError) as by_function:
        hessian_penalty(lambda z: z.square(), torch.randn(3, 2), **options)
    assert str(by_config.value) == str(by_function.value) == message


def test_a_hessian_penalty_checks_its_options_when_built_not_when_called(
        monkeypatch: pytest.MonkeyPatch) -> None:
    penalty = make_penalty("hessian", count=3)

    def refuse(**options: object) -> None:
        raise AssertionError(f"options checked again: {options}")

    monkeypatch.setattr(hessian_penalty_module, "check_hessian_options", refuse)
    z = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    assert penalty(lambda q: (q[:, 0] * q[:, 1]).unsqueeze(1), z).item() >= 0
    with pytest.raises(AssertionError, match="options checked again"):
        hessian_penalty(lambda q: q.square(), z)
