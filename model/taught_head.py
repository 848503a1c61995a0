"""Classes taught by example: a head over a backbone's embeddings, fitted from a few images of each class.

A served model's embeddings (a classifier's pre-logits, a CLIP or SigLIP image tower's joint-space output) already
tell most classes apart; a head taught from examples is a linear map on them, made in a second rather than trained.
Both rules work on the embeddings centred on the examples' mean and scaled to unit length (what few-shot work calls
CL2N, which helps the nearest-mean rule most):

- `means`: each class is the unit mean of its examples, and an image's logit for a class is its cosine similarity
  to that mean times a scale;
- `logistic`: a multinomial logistic regression with an L2 penalty, fitted by accelerated gradient, its penalty chosen where the
  held-out accuracy is best (fewest errors, then the least log loss).

`rule="auto"` fits both and keeps `logistic` only where its held-out accuracy is higher. Either rule's logits are
then scaled so that the held-out examples' mean top probability matches their accuracy by Laplace's rule,
(right + 1) / (n + 2): taught from thirty images, all held out right, a head answers 0.97 on average, not 1.0.
The held-out estimate is leave-one-out up to `LEAVE_ONE_OUT_MAX` examples and a stratified k-fold past that (`FOLDS`, fewer where a class has
fewer examples); a class of one example leaves nothing to hold out, so a head with one has no estimate. The
logistic rule's estimate is read on the folds its penalty was chosen on, so it leans a little high; the means
rule's is not (its scale changes no answer).

Either way a head is `logits = normalize(e - center) @ weight.T + bias`: one matrix product on a batch's embeddings,
stored as a small safetensors file that names its backbone by content hash (`save`, `load`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

Rule = Literal["means", "logistic"]
RuleSetting = Literal["auto", "means", "logistic"]
Embedding = Literal["pre-logits", "joint"]  # a classifier's embedding, or a zero-shot model's image in the joint space
FORMAT = "vit-serve.taught-head"
FORMAT_VERSION = 1
LEAVE_ONE_OUT_MAX = 12  # examples up to which the estimate leaves each out in turn; k-fold past that
FOLDS = 5
SCALES = tuple(2.0 ** (k / 4) for k in range(-16, 33))  # the factors on logits tried (1/16 to 256)
UNHELD_SCALE = 16.0  # the means rule's scale where nothing could be held out (a class of one example)
LOGISTIC_STEPS = 600  # `logistic`: the most gradient steps of a fit (a few hundred reach LOGISTIC_TOLERANCE)
LOGISTIC_TOLERANCE = 1e-5  # the largest entry of the gradient at which a fit stops
PENALTIES = (1e-3, 1e-2, 1e-1)  # `logistic`: the L2 penalties on the weight tried (the loss is a mean)
HEADS = "heads"  # the folder beside a checkpoint (in the model repository) that holds heads, a folder per model
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$")


class HeadError(ValueError):
    """Examples a head cannot be taught from, or a head file that cannot serve: the message says why, in one line."""


def check_head_name(name: str) -> str:
    """A head's name: letters, digits, '.', '_', '-', at most 64, not starting with '.' and no '..'."""
    if not NAME.match(name) or ".." in name:
        raise HeadError(
            f"{name!r} is not a head name: use letters, digits, '.', '_' and '-' (at most 64, not starting with '.', "
            "no '..')"
        )
    return name


@dataclass(frozen=True)
class Estimate:
    """How well the head's rule did on examples it was fitted without."""

    method: str  # "leave-one-out" or "5-fold"
    accuracy: float
    examples: int

    def to_dict(self) -> dict[str, object]:
        return {"method": self.method, "accuracy": self.accuracy, "examples": self.examples}


