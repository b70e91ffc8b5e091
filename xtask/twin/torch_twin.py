#!/usr/bin/env python3
"""The PyTorch twin of vram's reference models (`cargo xtask twin`).

    python3 xtask/twin/torch_twin.py DIR [--device auto|cuda|cpu] [--sdpa]
                                         [--recipe match|defaults|bf16-autocast|compile]

Reads the export vram wrote into DIR (twin.json, weights.f32, input.*, targets.u32), builds
the same model in PyTorch (same layers, same parameter shapes, vram's initial weights),
trains it for the same AdamW steps on the same batch and writes DIR/torch.json: the losses,
each step's time, the bytes autograd saved for backward and, on CUDA, the caching
allocator's peaks.

The models follow vram's layers (harness/src/models/mod.rs, accum/src/layers/): convolutions
with batch norm where vram's model has it and the activation after it (in place, as
torchvision's layers), pre-norm transformer blocks with separate q, k, v
projections (GPT-2 layout, biases), GELU with the tanh approximation, LayerNorm eps 1e-5,
and the attention vram used: twin.json's arch says `"attention": "fused"` (vram's
FlashAttention-style op, whose PyTorch counterpart is F.scaled_dot_product_attention) or
`"explicit"` (`softmax(q k^T / sqrt(dh) + causal mask) v`); --sdpa forces SDPA.

Recipes (--recipe): `match` (the default) runs vram's math (f32, TF32 off, vram's attention
form) so that the losses compare step for step, and writes DIR/torch.json. The others run
PyTorch as its users do and write DIR/torch-<recipe>.json, compared on memory and time only:
`defaults` (f32 with PyTorch's shipped TF32 switches, SDPA, AdamW's default foreach),
`bf16-autocast` (torch.autocast bf16, SDPA, AdamW(fused=True) on CUDA, channels_last for
CNNs) and `compile` (`bf16-autocast` plus torch.compile; its compiling steps are warm-up
steps, outside the timed steps and the peaks).

The Llama family (`--hf-config`) is written from Hugging Face's modeling_llama.py: RMSNorm
with the variance in f32, rotary embeddings by rotate_half, grouped-query attention by
repeat_kv, the SiLU-gated MLP; its attention is explicit (vram's Llama block is) unless SDPA.

Exit status: 0 on success, 2 for bad input (missing file, unknown model kind, a shape that
does not match), 3 when PyTorch is not installed, 1 when the run itself failed (out of
memory, ...). Needs only torch and the standard library.
"""

import argparse
import json
import math
import os
import statistics
import struct
import sys
import time

FORMAT = 1

# --recipe: what each sets. `match` is vram's math; the rest are PyTorch as users run it.
RECIPES = {
    "match": dict(tf32="off", sdpa=None, autocast=False, fused_adamw=False, channels_last=False,
                  compile=False, warmup=0),
    "defaults": dict(tf32="shipped", sdpa=True, autocast=False, fused_adamw=False,
                     channels_last=False, compile=False, warmup=0),
    "bf16-autocast": dict(tf32="shipped", sdpa=True, autocast=True, fused_adamw=True,
                          channels_last=True, compile=False, warmup=0),
    "compile": dict(tf32="shipped", sdpa=True, autocast=True, fused_adamw=True,
                    channels_last=True, compile=True, warmup=2),
}


class BadInput(Exception):
    """The export is missing, malformed or does not fit the model (exit status 2)."""


def fail(message, code=2):
    print(f"torch_twin: {message}", file=sys.stderr)
    sys.exit(code)


try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except Exception as e:  # ImportError, or a broken installation (missing CUDA libraries)
    print(f"skipped: PyTorch is not installed ({e})", file=sys.stderr)
    sys.exit(3)


# ---------------------------------------------------------------------------------------
# Layers, each as vram's (accum/src/layers/). `vram_params(prefix)` lists the parameters
# in vram's order (`Layer::params()`) under vram's names, for loading by position.
# ---------------------------------------------------------------------------------------


def linear_params(prefix, lin):
    out = [(f"{prefix}weight", lin.weight)]
    if lin.bias is not None:
        out.append((f"{prefix}bias", lin.bias))
    return out


def norm_params(prefix, ln):
    # vram's LayerNorm calls its scale and shift gamma and beta.
    return [(f"{prefix}gamma", ln.weight), (f"{prefix}beta", ln.bias)]


def activate(x, act):
    """vram's Act: "relu", "hardswish" or None (the identity), in place on `x` (a fresh
    output no one saved) as torchvision's layers do (`nn.ReLU(inplace=True)`,
    `Conv2dNormActivation`'s `inplace=True`), so that the peaks are those of the models people
    run."""
    if act == "relu":
        return F.relu(x, inplace=True)
    if act == "hardswish":
        return F.hardswish(x, inplace=True)
    return x


class ConvAct(nn.Module):
    """vram's Conv2d: a square k x k convolution, padding k // 2, no bias, optionally a
    BatchNorm2d (eps 1e-5, momentum 0.1, scale 1, shift 0), with a fused activation (ReLU
    (relu=True), hard swish (act="hardswish") or none)."""

    def __init__(self, c_in, c_out, k, stride=1, groups=1, relu=True, bn=False, act=None):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, groups=groups,
                              bias=False)
        self.bn = nn.BatchNorm2d(c_out, eps=1e-5, momentum=0.1) if bn else None
        self.act = act if act is not None else ("relu" if relu else None)

    def forward(self, x):
        x = self.conv(x)
        if self.bn is not None:
            x = self.bn(x)
        return activate(x, self.act)

    def vram_params(self, prefix):
        out = [(f"{prefix}weight", self.conv.weight)]
        if self.bn is not None:
            out += [(f"{prefix}bn.weight", self.bn.weight), (f"{prefix}bn.bias", self.bn.bias)]
        return out


class ClassifierHead(nn.Module):
    """Global average pool, an optional hidden linear layer (ReLU or hard swish), the
    classifier."""

    def __init__(self, channels, classes, hidden=None, act="relu"):
        super().__init__()
        self.hidden = nn.Linear(channels, hidden) if hidden is not None else None
        self.fc = nn.Linear(hidden if hidden is not None else channels, classes)
        self.act = act

    def forward(self, x):
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        if self.hidden is not None:
            x = activate(self.hidden(x), self.act)
        return self.fc(x)

    def vram_params(self, prefix):
        out = []
        if self.hidden is not None:
            out += linear_params(f"{prefix}hidden.", self.hidden)
        return out + linear_params(f"{prefix}fc.", self.fc)


