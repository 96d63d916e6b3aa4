"""drafttrain.losses against a float64 brute-force reference written here from the formulas."""

from __future__ import annotations

import math

import pytest
import torch

from drafttrain.losses import LOSSES, acceptance_probability, distill_loss, per_token_divergence

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "tvd")


# ---------------------------------------------------------------- independent reference


def ref_softmax(logits_row: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits_row.double() / temperature
    e = torch.exp(z - z.max())
    return e / e.sum()


def ref_row(s_row, t_row, kind, beta, temperature, label=None) -> torch.Tensor:
    """One position, straight from the textbook formulas, float64."""
    q = ref_softmax(s_row, temperature)
    if kind == "ce":
        return -torch.log(q[label])
    p = ref_softmax(t_row, temperature)
    if kind == "forward_kl":
        return torch.sum(p * torch.log(p / q))
    if kind == "reverse_kl":
        return torch.sum(q * torch.log(q / p))
    if kind == "tvd":
        return 0.5 * torch.sum(torch.abs(p - q))
    if kind == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * torch.sum(p * torch.log(p / m)) + (1 - beta) * torch.sum(q * torch.log(q / m))
    raise AssertionError(kind)


def ref_loss(student, teacher, mask, kind, beta=0.5, temperature=1.0, labels=None):
    """Loop over masked positions only; vocab cut to min(Vs, Vt) like the module promises."""
    vocab = student.shape[-1] if teacher is None else min(student.shape[-1], teacher.shape[-1])
    total, count = 0.0, 0
    B, T = mask.shape
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            t_row = None if teacher is None else teacher[b, t, :vocab]
            label = None if labels is None else int(labels[b, t])
            total = total + ref_row(student[b, t, :vocab], t_row, kind, beta, temperature, label)
            count += 1
    return total / count


def random_case(seed, B, T, V, dtype=torch.float64, scale=3.0, p_mask=0.6):
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    teacher = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    mask = torch.rand(B, T, generator=g) < p_mask
    mask[0, 0] = True  # never empty
    labels = torch.randint(0, V, (B, T), generator=g)
    return student, teacher, mask, labels


def value_and_grad(fn, student):
    leaf = student.detach().clone().requires_grad_(True)
    loss = fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


# ---------------------------------------------------------------- values and gradients

CASES = [  # (B, T, V, temperature, beta)
    (1, 1, 2, 1.0, 0.5),
    (2, 5, 7, 1.0, 0.1),
    (3, 4, 11, 0.5, 0.9),
    (2, 6, 33, 2.0, 0.5),
]


@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_value_and_gradient_match_reference(kind, case):
    B, T, V, temperature, beta = CASES[case]
    student, teacher, mask, labels = random_case(case, B, T, V)
    teacher_arg = None if kind == "ce" else teacher

    ours, grad = value_and_grad(
        lambda s: distill_loss(s, teacher_arg, mask, kind=kind, beta=beta,
                               temperature=temperature, chunk_size=4, labels=labels), student)
    ref, ref_grad = value_and_grad(
        lambda s: ref_loss(s, teacher_arg, mask, kind, beta, temperature, labels), student)

    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-8, atol=1e-12)
    assert torch.all(grad[~mask] == 0), "positions outside the mask must get no gradient"
    assert grad[mask].abs().sum() > 0


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_values_for_each_beta(beta):
    student, teacher, mask, _ = random_case(11, 3, 5, 17)
    ours = distill_loss(student, teacher, mask, kind="jsd", beta=beta, temperature=1.5)
    ref = ref_loss(student, teacher, mask, "jsd", beta, 1.5)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", LOSSES)
def test_per_token_divergence_rows(kind):
    student, teacher, _, labels = random_case(3, 1, 9, 13)
    s, t, y = student[0], teacher[0], labels[0]
    ours = per_token_divergence(s, t, kind, beta=0.3, temperature=0.7, labels=y)
    assert ours.shape == (9,)
    ref = torch.stack([ref_row(s[i], t[i], kind, 0.3, 0.7, int(y[i])) for i in range(9)])
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- chunking and precision


