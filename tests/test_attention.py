"""Attention with a double backward: gradcheck/gradgradcheck in float64, and exact penalties
through transformer models equal to the same models with MATH attention everywhere."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad, gradcheck, gradgradcheck
from torch.nn.attention import SDPBackend, sdpa_kernel

import gradreg
from gradreg import GradientError, differentiable_attention
from gradreg.attention import blockwise, scaled_dot_product_attention
from gradreg.graph import walk_backward_graph
from gradreg.penalties import presets

#: torch's attention as imported, before any context replaced the module attribute
FUSED = F.scaled_dot_product_attention


def has_gqa() -> bool:
    """Whether this torch's attention takes ``enable_gqa`` (torch >= 2.5)."""
    x = torch.zeros(1, 2, 1, 1)
    try:
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


def qkv(heads: int = 3, lq: int = 5, lk: int = 6, kv_heads: int | None = None
        ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    kv = heads if kv_heads is None else kv_heads
    shapes = ((2, heads, lq, 4), (2, kv, lk, 4), (2, kv, lk, 3))
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
                 for s in shapes)


def with_dead_row(dead: bool = True) -> torch.Tensor:
    """A boolean mask of 5 queries by 6 keys; row 2 allows no key where ``dead``."""
    mask = torch.rand(5, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[:, 0] = True
    mask[2] = not dead  # dead: no key allowed (the kernel's output there: 0, or NaN on torch 2.4)
    return mask


def kernel_gives_nan_on_a_dead_row() -> bool:
    """Whether this torch's attention returns NaN (torch 2.4) rather than 0 on a query row
    whose keys are all masked."""
    q, k, v = (t.detach() for t in qkv())
    return bool(FUSED(q, k, v, attn_mask=with_dead_row())[..., 2, :].isnan().all())


def check_derivatives(options: dict, inputs: tuple[torch.Tensor, ...]) -> None:
    """Finite differences (float64) of attention with ``options`` at ``inputs`` (q, k, v and a
    learned float mask where there are four): the gradient, the JVP, the double backward, and the
    JVP's own gradient (the spectral norm and the exact Hessian penalty differentiate it)."""

    def attention(*xs: torch.Tensor) -> torch.Tensor:
        extra = {"attn_mask": xs[3]} if len(xs) == 4 else {}
        return scaled_dot_product_attention(*xs[:3], **options, **extra)

    assert gradcheck(attention, inputs, check_forward_ad=True)
    assert gradgradcheck(attention, inputs)
    tangents = tuple(torch.randn_like(x) for x in inputs)
    assert gradcheck(lambda *xs: torch.func.jvp(attention, xs, tangents)[1], inputs)


@pytest.mark.parametrize("options", [
    {}, {"attn_mask": "bool"}, {"is_causal": True}, {"scale": 0.3}, {"attn_mask": "float"},
], ids=["plain", "bool_mask", "causal", "scale", "float_mask"])
def test_gradcheck_and_gradgradcheck(options: dict) -> None:
    q, k, v = qkv()
    kind = options.pop("attn_mask", None)
    inputs: tuple[torch.Tensor, ...] = (q, k, v)
    if kind == "bool":  # a NaN row has no finite Jacobian: the dead row where the kernel gives 0
        options["attn_mask"] = with_dead_row(dead=not kernel_gives_nan_on_a_dead_row())
    if kind == "float":  # an additive mask that is learned: its gradient is checked too
        mask = torch.randn(2, 1, 5, 6, dtype=torch.float64, requires_grad=True)
        inputs = (q, k, v, mask)

    check_derivatives(options, inputs)


def test_causal_with_more_queries_than_keys_is_top_left_aligned() -> None:
    q, k, v = qkv(lq=7, lk=4)
    ours = scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, reference)
    assert gradgradcheck(lambda *xs: scaled_dot_product_attention(*xs, is_causal=True), (q, k, v))


@pytest.mark.skipif(not has_gqa(), reason="this torch has no enable_gqa")
def test_grouped_query_attention() -> None:
    q, k, v = qkv(heads=4, kv_heads=2)

    def attention(*xs: torch.Tensor) -> torch.Tensor:
        return scaled_dot_product_attention(*xs, enable_gqa=True)

    with sdpa_kernel(SDPBackend.MATH):
        reference = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(attention(q, k, v), reference)
    assert gradgradcheck(attention, (q, k, v))
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        scaled_dot_product_attention(*qkv(heads=3, kv_heads=2), enable_gqa=True)


