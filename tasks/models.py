"""Model builders by name: ``build_model("resnet_cifar", depth=20)``.

* ``resnet_cifar``: the CIFAR ResNets of He et al. 2016 (depth 6n+2: 20, 32, 44, 56, 110),
  three stages of 16/32/64 channels, parameter-free shortcuts (option A: stride-2
  subsampling and zero-padded channels);
* ``torchvision``: any torchvision classification model by ``arch`` (ResNet-50, AlexNet, ...),
  randomly initialized (no download);
* ``fmnist_wide``: an AlexNet-shaped net for Fashion-MNIST (the end-to-end cluster benchmark's);
* ``lstm_lm``, ``deepspeech``: the word language model and the DeepSpeech acoustic model of the
  language and speech tasks (:mod:`dgc.tasks.rnn_models`);
* ``gpt``: the GPT-2-shaped transformer of the causal language-modelling tasks (:mod:`dgc.tasks.gpt`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from dgc.tasks.gpt import GPT
from dgc.tasks.rnn_models import deepspeech, lstm_lm
from torch import nn

from dgc.registry import Registry


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.stride, self.pad = stride, cout - cin

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride > 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.pad:
            x = F.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, depth: int = 20, num_classes: int = 10, in_channels: int = 3):
        super().__init__()
        if (depth - 2) % 6 != 0 or depth < 8:
            raise ValueError(f"resnet_cifar depth must be 6n+2 (20, 32, 44, 56, 110, ...), got {depth}")
        n = (depth - 2) // 6
        self.conv = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers, cin = [], 16
        for stage, cout in enumerate((16, 32, 64)):
            for i in range(n):
                layers.append(_Block(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet_cifar(depth: int = 20, num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    return CifarResNet(depth, num_classes, in_channels)


class FmnistWide(nn.Module):
    """An AlexNet-shaped net for 28x28 grey images: a little convolution, wide fully connected layers
    (17.3M parameters: a communication-heavy model whose compute per step is small)."""

    def __init__(self, num_classes: int = 10, width: int = 2048):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 64, 5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(128 * 7 * 7, width),
            nn.ReLU(inplace=True),
            nn.Linear(width, width),
            nn.ReLU(inplace=True),
            nn.Linear(width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def torchvision_model(arch: str = "resnet50", num_classes: int = 1000, zero_init_residual: bool = False) -> nn.Module:
    valid = torchvision.models.list_models(module=torchvision.models)
    if arch not in valid:
        raise ValueError(f"unknown torchvision arch {arch!r}; valid: {', '.join(sorted(valid))}")
    kwargs: dict[str, Any] = {"num_classes": num_classes}
    if zero_init_residual:
        kwargs["zero_init_residual"] = True
    return torchvision.models.get_model(arch, weights=None, **kwargs)


#: model builders by ``model.name`` (``MODELS.add(name, builder)`` adds one)
MODELS: Registry[Callable[..., nn.Module]] = Registry("model")
for _name, _builder in (("resnet_cifar", resnet_cifar), ("torchvision", torchvision_model),
                        ("fmnist_wide", FmnistWide), ("lstm_lm", lstm_lm), ("deepspeech", deepspeech),
                        ("gpt", GPT)):  # fmt: skip
    MODELS.add(_name, _builder)


def build_model(name: str, **args: Any) -> nn.Module:
    """Build a model; unknown names or arguments raise a ValueError naming the valid ones."""
    builder = MODELS.pick(name)
    valid = list(inspect.signature(builder).parameters)
    unknown = sorted(set(args) - set(valid))
    if unknown:
        raise ValueError(f"model {name!r} has no argument {', '.join(unknown)}; valid: {', '.join(valid)}")
    return builder(**args)