class ResidualBlock(nn.Module):
    """ResNet's basic block without normalization: relu(x + conv2(relu(conv1(x))))."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = ConvAct(c, c, 3, relu=True)
        self.conv2 = ConvAct(c, c, 3, relu=False)

    def forward(self, x):
        return F.relu(x + self.conv2(self.conv1(x)), inplace=True)

    def vram_params(self, prefix):
        return self.conv1.vram_params(f"{prefix}conv1.") + self.conv2.vram_params(f"{prefix}conv2.")


class Bottleneck(nn.Module):
    """ResNet-50's bottleneck: relu(conv3(conv2(conv1(x))) + shortcut), each conv batch-normed
    when bn, conv2 strided, a 1x1 strided projection shortcut when the stride or the width
    changes."""

    def __init__(self, c_in, mid, c_out, stride, bn):
        super().__init__()
        self.conv1 = ConvAct(c_in, mid, 1, relu=True, bn=bn)
        self.conv2 = ConvAct(mid, mid, 3, stride=stride, relu=True, bn=bn)
        self.conv3 = ConvAct(mid, c_out, 1, relu=False, bn=bn)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = ConvAct(c_in, c_out, 1, stride=stride, relu=False, bn=bn)

    def forward(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        # torchvision's `out += identity; out = self.relu(out)`: both in place.
        out = self.conv3(self.conv2(self.conv1(x)))
        out += shortcut
        return F.relu(out, inplace=True)

    def vram_params(self, prefix):
        out = []
        for name in ("conv1", "conv2", "conv3"):
            out += getattr(self, name).vram_params(f"{prefix}{name}.")
        if self.downsample is not None:
            out += self.downsample.vram_params(f"{prefix}downsample.")
        return out


class SqueezeExcitation(nn.Module):
    """torchvision's SqueezeExcitation (MobileNetV3's): x * hardsigmoid(fc2(relu(fc1(pool(x))))).
    fc1 and fc2 are 1x1 convolutions on the pooled [n, c, 1, 1] in torchvision; here linear
    layers on [n, c], the same parameters in vram's [out, in] shape."""

    def __init__(self, channels, squeeze):
        super().__init__()
        self.fc1 = nn.Linear(channels, squeeze)
        self.fc2 = nn.Linear(squeeze, channels)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1).flatten(1)
        # torchvision's nn.ReLU() and nn.Hardsigmoid() here are not in place.
        s = F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s[:, :, None, None]

    def vram_params(self, prefix):
        return linear_params(f"{prefix}fc1.", self.fc1) + linear_params(f"{prefix}fc2.", self.fc2)


class InvertedResidual(nn.Module):
    """MobileNetV2/V3's inverted residual, each conv batch-normed when bn: a 1x1 expansion
    (skipped when the width stays), a k x k depthwise convolution (strided), both activated by
    act, squeeze-excitation to `squeeze` channels when given, a linear 1x1 projection, and
    the input added when the stride is 1 and the width stays."""

    def __init__(self, c_in, expanded, c_out, k, stride, bn, act="relu", squeeze=None):
        super().__init__()
        self.expand = (ConvAct(c_in, expanded, 1, bn=bn, act=act)
                       if expanded != c_in else None)
        self.depthwise = ConvAct(expanded, expanded, k, stride=stride, groups=expanded, bn=bn,
                                 act=act)
        self.se = SqueezeExcitation(expanded, squeeze) if squeeze is not None else None
        self.project = ConvAct(expanded, c_out, 1, relu=False, bn=bn)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        h = self.expand(x) if self.expand is not None else x
        h = self.depthwise(h)
        if self.se is not None:
            h = self.se(h)
        y = self.project(h)
        if self.residual:
            y += x  # torchvision's `result += input`
        return y

    def vram_params(self, prefix):
        out = []
        if self.expand is not None:
            out += self.expand.vram_params(f"{prefix}expand.")
        out += self.depthwise.vram_params(f"{prefix}depthwise.")
        if self.se is not None:
            out += self.se.vram_params(f"{prefix}se.")
        return out + self.project.vram_params(f"{prefix}project.")