def test_the_forward_is_the_fused_kernels_bitwise() -> None:
    q, k, v = (t.float() for t in qkv())
    mask = with_dead_row()
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               rtol=0, atol=0, equal_nan=True)


def test_a_dead_rows_gradient_is_that_of_the_kernels_output_there() -> None:
    """Row 2 allows no key: 0 there and a finite gradient (torch 2.13, 2.14), or NaN there and
    NaN gradients like the MATH backend's (torch 2.4), never a finite gradient of NaN."""
    q, k, v = qkv()
    mask = with_dead_row()
    weights = torch.randn(2, 3, 5, 3, generator=torch.Generator().manual_seed(2),
                          dtype=torch.float64)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ours = torch.autograd.grad((out * weights).sum(), (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    nan = kernel_gives_nan_on_a_dead_row()
    assert bool(out[..., 2, :].isnan().all()) is nan
    assert nan or bool((out[..., 2, :] == 0).all())
    torch.testing.assert_close(out, reference, equal_nan=True)
    for got, want in zip(ours, expected, strict=True):
        assert bool(got.isfinite().all()) is not nan
        torch.testing.assert_close(got, want, equal_nan=True)


def test_the_triton_backend_without_triton_is_refused_naming_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Triton, backend="triton" is refused at the context's entry with the extra to
    install; "auto" keeps the blockwise path."""
    monkeypatch.setitem(sys.modules, "gradreg.attention.triton", None)
    monkeypatch.delattr(gradreg.attention, "triton", raising=False)
    with (pytest.raises(GradientError, match=r"backend='triton' needs Triton.*"
                                             r"pip install 'gradreg\[triton\]'"),
          differentiable_attention(backend="triton")):
        pass
    q, k, v = qkv()
    with differentiable_attention(backend="auto"):
        out = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, FUSED(q, k, v), rtol=0, atol=0)


def test_nested_tensors_are_refused() -> None:
    nested = torch.nested.nested_tensor([torch.randn(2, 3, 4), torch.randn(2, 5, 4)])
    with pytest.raises(GradientError, match="nested"):
        scaled_dot_product_attention(nested, nested, nested)


def transformer_critic(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=dropout, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    class Critic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.head = encoder, nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x).mean(dim=1)).squeeze(-1)

    return Critic().double()


def r1_gradients(critic: nn.Module, x: torch.Tensor, context, *, own_forward: bool = False,
                 seed: int = 1, **options) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """R1 (weight 10) and its parameter gradient, the critic's forward run in ``context``
    (or by the penalty itself where ``own_forward``)."""
    critic.zero_grad(set_to_none=True)
    points = x.clone().requires_grad_()
    penalty = presets.r1(10.0, **options)
    torch.manual_seed(seed)
    with context():
        value = penalty(critic, points) if own_forward else penalty(critic(points), points)
    value.backward()
    return value.detach(), [torch.zeros_like(p) if p.grad is None else p.grad
                            for p in critic.parameters()]


def math_backend():
    return sdpa_kernel(SDPBackend.MATH)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_r1_on_a_transformer_encoder_equals_the_math_backend(training: bool) -> None:
    critic = transformer_critic().train(training)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    with pytest.raises(GradientError, match="fused kernel.*inside `with gradreg.differentiable"):
        r1_gradients(critic, x, lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION))
    value, grads = r1_gradients(critic, x, differentiable_attention)
    expected_value, expected = r1_gradients(critic, x, math_backend)
    torch.testing.assert_close(value, expected_value)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)
    assert any(g.abs().sum() > 0 for g in grads)


def test_attention_dropout_in_training_equals_the_math_backend_with_the_same_seed() -> None:
    critic = transformer_critic(dropout=0.2).train()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    value, grads = r1_gradients(critic, x, differentiable_attention)
    expected_value, expected = r1_gradients(critic, x, math_backend)
    assert value == expected_value
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    other_seed, _ = r1_gradients(critic, x, differentiable_attention, seed=2)
    assert other_seed != value  # dropout is on: another seed, another value


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_penalty_that_runs_the_critic_routes_the_attention_itself(chunks: int) -> None:
    critic = transformer_critic()
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    value, grads = r1_gradients(critic, x, torch.enable_grad, own_forward=True, chunks=chunks)
    expected_value, expected = r1_gradients(critic, x, math_backend)
    torch.testing.assert_close(value, expected_value)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("preset", ["spectral", "hessian"])
def test_forward_mode_penalties_through_attention_equal_the_math_backend(preset: str) -> None:
    """The spectral norm (JVPs, differentiated) and the exact Hessian penalty (a JVP of a JVP,
    differentiated) run the critic themselves, through gradreg's attention: before, torch's
    "forward AD ... _scaled_dot_product_flash_attention_for_cpu ... not implemented"."""
    critic = transformer_critic()
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    options = {"method": "double_backward"} if preset == "hessian" else {}

    def penalty_and_gradients(context) -> tuple[torch.Tensor, list[torch.Tensor]]:
        critic.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the random start of the power iteration, the directions
        with context():
            value = getattr(presets, preset)(1.0, **options)(critic, x.clone().requires_grad_())
        value.backward()
        return value.detach(), [torch.zeros_like(p) if p.grad is None else p.grad
                                for p in critic.parameters()]

    value, grads = penalty_and_gradients(torch.enable_grad)
    expected_value, expected = penalty_and_gradients(math_backend)
    torch.testing.assert_close(value, expected_value)
    assert sum(bool(g.any()) for g in expected) > len(expected) // 2
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def attention_nodes(output: torch.Tensor) -> int:
    return sum(type(node).__name__ == "_AttentionBackward"
               for node in walk_backward_graph([output]).nodes)


def test_only_forwards_inside_the_context_are_routed() -> None:
    critic = transformer_critic()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    with differentiable_attention():
        with differentiable_attention():  # nested: one context
            inside = critic(x)
        also_inside = critic(x)
    outside = critic(x)
    assert attention_nodes(inside) == attention_nodes(also_inside) == 2
    assert attention_nodes(outside) == 0
    assert F.scaled_dot_product_attention is FUSED


def test_the_fused_function_is_restored_after_an_error() -> None:
    attention = nn.MultiheadAttention(8, 2, batch_first=True).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with pytest.raises(AssertionError, match="does not match"), differentiable_attention():
        attention(x, x, x[:, :, :3], need_weights=False)
    assert F.scaled_dot_product_attention is FUSED


def test_multihead_attention_with_a_key_padding_mask() -> None:
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])

    def r1_parameter_gradient(context) -> list[torch.Tensor]:
        with context():
            out = attention(x, x, x, key_padding_mask=padding, need_weights=False)[0]
        g, = torch.autograd.grad(out.sum(), x, create_graph=True)
        params = list(attention.parameters())
        grads = torch.autograd.grad(g.square().sum(), params, allow_unused=True)
        return [torch.zeros_like(p) if d is None else d for p, d in zip(params, grads, strict=True)]

    for got, want in zip(r1_parameter_gradient(differentiable_attention),
                         r1_parameter_gradient(math_backend), strict=True):
        torch.testing.assert_close(got, want)


class FusedAttentionBlock(nn.Module):
    """Attention as timm's ViT (``fused_attn``) and Hugging Face's ``"sdpa"`` implementation
    write it: ``F.scaled_dot_product_attention`` called directly on projected heads."""

    def __init__(self, dim: int = 8, heads: int = 2, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return self.proj(out.transpose(1, 2).reshape(b, n, d).tanh()).mean(dim=(1, 2))


@pytest.mark.parametrize("kind", ["plain", "causal", "float_mask"])
def test_a_direct_call_of_the_functional_attention_is_routed(kind: str) -> None:
    torch.manual_seed(0)
    block = FusedAttentionBlock(causal=kind == "causal").double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    # Hugging Face's padding mask: 0 where a key is kept, a large negative number where not
    mask = None if kind != "float_mask" else torch.zeros(3, 1, 1, 5, dtype=torch.float64)
    if mask is not None:
        mask[1, ..., 3:] = torch.finfo(torch.float64).min

    def r1(context) -> tuple[torch.Tensor, list[torch.Tensor]]:
        block.zero_grad(set_to_none=True)
        points = x.clone().requires_grad_()
        with context():
            scores = block(points, mask)
        value = presets.r1(10.0)(scores, points)
        value.backward()
        return value.detach(), [p.grad.clone() for p in block.parameters()
                                if p.grad is not None]

    value, grads = r1(differentiable_attention)
    expected_value, expected = r1(math_backend)
    torch.testing.assert_close(value, expected_value)
    assert len(grads) == len(expected) > 0
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


MASKS = ["none", "bool", "bool_2d", "float", "float_key_row", "causal", "causal_and_bool",
         "scale", "gqa"]


def attention_case(kind: str, lq: int, lk: int) -> tuple[dict, tuple[torch.Tensor, ...]]:
    """Options and the differentiated inputs (q, k, v[, a learned additive mask]) of one mask
    kind: a boolean mask per batch and head, one of queries x keys broadcast over both, an
    additive mask per batch, one additive row over keys, causal, causal with a boolean mask; a
    custom scale; grouped-query attention (4 query heads on 2 key/value heads)."""
    g = torch.Generator().manual_seed(3)
    inputs = qkv(lq=lq, lk=lk) if kind != "gqa" else qkv(heads=4, lq=lq, lk=lk, kv_heads=2)
    options: dict = {"scale": 0.3} if kind == "scale" else {}
    if kind == "gqa":
        if not has_gqa():
            pytest.skip("this torch has no enable_gqa")
        options["enable_gqa"] = True
    allowed = torch.rand(2, 3, lq, lk, generator=g) > 0.3
    allowed[..., 0] = True
    if kind in ("bool", "causal_and_bool"):
        options["attn_mask"] = allowed
    if kind == "bool_2d":
        options["attn_mask"] = allowed[0, 0]
    if kind.startswith("causal"):
        options["is_causal"] = kind == "causal"
        if kind == "causal_and_bool":  # a boolean mask and causal together: one mask
            options["attn_mask"] = allowed & torch.ones(lq, lk, dtype=torch.bool).tril()
    if kind.startswith("float"):
        shape = (2, 1, lq, lk) if kind == "float" else (1, lk)
        inputs += (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True),)
    return options, inputs


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 2 queries x 4 keys: several query and key blocks, a causal block skipped."""
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 2)
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 4)