@dataclass(frozen=True)
class TaughtHead:
    """`logits = normalize(e - center) @ weight.T + bias` over a backbone's embeddings; `classes` in answer order."""

    classes: tuple[str, ...]
    rule: Rule
    weight: Tensor  # (C, D) float32
    bias: Tensor  # (C,)
    center: Tensor  # (D,): the examples' mean embedding
    counts: tuple[int, ...]  # examples per class, in class order
    backbone: str  # the backbone's content hash
    embedding: Embedding
    estimate: Estimate | None  # None: a class had one example, so none could be held out
    setting: dict[str, float] = field(default_factory=dict)  # what was chosen: the scale, and the penalty

    @property
    def dim(self) -> int:
        return int(self.weight.shape[1])

    @functools.cached_property
    def digest(self) -> str:
        """What tells this head from another of the same name: its classes and weights, hashed (16 hex digits)."""
        h = hashlib.sha256("\x1f".join(self.classes).encode())
        for t in (self.weight, self.bias, self.center):
            h.update(t.float().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def logits(self, embeddings: Tensor) -> Tensor:
        """Embeddings (N, D) -> logits (N, C)."""
        x = F.normalize(embeddings.float() - self.center.to(embeddings.device), dim=-1)
        return F.linear(x, self.weight.to(embeddings.device), self.bias.to(embeddings.device))

    def probabilities(self, embeddings: Tensor) -> Tensor:
        return self.logits(embeddings).softmax(dim=-1)

    def describe(self) -> dict[str, object]:
        """What a listing of heads says of this one."""
        return {
            "classes": list(self.classes),
            "rule": self.rule,
            "examples": dict(zip(self.classes, self.counts, strict=True)),
            "estimate": None if self.estimate is None else self.estimate.to_dict(),
            "backbone": self.backbone[:12],
            "embedding": self.embedding,
        }


def check_examples(labels: Sequence[int], classes: Sequence[str]) -> None:
    """At least two classes, each with at least one example, names unique and non-empty; HeadError otherwise."""
    if len(classes) < 2:
        raise HeadError(f"a head tells classes apart: give at least two, got {len(classes)} ({', '.join(classes)})")
    if any(not c.strip() for c in classes):
        raise HeadError("an empty class name: each class needs a name")
    if len(set(classes)) != len(classes):
        twice = next(c for c, n in Counter(classes).items() if n > 1)
        raise HeadError(f"class {twice!r} is named twice")
    counts = Counter(labels)
    empty = [c for i, c in enumerate(classes) if counts[i] == 0]
    if empty:
        raise HeadError(f"class {empty[0]!r} has no example image: give each class at least one")


def features(embeddings: Tensor, center: Tensor) -> Tensor:
    return F.normalize(embeddings.float() - center, dim=-1)


def fit_means(x: Tensor, y: Tensor, num_classes: int, scale: float) -> tuple[Tensor, Tensor]:
    """Unit class means of unit features, times `scale`: (weight (C, D), bias (C,))."""
    sums = torch.zeros(num_classes, x.shape[1]).index_add_(0, y, x)
    return F.normalize(sums, dim=-1) * scale, torch.zeros(num_classes)


def fit_logistic(x: Tensor, y: Tensor, num_classes: int, penalty: float) -> tuple[Tensor, Tensor]:
    """Multinomial logistic regression with an L2 penalty on the weight, `mean cross-entropy + penalty * |W|^2`, by
    Nesterov's accelerated gradient at the step the loss's smoothness allows: (weight, bias).

    The features are unit length, so the gradient is at most (1 + 2 * penalty)-Lipschitz (softmax's curvature is at
    most 1/2 per unit of |x|^2, the bias a feature of 1), and the penalty makes the loss strongly convex in the
    weight: the momentum for that condition number converges in a few hundred steps of two small matrix products.
    Plain tensor arithmetic: torch.optim's first optimizer in a process imports the compiler, seconds of it."""
    n = len(x)
    features = torch.cat([x, torch.ones(n, 1)], dim=1)  # the bias as a last feature, not penalised
    target = F.one_hot(y, num_classes).float()
    penalised = torch.ones(x.shape[1] + 1)
    penalised[-1] = 0.0
    smoothness = 0.5 * float(features.square().sum(1).max()) + 2 * penalty
    step = 1.0 / smoothness
    root = (smoothness / (2 * penalty)) ** 0.5
    momentum = (root - 1) / (root + 1)
    theta = torch.zeros(num_classes, x.shape[1] + 1)
    previous = theta
    for k in range(LOGISTIC_STEPS):
        ahead = theta + momentum * (theta - previous)
        gradient = (features @ ahead.T).softmax(-1).sub_(target).T @ features / n + 2 * penalty * ahead * penalised
        previous, theta = theta, ahead - step * gradient
        if k % 25 == 24 and float(gradient.abs().max()) < LOGISTIC_TOLERANCE:
            break
    return theta[:, :-1].contiguous(), theta[:, -1].contiguous()


def folds(y: Tensor) -> tuple[str, list[Tensor]]:
    """The held-out indices of each fold: every example alone (up to LEAVE_ONE_OUT_MAX), else stratified k-fold."""
    n = len(y)
    if n <= LEAVE_ONE_OUT_MAX:
        return "leave-one-out", [torch.tensor([i]) for i in range(n)]
    k = max(2, min(FOLDS, int(torch.bincount(y).min())))
    assignment = torch.empty(n, dtype=torch.long)
    for c in y.unique():
        members = (y == c).nonzero().flatten()
        assignment[members] = torch.arange(len(members)) % k  # in input order: no randomness in the estimate
    return f"{k}-fold", [(assignment == f).nonzero().flatten() for f in range(k)]


def held_out_logits(
    embeddings: Tensor, y: Tensor, num_classes: int, held: list[Tensor], fit: str, value: float
) -> Tensor:
    """Each example's logits from the head fitted without its fold (the centre too)."""
    out = torch.empty(len(y), num_classes)
    everything = torch.ones(len(y), dtype=torch.bool)
    for indices in held:
        keep = everything.clone()
        keep[indices] = False
        center = embeddings[keep].mean(0)
        x_fit, x_held = features(embeddings[keep], center), features(embeddings[indices], center)
        weight, bias = (fit_means if fit == "means" else fit_logistic)(x_fit, y[keep], num_classes, value)
        out[indices] = F.linear(x_held, weight, bias)
    return out


def calibrated_scale(held_out: Tensor, y: Tensor) -> float:
    """The factor on held-out logits at which the examples' mean top probability is nearest their accuracy as
    Laplace's rule of succession estimates it, (right + 1) / (n + 2): no surer than the examples can show (a
    least log loss would grow without bound where every held-out example is right)."""
    right = int((held_out.argmax(-1) == y).sum())
    target = (right + 1) / (len(y) + 2)
    return min(SCALES, key=lambda s: abs(float((held_out * s).softmax(-1).amax(-1).mean()) - target))


def scored(logits: Tensor, y: Tensor) -> tuple[float, float]:
    """(accuracy, mean log loss) of held-out logits."""
    return float((logits.argmax(-1) == y).float().mean()), float(F.cross_entropy(logits, y))


def fit(
    embeddings: Tensor,
    labels: Sequence[int] | Tensor,
    classes: Sequence[str],
    backbone: str,
    embedding: Embedding = "pre-logits",
    rule: RuleSetting = "auto",
) -> TaughtHead:
    """A head from examples: `embeddings` (N, D) of images whose class indices are `labels`; HeadError for
    examples it cannot be taught from."""
    if rule not in get_args(RuleSetting):
        raise HeadError(f"rule must be one of {', '.join(get_args(RuleSetting))}; got {rule!r}")
    y = torch.as_tensor(labels, dtype=torch.long)
    check_examples(y.tolist(), classes)
    embeddings = embeddings.detach().float().cpu()
    if embeddings.ndim != 2 or len(embeddings) != len(y):
        raise HeadError(f"{len(y)} labels for embeddings of shape {tuple(embeddings.shape)}")
    num_classes = len(classes)
    counts = tuple(int(n) for n in torch.bincount(y, minlength=num_classes))
    center = embeddings.mean(0)
    x = features(embeddings, center)
    can_hold_out = min(counts) >= 2
    method, held = folds(y) if can_hold_out else ("", [])

    chosen: Rule = "means"
    means_estimate, logistic_estimate = None, None
    if can_hold_out:  # the cosines held out once: a scale changes no answer, only how sure it is
        cosines = held_out_logits(embeddings, y, num_classes, held, "means", 1.0)
        means_estimate = Estimate(method, scored(cosines, y)[0], len(y))
        held_out = cosines
    estimate, setting = means_estimate, {"scale": UNHELD_SCALE}
    if rule == "logistic" or (rule == "auto" and can_hold_out):
        penalty = PENALTIES[len(PENALTIES) // 2]
        if can_hold_out:  # the penalty held-out examples score best with: fewest errors, then least log loss
            results = [(held_out_logits(embeddings, y, num_classes, held, "logistic", p), p) for p in PENALTIES]
            logits, penalty = max(results, key=lambda r: (scored(r[0], y)[0], -scored(r[0], y)[1]))
            logistic_estimate = Estimate(method, scored(logits, y)[0], len(y))
        better = (
            logistic_estimate is not None
            and means_estimate is not None
            and logistic_estimate.accuracy > means_estimate.accuracy
        )
        if rule == "logistic" or better:
            chosen, estimate, setting = "logistic", logistic_estimate, {"penalty": penalty, "scale": 1.0}
            if can_hold_out:
                held_out = logits
    if can_hold_out:
        setting["scale"] = calibrated_scale(held_out, y)
    if chosen == "means":
        weight, bias = fit_means(x, y, num_classes, setting["scale"])
    else:
        weight, bias = fit_logistic(x, y, num_classes, setting["penalty"])
        weight, bias = weight * setting["scale"], bias * setting["scale"]
    return TaughtHead(tuple(classes), chosen, weight, bias, center, counts, backbone, embedding, estimate, setting)


def save(head: TaughtHead, path: Path) -> None:
    """The head as a safetensors file, written whole (a reader never sees half a file)."""
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "classes": json.dumps(list(head.classes)),
        "rule": head.rule,
        "counts": json.dumps(list(head.counts)),
        "backbone": head.backbone,
        "embedding": head.embedding,
        "estimate": json.dumps(None if head.estimate is None else head.estimate.to_dict()),
        "setting": json.dumps(head.setting),
    }
    tensors = {"weight": head.weight.contiguous(), "bias": head.bias.contiguous(), "center": head.center.contiguous()}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    save_file(tensors, str(partial), metadata=metadata)
    partial.replace(path)


def load(path: Path, backbone: str | None = None) -> TaughtHead:
    """A head file; with `backbone` (a content hash), one taught on that backbone. HeadError otherwise."""
    try:
        tensors = load_file(str(path))
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            metadata = json.loads(f.read(size)).get("__metadata__", {})
    except (OSError, SafetensorError, ValueError) as e:
        raise HeadError(f"head {path.name}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    if metadata.get("format") != FORMAT:
        raise HeadError(f"head {path.name}: not a taught head (its format is {metadata.get('format')!r})")
    if int(metadata.get("format_version", "0")) > FORMAT_VERSION:
        raise HeadError(f"head {path.name}: format version {metadata['format_version']} is newer than this software's")
    try:
        classes = tuple(json.loads(metadata["classes"]))
        raw_estimate = json.loads(metadata["estimate"])
        head = TaughtHead(
            classes,
            metadata["rule"],
            tensors["weight"].float(),
            tensors["bias"].float(),
            tensors["center"].float(),
            tuple(json.loads(metadata["counts"])),
            metadata["backbone"],
            metadata["embedding"],
            None if raw_estimate is None else Estimate(**raw_estimate),
            json.loads(metadata.get("setting", "{}")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise HeadError(f"head {path.name}: its metadata is incomplete ({e})") from None
    c, d = head.weight.shape
    if c != len(classes) or head.bias.shape != (c,) or head.center.shape != (d,) or len(head.counts) != c:
        raise HeadError(f"head {path.name}: {len(classes)} classes but weights of shape {tuple(head.weight.shape)}")
    if backbone is not None and head.backbone != backbone:
        raise HeadError(
            f"head {path.name} was taught on the backbone with content hash {head.backbone[:12]}, and the model now "
            f"has {backbone[:12]}: teach it again on this one"
        )
    return head


def accuracy_of(head: TaughtHead, embeddings: Tensor, labels: Sequence[int] | Tensor) -> float:
    """Top-1 accuracy of `head` on labelled embeddings (an evaluation's, not the held-out estimate)."""
    y = torch.as_tensor(labels, dtype=torch.long)
    return float((head.logits(embeddings).argmax(-1) == y).float().mean()) if len(y) else math.nan
