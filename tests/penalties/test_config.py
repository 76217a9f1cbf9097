"""The configuration as one validated, immutable value, and the method chosen once from it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from gradreg import GradientError
from gradreg.penalties import (
    GradientPenalty,
    PenaltyConfig,
    as_points,
    kinds,
    make_penalty,
    methods,
    presets,
    r1,
    wgan_gp,
)
from gradreg.penalties import config as config_module
from gradreg.penalties.call import Method, PenaltyCall, PenaltyFunctions
from gradreg.penalties.formulas import projections
from gradreg.penalties.formulas.options import Norm
from gradreg.penalties.guards.options import Option, require
from gradreg.penalties.kinds import hessian as hessian_penalty_module
from gradreg.penalties.kinds.hessian import hessian_penalty
from gradreg.penalties.methods.perturbation import perturbation_sq_norms
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
    config = PenaltyConfig.from_flat(gain=0.5, points="real")
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
                                             r"penalty.config.replace\(target="):
        penalty.target = 0.0
    assert penalty.config.target == 1.0 and penalty.config.points == "interpolates"
    penalty.weight = 3.0
    assert penalty.weight == 3.0 and penalty.state_dict()["_extra_state"] == {"weight": 3.0}
    other = GradientPenalty(penalty.config.replace(target=0.0), weight=1.0)
    assert (other.config.target, other.config.points, penalty.config.target) == (
        0.0, "interpolates", 1.0)


@pytest.mark.parametrize("option", [name for name in PenaltyConfig.options() if name != "step"])
def test_an_option_is_read_from_the_config_only(option: str) -> None:
    penalty = make_penalty("r1")
    with pytest.raises(AttributeError, match=rf"^'{option}' is an option of the penalty's "
                                             rf"configuration: read penalty\.config\.{option}$"):
        getattr(penalty, option)
    assert not hasattr(penalty, option)


def test_the_lazy_counter_is_lazy_step_and_the_step_size_is_the_configs() -> None:
    penalty = make_penalty("r1", every=2, method="finite_difference", step=0.01)
    penalty.due()
    assert (penalty.lazy_step.item(), penalty.steps_taken, penalty.config.step) == (1, 1, 0.01)
    assert list(penalty.state_dict()) == ["lazy_step", "ema", "_extra_state"]
    with pytest.raises(AttributeError, match=r"^penalty\.step: the lazy counter is "
                                             r"penalty\.steps_taken \(its buffer lazy_step\)"):
        _ = penalty.step
    with pytest.raises(AttributeError, match=r"step is part of the penalty's configuration"):
        penalty.step = 0.1


def test_a_state_dict_of_the_old_counter_key_loads_into_the_new_one() -> None:
    """A checkpoint written before the counter was renamed (its key ``<name>.step``) restores
    the counter and the lazy schedule; the new key is what is saved."""
    old = {"step": torch.tensor(5), "ema": torch.tensor(0.25), "_extra_state": {"weight": 3.0}}
    penalty = r1(10.0, every=4)
    penalty.load_state_dict(old)
    assert (penalty.steps_taken, penalty.lazy_step.item(), penalty.weight) == (5, 5, 3.0)
    assert [penalty.due() for _ in range(4)] == [False, False, False, True]  # 5, 6, 7, then 8
    module = nn.ModuleDict({"gp": r1(10.0, every=4)})
    module.load_state_dict({"gp.step": torch.tensor(3), "gp.ema": torch.tensor(0.0),
                            "gp._extra_state": {"weight": 1.0}})
    assert module["gp"].steps_taken == 3 and "gp.lazy_step" in module.state_dict()


def test_the_mistakes_in_building_one_are_named() -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['targte'\]; valid: weight, "
                                        r"target, one_sided"):
        GradientPenalty(targte=1.0)
    with pytest.raises(TypeError, match="got a config and options \\['target'\\]"):
        GradientPenalty(PenaltyConfig(), target=1.0)
    with pytest.raises(TypeError, match="takes a PenaltyConfig or keyword options, got a dict"):
        GradientPenalty({"target": 1.0})
    with pytest.raises(ValueError, match=r"power must be > 0, got 0\.$"):
        PenaltyConfig.from_flat(power=0)
    with pytest.raises(ValueError, match="weight must be a finite number >= 0, got -1"):
        GradientPenalty(weight=-1)


def test_the_removed_compiled_method_is_refused_naming_double_backward() -> None:
    """``method="compiled"`` (compiled torch.func, slower than the eager double backward in every
    case measured) is refused in one line naming the method to pass, never run as another."""
    for build in (lambda: make_penalty("wgan_gp", method="compiled"),
                  lambda: PenaltyConfig.from_flat(method="compiled")):
        with pytest.raises(GradientError) as refused:
            build()
        message = str(refused.value)
        assert "\n" not in message
        assert message == ("method='compiled' was removed (it was slower than the eager double "
                           "backward in every case measured): use method='double_backward', "
                           "which is exact.")


def test_a_new_method_slots_in_by_its_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method class added to METHOD_TYPES is a valid ``method`` by its name, its options
    checked when built; it is built once and handed each call with the points subsampled, and
    what it returns is weighted as any other."""
    calls: list[PenaltyCall] = []
    built: list[Method] = []

    @dataclasses.dataclass(frozen=True, eq=False)
    class Recorded(Option):
        name = "recorded"
        label: str = "calls"

        def __post_init__(self) -> None:
            require(isinstance(self.label, str), "label must be a string")

        @classmethod
        def from_flat(cls, flat: dict) -> Recorded:
            return cls()

        def check(self, config: PenaltyConfig) -> None:
            require(config.norm.numeric_target, "recorded takes a numeric target")

        def build(self, config: PenaltyConfig, penalty: PenaltyFunctions) -> Method:
            exact = methods.DoubleBackward().build(config, penalty)

            def method(call: PenaltyCall) -> Tensor:
                calls.append(call)
                return exact(call)

            built.append(method)
            return method

    monkeypatch.setattr(methods, "METHOD_TYPES", (*methods.METHOD_TYPES, Recorded))
    model, x = critic(), points(batch=6)
    penalty = make_penalty("r1", weight=4.0, method="recorded", subsample=0.5)
    assert penalty.config.method == Recorded() and penalty.config.method.name == "recorded"
    assert penalty.needs_callable and len(built) == 1
    value = penalty(model, x)
    penalty(model, x)
    assert len(built) == 1 and len(calls) == 2 and calls[0].inputs[0].shape == (3, 3)
    (g,) = torch.autograd.grad(model(x[:3]).sum(), x)
    torch.testing.assert_close(value, 4.0 * 0.5 * g[:3].square().sum(1).mean(), rtol=1e-12,
                               atol=0)
    with pytest.raises(ValueError, match="method must be one of .*'recorded'.*got 'other'"):
        make_penalty("r1", method="other")
    with pytest.raises(ValueError, match="recorded takes a numeric target"):
        make_penalty("path_length", method="recorded")


