"""The decoders of transformers' DacModel and diffusers' AutoencoderOobleck as a list of 1-d steps
that each know their geometry, so a time slice of the latent decodes to exactly the module's output.

Every step maps a tensor holding the absolute positions [a, b) of its input sequence (full length
``n``) to the positions of its output it can compute exactly from them. At a sequence end the step
applies the module's own zero padding; in the interior it pads nothing and its output shrinks by the
kernel's reach. ``need`` runs the geometry backwards: for output positions [c, e), the input positions
required (clipped to the sequence). Snake and tanh are pointwise; a residual unit adds its input,
aligned by absolute position, to its branch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import ember


def _int(v) -> int:
    return int(v[0]) if isinstance(v, (tuple, list)) else int(v)


def folded_weight(conv) -> torch.Tensor:
    """The conv's effective weight, weight norm folded (a new tensor then; the module is untouched)."""
    parametrizations = getattr(conv, "parametrizations", None)
    if parametrizations is not None and "weight" in parametrizations:
        return conv.weight.detach()  # torch.nn.utils.parametrizations.weight_norm computes a new tensor here
    for hook in conv._forward_pre_hooks.values():
        if type(hook).__name__ == "WeightNorm" and getattr(hook, "name", None) == "weight":
            return hook.compute_weight(conv).detach()  # torch.nn.utils.weight_norm: recompute from g and v
    return conv.weight.detach()


class Conv:
    """Stride-1 Conv1d: output j reads inputs j - p + i * d for i < k."""

    def __init__(self, conv, where: str):
        if _int(conv.stride) != 1 or conv.groups != 1 or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError(f"{where}: expected a stride-1, ungrouped Conv1d with integer zero padding, got {conv}")
        self.w, self.b = folded_weight(conv), None if conv.bias is None else conv.bias.detach()
        self.k, self.d, self.p = _int(conv.kernel_size), _int(conv.dilation), _int(conv.padding)
        self.reach = self.d * (self.k - 1)
        self.scale, self.channels = 1, conv.out_channels

    def length(self, n: int) -> int:
        return n + 2 * self.p - self.reach

    def need(self, c: int, e: int, n: int) -> tuple[int, int]:
        return max(c - self.p, 0), min(e - self.p + self.reach, n)

    def run(self, x: torch.Tensor, a: int, b: int, n: int):
        left, right = (self.p if a == 0 else 0), (self.p if b == n else 0)
        if left or right:
            x = F.pad(x, (left, right))
        y = F.conv1d(x, self.w, self.b, dilation=self.d)
        start = a - left + self.p
        return y, start, start + y.shape[-1]