@pytest.mark.parametrize("kind", LOSSES)
def test_chunk_size_does_not_change_value_or_gradient(kind):
    student, teacher, mask, labels = random_case(5, 3, 7, 19)
    results = [
        value_and_grad(lambda s: distill_loss(s, teacher, mask, kind=kind, beta=0.3,
                                              chunk_size=c, labels=labels), student)
        for c in (1, 3, 10**6)
    ]
    assert mask.sum() > 3  # so chunk sizes 1 and 3 really split the rows
    for value, grad in results[1:]:
        torch.testing.assert_close(value, results[0][0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", LOSSES)
def test_no_grad_path_matches_grad_path(kind):
    student, teacher, mask, labels = random_case(6, 2, 5, 9)
    with_grad = distill_loss(student.clone().requires_grad_(True), teacher, mask, kind=kind,
                             chunk_size=2, labels=labels)
    with torch.no_grad():
        without = distill_loss(student, teacher, mask, kind=kind, chunk_size=2, labels=labels)
    torch.testing.assert_close(with_grad.detach(), without, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", LOSSES)
def test_half_precision_inputs_are_computed_in_float32(kind, half):
    student, teacher, mask, labels = random_case(7, 2, 8, 50, dtype=half)
    leaf = student.clone().requires_grad_(True)
    loss = distill_loss(leaf, teacher, mask, kind=kind, beta=0.3, chunk_size=3, labels=labels)
    loss.backward()
    assert loss.dtype == torch.float32
    assert leaf.grad.dtype == half
    # Reference: float64 on the very same half-precision values. A computation done in half
    # precision would be off by ~1e-2 relative; float32 agrees to ~1e-6.
    ref_value, ref_grad = value_and_grad(
        lambda s: ref_loss(s, teacher.double(), mask, kind, 0.3, 1.0, labels), student.double())
    torch.testing.assert_close(loss.double(), ref_value, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad.double(), ref_grad, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_autograd_keeps_only_the_gathered_rows(kind):
    # Chunks are checkpointed: the graph must not hold float32 [N, V] softmaxes, only the
    # masked bf16 rows themselves (student + teacher), whatever the chunk size.
    student, teacher, mask, _ = random_case(20, 2, 32, 300, dtype=torch.bfloat16, p_mask=1.1)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    leaf = student.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = distill_loss(leaf, teacher, mask, kind=kind, chunk_size=8)
    rows_bytes = 2 * student.numel() * student.element_size()
    assert sum(saved) <= rows_bytes + 4096
    loss.backward()
    assert torch.isfinite(leaf.grad.float()).all()


# ---------------------------------------------------------------- vocabulary mismatch


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_student_padded_vocab_is_cut_to_teacher_vocab(kind):
    V, pad = 12, 5
    student, teacher, mask, _ = random_case(8, 2, 4, V + pad)
    teacher = teacher[..., :V]
    student[..., V:] = 40.0  # would dominate the softmax if it were not cut away
    value, grad = value_and_grad(
        lambda s: distill_loss(s, teacher, mask, kind=kind, beta=0.5), student)
    ref = ref_loss(student[..., :V], teacher, mask, kind, 0.5)
    torch.testing.assert_close(value, ref, rtol=1e-10, atol=1e-12)
    assert torch.all(grad[..., V:] == 0)


def test_teacher_padded_vocab_is_cut_too():
    V = 10
    student, teacher, mask, _ = random_case(9, 2, 3, V + 6)
    student = student[..., :V]
    teacher[..., V:] = 40.0
    value = distill_loss(student, teacher, mask, kind="forward_kl")
    torch.testing.assert_close(value, ref_loss(student, teacher[..., :V], mask, "forward_kl"),
                               rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- sanity properties


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_zero_when_draft_equals_target(kind):
    student, _, mask, _ = random_case(10, 2, 5, 21)
    value, grad = value_and_grad(
        lambda s: distill_loss(s, student, mask, kind=kind, temperature=0.8), student)
    assert abs(float(value)) < 1e-13
    if kind != "tvd":  # |p - q| has a kink at 0; the smooth divergences are stationary there
        assert grad.abs().max() < 1e-13


def test_acceptance_probability_by_hand():
    p = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    assert float(acceptance_probability(p, q)) == pytest.approx(0.5)
    # The same p and q as logits (exp(-1e4) underflows to an exact 0 in float64).
    p_logits = torch.tensor([[[math.log(0.5), math.log(0.5), -1e4]]], dtype=torch.float64)
    q_logits = torch.log(q).view(1, 1, 3)
    mask = torch.ones(1, 1, dtype=torch.bool)
    assert float(distill_loss(q_logits, p_logits, mask, kind="tvd")) == pytest.approx(0.5)


def test_one_minus_tvd_is_acceptance_probability():
    student, teacher, _, _ = random_case(12, 1, 16, 30)
    s, t = student[0], teacher[0]
    tvd = per_token_divergence(s, t, "tvd")
    p = torch.stack([ref_softmax(row, 1.0) for row in t])
    q = torch.stack([ref_softmax(row, 1.0) for row in s])
    torch.testing.assert_close(1 - tvd, acceptance_probability(p, q), rtol=1e-12, atol=1e-12)
    # ... and it really is the acceptance rate: sum_x q(x) min(1, p(x)/q(x)).
    torch.testing.assert_close(acceptance_probability(p, q),
                               (q * torch.clamp(p / q, max=1.0)).sum(-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_jsd_endpoints_are_zero_and_finite(beta):
    student, teacher, mask, _ = random_case(13, 2, 4, 9, scale=30.0)
    value, grad = value_and_grad(
        lambda s: distill_loss(s, teacher, mask, kind="jsd", beta=beta), student)
    assert float(value) == 0.0
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_jsd_is_bounded_and_finite_for_extreme_logits(beta, dtype):
    # Nearly one-hot on different tokens: JSD approaches its bound h(beta).
    V = 8
    student = torch.full((1, 4, V), -500.0, dtype=dtype)
    teacher = torch.full((1, 4, V), -500.0, dtype=dtype)
    student[..., 0] = 500.0
    teacher[..., 1] = 500.0
    mask = torch.ones(1, 4, dtype=torch.bool)
    value, grad = value_and_grad(
        lambda s: distill_loss(s, teacher, mask, kind="jsd", beta=beta), student)
    bound = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
    assert torch.isfinite(value) and torch.isfinite(grad).all()
    assert float(value) == pytest.approx(bound, rel=1e-5)
    # Random logits stay strictly below the bound.
    s, t, m, _ = random_case(14, 3, 5, 10)
    assert 0 < float(distill_loss(s, t, m, kind="jsd", beta=beta)) < bound


def test_jsd_interpolates_between_the_two_kls():
    student, teacher, mask, _ = random_case(15, 2, 4, 9, scale=1.0)
    eps = 1e-5
    fkl = distill_loss(student, teacher, mask, kind="forward_kl")
    rkl = distill_loss(student, teacher, mask, kind="reverse_kl")
    low = distill_loss(student, teacher, mask, kind="jsd", beta=eps) / eps
    high = distill_loss(student, teacher, mask, kind="jsd", beta=1 - eps) / eps
    torch.testing.assert_close(low, fkl, rtol=1e-3, atol=0)
    torch.testing.assert_close(high, rkl, rtol=1e-3, atol=0)


# ---------------------------------------------------------------- masks, labels, errors


@pytest.mark.parametrize("kind", LOSSES)
def test_all_zero_mask_gives_zero_with_grad(kind):
    student, teacher, _, labels = random_case(16, 2, 3, 7, dtype=torch.bfloat16)
    leaf = student.clone().requires_grad_(True)
    mask = torch.zeros(2, 3, dtype=torch.long)
    loss = distill_loss(leaf, teacher, mask, kind=kind, labels=labels)
    assert loss.grad_fn is not None and torch.isfinite(loss.detach()) and float(loss.detach()) == 0.0
    loss.backward()
    assert leaf.grad is not None and torch.all(leaf.grad == 0)


def test_integer_mask_equals_bool_mask():
    student, teacher, mask, _ = random_case(17, 2, 6, 9)
    as_bool = distill_loss(student, teacher, mask, kind="reverse_kl")
    as_int = distill_loss(student, teacher, mask.long(), kind="reverse_kl")
    assert torch.equal(as_bool, as_int)


def test_ce_ignores_labels_outside_the_mask_and_rejects_bad_ones_inside():
    student, _, mask, labels = random_case(18, 2, 5, 9)
    labels[~mask] = -100
    value = distill_loss(student, None, mask, kind="ce", labels=labels)
    torch.testing.assert_close(value, ref_loss(student, None, mask, "ce", labels=labels),
                               rtol=1e-10, atol=1e-12)
    labels[0, 0] = 9
    with pytest.raises(ValueError, match="labels"):
        distill_loss(student, None, mask, kind="ce", labels=labels)


def test_bad_arguments_raise_value_error():
    student, teacher, mask, _ = random_case(19, 1, 2, 5)
    with pytest.raises(ValueError) as info:
        distill_loss(student, teacher, mask, kind="kl")
    for name in LOSSES:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="beta"):
        distill_loss(student, teacher, mask, kind="jsd", beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        distill_loss(student, teacher, mask, kind="tvd", temperature=0.0)
    with pytest.raises(ValueError, match="labels"):
        distill_loss(student, teacher, mask, kind="ce")
    with pytest.raises(ValueError, match="teacher"):
        distill_loss(student, None, mask, kind="forward_kl")
    with pytest.raises(ValueError, match="mask"):
        distill_loss(student, teacher, mask[:, :1], kind="forward_kl")
    with pytest.raises(ValueError, match="chunk_size"):
        distill_loss(student, teacher, mask, kind="forward_kl", chunk_size=0)


@pytest.mark.parametrize("k", [1, 5, 24])
def test_topk_forward_kl_equals_the_dense_loss_on_the_reconstructed_teacher(k):
    from drafttrain.losses import topk_forward_kl, topk_teacher_logits

    g = torch.Generator().manual_seed(k)
    V = 24
    student = torch.randn(3, 5, V, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(3, 5, V, generator=g, dtype=torch.float64) * 3
    values, ids = teacher.log_softmax(-1).topk(k, dim=-1)
    mask = torch.rand(3, 5, generator=g) < 0.6
    mask[0, 0] = True
    dense = distill_loss(student, topk_teacher_logits(ids, values, V).to(torch.float64), mask, kind="forward_kl")
    (dense_grad,) = torch.autograd.grad(dense, student)
    sparse = topk_forward_kl(student, ids, values, mask)
    (sparse_grad,) = torch.autograd.grad(sparse, student)
    # topk_teacher_logits rebuilds the teacher in float32: agreement to float32 precision.
    torch.testing.assert_close(sparse, dense, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sparse_grad, dense_grad, rtol=1e-6, atol=1e-7)
    assert sparse_grad[~mask].abs().sum() == 0
    empty = topk_forward_kl(student, ids, values, torch.zeros_like(mask))
    assert empty.item() == 0.0
