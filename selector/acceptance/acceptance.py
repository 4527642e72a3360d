"""The acceptance model: β̂, the probability that a draft drawn at a node is accepted, from the draft's state there.

Trained with Lightning on dense per-node labels (data_gen/dense.py: β = 1 − TV(p, q) at every position of sampled
continuations), tracked in MLflow, exported to one ONNX file whose graph an expander embeds
(selector/expander/expander.py, decode/policies/expander.py).

The model starts from the entropy. On the Qwen pair the draft's entropy alone explains about 0.6 of β's variance held
out by prompt, while a network on the hidden state alone does worse until it has tens of thousands of nodes. So
``logit β̂ = base(s) + residual(h, s)``: ``base`` is a logistic regression on a fixed basis of the node's scalars
``s`` (entropy, its square root, top probability, its log, depth, temperature, entropy × temperature), and
``residual`` an MLP on the layer-normalised hidden state ``h`` projected to ``width`` and the same basis. The
residual's last layer starts at zero, so training begins at the scalar model and the hidden state has to earn its
place on held-out loss (the checkpoint kept is the best validation loss).

Inputs at decode time are what a per-node policy may read: the draft's hidden state ``(H,)``, entropy, top
probability and depth at the node, and the generation's temperature. Loss: binary cross-entropy against the soft
label β.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

BASIS_WIDTH = 7


def scalar_basis(scalars: torch.Tensor) -> torch.Tensor:
    """``(B, 7)`` the fixed basis of ``(B, 4)`` node scalars (entropy, top, depth, temperature)."""
    entropy, top, depth, temperature = scalars.unbind(-1)
    entropy = entropy.clamp(min=0.0)
    return torch.stack([entropy, entropy.sqrt(), top, torch.log(top.clamp(min=1e-6)), depth, temperature,
                        entropy * temperature], dim=-1)


class AcceptanceNet(nn.Module):
    """``logit β̂ = base(basis) + residual(hidden, basis)`` (see the module docstring).

    Args:
        hidden_size: H, the draft's hidden size.
        width: the residual's projection and hidden width.
        dropout: on the residual's hidden layer.
        basis_mean, basis_std: ``(7,)`` the training split's basis statistics (stored as buffers).
    """

    def __init__(self, hidden_size: int, width: int = 64, dropout: float = 0.1,
                 basis_mean: np.ndarray | None = None, basis_std: np.ndarray | None = None) -> None:
        super().__init__()
        mean = np.zeros(BASIS_WIDTH) if basis_mean is None else basis_mean
        std = np.ones(BASIS_WIDTH) if basis_std is None else basis_std
        self.register_buffer("basis_mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("basis_std", torch.as_tensor(std, dtype=torch.float32))
        self.base = nn.Linear(BASIS_WIDTH, 1)
        self.norm = nn.LayerNorm(hidden_size)
        self.project = nn.Linear(hidden_size, width)
        self.residual = nn.Sequential(nn.GELU(), nn.Dropout(dropout), nn.Linear(width + BASIS_WIDTH, width),
                                      nn.GELU(), nn.Linear(width, 1))
        nn.init.zeros_(self.residual[-1].weight)
        nn.init.zeros_(self.residual[-1].bias)

    def forward(self, hidden: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        """``(B,)`` logits of β̂ for ``hidden`` ``(B, H)`` and ``scalars`` ``(B, 4)``."""
        basis = (scalar_basis(scalars) - self.basis_mean) / self.basis_std
        projected = self.project(self.norm(hidden))
        return (self.base(basis) + self.residual(torch.cat([projected, basis], dim=-1))).squeeze(-1)


def basis_statistics(scalars: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) ``(7,)`` of the basis over ``scalars`` ``(N, 4)``; a constant column gets std 1."""
    basis = scalar_basis(torch.as_tensor(scalars, dtype=torch.float32)).numpy()
    std = basis.std(axis=0)
    return basis.mean(axis=0), np.where(std > 1e-6, std, 1.0)


class AcceptanceGraph(nn.Module):
    """The exported graph: ``node`` ``[batch, H + 3]`` (hidden state, entropy, top probability, depth: the order of an
    expander's node vector, decode/policies/files/expander_file.py) to ``beta`` ``[batch, C]``, β̂ at each of the C
    temperatures in ``temperatures`` (the column an expander's rule reads)."""

    def __init__(self, net: AcceptanceNet, hidden_size: int, temperatures: list[float]) -> None:
        super().__init__()
        self.net, self.hidden_size = net, hidden_size
        self.register_buffer("temperatures", torch.tensor(temperatures, dtype=torch.float32))

    def forward(self, node: torch.Tensor) -> torch.Tensor:
        hidden, scalars = node[:, :self.hidden_size], node[:, self.hidden_size:self.hidden_size + 3]
        columns = []
        for c in range(self.temperatures.shape[0]):
            temperature = self.temperatures[c].expand(node.shape[0], 1)
            columns.append(torch.sigmoid(self.net(hidden, torch.cat([scalars, temperature], dim=-1))))
        return torch.stack(columns, dim=-1)


def predict(net: AcceptanceNet, hidden: np.ndarray, scalars: np.ndarray, batch: int = 4096) -> np.ndarray:
    """``(N,)`` β̂ for ``hidden`` ``(N, H)`` and ``scalars`` ``(N, 4)`` (eval mode, no gradients)."""
    net.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(hidden), batch):
            logits = net(torch.as_tensor(hidden[start:start + batch]), torch.as_tensor(scalars[start:start + batch]))
            out.append(torch.sigmoid(logits).numpy())
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


def r_squared(predicted: np.ndarray, label: np.ndarray) -> float:
    """1 − SSE / SST (NaN for fewer than two labels or a constant label)."""
    total = float(((label - label.mean()) ** 2).sum()) if len(label) > 1 else 0.0
    return float("nan") if total == 0 else 1.0 - float(((predicted - label) ** 2).sum()) / total


def soft_cross_entropy(predicted: np.ndarray, label: np.ndarray) -> float:
    """Mean binary cross-entropy of β̂ against the soft label β."""
    p = np.clip(predicted.astype(np.float64), 1e-7, 1 - 1e-7)
    return float(-(label * np.log(p) + (1 - label) * np.log(1 - p)).mean())


def calibration_bins(predicted: np.ndarray, label: np.ndarray, bins: int = 10) -> list[tuple[float, float, int]]:
    """(mean β̂, mean β, nodes) per equal-width bin of β̂ (empty bins left out)."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    index = np.clip(np.digitize(predicted, edges[1:-1]), 0, bins - 1)
    return [(float(predicted[index == b].mean()), float(label[index == b].mean()), int((index == b).sum()))
            for b in range(bins) if (index == b).any()]


def calibration_error(predicted: np.ndarray, label: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error: the node-weighted mean |mean β̂ − mean β| over the bins."""
    cells = calibration_bins(predicted, label, bins)
    return sum(n * abs(p - y) for p, y, n in cells) / max(1, sum(n for _, _, n in cells))
