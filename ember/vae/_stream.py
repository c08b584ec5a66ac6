"""A causal, chunk-by-chunk run of a diffusers Wan-family decoder (and, via ``CausalStream``, encoder)
on its own weights.

diffusers' Wan decoder (AutoencoderKLWan, AutoencoderKLQwenImage) decodes one latent frame at a time
(its encoder: one video frame, then chunks of 4) and keeps, per causal Conv3d, the last two input
frames in a cache. Each conv then runs
``torch.cat([cache, x])`` and ``F.pad`` (time in front, H and W on both sides): two full copies of
every conv input, the padded one larger than the activation. Here, per conv:

* the spatial zero padding is the convolution's own ``padding`` argument: cuDNN reads the border
  implicitly, nothing is materialised;
* the conv input is one buffer ``[history (2 frames) | new frames]``; the producer of the new frames
  (RMS norm + SiLU) writes straight into it, the history is a 2-frame copy in and out (the stream's
  zero start is a zeroed history, exactly diffusers' zero padding in time);
* activations stay channels-last 3D (NDHWC) so cuDNN runs its native tensor-core layout and the
  per-frame 2D ops (upsampling, attention) reshape without copies.

The semantics match diffusers' feature cache chunk for chunk (including the ``Rep`` start of the
temporal upsampler's conv, which skips the first chunk), so outputs agree to rounding.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

import ember
from ember import _dispatch, _switches

CL3 = torch.channels_last_3d


def is_causal_conv(m) -> bool:
    return isinstance(m, torch.nn.Conv3d) and hasattr(m, "_padding")


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """[..., C] rows over the channel dim of a [B, C, *spatial] tensor, when that is a view."""
    xr = x.movedim(1, -1)
    if xr.stride(-1) != 1:
        return None
    try:
        return xr.view(-1, xr.shape[-1])
    except RuntimeError:
        return None


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[C] values viewed to broadcast over dim 1 of [B, C, *spatial] ``x``."""
    return v.reshape(-1, *[1] * (x.dim() - 2))


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``WanRMS_norm`` (channel-first): x / ||x||_C * sqrt(C) * gamma + bias.

    ``x * rsqrt(mean(x^2))`` is the same quantity; ember's fused RMSNorm computes it in fp32 over
    channels-last rows (one pass, no fp32 copy of the activation as F.normalize(x.float()) makes).
    """
    C = x.shape[1]
    gamma = norm.gamma.reshape(C)
    rows = _rows(x)
    if rows is not None:
        # eps far below any non-degenerate mean(x^2), where diffusers clamps ||x|| at 1e-12
        y = ember.ops.rmsnorm(rows, gamma, eps=1e-24).view(x.movedim(1, -1).shape).movedim(-1, 1)
    else:
        y = (F.normalize(x.float(), dim=1) * norm.scale * _per_channel(gamma.float(), x)).to(x.dtype)
    if isinstance(norm.bias, torch.Tensor):
        y = y + _per_channel(norm.bias, x)
    return y


def norm_silu(norm, x: torch.Tensor, out: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(rms_norm(norm, x + bias))`` (into ``out`` when given; ``bias``: the producing conv's,
    per channel, not yet added): one pass over channels-last rows when they are views and the norm
    has no bias (Wan's), else the two-step path."""
    rows = _rows(x)
    out_rows = _rows(out) if out is not None else None
    if rows is not None and (out is None or out_rows is not None) and not isinstance(norm.bias, torch.Tensor):
        y = ember.ops.norm.rmsnorm_silu(rows, norm.gamma.reshape(x.shape[1]), eps=1e-24, out=out_rows, bias=bias)
        return out if out is not None else y.view(x.movedim(1, -1).shape).movedim(-1, 1)
    if bias is not None:
        x = x + _per_channel(bias, x)
    if out is None:
        return F.silu(rms_norm(norm, x), inplace=True)
    return torch.ops.aten.silu.out(rms_norm(norm, x), out=out)


