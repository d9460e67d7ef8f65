"""A chunked linear attention with momentum (lossy from level 5) whose output is finished by
``close(o, x)``: the layer the guards' tests vary, each subclass finishing it on what its guard
watches (a setting, the input's layout), and the output types' test, on what it returns."""
import torch
import torch.nn as nn

import ttt2la

D = 8


class ClosingMemory(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S, M = x.new_zeros(B, D, D), x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            M = 0.5 * M + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
            S = S + 0.1 * M
        return self.close(torch.cat(outs, 1), x)


def converted_once(cache: dict, layers: dict, kind: str, level: int):
    """``(layer, its conversion at level)`` for ``layers[kind]``, seeded and converted on a
    (2, 16, D) example once per ``cache``."""
    if (kind, level) not in cache:
        torch.manual_seed(0)
        layer = layers[kind]()
        cache[kind, level] = layer, ttt2la.convert(
            layer, level=level, example_inputs=(torch.randn(2, 16, D),))
    return cache[kind, level]
