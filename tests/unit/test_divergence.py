import math

import numpy as np
import pytest
import torch

from sdpo_core.divergence import (
    TAIL_EPS,
    add_tail_bucket,
    full_vocab_divergence,
    generalized_jsd,
    sampled_token_advantage,
    sampled_token_loss,
    topk_divergence,
)

ALPHAS = [0.0, 0.25, 0.5, 0.75, 1.0]


def _np_kl(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * (np.log(a) - np.log(b))).sum(-1)


def _np_divergence(p: np.ndarray, q: np.ndarray, alpha: float) -> np.ndarray:
    """Direct float64 oracle: p = student, q = teacher, probabilities on the last axis."""
    if alpha == 0.0:
        return _np_kl(q, p)
    if alpha == 1.0:
        return _np_kl(p, q)
    m = (1 - alpha) * p + alpha * q
    return (1 - alpha) * _np_kl(p, m) + alpha * _np_kl(q, m)


def _np_topk_buckets(logprobs: np.ndarray, tail: bool) -> np.ndarray:
    probs = np.exp(logprobs)
    if tail:
        return np.concatenate([probs, 1.0 - probs.sum(-1, keepdims=True)], axis=-1)
    return probs / probs.sum(-1, keepdims=True)


@pytest.fixture
def topk_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary log-probs (V=12) of the student's top-5 ids, for student and teacher: [2, 3, 5]."""
    gen = torch.Generator().manual_seed(0)
    student_logits = torch.randn(2, 3, 12, generator=gen, dtype=torch.float64) * 2
    teacher_logits = torch.randn(2, 3, 12, generator=gen, dtype=torch.float64) * 2
    ids = student_logits.topk(5, dim=-1).indices
    student = torch.log_softmax(student_logits, -1).gather(-1, ids)
    teacher = torch.log_softmax(teacher_logits, -1).gather(-1, ids)
    return student, teacher


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_topk_divergence_matches_float64_oracle(topk_pair, alpha, tail):
    student, teacher = topk_pair
    got = topk_divergence(student, teacher, alpha=alpha, tail=tail)
    p = _np_topk_buckets(student.numpy(), tail)
    q = _np_topk_buckets(teacher.numpy(), tail)
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got.numpy(), _np_divergence(p, q, alpha), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_topk_divergence_float32_close_to_oracle(topk_pair, alpha):
    student, teacher = topk_pair
    got = topk_divergence(student.float(), teacher.float(), alpha=alpha, tail=True)
    p, q = _np_topk_buckets(student.numpy(), True), _np_topk_buckets(teacher.numpy(), True)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), _np_divergence(p, q, alpha), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_full_vocab_divergence_matches_float64_oracle(alpha):
    gen = torch.Generator().manual_seed(1)
    student_logits = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    teacher_logits = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    got = full_vocab_divergence(student_logits, teacher_logits, alpha=alpha)
    p = torch.softmax(student_logits, -1).numpy()
    q = torch.softmax(teacher_logits, -1).numpy()
    np.testing.assert_allclose(got.numpy(), _np_divergence(p, q, alpha), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_k_equal_to_vocabulary_matches_full_vocab_divergence(alpha, tail):
    gen = torch.Generator().manual_seed(2)
    student_logits = torch.randn(3, 9, generator=gen)
    teacher_logits = torch.randn(3, 9, generator=gen)
    student, teacher = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    topk = topk_divergence(student, teacher, alpha=alpha, tail=tail)
    full = full_vocab_divergence(student_logits, teacher_logits, alpha=alpha)
    torch.testing.assert_close(topk, full, rtol=1e-5, atol=1e-6)
    if tail:
        tail_mass = add_tail_bucket(student)[..., -1].exp()
        assert torch.all(tail_mass <= 1.01 * TAIL_EPS)


def test_add_tail_bucket_appends_remaining_mass():
    logprobs = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.05, 0.05, 0.0]], dtype=torch.float64))
    buckets = add_tail_bucket(logprobs)
    assert buckets.shape == (2, 4)
    torch.testing.assert_close(buckets[..., :3], logprobs)
    torch.testing.assert_close(buckets[..., 3].exp(), torch.tensor([0.2, 0.9], dtype=torch.float64))


@pytest.mark.parametrize("alpha", ALPHAS)
def test_tail_stays_finite_with_finite_gradients_when_topk_mass_reaches_one(alpha):
    # A near-one-hot student: the top-K (here the whole vocabulary, or all but a negligible id) holds
    # all the mass in float32, so 1 - sum p is 0 or rounding noise.
    logits = torch.tensor([[30.0, 0.0, -5.0, -5.0], [25.0, 0.0, 0.0, -40.0]])
    student = torch.log_softmax(logits, -1).requires_grad_(True)
    teacher = torch.log_softmax(torch.tensor([[1.0, 2.0, 0.0, -1.0], [5.0, 0.0, 1.0, -2.0]]), -1)
    for k in (4, 3):
        s = student[:, :k]
        value = topk_divergence(s, teacher[:, :k], alpha=alpha, tail=True)
        assert torch.isfinite(value).all()
        (grad,) = torch.autograd.grad(value.sum(), student)
        assert torch.isfinite(grad).all()
    assert torch.isfinite(add_tail_bucket(student)).all()


def test_gradients_reach_only_the_student(topk_pair):
    student, teacher = topk_pair
    student = student.clone().requires_grad_(True)
    teacher = teacher.clone().requires_grad_(True)
    for value in (
        topk_divergence(student, teacher, alpha=0.5, tail=True),
        topk_divergence(student, teacher, alpha=0.0, tail=False),
        full_vocab_divergence(student, teacher, alpha=1.0),
        sampled_token_loss(student[..., 0], teacher[..., 0]),
    ):
        value.sum().backward()
    assert teacher.grad is None
    assert student.grad is not None and torch.isfinite(student.grad).all()


