"""The few-rows linear path (float32) equals nn.Linear's product, keeps autograd, and leaves other models alone."""

import pytest
import torch

from drafttrain.decoding.engines import use_skinny_matmuls
from drafttrain.decoding.engines.matmul import MAX_ROWS


@pytest.mark.parametrize("shape", [(1, 1, 24), (1, 3, 24), (3, 24), (1, 5, 24), (2, 3, 24), (MAX_ROWS, 24), (1, MAX_ROWS + 1, 24), (0, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_skinny_product_equals_linear(shape, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    reference = torch.nn.functional.linear(x, layer.weight, layer.bias)
    use_skinny_matmuls(layer)
    assert "forward" in layer.__dict__
    out = layer(x)
    assert out.shape == reference.shape
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)


def test_gradients_flow_through_the_skinny_product():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    expected = torch.autograd.grad(torch.nn.functional.linear(x, layer.weight, layer.bias).sum(), [x, layer.weight])
    use_skinny_matmuls(layer)
    got = torch.autograd.grad(layer(x).sum(), [x, layer.weight])
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_only_cpu_float_linears_of_the_model_change_and_twice_is_once():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).half(), torch.nn.Embedding(3, 4),
                                torch.nn.Linear(4, 4).double())
    use_skinny_matmuls(model)
    first = model[0].forward
    use_skinny_matmuls(model)
    assert model[0].forward is first
    assert all("forward" not in m.__dict__ for m in model[1:])  # float16, not a Linear, float64