class ConvT:
    """ConvTranspose1d: uncropped output u = i * s + m * dl (m < K) for input i; output j = u - P."""

    def __init__(self, conv, where: str):
        self.s, self.K, self.P = _int(conv.stride), _int(conv.kernel_size), _int(conv.padding)
        self.dl, self.op = _int(conv.dilation), _int(conv.output_padding)
        self.reach = self.dl * (self.K - 1)
        if conv.groups != 1 or self.reach + 1 < self.s:
            raise ValueError(f"{where}: expected an ungrouped ConvTranspose1d whose kernel span covers its "
                             f"stride, got {conv}")
        self.w, self.b = folded_weight(conv), None if conv.bias is None else conv.bias.detach()
        self.scale, self.channels = self.s, conv.out_channels

    def length(self, n: int) -> int:
        return (n - 1) * self.s - 2 * self.P + self.reach + 1 + self.op

    def need(self, c: int, e: int, n: int) -> tuple[int, int]:
        lo = -((self.reach - c - self.P) // self.s)  # ceil((c + P - reach) / s)
        return max(lo, 0), min((e - 1 + self.P) // self.s + 1, n)

    def run(self, x: torch.Tensor, a: int, b: int, n: int):
        end = b == n
        y = F.conv_transpose1d(x, self.w, self.b, stride=self.s, output_padding=self.op if end else 0,
                               dilation=self.dl)
        # u is complete when every input reaching it is in [a, b) (or past a sequence end)
        u_lo = 0 if a == 0 else (a - 1) * self.s + self.reach + 1
        u_hi = (n - 1) * self.s + self.reach + 1 + self.op if end else b * self.s
        j_lo, j_hi = max(u_lo - self.P, 0), min(u_hi - self.P, self.length(n))
        off = self.P - a * self.s
        return y[..., j_lo + off:j_hi + off], j_lo, j_hi


class Snake:
    """x + 1 / (beta + 1e-9) * sin(alpha * x)^2 with the module's alpha and beta (DAC: beta = alpha;
    Oobleck: exp of both when logscale) through ``ember.ops.snake``: one launch, float32 math rounded
    once, where the module's five bf16 ops cost 5x the memory traffic (H200, DAC 44 kHz 600 s bf16:
    the stock snakes took ~0.3 of the decode's 1.22 s)."""

    def __init__(self, m):
        with torch.no_grad():
            log = hasattr(m, "beta") and getattr(m, "logscale", False)
            self.alpha = (torch.exp(m.alpha) if log else m.alpha.detach()).reshape(-1)
            self.beta = None
            if hasattr(m, "beta"):
                self.beta = (torch.exp(m.beta) if log else m.beta.detach()).reshape(-1)
        self.scale, self.channels = 1, m.alpha.shape[1]

    def length(self, n: int) -> int:
        return n

    def need(self, c: int, e: int, n: int) -> tuple[int, int]:
        return c, e

    def run(self, x: torch.Tensor, a: int, b: int, n: int):
        return ember.ops.snake(x, self.alpha, beta=self.beta), a, b


class Tanh:
    scale, channels = 1, 0

    def length(self, n: int) -> int:
        return n

    def need(self, c: int, e: int, n: int) -> tuple[int, int]:
        return c, e

    def run(self, x: torch.Tensor, a: int, b: int, n: int):
        return x.tanh_(), a, b  # x is the last conv's fresh output


class Residual:
    """x + branch(x), the skip taken at the branch output's positions (the module's length-preserving
    convs make its own symmetric crop zero, checked here)."""

    def __init__(self, steps: list, where: str):
        self.steps = steps
        n = 1000
        if Plan.length_of(steps, n) != n:
            raise ValueError(f"{where}: expected a length-preserving residual branch (padding = dilation * "
                             f"(kernel - 1) / 2)")
        self.scale, self.channels = 1, max(s.channels for s in steps)

    def length(self, n: int) -> int:
        return n

    def need(self, c: int, e: int, n: int) -> tuple[int, int]:
        lo, hi = Plan.need_of(self.steps, c, e, n)
        return min(lo, c), max(hi, e)

    def run(self, x: torch.Tensor, a: int, b: int, n: int):
        y, a2, b2 = Plan.run_of(self.steps, x, a, b, n)
        return y.add_(x[..., a2 - a:b2 - a]), a2, b2


class Plan:
    """A decoder's steps, its latent channel count and output channels."""

    def __init__(self, steps: list, in_channels: int, out_channels: int):
        self.steps, self.in_channels, self.out_channels = steps, in_channels, out_channels

    @staticmethod
    def length_of(steps, n: int) -> int:
        for s in steps:
            n = s.length(n)
        return n

    @staticmethod
    def need_of(steps, c: int, e: int, n: int) -> tuple[int, int]:
        lengths = [n]
        for s in steps[:-1]:
            lengths.append(s.length(lengths[-1]))
        for s, n_in in zip(reversed(steps), reversed(lengths)):
            c, e = s.need(c, e, n_in)
        return c, e

    @staticmethod
    def run_of(steps, x: torch.Tensor, a: int, b: int, n: int):
        for s in steps:
            n_out = s.length(n)
            x, a, b = s.run(x, a, b, n)
            n = n_out
        return x, a, b

    def length(self, n: int) -> int:
        return self.length_of(self.steps, n)

    def need(self, c: int, e: int, n: int) -> tuple[int, int]:
        return self.need_of(self.steps, c, e, n)

    def run(self, x: torch.Tensor, a: int, b: int, n: int):
        return self.run_of(self.steps, x, a, b, n)

    def elems_per_frame(self) -> int:
        """Largest activation, in elements per latent frame and batch row (channels x upsampling)."""
        best, scale = self.in_channels, 1

        def walk(steps):
            nonlocal best, scale
            for s in steps:
                scale *= s.scale
                if isinstance(s, Residual):
                    walk(s.steps)
                best = max(best, s.channels * scale)
        walk(self.steps)
        return best


def _residual_unit(unit, where: str) -> Residual:
    return Residual([Snake(unit.snake1), Conv(unit.conv1, f"{where}.conv1"), Snake(unit.snake2),
                     Conv(unit.conv2, f"{where}.conv2")], where)


def build(decoder) -> Plan:
    """The Plan of a DacDecoder / OobleckDecoder (conv1, upsampling blocks, snake, conv2, DAC's tanh)."""
    steps = [Conv(decoder.conv1, "decoder.conv1")]
    for i, block in enumerate(decoder.block):
        where = f"decoder.block[{i}]"
        steps += [Snake(block.snake1), ConvT(block.conv_t1, f"{where}.conv_t1")]
        steps += [_residual_unit(getattr(block, f"res_unit{r}"), f"{where}.res_unit{r}") for r in (1, 2, 3)]
    steps += [Snake(decoder.snake1), Conv(decoder.conv2, "decoder.conv2")]
    if isinstance(getattr(decoder, "tanh", None), torch.nn.Tanh):
        steps.append(Tanh())
    return Plan(steps, decoder.conv1.in_channels, decoder.conv2.out_channels)
