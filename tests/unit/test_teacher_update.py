import pytest
import torch

from sdpo_core.teacher_update import ema_update_, trust_region_logits


@pytest.fixture
def states() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    teacher = {"w": torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64), "steps": torch.tensor(3)}
    students = [
        {"w": torch.tensor([3.0, 2.0, 0.0], dtype=torch.float64), "steps": torch.tensor(4)},
        {"w": torch.tensor([-1.0, 6.0, 8.0], dtype=torch.float64), "steps": torch.tensor(5)},
    ]
    return teacher, students


def test_ema_two_steps_closed_form(states):
    teacher, (s1, s2) = states
    t0 = teacher["w"].clone()
    ema_update_(teacher, s1, rate=0.25)
    torch.testing.assert_close(teacher["w"], 0.75 * t0 + 0.25 * s1["w"])
    ema_update_(teacher, s2, rate=0.25)
    torch.testing.assert_close(teacher["w"], 0.5625 * t0 + 0.1875 * s1["w"] + 0.25 * s2["w"])
    assert teacher["steps"].item() == 5  # integer buffers are copied


def test_ema_rate_one_copies_exactly(states):
    teacher, (s1, _) = states
    teacher["w"] = torch.tensor([0.1, 1e8, -3.3])
    student = {"w": torch.tensor([0.7, -1e-8, 12.345]), "steps": s1["steps"]}
    ema_update_(teacher, student, rate=1.0)
    assert torch.equal(teacher["w"], student["w"])


def test_ema_updates_in_place_without_grad():
    param = torch.nn.Parameter(torch.zeros(2))
    teacher = {"p": param}
    ema_update_(teacher, {"p": torch.ones(2, requires_grad=True)}, rate=0.5)
    assert teacher["p"] is param
    torch.testing.assert_close(param.detach(), torch.full((2,), 0.5))
    assert param.grad is None


def test_ema_casts_student_to_teacher_dtype():
    teacher = {"w": torch.zeros(2, dtype=torch.float32)}
    ema_update_(teacher, {"w": torch.ones(2, dtype=torch.bfloat16)}, rate=0.1)
    assert teacher["w"].dtype == torch.float32
    torch.testing.assert_close(teacher["w"], torch.full((2,), 0.1))


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.1])
def test_ema_rejects_rates_outside_unit_interval(states, rate):
    teacher, (s1, _) = states
    before = teacher["w"].clone()
    with pytest.raises(ValueError, match=f"tau={rate}"):
        ema_update_(teacher, s1, rate=rate)
    assert torch.equal(teacher["w"], before)


def test_ema_key_mismatch_names_the_keys(states):
    teacher, (s1, _) = states
    student = {"w": s1["w"], "extra.bias": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"\['steps'\].*\['extra.bias'\]"):
        ema_update_(teacher, student, rate=0.5)


def test_ema_shape_mismatch_names_the_tensor(states):
    teacher, (s1, _) = states
    with pytest.raises(ValueError, match="w: teacher shape"):
        ema_update_(teacher, {**s1, "w": torch.zeros(4, dtype=torch.float64)}, rate=0.5)


def test_trust_region_logits_mix_reference_and_student():
    ref = torch.tensor([[1.0, 2.0, -3.0]])
    student = torch.tensor([[5.0, -2.0, 1.0]], requires_grad=True)
    mixed = trust_region_logits(ref, student, rate=0.25)
    torch.testing.assert_close(mixed, 0.75 * ref + 0.25 * student.detach())
    assert torch.equal(trust_region_logits(ref, student, rate=1.0), student.detach())
    with pytest.raises(ValueError, match="tau=0.0"):
        trust_region_logits(ref, student, rate=0.0)
    with pytest.raises(ValueError, match="differ in shape"):
        trust_region_logits(ref, student[:, :2], rate=0.5)


def test_the_ema_teacher_of_a_bf16_policy_moves_because_it_is_kept_in_float32():
    """100 EMA steps (tau = 0.05) toward bf16 students that drift by 1e-4 a step: a bf16 teacher
    would round almost every update away; the teacher starts as the bf16 base read as float32, stays
    float32 and follows the students, each step updating the copy the last one returned in place."""
    import torch

    from tasks.train import ema_step

    torch.manual_seed(0)
    base = torch.randn(4096).to(torch.bfloat16)
    teacher = {"w": base.float()}
    student = base.float()
    for _ in range(100):
        student = student + 1e-4  # what a small learning rate does to a weight of magnitude ~1
        kept = teacher["w"]
        teacher = ema_step(teacher, {"w": student.to(torch.bfloat16)}, rate=0.05)
        assert teacher["w"] is kept  # on the student's device already: updated where it is kept
    assert teacher["w"].dtype == torch.float32
    moved = (teacher["w"] != base.float()).float().mean().item()
    assert moved > 0.95, f"only {moved:.0%} of the teacher's weights moved"
    # the same updates applied in bf16 leave most weights where they were (what the fix prevents)
    in_bf16 = base.clone()
    for step in range(100):
        in_bf16.lerp_((base.float() + 1e-4 * (step + 1)).to(torch.bfloat16), 0.05)
    assert (in_bf16 != base).float().mean().item() < 0.5
