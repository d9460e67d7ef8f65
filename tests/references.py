"""Hand-written pieces the test references share: written here, with their own literal constants,
so that no reference shares code with ttt2la."""
import torch


def ref_ns3(G):
    """Three steps of Muon's quintic Newton–Schulz iteration, plainly."""
    X = G / (torch.sqrt((G * G).sum(dim=(-2, -1), keepdim=True)) + 1e-7)
    for _ in range(3):
        A = X @ X.transpose(-1, -2)
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * (A @ A)) @ X
    return X
