"""Build AOTAutograd joint graphs of small models for planner tests.

``joint_of(model, *inputs)`` traces through ``aot_function`` (no Dynamo: fast, but
no ``nn_module_stack``); ``joint_of_compiled`` goes through ``torch.compile`` so
nodes carry their module paths (what ``mirrorgrad.mark`` needs). Both capture the
joint graph with a partition_fn and then partition it PyTorch's default way.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from mirrorgrad import _compat
from mirrorgrad.graph.joint import JointGraph

MiB = 2**20  # a 512x512 fp32 tensor


class _Capture:
    def __init__(self) -> None:
        self.joints: list[JointGraph] = []

    def partition(self, gm, joint_inputs, *, num_fwd_outputs, **kwargs):
        self.joints.append(JointGraph.from_fx(gm, num_fwd_outputs))
        return _compat.default_partition(
            gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
        )


def _nop(gm, _example_inputs):
    return _compat.boxed_nop(gm, _example_inputs)


def joint_of(model: nn.Module, *inputs: torch.Tensor, decompose: bool = False) -> JointGraph:
    """The joint graph of ``model(*inputs)``'s forward and backward.

    ``decompose=True`` traces with Inductor's decompositions (BatchNorm becomes
    var_mean and pointwise ops), as ``torch.compile`` hands the graph to us.
    """
    capture = _Capture()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())

    def fn(params, buffers, *args):
        return torch.func.functional_call(model, {**params, **buffers}, args)

    compiled = _compat.aot_function(
        fn,
        fw_compiler=_nop,
        bw_compiler=_nop,
        partition_fn=capture.partition,
        decompositions=_compat.inductor_decompositions() if decompose else None,
    )
    out = compiled(params, buffers, *inputs)
    del out
    (joint,) = capture.joints
    return joint


def joint_of_compiled(
    model: nn.Module, *inputs: torch.Tensor, decompose: bool = False
) -> JointGraph:
    """Like ``joint_of`` but traced by Dynamo: nodes carry ``nn_module_stack``, and
    models with data-dependent Python branches (Hugging Face's) trace."""
    capture = _Capture()

    def backend(gm, example_inputs):
        return _compat.aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=_nop,
            bw_compiler=_nop,
            partition_fn=capture.partition,
            decompositions=_compat.inductor_decompositions() if decompose else None,
        )

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(*inputs)
    (joint,) = capture.joints
    return joint


class LayerNormGeluLinear(nn.Module):
    def __init__(self, d: int, out: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.act = nn.GELU()
        self.proj = nn.Linear(d, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.norm(x)))


class LSTMCellStep(nn.Module):
    """One nn.LSTMCell step returning (h, c)."""

    def __init__(self, n_in: int, hidden: int) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(n_in, hidden)

    def forward(self, x, h, c):
        return self.cell(x, (h, c))


class BahdanauDecoder(nn.Module):
    """MLP attention over encoder keys for ``steps`` decoder queries.

    score[b, t, s] = v . tanh(W q[b, t] + U k[b, s]); ``U k`` is computed once, the
    large tanh intermediate [B, S, A] once per decoder step.
    """

    def __init__(self, d: int, attn: int) -> None:
        super().__init__()
        self.W = nn.Linear(d, attn, bias=False)
        self.U = nn.Linear(d, attn, bias=False)
        self.v = nn.Linear(attn, 1, bias=False)

    def forward(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        uk = self.U(keys)  # [B, S, A]
        contexts = []
        for t in range(queries.shape[1]):
            hidden = torch.tanh(self.W(queries[:, t]).unsqueeze(1) + uk)  # [B, S, A]
            alpha = torch.softmax(self.v(hidden).squeeze(-1), dim=-1)  # [B, S]
            contexts.append(torch.bmm(alpha.unsqueeze(1), keys).squeeze(1))  # [B, D]
        return torch.stack(contexts, dim=1)


class Bottleneck(nn.Module):
    """ResNet's bottleneck block: 1x1 -> 3x3 -> 1x1 convolutions, each with BatchNorm,
    ReLU after the first two and after the residual add."""

    def __init__(self, channels: int, width: int, stride: int = 1, in_channels: int = 0) -> None:
        super().__init__()
        in_channels = in_channels or channels
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)
        self.shortcut = (
            nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(channels),
            )
            if stride != 1 or in_channels != channels
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        return torch.relu(self.bn3(self.conv3(out)) + self.shortcut(x))


def resnet152_shaped(width: int = 4) -> nn.Sequential:
    """ResNet-152's layout at tiny widths: 3, 8, 36 and 3 bottleneck blocks in four
    stages, each stage doubling the channels and halving the resolution."""
    blocks: list[nn.Module] = [nn.Conv2d(3, 4 * width, 3, padding=1, bias=False)]
    in_channels = 4 * width
    for stage, depth in enumerate((3, 8, 36, 3)):
        w = width * 2**stage
        for i in range(depth):
            stride = 2 if stage > 0 and i == 0 else 1
            blocks.append(Bottleneck(4 * w, w, stride=stride, in_channels=in_channels))
            in_channels = 4 * w
    return nn.Sequential(*blocks)


@functools.cache
def resnet152_layout() -> JointGraph:
    """ResNet-152's layout at 1/16 of its widths (16..512 channels), 10k nodes, traced as
    torch.compile's Inductor path traces it (BatchNorm decomposed). Built once per
    process (tens of seconds): the planner reads a joint graph and changes nothing."""
    torch.manual_seed(0)
    return joint_of(resnet152_shaped(width=4), torch.randn(16, 3, 32, 32), decompose=True)


def suite_transformer() -> JointGraph:
    """The suite's transformer (bench/models.py) at 2 x 64, length 64."""
    from mirrorgrad.bench import models

    torch.manual_seed(0)
    model = models.TransformerLM(vocab=512, width=64, heads=4, layers=2, length=64, dropout=0.1)
    tokens = torch.randint(0, 512, (2, 65))
    return joint_of(model, tokens[:, :-1], tokens[:, 1:], decompose=True)


@functools.cache
def suite_resnet50ish() -> JointGraph:
    """The suite's ResNet-50 layout (3, 4, 6, 3 bottlenecks) at width 8, 32x32. Built once
    per process (~10 s)."""
    from mirrorgrad.bench import models

    torch.manual_seed(0)
    model = models.ResNet(layers=(3, 4, 6, 3), width=8, classes=10)
    return joint_of(model, torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)), decompose=True)


# Graphs whose joint takes many seconds to build: the tests of every file that plan one
# share an xdist group, so one worker builds it (once: its builder is cached).
COSTLY_GRAPHS = ("resnet50-ish",)


def graph_param(name: str, *values):
    """``pytest.param(name, *values)``, in its graph's xdist group where it is costly."""
    marks = [pytest.mark.xdist_group(name)] if name in COSTLY_GRAPHS else []
    return pytest.param(name, *values, marks=marks)