def test_the_registries_are_the_classes() -> None:
    """Each name a flat option takes is a class's, and builds that class: the methods, the kinds
    and the projections have no list of names of their own."""
    for method in methods.METHOD_TYPES:
        assert type(PenaltyConfig.from_flat(method=method.name).method) is method
    assert tuple(method.name for method in methods.METHOD_TYPES) == config_module.METHODS
    for kind in kinds.KIND_TYPES:
        options = {"spectral": {}, "hessian": {"points": "latents", "reduction": "max"}}
        config = PenaltyConfig.from_flat(kind=kind.name, **options.get(kind.name, {}))
        assert type(config.kind) is kind
    for projection in projections.PROJECTIONS:
        assert PenaltyConfig.from_flat(projection=projection).norm.projection == projection
    assert type(PenaltyConfig.from_flat(method="finite_difference", points="parameters",
                                        of="loss").method) is methods.ParameterShift


def test_an_invalid_option_object_cannot_be_built() -> None:
    """Each object checks its own fields, and the configuration what its objects do not
    support of each other."""
    with pytest.raises(ValueError, match=r"^power must be > 0, got 0\.$"):
        Norm(power=0)
    with pytest.raises(ValueError, match=r"^chunks must be an int >= 1"):
        methods.DoubleBackward(chunks=0)
    with pytest.raises(ValueError, match=r"^count \(random directions per sample\) must be"):
        methods.Perturbation(count=0)
    with pytest.raises(ValueError, match=r"^shift must be one of"):
        methods.ParameterShift(shift="sideways")
    with pytest.raises(ValueError, match=r"^iterations must be an int >= 1"):
        kinds.Spectral(iterations=0)
    with pytest.raises(ValueError, match=r"^method='perturbation' estimates squared per-sample "):
        PenaltyConfig(Norm(target=1.0), methods.Perturbation())
    with pytest.raises(ValueError, match=r"^kind='spectral' is computed by method "):
        PenaltyConfig(method=methods.FiniteDifference(), kind=kinds.Spectral())
    with pytest.raises(ValueError, match=r"^ParameterShift shifts the parameters; it does "
                                         r"nothing with points='inputs'"):
        PenaltyConfig(method=methods.ParameterShift())
    with pytest.raises(ValueError, match=r"^scale is the factor of shift='gradient'"):
        methods.ParameterShift(scale=0.1)
    with pytest.raises(ValueError, match=r"^radius is the length of shift='normalized'"):
        methods.ParameterShift("gradient", radius=0.1)
    with pytest.raises(ValueError, match=r"^points='parameters' by finite difference shifts"):
        PenaltyConfig(Norm(power=1.0), methods.FiniteDifference(), points="parameters")
    with pytest.raises(ValueError, match=r"^method must be one of"):
        PenaltyConfig(method="finite_difference")