def add_conv_bias_(y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``y += bias`` per channel, then ``y += residual`` (a residual block's shortcut), in place.

    torch's conv adds its bias with a broadcast [1, C, 1, ...] add, which on a channels-last 5-D
    output runs a non-vectorised kernel: 0.19 ms for a [1, 256, 4, 192, 336] bf16 output on the H200
    (0.7 TB/s). As a [rows, C] + [C] add it streams, still at 1.4 TB/s in torch
    (bench/results/h200/profile_vae_shapes.txt); with Triton, both adds are one pass over
    channels-last rows (``kernels.norm.bias_add_rows_``). Same values every way: each sum rounded to
    y's dtype, as the separate adds store it.
    """
    if bias is None and residual is None:
        return y
    rows = _rows(y)
    res_rows = _rows(residual) if residual is not None else None
    if bias is not None and rows is not None and (residual is None or res_rows is not None) and _dispatch.use_triton(y):
        _dispatch.prepare_triton()
        from ember.kernels import norm as norm_kernels
        norm_kernels.bias_add_rows_(rows, bias.contiguous(), res_rows)
        return y
    if bias is not None:
        if rows is None:
            y.add_(_per_channel(bias, y))
        else:
            rows.add_(bias)
    return y if residual is None else y.add_(residual)


class CausalStream:
    """The layers decoder and encoder share, each causal conv keeping its time history between chunks.

    Subclasses (``StreamDecoder`` here, ``ember.vae._encode.StreamEncoder``) walk their network with them.
    """

    def __init__(self):
        self.history: dict[int, torch.Tensor] = {}

    def reset(self) -> None:
        """Start a new stream (a new tile): every causal conv's history is zero again."""
        self.history.clear()

    # ------------------------------------------------------------------ layers
    def causal(self, conv, x: torch.Tensor, norm=None, in_bias: torch.Tensor | None = None,
               add_bias: bool = True) -> torch.Tensor:
        """``conv(silu(norm(x + in_bias)))`` (or ``conv(x)``) with the stream's time history, no padded
        copy. ``in_bias``: the previous conv's bias, added inside the norm's pass (needs ``norm``);
        ``add_bias=False``: return the output without this conv's bias, for the caller to fold in."""
        pw, ph, k = conv._padding[0], conv._padding[2], conv._padding[4]
        B, _, T, H, W = x.shape
        C = conv.in_channels
        if in_bias is not None and norm is None:
            raise ValueError("vae: a folded input bias needs the norm that adds it")
        bias = conv.bias if add_bias else None
        if k == 0:  # a 1x1x1 (or spatial-only) conv has no history
            inp = x if norm is None else norm_silu(norm, x, bias=in_bias)
            return add_conv_bias_(F.conv3d(inp, conv.weight, None, conv.stride, (0, ph, pw)), bias)
        buf = torch.empty((B, C, k + T, H, W), dtype=x.dtype, device=x.device, memory_format=CL3)
        new = buf[:, :, k:]
        if norm is None:
            new.copy_(x)
        else:
            norm_silu(norm, x, out=new, bias=in_bias)
        hist = self.history.get(id(conv))
        if hist is None:
            buf[:, :, :k].zero_()
            hist = torch.empty((B, C, k, H, W), dtype=x.dtype, device=x.device, memory_format=CL3)
            self.history[id(conv)] = hist
        else:
            buf[:, :, :k].copy_(hist)
        y = add_conv_bias_(F.conv3d(buf, conv.weight, None, conv.stride, (0, ph, pw)), bias)
        hist.copy_(buf[:, :, T:])  # the stream's last k frames (old history too when T < k)
        return y

    def resblock(self, blk, x: torch.Tensor) -> torch.Tensor:
        """conv1's bias goes into norm2's pass and conv2's into the shortcut add: two passes over
        the block's activations fewer than adding each bias on its own (same values)."""
        h = x if isinstance(blk.conv_shortcut, torch.nn.Identity) else self.causal(blk.conv_shortcut, x)
        y = self.causal(blk.conv1, x, norm=blk.norm1, add_bias=False)
        y = self.causal(blk.conv2, y, norm=blk.norm2, in_bias=blk.conv1.bias, add_bias=False)
        return add_conv_bias_(y, blk.conv2.bias, residual=h)

    def attention(self, blk, x: torch.Tensor) -> torch.Tensor:
        """Single-head attention over each frame's H*W positions, on channels-last rows."""
        B, C, T, H, W = x.shape
        n = rms_norm(blk.norm, x)
        rows = n.permute(0, 2, 3, 4, 1).reshape(B * T, H * W, C)
        qkv = F.linear(rows, blk.to_qkv.weight.reshape(3 * C, C), blk.to_qkv.bias)
        q, k, v = (t.unsqueeze(1) for t in qkv.split(C, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v).squeeze(1)
        o = F.linear(o, blk.proj.weight.reshape(C, C), blk.proj.bias)
        return o.view(B, T, H, W, C).permute(0, 4, 1, 2, 3).add_(x)

    def mid_block(self, mid, x: torch.Tensor) -> torch.Tensor:
        x = self.resblock(mid.resnets[0], x)
        for attn, res in zip(mid.attentions, mid.resnets[1:]):
            if attn is not None:
                x = self.attention(attn, x)
            x = self.resblock(res, x)
        return x


def tile_starts(n: int, tile: int, stride: int, trim: bool) -> list[int]:
    """Tile origins along an axis of n latent px: diffusers' (every stride below n) or, ``trim``, up to
    the first tile that reaches n (no redundant strip inside the last tile; ``_decode._Axis``)."""
    starts = []
    for s in range(0, n, stride):
        starts.append(s)
        if trim and s + tile >= n:
            break
    return starts


def env_switch(name: str) -> bool:
    """An on/off switch of the registry (ember._switches), read per call."""
    return bool(_switches.get(name))


def subpixel_enabled() -> bool:
    """Whether the decoder's 2x upsample + 3x3 conv runs as the 2x2 sub-pixel conv (EMBER_VAE_SUBPIXEL,
    default 1)."""
    return env_switch("EMBER_VAE_SUBPIXEL")


def _subpixel_ok(conv) -> bool:
    return (isinstance(conv, torch.nn.Conv2d) and tuple(conv.kernel_size) == (3, 3) and tuple(conv.padding) == (1, 1)
            and tuple(conv.stride) == (1, 1) and tuple(conv.dilation) == (1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros")


# Row (column) taps of the 2x2 sub-pixel kernels from a 3x3 kernel over a 2x nearest-upsampled input:
# output parity 0 reads source rows (i - 1, i) with taps (w0, w1 + w2), parity 1 rows (i, i + 1)
# with taps (w0 + w1, w2).
_SUBPIXEL_TAPS = ((1.0, 0.0, 0.0), (0.0, 1.0, 1.0)), ((1.0, 1.0, 0.0), (0.0, 0.0, 1.0))


def _subpixel_weights(w: torch.Tensor) -> torch.Tensor:
    """[4 Co, Ci, 2, 2] sub-pixel kernels (parity (a, b) at block 2a + b) of a [Co, Ci, 3, 3] kernel,
    summed in float32 (float64 for float64), rounded once to w's dtype, channels-last."""
    acc = torch.promote_types(w.dtype, torch.float32)
    taps = torch.tensor(_SUBPIXEL_TAPS, dtype=acc, device=w.device)  # [parity, 2, 3]
    w4 = torch.einsum("apk,ocks,bqs->abocpq", taps, w.to(acc), taps)
    return w4.reshape(4 * w.shape[0], w.shape[1], 2, 2).to(w.dtype).contiguous(memory_format=torch.channels_last)


class StreamDecoder(CausalStream):
    """Runs ``vae.decoder`` on one spatial tile, latent frame by latent frame.

    Example:
        >>> s = StreamDecoder(vae.decoder)
        >>> s.reset()
        >>> frames = [s.step(z[:, :, k:k + 1], first=(k == 0)) for k in range(z.shape[2])]
    """

    def __init__(self, decoder: torch.nn.Module, frames_per_chunk: int | None = None):
        super().__init__()
        self.dec = decoder
        self.frames_per_chunk = frames_per_chunk
        self.subpixel_weights: dict[int, tuple] = {}  # id(conv) -> (weight, its version, sub-pixel kernels)
        # up blocks from here on change no frame count: they (and the output conv) can run on a few
        # frames at a time, their causal convs carrying the history between sub-chunks
        self.time_fixed_from = 1 + max((i for i, ub in enumerate(decoder.up_blocks) if _upsamples_time(ub)),
                                       default=-1)

    def resample(self, r, x: torch.Tensor, first: bool) -> torch.Tensor:
        if r.mode == "upsample3d" and not first:
            # diffusers marks the first chunk "Rep" and skips this conv there: its stream starts at
            # chunk 1 with zero history, which is what an absent history gives.
            y = self.causal(r.time_conv, x)  # [B, 2C, T, H, W]: channel half s is frame 2t + s
            B, C2, T, H, W = y.shape
            C = C2 // 2
            inter = torch.empty((B, T, 2, H, W, C), dtype=y.dtype, device=y.device)
            inter.copy_(y.permute(0, 2, 3, 4, 1).unflatten(-1, (2, C)).permute(0, 1, 4, 2, 3, 5))
            x = inter.view(B, 2 * T, H, W, C).permute(0, 4, 1, 2, 3)
        elif r.mode not in ("upsample2d", "upsample3d"):
            raise ValueError(f"vae: expected decoder resample modes upsample2d/upsample3d, got {r.mode!r}")
        B, C, T, H, W = x.shape
        x4 = x.permute(0, 2, 1, 3, 4).reshape(B * T, C, H, W)  # a view for channels-last input
        conv = r.resample[1]
        if subpixel_enabled() and _subpixel_ok(conv):
            y = self._subpixel_upsample_conv(x4, conv)
        else:
            # nearest-exact at an integer scale copies values, so the input dtype gives diffusers' result
            up = F.interpolate(x4, scale_factor=2.0, mode="nearest-exact")
            y = add_conv_bias_(F.conv2d(up, conv.weight, None, conv.stride, conv.padding), conv.bias)
        return y.view(B, T, *y.shape[1:]).permute(0, 2, 1, 3, 4)

    def _subpixel_upsample_conv(self, x4: torch.Tensor, conv) -> torch.Tensor:
        """``conv(2x nearest upsample of x4)`` for a 3x3, padding-1 conv, without the upsampled copy:
        output pixel (2i + a, 2j + b) sees source rows i - 1 + a .. i + a and columns j - 1 + b .. j + b
        only, so it is a 2x2 conv over the source with summed 3x3 taps (``_subpixel_weights``), one
        of 4 for the 4 parities, as one conv with 4x the output channels (padding 1: [H + 1, W + 1]),
        then each parity's slice goes to its pixels with the bias added. 4 instead of 9 taps per
        output pixel; the summed weights are rounded once to the weight dtype, so the result differs
        from the upsample-then-conv path at that rounding (EMBER_VAE_SUBPIXEL=0 for that path)."""
        w = self.subpixel_weights.get(id(conv))
        if w is None or w[0] is not conv.weight or w[1] != conv.weight._version:
            w = self.subpixel_weights[id(conv)] = (conv.weight, conv.weight._version, _subpixel_weights(conv.weight))
        N, _, H, W = x4.shape
        Co = conv.out_channels
        out = F.conv2d(x4, w[2], None, 1, 1)  # [N, 4 Co, H + 1, W + 1], channels-last
        y = torch.empty((N, Co, 2 * H, 2 * W), dtype=x4.dtype, device=x4.device, memory_format=torch.channels_last)
        yv = y.permute(0, 2, 3, 1).view(N, H, 2, W, 2, Co)
        ov = out.permute(0, 2, 3, 1)
        for a in (0, 1):
            for b in (0, 1):
                src = ov[:, a:a + H, b:b + W, (2 * a + b) * Co:(2 * a + b + 1) * Co]
                if conv.bias is None:
                    yv[:, :, a, :, b].copy_(src)
                else:
                    torch.add(src, conv.bias, out=yv[:, :, a, :, b])
        return y

    def dup_up_add(self, du, x_in: torch.Tensor, x: torch.Tensor, first: bool) -> torch.Tensor:
        """``x + DupUp3D(x_in)`` (Wan2.2's parameter-free shortcut) as one gather added in place.

        DupUp3D repeats channels and unfolds them into (time, row, column) sub-positions: output
        channel o, sub-position (a, i, j) reads input channel ((((o*ft + a)*fs + i)*fs + j) // repeats).
        """
        ft, fs, rep, oc = du.factor_t, du.factor_s, du.repeats, du.out_channels
        B, _, t, h, w = x_in.shape
        drop = ft - 1 if first else 0  # diffusers drops the first ft - 1 frames of the first chunk
        if (_dispatch.use_triton(x) and x.permute(0, 2, 3, 4, 1).is_contiguous()
                and tuple(x.shape) == (B, oc, t * ft - drop, h * fs, w * fs)):
            # one pass (H200 profile: the gather alone was 35 ms and the add 29 ms per 9 Wan2.2 latent frames)
            _dispatch.prepare_triton()
            from ember.kernels import vae as vae_kernels
            vae_kernels.dup_up_add_(x, x_in, ft, fs, rep, drop)
            return x
        idx = (torch.arange(oc * ft * fs * fs, device=x.device) // rep).view(oc, ft, fs, fs)
        g = x_in.permute(0, 2, 3, 4, 1)[..., idx]  # [B, t, h, w, oc, ft, fs, fs]
        g = g.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(B, t * ft, h, fs, w, fs, oc)[:, drop:]
        xv = x.permute(0, 2, 3, 4, 1)
        if xv.is_contiguous():
            xv.view(g.shape).add_(g)
            return x
        return x + g.reshape(B, t * ft - drop, h * fs, w * fs, oc).permute(0, 4, 1, 2, 3)

    def up_block(self, ub, x: torch.Tensor, first: bool) -> torch.Tensor:
        x_in = x
        for r in ub.resnets:
            x = self.resblock(r, x)
        if hasattr(ub, "avg_shortcut"):  # Wan2.2 residual up block
            if ub.upsampler is not None:
                x = self.resample(ub.upsampler, x, first)
            if ub.avg_shortcut is not None:
                x = self.dup_up_add(ub.avg_shortcut, x_in, x, first)
        elif ub.upsamplers is not None:
            x = self.resample(ub.upsamplers[0], x, first)
        return x

    # ------------------------------------------------------------------ one latent frame
    @torch.no_grad()
    def step(self, z: torch.Tensor, first: bool) -> torch.Tensor:
        """Decode one post-quant latent frame [B, z, 1, h, w] into 1 (first) or 4 frames.

        Once the frame count is final (after the last temporal upsampler), the remaining up blocks
        and the output conv run ``frames_per_chunk`` frames at a time (None: all at once). Every
        layer there is per frame or a causal conv with its history, so the result is the same and
        the largest (full-resolution) activations hold fewer frames: ~25% less peak memory for
        ~25-35% more time on the H200 (``ember.vae._decode._frames_per_chunk``), so off by default.
        """
        d = self.dec
        x = self.causal(d.conv_in, z.contiguous(memory_format=CL3))
        x = self.mid_block(d.mid_block, x)
        for ub in d.up_blocks[:self.time_fixed_from]:
            x = self.up_block(ub, x, first)
        c = self.frames_per_chunk
        if not c or x.shape[2] <= c:
            return self._tail(x, first)
        return torch.cat([self._tail(x[:, :, s:s + c], first) for s in range(0, x.shape[2], c)], dim=2)

    def _tail(self, x: torch.Tensor, first: bool) -> torch.Tensor:
        """The up blocks after the last temporal upsampler and the output conv, on some frames."""
        d = self.dec
        for ub in d.up_blocks[self.time_fixed_from:]:
            x = self.up_block(ub, x, first)
        return self.causal(d.conv_out, x, norm=d.norm_out)


def _upsamples_time(ub) -> bool:
    """Whether a decoder up block changes the frame count (a 3-D upsampler or a temporal DupUp3D)."""
    ups = [getattr(ub, "upsampler", None)] + list(getattr(ub, "upsamplers", None) or [])
    if any(u is not None and getattr(u, "mode", None) == "upsample3d" for u in ups):
        return True
    du = getattr(ub, "avg_shortcut", None)
    return du is not None and getattr(du, "factor_t", 1) > 1


def to_channels_last(module: torch.nn.Module) -> None:
    """Give every conv weight the channels-last layout in place (same Parameter objects and values).

    cuDNN then runs NDHWC/NHWC kernels without converting weights on each call.
    """
    for m in module.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.nn.Parameter) and w.dim() in (4, 5):
            fmt = CL3 if w.dim() == 5 else torch.channels_last
            if not w.is_contiguous(memory_format=fmt):
                w.data = w.data.contiguous(memory_format=fmt)


def progress_bar(total: int, enabled: bool, label: str, unit: str):
    """A transient rich progress bar over ``total`` steps, or None (disabled, short, or no rich)."""
    if not enabled or total < 8:
        return None
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:
        return None
    bar = Progress(TextColumn(label), BarColumn(), TextColumn("{task.completed}/{task.total} " + unit),
                   TimeRemainingColumn(), transient=True)
    bar.start()
    bar.add_task(label, total=total)
    return bar
