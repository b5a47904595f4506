"""Image difference metrics that need no downloaded weights: PSNR and SSIM."""

from __future__ import annotations

import math

import torch
from torch.nn import functional


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of two images (..., H, W, C) in [0, 1]; inf when identical."""
    mse = torch.mean((a.double() - b.double()) ** 2).item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean SSIM (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 0.01, K2 0.03) over channels.

    ``a``, ``b``: images (1, H, W, C) or (H, W, C) in [0, 1]. Images smaller than the window use a
    window as large as the smaller side (odd).
    """
    x = a.double().reshape(-1, *a.shape[-3:])[0].permute(2, 0, 1)[:, None]
    y = b.double().reshape(-1, *b.shape[-3:])[0].permute(2, 0, 1)[:, None]
    size = min(11, min(x.shape[-2:]) // 2 * 2 - 1 if min(x.shape[-2:]) < 11 else 11)
    window = _gaussian_window(max(size, 1))
    c1, c2 = 0.01**2, 0.03**2
    mu_x, mu_y = functional.conv2d(x, window), functional.conv2d(y, window)
    sigma_x = functional.conv2d(x * x, window) - mu_x**2
    sigma_y = functional.conv2d(y * y, window) - mu_y**2
    sigma_xy = functional.conv2d(x * y, window) - mu_x * mu_y
    value = ((2 * mu_x * mu_y + c1) * (2 * sigma_xy + c2)) / ((mu_x**2 + mu_y**2 + c1) * (sigma_x + sigma_y + c2))
    return value.mean().item()