DEFAULTS = config_module.FLAT
HESSIAN = {"kind": "hessian", "points": "latents", "method": "finite_difference",
           "reduction": "max"}


def test_an_option_of_another_kind_may_be_written_at_its_default_only() -> None:
    """iterations (kind='spectral'), and target, one_sided, power and p (not of kind='hessian'),
    compared with the fields' own defaults."""
    assert PenaltyConfig.from_flat(iterations=DEFAULTS["iterations"]).iterations == 10
    with pytest.raises(ValueError, match="^iterations=11 is not an option of "
                                         "method='double_backward', kind='gradient_norm', "
                                         "which take chunks .* or choose kind='spectral'.$"):
        PenaltyConfig.from_flat(iterations=DEFAULTS["iterations"] + 1)
    written = {name: DEFAULTS[name] for name in ("target", "one_sided", "power", "p")}
    assert PenaltyConfig.from_flat(**HESSIAN, **written) == PenaltyConfig.from_flat(**HESSIAN)
    for name, other in (("target", 1.0), ("one_sided", True), ("power", 1.0), ("p", 1.0)):
        with pytest.raises(ValueError, match="penalizes a variance, not a norm"):
            PenaltyConfig.from_flat(**HESSIAN, **{name: other})


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
        PenaltyConfig.from_flat(**{**HESSIAN, **options})
    with pytest.raises(ValueError) as by_function:
        hessian_penalty(lambda z: z.square(), torch.randn(3, 2), **options)
    # the function's step is the option object's epsilon (the flat alias step sets it)
    assert str(by_function.value) == message
    assert str(by_config.value) == message.replace("step (", "epsilon (")


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


@pytest.mark.parametrize(("weight", "expected"), [
    (np.float32(2.5), 2.5), (np.float64(0.5), 0.5), (np.int64(3), 3.0), (np.array(1.5), 1.5),
    (torch.tensor(4.0), 4.0), (torch.tensor(2, dtype=torch.int32), 2.0), (7, 7.0)])
def test_numpy_scalars_and_0d_tensors_are_weights(weight: object, expected: float) -> None:
    penalty = r1(weight)
    assert penalty.weight == expected and type(penalty.weight) is float