def test_inputs_without_grad_give_output_without_grad(topk_pair):
    student, teacher = topk_pair
    assert not topk_divergence(student, teacher, alpha=0.5, tail=True).requires_grad


def test_alpha_zero_is_forward_kl_and_alpha_one_is_reverse_kl(topk_pair):
    student, teacher = topk_pair
    p, q = add_tail_bucket(student), add_tail_bucket(teacher)
    forward = (q.exp() * (q - p)).sum(-1)  # KL(q || p)
    reverse = (p.exp() * (p - q)).sum(-1)  # KL(p || q)
    torch.testing.assert_close(topk_divergence(student, teacher, alpha=0.0, tail=True), forward, rtol=0, atol=1e-14)
    torch.testing.assert_close(topk_divergence(student, teacher, alpha=1.0, tail=True), reverse, rtol=0, atol=1e-14)
    assert not torch.allclose(forward, reverse)


def test_mixture_weights_follow_the_paper_convention():
    # With alpha = 0.25 the mixture is 0.75 p + 0.25 q and the student term carries weight 0.75.
    p = torch.tensor([0.9, 0.1], dtype=torch.float64)
    q = torch.tensor([0.2, 0.8], dtype=torch.float64)
    m = 0.75 * p + 0.25 * q
    expected = 0.75 * (p * (p / m).log()).sum() + 0.25 * (q * (q / m).log()).sum()
    swapped = generalized_jsd(q.log(), p.log(), alpha=0.25)
    got = generalized_jsd(p.log(), q.log(), alpha=0.25)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, swapped)


def test_jsd_is_symmetric_and_bounded_by_ln2():
    gen = torch.Generator().manual_seed(3)
    p = torch.log_softmax(torch.randn(50, 6, generator=gen, dtype=torch.float64) * 4, -1)
    q = torch.log_softmax(torch.randn(50, 6, generator=gen, dtype=torch.float64) * 4, -1)
    pq = generalized_jsd(p, q, alpha=0.5)
    torch.testing.assert_close(pq, generalized_jsd(q, p, alpha=0.5))
    assert torch.all(pq <= math.log(2) + 1e-12) and torch.all(pq >= 0)
    # Disjoint supports reach the bound.
    disjoint = generalized_jsd(
        torch.tensor([0.0, -math.inf], dtype=torch.float64),
        torch.tensor([-math.inf, 0.0], dtype=torch.float64),
        alpha=0.5,
    )
    torch.testing.assert_close(disjoint, torch.tensor(math.log(2), dtype=torch.float64))


def test_zero_probability_entries_give_finite_values_and_gradients():
    student = torch.tensor([0.0, -math.inf, -math.inf]).requires_grad_(True)
    teacher = torch.log(torch.tensor([0.7, 0.3, 0.0]))
    for alpha in (0.25, 0.5, 1.0):
        value = generalized_jsd(student, teacher, alpha=alpha)
        (grad,) = torch.autograd.grad(value, student)
        assert torch.isfinite(value) and torch.isfinite(grad).all()


def test_identical_distributions_have_zero_divergence(topk_pair):
    student, _ = topk_pair
    for alpha in ALPHAS:
        value = topk_divergence(student, student.clone(), alpha=alpha, tail=True)
        torch.testing.assert_close(value, torch.zeros_like(value), rtol=0, atol=1e-14)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("tail", [True, False])
def test_topk_divergence_gradcheck(topk_pair, alpha, tail):
    student, teacher = topk_pair
    student = student[:1, :2].clone().requires_grad_(True)
    teacher = teacher[:1, :2]
    assert torch.autograd.gradcheck(
        lambda s: topk_divergence(s, teacher, alpha=alpha, tail=tail), (student,), eps=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_full_vocab_divergence_gradcheck(alpha):
    gen = torch.Generator().manual_seed(4)
    student = torch.randn(2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 5, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda s: full_vocab_divergence(s, teacher, alpha=alpha), (student,))


def test_half_precision_inputs_are_computed_in_float32(topk_pair):
    student, teacher = topk_pair
    value = topk_divergence(student.bfloat16(), teacher.bfloat16(), alpha=0.5, tail=True)
    assert value.dtype == torch.float32
    reference = topk_divergence(student, teacher, alpha=0.5, tail=True)
    torch.testing.assert_close(value.double(), reference, rtol=5e-2, atol=5e-3)


def test_sampled_token_loss_gradient_is_minus_advantage():
    student = torch.tensor([-0.5, -2.0, -0.1], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([-1.0, -0.5, -0.1], dtype=torch.float64, requires_grad=True)
    advantage = sampled_token_advantage(student, teacher)
    torch.testing.assert_close(advantage, torch.tensor([-0.5, 1.5, 0.0], dtype=torch.float64))
    loss = sampled_token_loss(student, teacher)
    torch.testing.assert_close(loss, (student - teacher).detach() * student.detach())
    loss.sum().backward()
    torch.testing.assert_close(student.grad, -advantage)
    assert teacher.grad is None


def test_invalid_alpha_and_shape_mismatch_are_rejected(topk_pair):
    student, teacher = topk_pair
    with pytest.raises(ValueError, match="alpha=1.5"):
        topk_divergence(student, teacher, alpha=1.5, tail=True)
    with pytest.raises(ValueError, match="alpha=-0.1"):
        full_vocab_divergence(student, teacher, alpha=-0.1)
    with pytest.raises(ValueError, match=r"\(2, 3, 4\)"):
        topk_divergence(student, teacher[..., :4], alpha=0.5, tail=True)
