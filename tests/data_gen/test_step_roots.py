"""Roots at the reference loop's step starts (``roots: steps``): the kept coin's exact law, and the roots' places."""

from __future__ import annotations

import json

import pytest
import torch

from data_gen.collection import collect
from data_gen.collector import kept_probability
from data_gen.config import load_collect_config
from tests.data_gen.test_collect import _rows
from tests.factories import collect_overrides, save_collect_pair


def chain_step_joint(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``(V, 2)`` P(output = x, kept) of one speculative-sampling step, enumerated over the proposal y ~ q: y is
    kept with probability min(1, p(y)/q(y)), else the output comes from the residual norm(max(p - q, 0))."""
    joint = torch.zeros(len(p), 2, dtype=torch.float64)
    residual = (p - q).clamp_min(0)
    residual = residual / residual.sum() if residual.sum() > 0 else residual
    for y in range(len(p)):
        keep = min(1.0, float(p[y] / q[y])) if q[y] > 0 else 0.0
        joint[y, 1] += q[y] * keep
        joint[:, 0] += q[y] * (1 - keep) * residual
    return joint


def coin_joint(p: torch.Tensor, q: torch.Tensor, kept) -> torch.Tensor:
    """``(V, 2)`` the law of (x ~ p, a coin of weight ``kept(p, q, x)``)."""
    weights = torch.tensor([kept(p, q, x) for x in range(len(p))], dtype=torch.float64)
    return torch.stack([p * (1 - weights), p * weights], dim=1)


def laws(seed: int, vocab: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p, q = (torch.rand(vocab, generator=g, dtype=torch.float64) ** 3 for _ in range(2))
    q[seed % vocab] = 0.0  # a token the draft never proposes
    return p / p.sum(), q / q.sum()


@pytest.mark.parametrize("seed", range(6))
def test_the_kept_coin_gives_the_loops_joint_law(seed):
    p, q = laws(seed)
    torch.testing.assert_close(coin_joint(p, q, kept_probability), chain_step_joint(p, q), rtol=0, atol=1e-12)


def test_the_harness_catches_a_coin_of_the_wrong_weight():
    """Negative controls: a coin of weight q(x) (the proposal's own probability) or min(1, p/q) (the acceptance of
    a proposal, not of an output) breaks the joint law."""
    p, q = laws(1)
    for wrong in (lambda p, q, x: float(q[x]), lambda p, q, x: min(1.0, float(p[x] / q[x])) if q[x] > 0 else 0.0):
        assert (coin_joint(p, q, wrong) - chain_step_joint(p, q)).abs().max() > 1e-3


def test_steps_roots_sit_every_stride_steps_of_the_reference_chain(tmp_path):
    """With the draft equal to the target every proposal is kept (q = p up to rounding), so each reference step is
    the trunk and a bonus, trunk + 1 tokens: roots fall every stride·(trunk + 1) tokens, the first at a step below
    ``stride`` after the prompt's end. A positions collection of the same trajectories puts its roots elsewhere."""
    folder = save_collect_pair(tmp_path / "pair")
    pair = json.loads((folder / "pair.yaml").read_text())
    (folder / "same.yaml").write_text(json.dumps({**pair, "draft": pair["target"]}))
    stride, trunk = 2, 2
    out = tmp_path / "steps"
    config = load_collect_config(None, collect_overrides(folder, out, pair=folder / "same.yaml", stride=stride,
                                                         roots="steps", reference_trunk=trunk, new_tokens=24))
    collect(config, progress=False)
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["roots"] == "steps" and meta["reference_trunk"] == trunk
    by_trajectory: dict = {}
    for row in _rows(out):
        by_trajectory.setdefault((row["prompt_id"], row["sampling_index"]), []).append(row["root_position"])
    gaps = {b - a for positions in by_trajectory.values() for a, b in zip(positions[:-1], positions[1:], strict=True)}
    assert gaps == {stride * (trunk + 1)}
    assert len(by_trajectory) >= 4


def test_a_bad_root_spacing_is_refused():
    with pytest.raises(ValueError, match="roots must be positions or steps"):
        load_collect_config(None, ["roots=tokens"])
    with pytest.raises(ValueError, match="reference_trunk must be >= 1"):
        load_collect_config(None, ["roots=steps", "reference_trunk=0"])