@pytest.mark.parametrize(("weight", "message"), [
    (10**400, r"weight is an integer of 1329 bits, too large for a float"),
    (True, "weight must be a number, got bool True"),
    ("1.0", "weight must be a number, got str '1.0'"),
    (torch.tensor([1.0, 2.0]), r"weight must be a number, got a tensor of shape \(2,\)"),
    (float("inf"), "weight must be a finite number >= 0, got inf"),
    (np.float64("nan"), "weight must be a finite number >= 0"),
    (np.bool_(True), "weight must be a number, got bool True"),
    (np.ones(2), "weight must be a number, got ndarray"),
], ids=["huge_int", "bool", "str", "vector", "inf", "nan", "numpy_bool", "numpy_vector"])
def test_weights_that_are_not_finite_numbers_are_refused(weight: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        r1(weight)


@pytest.mark.parametrize(("options", "message"), [
    ({"gain": 10**400}, "gain is an integer of"),
    ({"target": True}, "target must be a number, got bool"),
    ({"power": "2"}, "power must be a number, got str"),
    ({"one_sided": "yes"}, "one_sided is a flag: pass True or False"),
    ({"gain": float("inf")}, "gain must be a finite number"),
])
def test_numeric_options_that_are_not_numbers_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        r1(**options)


def test_numpy_options_are_converted_to_floats() -> None:
    penalty = wgan_gp(target=np.float32(0.5), p=float("inf"))
    config = penalty.config
    assert config.target == 0.5 and type(config.target) is float and config.p == float("inf")


# One name per concept: ``step`` for a step size, ``count`` for a number of random directions,
# ``"double_backward"`` for the exact method everywhere; the names of earlier releases are refused
# with the new one.

F64 = torch.float64


RENAMED = [("fd_eps", "step", "r1", {"method": "finite_difference"}, 0.01),
           ("num_projections", "count", "jacobian", {}, 2),
           ("probes", "count", "approx_r1", {}, 3),
           ("k", "count", "hessian", {}, 3)]


@pytest.mark.parametrize(("old", "new", "preset", "options", "value"), RENAMED)
def test_an_old_option_name_is_refused_with_the_new_one(old: str, new: str, preset: str,
                                                        options: dict, value: float) -> None:
    message = f"option '{old}' was renamed '{new}': pass {new}={value!r}"
    with pytest.raises(TypeError, match=message):
        make_penalty(preset, **options, **{old: value})
    with pytest.raises(TypeError, match=message):
        getattr(presets, preset)(1.0, **options, **{old: value})
    with pytest.raises(TypeError, match=message):
        GradientPenalty(**{**presets.PRESETS[preset], **options, old: value})
    penalty = make_penalty(preset, **options, **{new: value})  # the new name takes it
    assert getattr(penalty.config, new) == value
    with pytest.raises(AttributeError,
                       match=f"'{old}' was renamed '{new}': read penalty.config.{new}"):
        getattr(penalty, old)


def _generator() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()


def test_left_out_step_and_count_are_the_estimates_defaults() -> None:
    """hessian(): count 2, step 0.1 (the authors' k and epsilon); approx_r1(): one probe at
    step 0.01 (APT's sigma); each equal to the function called with those values and the same
    random draws."""
    g, z = _generator(), torch.randn(6, 3, dtype=F64)
    torch.manual_seed(3)
    got = presets.hessian(1.0)(g, as_points(z))
    torch.manual_seed(3)
    expected = hessian_penalty(g, z, count=2, step=0.1, reduction="max")
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    critic = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0)).double()
    x = torch.randn(5, 3, dtype=F64)
    torch.manual_seed(4)
    got = presets.approx_r1(2.0)(critic, as_points(x))
    torch.manual_seed(4)
    expected = perturbation_sq_norms(critic, x, step=0.01, count=1).mean()
    # a linear critic: the estimate is exactly (eps . w)^2, the same draws
    torch.testing.assert_close(got, 2.0 * 0.5 * expected, rtol=1e-12, atol=0)