def math_derivatives(attention, inputs: tuple[torch.Tensor, ...], seed: int = 4, *,
                     dual: bool = False) -> list[torch.Tensor]:
    """The value, the gradient of <out, G>, the double backward of that gradient for random
    cotangents (w.r.t. the inputs and G), the JVP for random tangents and the JVP's gradient,
    of ``attention``, all concatenated (the random tensors in the inputs' dtype and device). The
    JVP by ``torch.func.jvp``, or where ``dual`` by forward-mode AD on dual tensors, which runs
    gradreg's autograd Functions' own ``jvp`` (under ``torch.func`` attention runs in
    differentiable ops; MATH's own backward of a dual-tensor JVP fails on an in-place op)."""
    g = torch.Generator().manual_seed(seed)

    def like(x: torch.Tensor) -> torch.Tensor:  # drawn in float64 on the CPU, as x
        return torch.randn(x.shape, generator=g, dtype=torch.float64).to(x)

    out = attention(*inputs)
    weight = like(out).requires_grad_()
    grads = torch.autograd.grad(out, inputs, weight, create_graph=True)
    cotangents = [like(x) for x in inputs]
    second = torch.autograd.grad(grads, (*inputs, weight), cotangents, allow_unused=True)
    tangents = tuple(like(x) for x in inputs)
    if dual:
        with forward_ad.dual_level():
            dout = forward_ad.unpack_dual(attention(*(
                forward_ad.make_dual(x, t) for x, t in zip(inputs, tangents, strict=True)))
            ).tangent
    else:
        dout = torch.func.jvp(attention, inputs, tangents)[1]
    of_jvp = torch.autograd.grad(dout, inputs, weight.detach())
    return [out, *grads, *second, dout, *of_jvp]


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("lq", [5, 7])
def test_blockwise_derivatives_equal_the_math_backends(kind: str, lq: int,
                                                       small_blocks: None) -> None:
    """Several query and key blocks, every mask kind: the gradient, the double backward (w.r.t.
    q, k, v, a learned mask and the output cotangent), the JVP and its gradient equal those of
    the MATH backend in float64."""
    options, inputs = attention_case(kind, lq, 6)

    got = math_derivatives(attention_of(scaled_dot_product_attention, options), inputs,
                           dual=True)
    assert_float64_derivatives_equal(got, math_backend_derivatives(options, inputs))


