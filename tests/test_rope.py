import pytest
import torch

from landmark_memory import RotaryEmbedding
from landmark_memory.core.rope import rotary


def test_position_zero_is_identity_and_norms_are_kept():
    rope = RotaryEmbedding(16)
    x = torch.randn(2, 3, 5, 16)
    torch.testing.assert_close(rope(x, torch.zeros(5)), x)
    torch.testing.assert_close(rope(x, torch.arange(5) * 97).norm(dim=-1), x.norm(dim=-1))


def test_scores_depend_only_on_position_difference():
    rope = RotaryEmbedding(32)
    q, k = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)

    def score(m, n):
        return (rope(q[None], torch.tensor([m])) * rope(k[None], torch.tensor([n]))).sum()

    torch.testing.assert_close(score(7, 3), score(1007, 1003))
    torch.testing.assert_close(score(0, 50), score(12345, 12395))
    assert not torch.allclose(score(7, 3), score(7, 4))


def test_matches_complex_rotation_at_arbitrary_positions():
    D, base = 8, 10000.0
    rope = RotaryEmbedding(D, base)
    x = torch.randn(2, 4, 3, D, dtype=torch.float64)
    pos = torch.tensor([[5, 0, 123456], [2, 2, 9]])[:, None, :]  # (B, 1, T): per batch element
    z = torch.complex(x[..., : D // 2], x[..., D // 2:])
    theta = pos[..., None].double() * base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    r = z * torch.polar(torch.ones_like(theta), theta)
    torch.testing.assert_close(rope(x, pos), torch.cat([r.real, r.imag], dim=-1))


def test_keeps_dtype():
    rope = RotaryEmbedding(8)
    assert rope(torch.randn(1, 2, 8, dtype=torch.bfloat16), torch.arange(2)).dtype == torch.bfloat16


def test_tensors_rotated_together_equal_each_rotated_alone():
    rope, pos = RotaryEmbedding(16), torch.tensor([3, 70000, 5])
    q, k = torch.randn(2, 4, 3, 16), torch.randn(2, 1, 3, 16)
    rq, rk = rope(q, pos, k)
    assert torch.equal(rq, rope(q, pos)) and torch.equal(rk, rope(k, pos))
    assert torch.equal(rotary(16, 10000.0)(q, pos), rq) and rotary(16, 10000.0) is rotary(16, 10000.0)


def test_given_frequencies_rotate_as_the_base_would_and_a_wrong_count_is_refused():
    x, pos = torch.randn(2, 5, 8, dtype=torch.float64), torch.tensor([0, 3, 70, 1000, 12345])
    base = RotaryEmbedding(8, 500.0)
    given = RotaryEmbedding(8, inv_freq=500.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    torch.testing.assert_close(given(x, pos), base(x, pos), rtol=0, atol=1e-12)
    halved = RotaryEmbedding(8, inv_freq=given.inv_freq("cpu") / 2)  # linear scaling by 2: position 2p as p
    torch.testing.assert_close(halved(x, 2 * pos), given(x, pos), rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="head_dim / 2 = 4"):
        RotaryEmbedding(8, inv_freq=torch.ones(8))