def test_the_exact_hessian_penalty_is_double_backward_at_every_level() -> None:
    """method='double_backward' names the exact form of the function and of the preset alike;
    on a quadratic generator G(z) = (z . a)(z . b) the second difference is exact too, so both
    methods give one value."""
    a, b = torch.tensor([1.0, 2.0, -1.0], dtype=F64), torch.tensor([0.5, -1.0, 3.0], dtype=F64)

    def quadratic(z: torch.Tensor) -> torch.Tensor:
        return ((z @ a) * (z @ b)).unsqueeze(1)

    z = torch.randn(4, 3, dtype=F64)
    directions = torch.tensor([1.0, -1.0], dtype=F64)[torch.randint(0, 2, (2, 4, 3))]
    exact = hessian_penalty(quadratic, z, directions=directions, method="double_backward")
    fd = hessian_penalty(quadratic, z, directions=directions, method="finite_difference")
    # v^T H v = 2 (v . a)(v . b) per sample; the unbiased variance over the 2 directions
    second = 2 * (directions @ a) * (directions @ b)  # [2, 4]
    expected = second.var(dim=0, correction=1).amax()
    torch.testing.assert_close(exact, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(fd, expected, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="method 'finite_difference' or 'double_backward', got "
                                         "method='exact'"):
        hessian_penalty(quadratic, z, method="exact")


# One configuration language: the flat options are the option classes' fields, and a key the
# chosen classes do not take is refused by one rule.

OPTION_TYPES = (Norm, *methods.METHOD_TYPES, methods.ParameterShift, *kinds.KIND_TYPES)


def test_options_compare_as_objects_not_as_their_names() -> None:
    """An option equals an option of its type and fields, never its name; equal objects hash
    alike, so a set or a dict of them agrees with ``==``."""
    config = PenaltyConfig.from_flat(method="perturbation", count=2)
    assert config.method != "perturbation" and config.kind != "gradient_norm"
    assert config.method.name == "perturbation" and config.kind.name == "gradient_norm"
    assert config.method == methods.Perturbation(count=2) != methods.Perturbation(count=3)
    assert methods.DoubleBackward() not in {"double_backward"}
    assert methods.DoubleBackward(1) in {methods.DoubleBackward()}
    assert len({methods.FiniteDifference(), methods.ParameterShift()}) == 2  # two types
    assert hash(kinds.Hessian(count=3)) == hash(kinds.Hessian(3))


def test_the_flat_options_are_the_fields_of_the_option_classes() -> None:
    """FLAT is the configuration's own fields, ``method``, ``kind``, the fields of every option
    class (each with its class's default) and the alias ``step``; NUMBERS and FLAGS are the
    fields annotated float and bool."""
    fields = {f.name: f for option in (PenaltyConfig, *OPTION_TYPES)
              for f in dataclasses.fields(option)}
    assert set(DEFAULTS) == (set(fields) - {"norm", "method", "kind"}) | {"method", "kind", "step"}
    assert {"sigma", "epsilon", "radius", "scale", "iterations", "chunks"} <= set(DEFAULTS)
    for option in OPTION_TYPES:
        for f in dataclasses.fields(option):
            assert f.name in DEFAULTS
    assert DEFAULTS["reduction"] == "mean"  # the norm's, the first class that has it
    assert set(config_module.FLAGS) == {"one_sided", "check_finite", "central", "adaptive"}
    assert {"target", "p", "gain", "sigma", "epsilon", "radius", "scale", "step"} <= set(
        config_module.NUMBERS)


@pytest.mark.parametrize(("options", "message"), [
    ({"central": True}, "central=True is not an option of method='double_backward', "
                        "kind='gradient_norm', which take chunks besides the norm's and the "
                        "penalty's: leave it out, or choose method='perturbation'."),
    ({"method": "perturbation", "chunks": 2},
     "chunks=2 is not an option of method='perturbation', kind='gradient_norm', which take "
     "central, count, sigma, step besides the norm's and the penalty's: leave it out, or choose "
     "method='double_backward'."),
    ({"method": "finite_difference", "shift": "gradient"},
     "shift='gradient' is not an option of method='finite_difference', kind='gradient_norm', "
     "which take step besides the norm's and the penalty's: leave it out, or choose "
     "method='finite_difference', points='parameters'."),
    ({"kind": "hessian", "points": "latents", "sigma": 0.1},
     "sigma=0.1 is not an option of method='double_backward', kind='hessian', which take "
     "chunks, count, epsilon, reduction, step besides the norm's and the penalty's: leave it "
     "out, or choose method='perturbation'."),
    ({"count": 3}, "count=3 is not an option of method='double_backward', kind='gradient_norm', "
                   "which take chunks besides the norm's and the penalty's: leave it out, or "
                   "choose method='perturbation' or kind='hessian' or "
                   "projection='orthonormal'."),
], ids=["central", "chunks", "shift", "sigma", "count"])
def test_a_key_the_chosen_classes_do_not_take_is_refused_in_one_line(options: dict,
                                                                     message: str) -> None:
    with pytest.raises(ValueError) as refused:
        PenaltyConfig.from_flat(**options)
    assert str(refused.value) == message and "\n" not in message
    # at its default it is accepted, as a config listing every option writes it
    key = next(k for k in options if k not in ("method", "kind", "points"))
    PenaltyConfig.from_flat(**{**options, key: DEFAULTS[key]})


@pytest.mark.parametrize(("options", "part", "field"), [
    ({"method": "finite_difference"}, "method", "step"),
    ({"method": "perturbation"}, "method", "sigma"),
    ({"kind": "hessian", "points": "latents", "method": "finite_difference"}, "kind", "epsilon"),
    ({"method": "finite_difference", "points": "parameters", "of": "loss", "power": 1.0},
     "method", "radius"),
    ({"method": "finite_difference", "points": "parameters", "of": "loss", "power": 1.0,
      "shift": "gradient"}, "method", "scale"),
], ids=["finite_difference", "perturbation", "hessian", "radius", "scale"])
def test_step_is_the_alias_of_the_step_size_by_its_role(options: dict, part: str,
                                                        field: str) -> None:
    """``step`` sets the chosen object's step size by its role name, and reads it back; the
    role name itself gives the same configuration; both at once are refused."""
    by_alias = PenaltyConfig.from_flat(**options, step=0.02)
    assert getattr(getattr(by_alias, part), field) == 0.02
    assert by_alias.step == getattr(by_alias, field) == 0.02
    assert PenaltyConfig.from_flat(**options, **{field: 0.02}) == by_alias
    assert PenaltyConfig.from_flat(**by_alias.flat()) == by_alias
    assert by_alias.replace(step=0.03).step == 0.03
    if field != "step":
        with pytest.raises(ValueError, match=rf"^step is the alias of {field}: pass one of "
                                             rf"step=0.02 and {field}=0.03\.$"):
            PenaltyConfig.from_flat(**options, step=0.02, **{field: 0.03})
    hessian = PenaltyConfig.from_flat(kind="hessian", points="latents",
                                      method="finite_difference", step=0.2)
    assert hessian.method == methods.FiniteDifference()  # the Hessian's step, not the method's


def test_the_rename_refusals_run_only_when_an_option_is_unknown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a penalty does not look up the names of earlier releases (only an unknown
    option does), and setting the penalty's own attributes on each call checks no option name:
    the refusal of setting an option is a descriptor of the option's name alone."""
    def refuse(options: object) -> None:
        raise AssertionError("the renamed options were checked")

    monkeypatch.setattr(config_module, "check_renamed", refuse)
    monkeypatch.setattr(presets, "check_renamed", refuse)
    make_penalty("wgan_gp", method="finite_difference", step=0.01)
    PenaltyConfig.from_flat(method="perturbation", sigma=0.02)
    for build in (lambda: make_penalty("r1", fd_eps=0.1), lambda: GradientPenalty(k=2)):
        with pytest.raises(AssertionError, match="renamed options were checked"):
            build()
    assert "__setattr__" not in vars(GradientPenalty)
    penalty = r1(1.0, every=2)
    penalty.due()
    penalty.last_value = torch.zeros(())  # an attribute of the penalty's own: no check
    assert penalty.lazy_step.item() == 1