def attention_of(attention, options: dict, **keywords: object):
    """``attention(q, k, v, **options, **keywords)`` as a function of ``(q, k, v[, mask])``, a
    fourth input being the ``attn_mask`` (a learned one, differentiated)."""
    def of_inputs(*xs: torch.Tensor) -> torch.Tensor:
        extra = {"attn_mask": xs[3]} if len(xs) == 4 else {}
        return attention(*xs[:3], **options, **extra, **keywords)
    return of_inputs


def math_backend_derivatives(options: dict, inputs: tuple[torch.Tensor, ...]) -> list:
    """:func:`math_derivatives` of torch's attention with ``options`` on the MATH backend."""
    with sdpa_kernel(SDPBackend.MATH):
        return math_derivatives(attention_of(FUSED, options), inputs)


def assert_float64_derivatives_equal(got: list, expected: list) -> None:
    """Each derivative equal to float64 rounding; where MATH gives None, ``got``'s is None or 0."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["float", "causal_and_bool"])
def test_blockwise_gradgradcheck(kind: str, small_blocks: None) -> None:
    """Finite differences: the blockwise gradient, double backward, JVP and JVP's gradient."""
    options, inputs = attention_case(kind, 5, 6)

    check_derivatives(options, inputs)


def test_third_order_derivatives(small_blocks: None) -> None:
    """The double backward's own backward (in differentiable ops), checked by finite
    differences; the JVP of the JVP (the exact Hessian penalty's) and its gradient equal the
    MATH backend's."""
    q, k, v = qkv(lq=5, lk=6)
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(2, 3, 5, 3, generator=g, dtype=torch.float64)

    def gradient(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = scaled_dot_product_attention(*xs, is_causal=True)
        return torch.autograd.grad(out, xs, weight, create_graph=True)

    assert gradgradcheck(gradient, (q, k, v))
    first, second = ([torch.randn(x.shape, generator=g, dtype=torch.float64) for x in (q, k, v)]
                     for _ in range(2))

    def jvp_of_jvp(attention) -> list[torch.Tensor]:
        def jvp(*xs: torch.Tensor) -> torch.Tensor:
            return torch.func.jvp(lambda *ys: attention(*ys, is_causal=True), xs, tuple(first))[1]

        value = torch.func.jvp(jvp, (q, k, v), tuple(second))[1]
        return [value, *torch.autograd.grad(value, (q, k, v), weight)]

    got = jvp_of_jvp(scaled_dot_product_attention)
    with sdpa_kernel(SDPBackend.MATH):
        expected = jvp_of_jvp(FUSED)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_bfloat16_blocks_are_as_accurate_as_the_math_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In bfloat16 the blocks are summed in float32: the gradient and the double backward
    through 8 x 4 blocks are as close to float64 as MATH's bfloat16 ones (measured: within 5%;
    summed in bfloat16 they were 3x further off)."""
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 8)
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 16)
    g = torch.Generator().manual_seed(0)
    q, k, v, weight, *cotangents = (torch.randn(2, 2, 64, 16, generator=g, dtype=torch.float64)
                                    for _ in range(7))

    def derivatives(attention, dtype: torch.dtype) -> list[torch.Tensor]:
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = attention(*xs, is_causal=True)
        grads = torch.autograd.grad(out, xs, weight.to(dtype), create_graph=True)
        second = torch.autograd.grad(grads, xs, [c.to(dtype) for c in cotangents])
        return [t.detach().double() for t in (*grads, *second)]

    def errors(got: list[torch.Tensor]) -> list[float]:
        return [float((a - r).norm() / r.norm()) for a, r in zip(got, exact, strict=True)]

    exact = derivatives(scaled_dot_product_attention, torch.float64)
    ours = errors(derivatives(scaled_dot_product_attention, torch.bfloat16))
    with sdpa_kernel(SDPBackend.MATH):
        math = errors(derivatives(FUSED, torch.bfloat16))
    for got, reference in zip(ours, math, strict=True):
        assert got < 1.5 * reference, (ours, math)
