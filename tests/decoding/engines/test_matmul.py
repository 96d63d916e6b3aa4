"""The few-rows linear path (float32) equals nn.Linear's product, keeps autograd, is taken only for
the row counts where this machine computes it faster, and leaves other models alone."""

import pytest
import torch

from drafttrain.decoding.engines import matmul, use_skinny_matmuls
from drafttrain.decoding.engines.matmul import MAX_ROWS, faster_rows

EVERY_ROW_COUNT = frozenset(range(1, MAX_ROWS + 1))


@pytest.mark.parametrize("shape", [(1, 1, 24), (1, 3, 24), (3, 24), (1, 5, 24), (2, 3, 24), (MAX_ROWS, 24), (1, MAX_ROWS + 1, 24), (0, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_skinny_product_equals_linear(shape, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    reference = torch.nn.functional.linear(x, layer.weight, layer.bias)
    use_skinny_matmuls(layer, rows_for=lambda w: EVERY_ROW_COUNT)
    assert "forward" in layer.__dict__
    out = layer(x)
    assert out.shape == reference.shape
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)


def test_gradients_flow_through_the_skinny_product():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    expected = torch.autograd.grad(torch.nn.functional.linear(x, layer.weight, layer.bias).sum(), [x, layer.weight])
    use_skinny_matmuls(layer, rows_for=lambda w: EVERY_ROW_COUNT)
    got = torch.autograd.grad(layer(x).sum(), [x, layer.weight])
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_the_path_is_kept_only_where_it_is_measured_clearly_faster(monkeypatch):
    monkeypatch.setattr(matmul, "_FASTER", {})
    measured = []

    def measure(weight, rows):  # W·xᵀ twice as fast for even rows, a hair faster (not clearly) for odd
        measured.append((tuple(weight.shape), rows))
        return (1.0, 2.0) if rows % 2 == 0 else (0.95, 1.0)

    weight = torch.randn(40, 24)
    assert faster_rows(weight, measure) == frozenset(range(2, MAX_ROWS + 1, 2))
    assert faster_rows(weight, measure) == frozenset(range(2, MAX_ROWS + 1, 2))
    assert measured == [((40, 24), rows) for rows in range(1, MAX_ROWS + 1)]  # once per shape

    layer = torch.nn.Linear(24, 40)
    use_skinny_matmuls(layer, rows_for=lambda w: faster_rows(w, measure))
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a: calls.append(a[1].shape[1]) or real_mm(*a))
    for rows in (1, 2, 3, 4):
        layer(torch.randn(rows, 24))
    assert calls == [2, 4]  # only the even row counts took W·xᵀ

    slower = torch.nn.Linear(24, 8)  # where W·xᵀ never wins, the layer is left as it was
    use_skinny_matmuls(slower, rows_for=lambda w: frozenset())
    assert "forward" not in slower.__dict__


def test_the_product_multiplies_the_layout_it_was_timed_on(monkeypatch):
    """A skinny layer's output is a transposed view; fed to the next skinny layer as it is, its
    rows reached MKL as a row-major right operand, which on 2 EPYC cores took Gemma-3's down
    projection from 0.19 to 0.54 ms (a 2-token forward 49 ms against 37 for one). The rows must
    reach `mm` as the timed product has them: the transpose of contiguous rows."""
    first, second = torch.nn.Linear(24, 40), torch.nn.Linear(40, 16)
    for layer in (first, second):
        use_skinny_matmuls(layer, rows_for=lambda w: EVERY_ROW_COUNT)
    operands = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda w, xt: operands.append(xt.stride()) or real_mm(w, xt))
    for rows in (2, 4):
        x = torch.randn(rows, 24)
        reference = torch.nn.functional.linear(torch.nn.functional.linear(x, first.weight, first.bias),
                                               second.weight, second.bias)
        torch.testing.assert_close(second(first(x)), reference, rtol=1e-5, atol=1e-6)
    assert operands and all(stride[0] == 1 for stride in operands)  # column-major: contiguous rows, transposed


def test_every_row_count_is_timed_on_cold_weights(monkeypatch):
    """A decoding forward meets each weight cold from memory, whatever its number of rows; timed on
    one weight over and over (hot), 2-8 rows misjudged which product is faster (issue 28)."""
    monkeypatch.setattr(matmul, "COLD_BYTES", 4 * 40 * 24 * 4)  # four copies of the weight below
    weight = torch.randn(40, 24)
    seen = set()
    real_mm, real_linear = matmul._mm_product, torch.nn.functional.linear
    monkeypatch.setattr(matmul, "_mm_product", lambda w, x: seen.add(w.data_ptr()) or real_mm(w, x))
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w: seen.add(w.data_ptr()) or real_linear(x, w))
    for rows in (1, 4):
        seen.clear()
        matmul.product_seconds(weight, rows)
        assert len(seen) == 4


def test_the_real_measurement_covers_every_row_count(monkeypatch):
    monkeypatch.setattr(matmul, "_FASTER", {})
    rows = faster_rows(torch.randn(16, 8))
    assert rows <= EVERY_ROW_COUNT


def test_only_cpu_float_linears_of_the_model_change_and_twice_is_once():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).half(), torch.nn.Embedding(3, 4),
                                torch.nn.Linear(4, 4).double())
    use_skinny_matmuls(model, rows_for=lambda w: EVERY_ROW_COUNT)
    first = model[0].forward
    use_skinny_matmuls(model, rows_for=lambda w: EVERY_ROW_COUNT)
    assert model[0].forward is first
    assert all("forward" not in m.__dict__ for m in model[1:])  # float16, not a Linear, float64


def test_a_weight_sharded_away_by_zero3_is_left_alone():
    """DeepSpeed ZeRO-3 leaves each rank an empty 1-D stand-in for a weight (tagged ds_id): it can be
    neither timed nor multiplied outside a forward, so the layer keeps its own (hooked) forward."""
    layer = torch.nn.Linear(4, 4)
    layer.weight = torch.nn.Parameter(torch.empty(0))
    layer.weight.ds_id = 0
    measured = []
    use_skinny_matmuls(layer, rows_for=lambda w: measured.append(w) or EVERY_ROW_COUNT)
    assert measured == [] and "forward" not in layer.__dict__