class Attention(nn.Module):
    """Multi-head attention with separate q, k, v projections (with biases) and an output
    projection; explicit `softmax(q k^T * scale [+ causal mask]) v`, or SDPA."""

    def __init__(self, d, heads, dropout, sdpa, causal):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.c_proj = nn.Linear(d, d)
        self.heads = heads
        self.scale = 1.0 / math.sqrt(d // heads)
        self.p = dropout
        self.attn_drop = nn.Dropout(dropout)
        self.sdpa = sdpa
        self.causal = causal

    def forward(self, x, future=None):
        """`future`: the causal model's [seq, seq] mask, True where a key is after the query
        (explicit attention only)."""
        b, s, d = x.shape
        h = self.heads
        # [b, s, d] -> [b, heads, s, dh]
        q = self.q(x).view(b, s, h, d // h).transpose(1, 2)
        k = self.k(x).view(b, s, h, d // h).transpose(1, 2)
        v = self.v(x).view(b, s, h, d // h).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=self.causal)
        else:
            att = (q @ k.transpose(-2, -1)) * self.scale
            if self.causal:
                att = att.masked_fill(future[:s, :s], float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_drop(att)
            y = att @ v
        y = y.transpose(1, 2).reshape(b, s, d)
        return self.c_proj(y)

    def vram_params(self, prefix):
        out = []
        for name in ("q", "k", "v", "c_proj"):
            out += linear_params(f"{prefix}{name}.", getattr(self, name))
        return out


class Mlp(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.c_fc = nn.Linear(d, hidden)
        self.c_proj = nn.Linear(hidden, d)

    def forward(self, x):
        # vram's GELU is the tanh approximation.
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    def vram_params(self, prefix):
        return linear_params(f"{prefix}c_fc.", self.c_fc) + linear_params(f"{prefix}c_proj.", self.c_proj)


class Block(nn.Module):
    """vram's TransformerBlock: x2 = x + drop(attn(ln_1(x))), y = x2 + drop(mlp(ln_2(x2)))."""

    def __init__(self, d, heads, dropout, sdpa, causal, mlp_ratio=4):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.attn = Attention(d, heads, dropout, sdpa, causal)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        self.mlp = Mlp(d, mlp_ratio * d)
        self.drop1 = nn.Dropout(dropout)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x, future=None):
        x = x + self.drop1(self.attn(self.ln_1(x), future))
        return x + self.drop2(self.mlp(self.ln_2(x)))

    def vram_params(self, prefix):
        return (norm_params(f"{prefix}ln_1.", self.ln_1) + self.attn.vram_params(f"{prefix}attn.")
                + norm_params(f"{prefix}ln_2.", self.ln_2) + self.mlp.vram_params(f"{prefix}mlp."))


# ---------------------------------------------------------------------------------------
# Models, as vram's Model::new builds each Arch (harness/src/models/mod.rs).
# ---------------------------------------------------------------------------------------


class MLP(nn.Module):
    """Linear layers with ReLU; the last (`head`) without."""

    def __init__(self, dims, classes):
        super().__init__()
        widths = list(dims) + [classes]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < last:
                x = F.relu(x)
        return x

    def vram_params(self):
        out = []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            out += linear_params("head." if i == last else f"fc{i}.", layer)
        return out


class SmallCNN(nn.Module):
    """The ResNet-like (basic residual blocks) and MobileNet-like (depthwise 3x3 + pointwise
    1x1, both ReLU) CNNs: a 3x3 stem, stages (each after the first opens with a 3x3/2
    convolution doubling the width), global pool and a linear classifier."""

    def __init__(self, width, blocks, classes, depthwise):
        super().__init__()
        self.names = ["stem"]
        layers = [ConvAct(3, width, 3)]
        c = width
        for stage, n in enumerate(blocks):
            if stage > 0:
                layers.append(ConvAct(c, 2 * c, 3, stride=2))
                self.names.append(f"down{stage}")
                c *= 2
            for i in range(n):
                if depthwise:
                    layers.append(ConvAct(c, c, 3, groups=c))
                    self.names.append(f"s{stage}b{i}.dw")
                    layers.append(ConvAct(c, c, 1))
                    self.names.append(f"s{stage}b{i}.pw")
                else:
                    layers.append(ResidualBlock(c))
                    self.names.append(f"s{stage}b{i}")
        self.features = nn.Sequential(*layers)
        self.head = ClassifierHead(c, classes)

    def forward(self, x):
        return self.head(self.features(x))

    def vram_params(self):
        out = []
        for name, layer in zip(self.names, self.features):
            out += layer.vram_params(f"{name}.")
        return out + self.head.vram_params("head.")


class BottleneckResNet(nn.Module):
    """ResNet-50 (torchvision's layout, every conv batch-normed when bn): 7x7/2 stem (ReLU),
    3x3/2 max pool (padding 1), stages of bottlenecks (width 64 << stage, output 4x, the first
    block of stages after the first strided), global pool and a linear classifier."""

    def __init__(self, width, blocks, classes, bn):
        super().__init__()
        self.conv1 = ConvAct(3, width, 7, stride=2, bn=bn)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.names = []
        layers = []
        c_in = width
        for stage, n in enumerate(blocks):
            mid = width << stage
            for i in range(n):
                stride = 2 if i == 0 and stage > 0 else 1
                layers.append(Bottleneck(c_in, mid, 4 * mid, stride, bn))
                self.names.append(f"layer{stage + 1}.{i}")
                c_in = 4 * mid
        self.layers = nn.Sequential(*layers)
        self.head = ClassifierHead(c_in, classes)

    def forward(self, x):
        return self.head(self.layers(self.maxpool(self.conv1(x))))

    def vram_params(self):
        out = self.conv1.vram_params("conv1.")
        for name, layer in zip(self.names, self.layers):
            out += layer.vram_params(f"{name}.")
        return out + self.head.vram_params("head.")


# torchvision's _mobilenet_v3_conf for MobileNetV3-Large: input channels, kernel, expanded
# channels, output channels, squeeze-excitation, activation ("RE" ReLU, "HS" hard swish),
# stride.
MOBILENETV3_LARGE = [
    (16, 3, 16, 16, False, "RE", 1),
    (16, 3, 64, 24, False, "RE", 2),
    (24, 3, 72, 24, False, "RE", 1),
    (24, 5, 72, 40, True, "RE", 2),
    (40, 5, 120, 40, True, "RE", 1),
    (40, 5, 120, 40, True, "RE", 1),
    (40, 3, 240, 80, False, "HS", 2),
    (80, 3, 200, 80, False, "HS", 1),
    (80, 3, 184, 80, False, "HS", 1),
    (80, 3, 184, 80, False, "HS", 1),
    (80, 3, 480, 112, True, "HS", 1),
    (112, 3, 672, 112, True, "HS", 1),
    (112, 5, 672, 160, True, "HS", 2),
    (160, 5, 960, 160, True, "HS", 1),
    (160, 5, 960, 160, True, "HS", 1),
]


def f32(x):
    """`x` rounded to an f32, as vram's arithmetic on f32 values does."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def make_divisible(c, mult):
    """vram's make_divisible (torchvision's _make_divisible(c * mult, 8)) in f32."""
    v = f32(f32(float(c)) * f32(mult))
    r = max(int(f32(v + 4.0)) // 8 * 8, 8)
    if r < f32(0.9 * v):
        r += 8
    return r


class MobileNetV3(nn.Module):
    """torchvision's MobileNetV3-Large without the classifier's dropout: a 3x3/2 stem (hard
    swish), the 15 inverted residuals (ReLU or hard swish, squeeze-excitation to
    make_divisible(expanded // 4) where the table says), a 1x1 convolution to 6x the last
    width (hard swish), global pool, a hard-swish hidden layer of make_divisible(1280) units
    and the classifier; every conv batch-normed when bn."""

    def __init__(self, width_mult, classes, bn):
        super().__init__()
        ch = lambda c: make_divisible(c, width_mult)  # noqa: E731
        first = ch(MOBILENETV3_LARGE[0][0])
        self.stem = ConvAct(3, first, 3, stride=2, bn=bn, act="hardswish")
        blocks = []
        last = first
        for c_in, k, e, c_out, se, act, stride in MOBILENETV3_LARGE:
            e = ch(e)
            squeeze = make_divisible(e // 4, 1.0) if se else None
            act = "hardswish" if act == "HS" else "relu"
            blocks.append(InvertedResidual(ch(c_in), e, ch(c_out), k, stride, bn, act, squeeze))
            last = ch(c_out)
        self.features = nn.Sequential(*blocks)
        self.lastconv = ConvAct(last, 6 * last, 1, bn=bn, act="hardswish")
        self.head = ClassifierHead(6 * last, classes, hidden=ch(1280), act="hardswish")

    def forward(self, x):
        return self.head(self.lastconv(self.features(self.stem(x))))

    def vram_params(self):
        out = self.stem.vram_params("stem.")
        for i, block in enumerate(self.features):
            out += block.vram_params(f"features.{i + 1}.")
        return out + self.lastconv.vram_params("lastconv.") + self.head.vram_params("head.")


class GPT(nn.Module):
    """GPT-2's layout: token + position embeddings (no embedding dropout, as vram), causal
    pre-norm blocks, a final LayerNorm and the LM head (tied: logits = h wte^T)."""

    def __init__(self, vocab, d, layers, heads, seq, dropout, tied, sdpa):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(
            Block(d, heads, dropout, sdpa, causal=True) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)
        self.lm_head = None if tied else nn.Linear(d, vocab, bias=False)
        # Where a query may not look (keys after it): one mask for every block (SDPA needs
        # none: is_causal).
        future = None if sdpa else torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)
        self.register_buffer("future", future, persistent=False)

    def forward(self, ids):
        b, s = ids.shape
        pos = torch.arange(s, device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x, self.future)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight) if self.lm_head is None else self.lm_head(x)
        return logits.view(b * s, -1)

    def vram_params(self):
        out = [("wte", self.wte.weight), ("wpe", self.wpe.weight)]
        for i, block in enumerate(self.blocks):
            out += block.vram_params(f"h{i}.")
        out += norm_params("ln_f.", self.ln_f)
        if self.lm_head is not None:
            out += linear_params("lm_head.", self.lm_head)
        return out


# ---------------------------------------------------------------------------------------
# The Llama family (Llama, Mistral, Qwen2, TinyLlama), written from Hugging Face's
# modeling_llama.py (LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half, apply_rotary_pos_emb,
# repeat_kv, eager_attention_forward, LlamaMLP, LlamaDecoderLayer) and modeling_rope_utils.py
# (the default, linear and llama3 inverse frequencies), with vram's parameter names
# (accum/src/layers/llama.rs, the Arch::Llama branch of harness/src/models/mod.rs).
# ---------------------------------------------------------------------------------------


class LlamaRMSNorm(nn.Module):
    """HF's LlamaRMSNorm: the variance in f32, x * rsqrt(mean(x^2) + eps), cast back to the
    input's dtype, then times the weight."""

    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim, theta, scaling):
    """HF's _compute_default_rope_parameters, _compute_linear_scaling_rope_parameters and
    _compute_llama3_parameters: the head_dim / 2 inverse frequencies."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # wavelen < high_freq_wavelen: kept; wavelen > low_freq_wavelen: divided by factor.
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        # Between the two: interpolated smoothly.
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    raise BadInput(f"twin.json arch: rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def rotate_half(x):
    """HF's rotate_half: the first half of the features against the second."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """HF's apply_rotary_pos_emb on [b, heads, s, dh] with cos, sin of [s, dh]."""
    cos = cos.unsqueeze(0).unsqueeze(0)
    sin = sin.unsqueeze(0).unsqueeze(0)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    """HF's repeat_kv: [b, kv_heads, s, dh] -> [b, kv_heads * n_rep, s, dh]."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaAttention(nn.Module):
    """HF's LlamaAttention with the eager attention (softmax in f32), or SDPA."""

    def __init__(self, d, heads, kv_heads, head_dim, qkv_bias, sdpa):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(d, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        self.scaling = head_dim ** -0.5
        self.sdpa = sdpa

    def forward(self, x, cos, sin, future):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        n_rep = self.heads // self.kv_heads
        k = repeat_kv(k, n_rep)
        v = repeat_kv(v, n_rep)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = torch.matmul(q, k.transpose(2, 3)) * self.scaling
            att = att.masked_fill(future[:s, :s], float("-inf"))
            att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
            y = torch.matmul(att, v)
        y = y.transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(y)

    def vram_params(self, prefix):
        out = []
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out += linear_params(f"{prefix}{name}.", getattr(self, name))
        return out


class LlamaMLP(nn.Module):
    """HF's LlamaMLP: down_proj(silu(gate_proj(x)) * up_proj(x)), no biases."""

    def __init__(self, d, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def vram_params(self, prefix):
        out = []
        for name in ("gate_proj", "up_proj", "down_proj"):
            out += linear_params(f"{prefix}{name}.", getattr(self, name))
        return out


class LlamaDecoderLayer(nn.Module):
    """HF's LlamaDecoderLayer: x2 = x + attn(norm(x)), y = x2 + mlp(norm(x2))."""

    def __init__(self, d, heads, kv_heads, head_dim, hidden, eps, qkv_bias, sdpa):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(d, eps)
        self.self_attn = LlamaAttention(d, heads, kv_heads, head_dim, qkv_bias, sdpa)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps)
        self.mlp = LlamaMLP(d, hidden)

    def forward(self, x, cos, sin, future):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, future)
        return x + self.mlp(self.post_attention_layernorm(x))

    def vram_params(self, prefix):
        return ([(f"{prefix}input_layernorm.weight", self.input_layernorm.weight)]
                + self.self_attn.vram_params(f"{prefix}self_attn.")
                + [(f"{prefix}post_attention_layernorm.weight", self.post_attention_layernorm.weight)]
                + self.mlp.vram_params(f"{prefix}mlp."))


class Llama(nn.Module):
    """HF's LlamaForCausalLM: token embedding, decoder layers sharing one (cos, sin) table
    (HF's LlamaRotaryEmbedding: emb = cat(freqs, freqs), in f32, cast to the activations'
    dtype), a final RMS norm and the LM head (tied: logits = h embed_tokens^T)."""

    def __init__(self, vocab, d, layers, heads, kv_heads, head_dim, hidden, seq, eps, theta,
                 scaling, qkv_bias, tied, sdpa):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(d, heads, kv_heads, head_dim, hidden, eps, qkv_bias, sdpa)
            for _ in range(layers))
        self.norm = LlamaRMSNorm(d, eps)
        self.lm_head = None if tied else nn.Linear(d, vocab, bias=False)
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(seq, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        future = None if sdpa else torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)
        self.register_buffer("future", future, persistent=False)

    def forward(self, ids):
        b, s = ids.shape
        x = self.embed_tokens(ids)
        cos = self.cos[:s].to(x.dtype)
        sin = self.sin[:s].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, self.future)
        x = self.norm(x)
        logits = F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        return logits.view(b * s, -1)

    def vram_params(self):
        out = [("embed_tokens.weight", self.embed_tokens.weight)]
        for i, layer in enumerate(self.layers):
            out += layer.vram_params(f"layers.{i}.")
        out.append(("norm.weight", self.norm.weight))
        if self.lm_head is not None:
            out += linear_params("lm_head.", self.lm_head)
        return out


class PatchEmbed(nn.Module):
    """ViT's patches: a patch x patch convolution of stride patch (with bias), the tokens as
    rows, plus a learned position per token (no class token)."""

    def __init__(self, channels, d, patch, side):
        super().__init__()
        self.proj = nn.Conv2d(channels, d, patch, stride=patch, bias=True)
        tokens = (side // patch) ** 2
        self.pos_embed = nn.Parameter(torch.zeros(tokens, d))

    def forward(self, x):
        x = self.proj(x).flatten(2).transpose(1, 2)  # [b, tokens, d]
        return x + self.pos_embed

    def vram_params(self, prefix):
        return [(f"{prefix}proj.weight", self.proj.weight), (f"{prefix}proj.bias", self.proj.bias),
                (f"{prefix}pos_embed", self.pos_embed)]


class ViT(nn.Module):
    """ViT with mean pooling: patches, non-causal pre-norm blocks, a final LayerNorm, the
    mean over tokens and a linear classifier."""

    def __init__(self, side, patch, d, layers, heads, classes, dropout, sdpa):
        super().__init__()
        self.patch_embed = PatchEmbed(3, d, patch, side)
        self.blocks = nn.ModuleList(
            Block(d, heads, dropout, sdpa, causal=False) for _ in range(layers))
        self.norm = nn.LayerNorm(d, eps=1e-5)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch_embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))

    def vram_params(self):
        out = self.patch_embed.vram_params("patch_embed.")
        for i, block in enumerate(self.blocks):
            out += block.vram_params(f"blocks.{i}.")
        return out + norm_params("norm.", self.norm) + linear_params("head.", self.head)


# ---------------------------------------------------------------------------------------
# Reading the export.
# ---------------------------------------------------------------------------------------


def field(obj, key, kind, where):
    """obj[key], checked to be of `kind` (a type or a tuple of types)."""
    if not isinstance(obj, dict) or key not in obj:
        raise BadInput(f"{where}: missing `{key}`")
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise BadInput(f"{where}: `{key}` is {value!r}, not a {names}")
    return value


def positive_int(obj, key, where):
    v = field(obj, key, int, where)
    if v <= 0:
        raise BadInput(f"{where}: `{key}` must be positive, got {v}")
    return v


def int_list(obj, key, where):
    v = field(obj, key, list, where)
    if not v or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v):
        raise BadInput(f"{where}: `{key}` must be a non-empty list of positive integers, got {v!r}")
    return v


def dropout_of(arch):
    """The arch's dropout (GPT, ViT), 0 when absent."""
    p = arch.get("dropout", 0.0)
    if p is None:
        return 0.0
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise BadInput(f"twin.json arch: dropout {p!r} is not a number in [0, 1)")
    return float(p)


def transformer_sizes(arch, where):
    """GPT's and ViT's width, block count and heads; the width must be whole heads."""
    d = positive_int(arch, "d", where)
    layers = positive_int(arch, "layers", where)
    heads = positive_int(arch, "heads", where)
    if d % heads:
        raise BadInput(f"{where}: width {d} is not a multiple of the {heads} heads")
    return d, layers, heads


def build_model(arch, sdpa):
    """The PyTorch model for twin.json's `arch`, the number of its classes (logit columns)
    and what its input must look like: ("tokens", seq) or ("dense", shape without batch)."""
    where = "twin.json arch"
    kind = field(arch, "kind", str, where)
    if kind == "mlp":
        dims = int_list(arch, "dims", where)
        classes = positive_int(arch, "classes", where)
        return MLP(dims, classes), classes, ("dense", [dims[0]])
    if kind in ("resnet", "mobilenet"):
        width = positive_int(arch, "width", where)
        blocks = int_list(arch, "blocks", where)
        classes = positive_int(arch, "classes", where)
        return SmallCNN(width, blocks, classes, kind == "mobilenet"), classes, ("dense", [3, None, None])
    if kind == "gpt":
        vocab = positive_int(arch, "vocab", where)
        d, layers, heads = transformer_sizes(arch, where)
        seq = positive_int(arch, "seq", where)
        tied = arch.get("tied", False)
        if not isinstance(tied, bool):
            raise BadInput(f"{where}: `tied` is {tied!r}, not a boolean")
        model = GPT(vocab, d, layers, heads, seq, dropout_of(arch), tied, sdpa)
        return model, vocab, ("tokens", seq)
    if kind == "bottleneck_resnet":
        side = positive_int(arch, "side", where)
        width = positive_int(arch, "width", where)
        blocks = int_list(arch, "blocks", where)
        classes = positive_int(arch, "classes", where)
        bn = field(arch, "batch_norm", bool, where)
        return BottleneckResNet(width, blocks, classes, bn), classes, ("dense", [3, side, side])
    if kind == "mobilenetv3":
        side = positive_int(arch, "side", where)
        mult = field(arch, "width_mult", (int, float), where)
        if not (math.isfinite(mult) and mult > 0):
            raise BadInput(f"{where}: width_mult {mult} is not finite and > 0")
        classes = positive_int(arch, "classes", where)
        bn = field(arch, "batch_norm", bool, where)
        return MobileNetV3(float(mult), classes, bn), classes, ("dense", [3, side, side])
    if kind == "vit":
        side = positive_int(arch, "side", where)
        patch = positive_int(arch, "patch", where)
        d, layers, heads = transformer_sizes(arch, where)
        classes = positive_int(arch, "classes", where)
        if side % patch:
            raise BadInput(f"{where}: side {side} is not whole {patch} px patches")
        model = ViT(side, patch, d, layers, heads, classes, dropout_of(arch), sdpa)
        return model, classes, ("dense", [3, side, side])
    if kind == "llama":
        vocab = positive_int(arch, "vocab", where)
        d = positive_int(arch, "d", where)
        layers = positive_int(arch, "layers", where)
        heads = positive_int(arch, "heads", where)
        kv_heads = positive_int(arch, "kv_heads", where)
        head_dim = positive_int(arch, "head_dim", where)
        hidden = positive_int(arch, "hidden", where)
        seq = positive_int(arch, "seq", where)
        if heads % kv_heads:
            raise BadInput(f"{where}: {heads} heads are not whole groups of {kv_heads} key/value heads")
        if head_dim % 2:
            raise BadInput(f"{where}: head_dim {head_dim} is odd")
        eps = float(field(arch, "eps", (int, float), where))
        theta = float(field(arch, "rope_theta", (int, float), where))
        scaling = arch.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise BadInput(f"{where}: `rope_scaling` is {scaling!r}, not an object or null")
        qkv_bias = field(arch, "qkv_bias", bool, where)
        tied = field(arch, "tied", bool, where)
        model = Llama(vocab, d, layers, heads, kv_heads, head_dim, hidden, seq, eps, theta,
                      scaling, qkv_bias, tied, sdpa)
        return model, vocab, ("tokens", seq)
    raise BadInput(
        f"{where}: unknown kind `{kind}` (known: mlp, resnet, mobilenet, gpt, "
        "bottleneck_resnet, mobilenetv3, vit, llama)")


def read_binary(directory, name, dtype, count, what):
    """`count` little-endian 4-byte values of `dtype` from DIR/name, as a CPU tensor."""
    if not isinstance(name, str) or not name or os.path.basename(name) != name:
        raise BadInput(f"twin.json: the {what} file name {name!r} is not a plain file name")
    path = os.path.join(directory, name)
    try:
        size = os.path.getsize(path)
        if size != 4 * count:
            raise BadInput(
                f"{path}: {size} bytes, but the {what} needs {count} values ({4 * count} bytes)")
        buf = bytearray(size)
        with open(path, "rb") as f:
            got = f.readinto(buf)
        if got != size:
            raise BadInput(f"{path}: read {got} of {size} bytes")
    except OSError as e:
        raise BadInput(f"cannot read the {what}: {e}") from None
    if count == 0:
        return torch.zeros(0, dtype=dtype)
    t = torch.frombuffer(buf, dtype=dtype)
    if sys.byteorder != "little":
        t = t.view(torch.uint8).view(-1, 4).flip(1).contiguous().view(dtype).view(-1)
    return t


def shape_list(obj, key, where):
    v = field(obj, key, list, where)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise BadInput(f"{where}: `{key}` {v!r} is not a list of sizes")
    return v


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def load_weights(directory, spec, model):
    """Copies vram's weights into the model's parameters, the i-th of vram's list into the
    i-th of the model's `vram_params()`; checks counts, shapes and the file's length. Returns
    notes (names that differ while the shapes agree)."""
    exported = field(spec, "params", list, "twin.json")
    ours = model.vram_params()
    notes = []
    if len(exported) != len(ours):
        k = next((i for i, (e, o) in enumerate(zip(exported, ours))
                  if list(e.get("shape", [])) != list(o[1].shape)), min(len(exported), len(ours)))
        ctx = ""
        if k < len(exported) and k < len(ours):
            ctx = (f"; the first difference is at #{k}: vram {exported[k].get('name')!r} "
                   f"{exported[k].get('shape')} vs PyTorch {ours[k][0]!r} {list(ours[k][1].shape)}")
        elif k < len(exported):
            ctx = f"; vram's #{k} {exported[k].get('name')!r} has no PyTorch counterpart"
        else:
            ctx = f"; PyTorch's #{k} {ours[k][0]!r} has no vram counterpart"
        raise BadInput(f"the export has {len(exported)} parameters, the PyTorch model "
                       f"{len(ours)}{ctx}")
    # Checks before reading the weights.
    total = 0
    for i, (entry, (name, param)) in enumerate(zip(exported, ours)):
        where = f"twin.json params[{i}]"
        vname = field(entry, "name", str, where)
        shape = shape_list(entry, "shape", where)
        offset = field(entry, "offset", int, where)
        if shape != list(param.shape):
            raise BadInput(f"parameter #{i}: vram's {vname!r} is {shape}, the PyTorch model's "
                           f"{name!r} is {list(param.shape)}")
        if offset < 0:
            raise BadInput(f"parameter #{i} {vname!r}: negative offset {offset}")
        total = max(total, offset + numel(shape))
        if vname != name:
            notes.append(f"parameter #{i}: vram calls it {vname!r}, the twin {name!r} (shapes agree)")
    weights_file = field(spec, "weights", str, "twin.json")
    path = os.path.join(directory, weights_file)
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise BadInput(f"cannot read the weights: {e}") from None
    if size % 4 or size // 4 < total:
        raise BadInput(f"{path}: {size} bytes, but the parameters need {total} f32 values")
    weights = read_binary(directory, weights_file, torch.float32, size // 4, "weights")
    with torch.no_grad():
        for entry, (_, param) in zip(exported, ours):
            n = numel(entry["shape"])
            src = weights[entry["offset"]:entry["offset"] + n].view(entry["shape"])
            param.copy_(src)
    return notes


def load_batch(directory, spec, classes, expect):
    """The input and targets as CPU tensors, checked against the model."""
    inp = field(spec, "input", dict, "twin.json")
    kind = field(inp, "kind", str, "twin.json input")
    shape = shape_list(inp, "shape", "twin.json input")
    if not shape or shape[0] == 0:
        raise BadInput(f"twin.json input: shape {shape} has no samples")
    want_kind = expect[0]
    if kind != want_kind:
        raise BadInput(f"twin.json input: kind `{kind}`, but the model takes `{want_kind}`")
    if kind == "tokens":
        seq = expect[1]
        if len(shape) != 2 or shape[1] != seq:
            raise BadInput(f"twin.json input: token shape {shape}, the model takes [b, {seq}]")
        x = read_binary(directory, field(inp, "file", str, "twin.json input"), torch.int32,
                        numel(shape), "input tokens")
        x = (x.to(torch.int64) & 0xFFFFFFFF).view(shape)
        if x.numel() and int(x.max()) >= classes:
            raise BadInput(f"input token {int(x.max())} is outside the vocabulary of {classes}")
        n_targets = shape[0] * shape[1]
    elif kind == "dense":
        rest = expect[1]
        if len(shape) != 1 + len(rest) or any(
                w is not None and w != s for w, s in zip(rest, shape[1:])):
            want = "[b, " + ", ".join("*" if w is None else str(w) for w in rest) + "]"
            raise BadInput(f"twin.json input: shape {shape}, the model takes {want}")
        x = read_binary(directory, field(inp, "file", str, "twin.json input"), torch.float32,
                        numel(shape), "input").view(shape)
        n_targets = shape[0]
    else:
        raise BadInput(f"twin.json input: unknown kind `{kind}` (known: tokens, dense)")
    tgt = field(spec, "targets", dict, "twin.json")
    tshape = shape_list(tgt, "shape", "twin.json targets")
    if numel(tshape) != n_targets:
        raise BadInput(f"twin.json targets: shape {tshape}, but the input has {n_targets} "
                       "predictions to score")
    y = read_binary(directory, field(tgt, "file", str, "twin.json targets"), torch.int32,
                    n_targets, "targets")
    y = y.to(torch.int64) & 0xFFFFFFFF
    if y.numel() and int(y.max()) >= classes:
        raise BadInput(f"target {int(y.max())} is not below the {classes} classes")
    return x.clone(), y


def optimizer_settings(spec):
    opt = field(spec, "optimizer", dict, "twin.json")
    kind = field(opt, "kind", str, "twin.json optimizer")
    if kind != "adamw":
        raise BadInput(f"twin.json optimizer: unknown kind `{kind}` (known: adamw)")
    where = "twin.json optimizer"
    lr = float(field(opt, "lr", (int, float), where))
    betas = field(opt, "betas", list, where)
    if len(betas) != 2 or not all(isinstance(b, (int, float)) for b in betas):
        raise BadInput(f"{where}: betas {betas!r} is not two numbers")
    eps = float(field(opt, "eps", (int, float), where))
    wd = float(field(opt, "weight_decay", (int, float), where))
    return dict(lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps, weight_decay=wd)


# ---------------------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------------------


def pick_device(choice):
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise BadInput("--device cuda, but torch.cuda.is_available() is False")
        return torch.device("cuda")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def loss_difference(ours, theirs):
    """The largest |a - b| / max(1, |b|) over the steps (vram's TWIN.md measure)."""
    if not theirs or len(theirs) != len(ours):
        return None
    return max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(theirs, ours))


def saved_for_backward(model, x, y):
    """Bytes autograd keeps for backward once forward and loss have run: the distinct storages
    the graph saves (`saved_tensors_hooks` sees every one), their sizes as requested (before
    the caching allocator's rounding), without the parameters, the buffers (there before the
    step) and the targets. The input counts when a layer saves it, as on vram's side. Measured on one
    extra forward after the steps (no backward); the buffers it moves are put back."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    skip = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    skip.add(y.untyped_storage().data_ptr())
    kept = []

    def pack(t):
        kept.append(t)  # held as the graph would hold it, so no storage is reused meanwhile
        return None

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
        loss = F.cross_entropy(model(x), y)
    sizes = {}
    for t in kept:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr not in skip and nbytes > 0:
            sizes[ptr] = max(sizes.get(ptr, 0), nbytes)
    del loss, kept
    with torch.no_grad():
        for b, saved in buffers:
            b.copy_(saved)
    return sum(sizes.values())


TRACKED_STEPS = 2


def train_step(model, opt, x, y, autocast=None):
    """One step as the twin measures it: forward, cross-entropy, backward, AdamW step,
    gradients set to None; returns the loss. No reference to the logits is kept: autograd
    alone decides how long they live (cross-entropy's backward needs its log-softmax, not
    the logits). `autocast`: the device type to run forward and loss under
    torch.autocast(dtype=torch.bfloat16), as users write it (backward outside)."""
    if autocast is not None:
        with torch.autocast(device_type=autocast, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
    else:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    value = loss.item()
    del loss
    return value


def tracked_peak(model, opt, x, y):
    """PyTorch's peak over TRACKED_STEPS more training steps as MemTracker
    (torch.distributed._tools.mem_tracker) sees it: every storage from its creation to its
    release at the dispatcher (parameters, buffers, gradients, optimizer state, activations,
    temporaries, the batch), what the CPU allocator is asked for; workspaces a kernel
    allocates inside itself are not seen. On CUDA the tracker rounds each storage up to 512
    bytes while vram's figure is unrounded, so only host runs call this. None when this
    build has no torch.distributed."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except Exception:  # noqa: BLE001 (a build without torch.distributed)
        return None
    tracker = MemTracker()
    tracker.track_external(model, opt, x, y)
    peak = None
    for _ in range(TRACKED_STEPS):
        with tracker:  # one step per entry: the tracker refuses a module called twice
            train_step(model, opt, x, y)
        total = tracker.get_tracker_snapshot("peak").get(x.device, {}).get("Total")
        if total is not None:
            peak = total if peak is None else max(peak, total)
        tracker.reset_mod_stats()
    return peak


PROFILE_ROWS = 25


def profiled_step(model, opt, x, y, cuda):
    """One more training step under torch.profiler: the PROFILE_ROWS entries with the most
    time (on the GPU its kernels by device time, on the CPU the aten ops by self CPU time), as
    {"name", "calls", "ms"}, their total, and the step's wall time (profiling included)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        train_step(model, opt, x, y)
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3

    if cuda:
        # The kernels (device events), by their device time: they do not overlap, and they
        # add up to the time the GPU was busy. (An aten op's self device time would count
        # its kernels a second time.)
        events = [e for e in prof.key_averages()
                  if str(getattr(e, "device_type", "")).endswith("CUDA")]

        def self_us(e):
            return getattr(e, "self_device_time_total", None) or e.self_cuda_time_total
    else:
        events = list(prof.key_averages())

        def self_us(e):
            return e.self_cpu_time_total

    events.sort(key=self_us, reverse=True)
    ops = [{"name": e.key[:100], "calls": int(e.count), "ms": self_us(e) / 1e3}
           for e in events if self_us(e) > 0][:PROFILE_ROWS]
    total = sum(self_us(e) for e in events) / 1e3
    return {"step_ms": wall, "total_ms": total,
            "time": "CUDA kernel time" if cuda else "self CPU time", "ops": ops}


def run(args):
    directory = args.dir
    path = os.path.join(directory, "twin.json")
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except OSError as e:
        raise BadInput(f"cannot read the export: {e}") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"{path}: not JSON ({e})") from None
    if not isinstance(spec, dict):
        raise BadInput(f"{path}: not a JSON object")
    fmt = spec.get("format")
    if fmt != FORMAT:
        raise BadInput(f"{path}: format {fmt!r}, this script reads format {FORMAT}")
    steps = positive_int(spec, "steps", "twin.json")
    arch = field(spec, "arch", dict, "twin.json")
    opt_cfg = optimizer_settings(spec)
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    notes = []

    recipe = RECIPES[args.recipe]
    notes.append(f"recipe: {args.recipe}")
    if cuda:
        if recipe["tf32"] == "off":
            # vram computes f32 in f32: no TF32 in matmuls or convolutions.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            notes.append("TF32 off (torch.backends.cuda.matmul.allow_tf32 = False, "
                         "torch.backends.cudnn.allow_tf32 = False): vram computes f32 in f32")
        else:
            notes.append("TF32 as PyTorch ships it: torch.backends.cuda.matmul.allow_tf32 = "
                         f"{torch.backends.cuda.matmul.allow_tf32}, "
                         f"torch.backends.cudnn.allow_tf32 = {torch.backends.cudnn.allow_tf32}")
        notes.append(f"cuDNN {torch.backends.cudnn.version()}, benchmark "
                     f"{torch.backends.cudnn.benchmark}")
    else:
        notes.append(f"CPU, {torch.get_num_threads()} threads")

    # vram's attention form (twin.json's arch), unless --sdpa or the recipe says SDPA.
    attention = arch.get("attention", "explicit")
    if attention not in ("fused", "explicit"):
        raise BadInput(f"twin.json arch: attention `{attention}` (known: fused, explicit)")
    sdpa = (args.sdpa or attention == "fused") if recipe["sdpa"] is None else recipe["sdpa"]

    # The model on the CPU (PyTorch's default init, then overwritten by vram's weights).
    model, classes, expect = build_model(arch, sdpa)
    notes += load_weights(directory, spec, model)
    x, y = load_batch(directory, spec, classes, expect)
    p = dropout_of(arch)
    if arch.get("kind") in ("gpt", "vit", "llama"):
        notes.append(f"vram's attention: {attention}; here: "
                     + ("F.scaled_dot_product_attention" if sdpa else
                        "explicit softmax(q k^T * scale + mask) @ v (vram's explicit math)"))
    if p > 0:
        notes.append(f"dropout {p:g}: PyTorch draws other masks than vram, so the losses differ")
    if arch.get("kind") == "gpt":
        if not sdpa:
            seq = arch.get("seq")
            notes.append(f"causal mask: one [{seq}, {seq}] bool buffer shared by the blocks "
                         "(in weights_bytes), applied with masked_fill(-inf)")
        if arch.get("tied"):
            notes.append("tied LM head: logits = h @ wte.weight^T (wte counted once)")

    param_count = sum(q.numel() for q in model.parameters())  # a shared tensor counted once
    model.to(device)
    x = x.to(device)
    y = y.to(device)
    if recipe["channels_last"] and x.dim() == 4:
        model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
        notes.append("channels_last: model and input (torch.channels_last)")
    model.train()
    fused = recipe["fused_adamw"] and cuda
    opt = torch.optim.AdamW(model.parameters(), **opt_cfg, **({"fused": True} if fused else {}))
    notes.append("AdamW(fused=True): one multi-tensor kernel over every parameter" if fused else
                 "AdamW with foreach=None, PyTorch's default choice (the foreach "
                 "implementation when every parameter is on CUDA); its state is created at "
                 "the first step")
    autocast = device.type if recipe["autocast"] else None
    if autocast:
        notes.append("torch.autocast(bfloat16) around forward and loss; backward outside")
    step_model = model
    if recipe["compile"]:
        step_model = torch.compile(model)
        notes.append(f"torch.compile (default mode); {recipe['warmup']} warm-up steps "
                     "(compilation) before the timed steps, outside the peaks")
    notes.append("step = forward, cross-entropy, backward, opt.step(), "
                 "opt.zero_grad(set_to_none=True), loss.item(), timed between two "
                 "device synchronizations")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    warmup_losses = [train_step(step_model, opt, x, y, autocast) for _ in range(recipe["warmup"])]
    weights_bytes = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        weights_bytes = torch.cuda.memory_allocated()

    losses, step_ms = [], []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        value = train_step(step_model, opt, x, y, autocast)
        sync()
        step_ms.append((time.perf_counter() - start) * 1e3)
        losses.append(value)

    peak_allocated = torch.cuda.max_memory_allocated() if cuda else None
    peak_reserved = torch.cuda.max_memory_reserved() if cuda else None
    match = args.recipe == "match"
    # The tensor-level figures compare vram's math with PyTorch's: the matching recipe only.
    tracked = None if cuda or not match else tracked_peak(model, opt, x, y)
    if tracked is not None:
        notes.append(f"tracked peak: MemTracker over {TRACKED_STEPS} more steps (storages at the "
                     "dispatcher, unrounded; kernels' internal workspaces unseen), AdamW's "
                     "for-loop implementation (PyTorch's default on the CPU)")
    profile = None
    if spec.get("profile") is True and match:
        profile = profiled_step(model, opt, x, y, cuda)
        notes.append(f"profile: one more step under torch.profiler, ops by {profile['time']}")
    saved = None
    if match:
        saved = saved_for_backward(model, x, y)
        notes.append("saved for backward: the distinct storages autograd saved in one more "
                     "forward after the steps (saved_tensors_hooks), their requested bytes, "
                     "without parameters, buffers and targets")
    tf32 = bool(cuda and torch.backends.cuda.matmul.allow_tf32)
    result = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "backend": "cuda" if cuda else "cpu",
        "recipe": args.recipe,
        "param_count": param_count,
        "losses": losses,
        "warmup_losses": warmup_losses,
        "step_ms": step_ms,
        "peak_allocated": peak_allocated,
        "peak_reserved": peak_reserved,
        "weights_bytes": weights_bytes,
        "saved_for_backward": saved,
        "tracked_peak": tracked,
        "tf32": tf32,
        "cudnn_tf32": bool(cuda and torch.backends.cudnn.allow_tf32),
        "sdpa": sdpa,
        "autocast": "bf16" if autocast else None,
        "fused_adamw": fused,
        "channels_last": bool(recipe["channels_last"] and x.dim() == 4),
        "compiled": recipe["compile"],
        "notes": notes,
    }
    if profile is not None:
        result["profile"] = profile
    out = os.path.join(directory, "torch.json" if match else f"torch-{args.recipe}.json")
    try:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise BadInput(f"cannot write {out}: {e}") from None

    vram = spec.get("vram") if isinstance(spec.get("vram"), dict) else {}
    diff = loss_difference(losses, vram.get("losses")) if match else None
    median = statistics.median(step_ms[1:] if len(step_ms) > 1 else step_ms)
    peak = f"{peak_allocated / 2**20:.2f} MiB" if peak_allocated is not None else "n/a (cpu)"
    shown = ", ".join(f"{v:.6g}" for v in losses)
    line = (f"{spec.get('model', arch.get('kind'))} [{args.recipe}]: {param_count} params on "
            f"{result['device']}, losses [{shown}], peak allocated {peak}, "
            + (f"saved for backward {saved / 2**20:.2f} MiB, " if saved is not None else "")
            + f"median step {median:.1f} ms")
    if diff is not None:
        line += f", largest loss difference vs vram {diff:.3g}"
    print(line)


def main():
    parser = argparse.ArgumentParser(
        description="Train vram's exported reference model in PyTorch and write DIR/torch.json.")
    parser.add_argument("dir", metavar="DIR", help="the folder vram's `cargo xtask twin` wrote")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="where to run (auto: CUDA if available)")
    parser.add_argument("--sdpa", action="store_true",
                        help="attention by F.scaled_dot_product_attention even where vram's "
                             "was explicit (informational)")
    parser.add_argument("--recipe", choices=list(RECIPES), default="match",
                        help="match: vram's math, losses compared (torch.json); the others: "
                             "PyTorch as users run it, written to torch-<recipe>.json")
    args = parser.parse_args()
    try:
        run(args)
    except BadInput as e:
        fail(str(e), 2)
    except torch.cuda.OutOfMemoryError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
        fail(f"out of memory on the device: {first}", 1)


if __name__ == "__main__":
    main()
