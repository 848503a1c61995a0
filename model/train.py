"""Train a ViT and write a self-describing checkpoint.

    python -m model.train --dataset shapes --epochs 12 --output weights/vit-shapes.safetensors
    torchrun --nproc_per_node 4 -m model.train --dataset cifar10 --download ...   # data-parallel
    python -m model.train --init-from vit-small.safetensors --dataset imagefolder ...  # fine-tune

AdamW with linear warm-up then cosine decay, gradient clipping, label smoothing, bf16 autocast on
CUDA. Each epoch prints and records train loss/accuracy and test accuracy; the best checkpoint by
test accuracy is kept at --output, with metrics JSON, a PNG of the curves and a resumable state
beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from model.arguments import at_least
from model.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from model.data import DATASETS, DEFAULT_GEOMETRY, DataBundle, DataOptions, DatasetNotFoundError, build_data
from model.device import resolve_device
from model.preprocessing import Preprocessing
from model.reference import OOD_SCORES, from_labelled
from model.shapes import NO_SHAPE
from model.vit import (
    POS_EMBED_KINDS,
    PRESETS,
    AttentionPattern,
    Head,
    Norm,
    ViT,
    ViTConfig,
    param_count_str,
    resample_pos_embed,
)

ARCHITECTURE_FLAGS = (
    "preset",
    "patch_size",
    "dim",
    "depth",
    "heads",
    "mlp_ratio",
    "pos_embed",
    "norm",
    "head",
    "head_hidden",
    "attention_pattern",
)
SCRATCH_LR, FINETUNE_LR = 5e-4, 1e-4
FINETUNE_LAYER_DECAY = 0.75
OUTLIER_WEIGHT = 0.5  # outlier exposure's weight against the labelled images' loss (Hendrycks et al. 2019)


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class History:
    epochs: list[dict[str, float]] = field(default_factory=list)
    best_accuracy: float = -1.0
    best_epoch: int = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m model.train", description=__doc__.split("\n\n")[0])
    d = p.add_argument_group("data")
    d.add_argument("--dataset", choices=DATASETS, default="shapes")
    d.add_argument("--data-dir", type=Path, default=Path("data"), help="where datasets live (default: data/)")
    d.add_argument("--download", action="store_true", help="download cifar10/mnist if missing")
    d.add_argument("--channels", type=int, choices=(1, 3), help="mnist: 1 (default) or 3; shapes: 3 (default) or 1")
    d.add_argument("--randaugment", action="store_true", help="RandAugment for natural images")
    d.add_argument("--shapes-train", type=at_least(1), default=50_000, help="shapes: training samples")
    d.add_argument("--shapes-test", type=at_least(1), default=5_000, help="shapes: test samples")
    d.add_argument(
        "--shapes-outliers",
        type=int,
        default=0,
        help="shapes: backgrounds without a shape added to the training set, trained towards equal probabilities "
        "(outlier exposure), so that what is not a shape scores as unknown",
    )
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=sorted(PRESETS), help="size preset (default: micro)")
    m.add_argument("--image-size", type=int, help="input side (default: per dataset)")
    m.add_argument("--patch-size", type=int, help="patch side (default: per dataset)")
    m.add_argument("--dim", type=int, help="overrides the preset")
    m.add_argument("--depth", type=int, help="overrides the preset")
    m.add_argument("--heads", type=int, help="overrides the preset")
    m.add_argument("--mlp-ratio", type=float, help="overrides the preset")
    m.add_argument("--dropout", type=float, default=0.0)
    m.add_argument("--pos-embed", choices=POS_EMBED_KINDS, help="position embedding (default: learned)")
    m.add_argument("--norm", choices=get_args(Norm), help="pre-norm blocks (default) or post-norm, LN(x + f(x))")
    m.add_argument(
        "--head",
        choices=get_args(Head),
        help="linear (default) or the ViT paper's MLP head; with --backbone, a folder of examples: "
        "--head DIR --backbone NAME teaches a head by example (model/teach.py)",
    )
    m.add_argument("--head-hidden", type=int, help="hidden width of the MLP head (default: 4 x classes)")
    m.add_argument(
        "--attention-pattern",
        choices=get_args(AttentionPattern),
        help="full (default) or axial: rows of the patch grid, then columns (Ho et al. 2019)",
    )
    m.add_argument(
        "--init",
        choices=("mimetic", "timm"),
        default="mimetic",
        help="attention init: mimetic (local attention from the start; default) or plain timm trunc-normal",
    )
    f = p.add_argument_group("fine-tuning")
    f.add_argument(
        "--init-from",
        type=Path,
        help="start from this checkpoint (ours or converted): its architecture and preprocessing; a new head "
        "when the classes differ, positions resampled when --image-size differs",
    )
    f.add_argument(
        "--layer-decay",
        type=float,
        help=f"layer-wise lr decay: block i of d trains at lr * decay^(d + 1 - i) "
        f"(default: {FINETUNE_LAYER_DECAY} with --init-from, else 1.0)",
    )
    f.add_argument("--freeze-backbone", action="store_true", help="train the head only (linear probing)")
    f.add_argument("--mean", type=float, nargs="+", help="override the checkpoint's normalisation mean")
    f.add_argument("--std", type=float, nargs="+", help="override the checkpoint's normalisation std")
    o = p.add_argument_group("optimisation")
    o.add_argument("--epochs", type=at_least(1), default=12)
    o.add_argument("--batch-size", type=at_least(1), default=128, help="per process")
    o.add_argument(
        "--lr", type=float, help=f"peak learning rate (default: {SCRATCH_LR}, or {FINETUNE_LR} with --init-from)"
    )
    o.add_argument("--weight-decay", type=float, default=0.05)
    o.add_argument("--warmup-epochs", type=float, default=1.0)
    o.add_argument("--label-smoothing", type=float, default=0.1)
    o.add_argument("--clip-grad", type=float, default=1.0, help="max gradient norm (0: off)")
    r = p.add_argument_group("run")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    r.add_argument("--workers", type=at_least(0), default=2, help="data loader processes")
    r.add_argument("--output", type=Path, default=Path("runs/vit.safetensors"), help="checkpoint path")
    r.add_argument("--resume", action="store_true", help="continue from <output>.state.pt")
    r.add_argument("--no-progress", action="store_true", help="no progress bars (logs and CI)")
    r.add_argument(
        "--ood-score",
        choices=OOD_SCORES,
        default="mahalanobis",
        help="the out-of-distribution score the reference statistics written at the end give (model.reference)",
    )
    args = p.parse_args(argv)
    if args.init_from is not None:
        given = [f"--{f.replace('_', '-')}" for f in ARCHITECTURE_FLAGS if getattr(args, f) is not None]
        if given:
            p.error(f"--init-from takes the architecture from the checkpoint; drop {', '.join(given)}")
    elif args.freeze_backbone or args.mean or args.std:
        p.error("--freeze-backbone, --mean and --std apply to fine-tuning: also pass --init-from CHECKPOINT")
    finetuning = args.init_from is not None
    args.lr = args.lr if args.lr is not None else (FINETUNE_LR if finetuning else SCRATCH_LR)
    args.layer_decay = (
        args.layer_decay if args.layer_decay is not None else (FINETUNE_LAYER_DECAY if finetuning else 1.0)
    )
    if not 0.0 < args.layer_decay <= 1.0:
        p.error(f"--layer-decay must be in (0, 1], got {args.layer_decay}")
    if args.shapes_outliers and args.dataset != "shapes":
        p.error("--shapes-outliers adds shape-less backgrounds to the shapes dataset; drop it for other datasets")
    if args.shapes_outliers < 0:
        p.error(f"--shapes-outliers must be >= 0, got {args.shapes_outliers}")
    if args.warmup_epochs < 0:
        p.error(f"--warmup-epochs must be at least 0, got {args.warmup_epochs}")
    if not finetuning:  # the shape asked for, checked before any data is read (the classes do not change it)
        try:
            build_config(args, num_classes=2, channels=args.channels or 3)
        except ValueError as e:
            p.error(f"the model's shape: {e}")
    return args


def build_config(args: argparse.Namespace, num_classes: int, channels: int) -> ViTConfig:
    image_size, patch_size = DEFAULT_GEOMETRY[args.dataset]
    size = dict(PRESETS[args.preset or "micro"])
    for key in ("dim", "depth", "heads", "mlp_ratio"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    return ViTConfig(
        image_size=args.image_size or image_size,
        patch_size=args.patch_size or patch_size,
        in_channels=channels,
        num_classes=num_classes,
        dropout=args.dropout,
        pos_embed=args.pos_embed or "learned",
        norm=args.norm or "pre",
        head=args.head or "linear",
        head_hidden=args.head_hidden or 0,
        attention_pattern=args.attention_pattern or "full",
        **size,
    )


def finetune_preprocessing(args: argparse.Namespace, source: Checkpoint) -> Preprocessing:
    """The source checkpoint's recipe at the new image size, with --mean/--std when given."""
    p = source.preprocessing.with_image_size(args.image_size or source.config.image_size)
    mean, std = tuple(args.mean or p.mean), tuple(args.std or p.std)
    try:
        return Preprocessing(
            p.image_size, p.channels, mean, std, p.resize, p.crop_pct, p.interpolation, p.resize_backend
        )
    except ValueError as e:
        raise SystemExit(f"--mean/--std: {e}") from None


def finetune_model(args: argparse.Namespace, source: Checkpoint, data: DataBundle) -> ViT:
    """The source model adapted to the data: a new head for new classes, positions resampled to the new grid."""
    try:
        config = ViTConfig(
            **{
                **source.config.to_dict(),
                "num_classes": len(data.classes),
                "image_size": data.preprocessing.image_size,
                "dropout": args.dropout,
            }
        )
    except ValueError as e:
        raise SystemExit(f"cannot fine-tune {args.init_from} at this size: {e}") from None
    state = dict(source.model.state_dict())
    new_head = data.classes != source.classes  # another label set: the old head's outputs mean nothing here
    if new_head:
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
    resized = config.grid_size != source.config.grid_size
    if resized and (config.rope != "none" or config.rel_pos_bias):
        raise SystemExit(
            f"cannot fine-tune {args.init_from} at another size: its rotary or relative position tables are for "
            f"its own {source.config.image_size} px; keep --image-size {source.config.image_size}"
        )
    if "pos_embed" in state and resized:
        state["pos_embed"] = resample_pos_embed(state["pos_embed"], config.grid_size, config.num_embedded_prefix_tokens)
    model = ViT(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("head.") for k in missing) and (new_head or not missing)
    if args.freeze_backbone:
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("head."))
    return model


def setup_distributed() -> Distributed:
    """Join the process group when launched by torchrun; a plain launch is a group of one."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Distributed()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Distributed(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def layer_id(name: str, depth: int) -> int:
    """0 for the embeddings, i + 1 for block i, depth + 1 for the final norm and head."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    if name.startswith(("patch_embed.", "cls_token", "reg_token", "pos_embed", "norm_pre.")):
        return 0
    return depth + 1


def param_groups(model: ViT, weight_decay: float, layer_decay: float = 1.0) -> list[dict[str, Any]]:
    """Decay matrices only (biases, norms, tokens and positions are left alone); with layer_decay < 1
    each layer's lr is scaled by layer_decay^(distance from the head), as BEiT and MAE fine-tune."""
    skip = model.no_weight_decay()
    depth = model.config.depth
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decays = not (p.ndim < 2 or name in skip)
        layer = layer_id(name, depth)
        group = groups.setdefault(
            (layer, decays),
            {
                "params": [],
                "weight_decay": weight_decay if decays else 0.0,
                "lr_scale": layer_decay ** (depth + 1 - layer),
            },
        )
        group["params"].append(p)
    return list(groups.values())


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    """Linear warm-up to `peak`, then cosine decay to zero."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_loader(ds: Dataset[Any], args: argparse.Namespace, ddp: Distributed, train: bool) -> DataLoader[Any]:
    sampler: DistributedSampler[Any] | None = (
        DistributedSampler(ds, shuffle=train, seed=args.seed) if ddp.enabled else None
    )
    return DataLoader(
        ds,
        batch_size=args.batch_size,
        shuffle=train and sampler is None,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=torch.cuda.is_available(),
        drop_last=train,
        persistent_workers=args.workers > 0,
    )


@torch.inference_mode()
def evaluate_accuracy(model: nn.Module, loader: DataLoader[Any], device: torch.device, ddp: Distributed) -> float:
    model.eval()
    correct = torch.zeros((), device=device)
    seen = torch.zeros((), device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device):
            correct += (model(x).argmax(1) == y).sum()
        seen += y.numel()
    if ddp.enabled:
        dist.all_reduce(correct)
        dist.all_reduce(seen)
    return float(correct / seen)


def autocast(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def save_plot(history: History, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [e["epoch"] for e in history.epochs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(epochs, [e["train_loss"] for e in history.epochs], marker="o")
    ax1.set(xlabel="epoch", ylabel="train loss", title="Loss")
    ax2.plot(epochs, [e["train_accuracy"] for e in history.epochs], marker="o", label="train")
    ax2.plot(epochs, [e["test_accuracy"] for e in history.epochs], marker="o", label="test")
    ax2.set(xlabel="epoch", ylabel="accuracy", title="Accuracy")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def state_path(output: Path) -> Path:
    return output.with_name(output.name + ".state.pt")


def load_source(path: Path) -> Checkpoint:
    try:
        return load_checkpoint(path)
    except CheckpointError as e:
        raise SystemExit(f"--init-from: {e}") from None


def load_data(args: argparse.Namespace, ddp: Distributed, source: Checkpoint | None) -> DataBundle:
    """The dataset, with the source checkpoint's preprocessing when fine-tuning."""
    opts = DataOptions(
        dataset=args.dataset,
        data_dir=args.data_dir,
        download=args.download and ddp.is_main,
        image_size=args.image_size,
        channels=args.channels,
        randaugment=args.randaugment,
        shapes_train=args.shapes_train,
        shapes_test=args.shapes_test,
        shapes_outliers=args.shapes_outliers,
        seed=args.seed,
        preprocessing=finetune_preprocessing(args, source) if source else None,
    )
    try:
        if ddp.enabled and args.download:  # rank 0 downloads first; the others then read the files
            if ddp.is_main:
                build_data(opts)
            dist.barrier()
        return build_data(opts)
    except DatasetNotFoundError as e:
        raise SystemExit(str(e)) from None  # where the files should be and how to get them: no traceback


def build_model(args: argparse.Namespace, data: DataBundle, source: Checkpoint | None) -> ViT:
    """From the source checkpoint when fine-tuning, else a fresh model of the asked-for size."""
    if source is not None:
        return finetune_model(args, source, data)
    config = build_config(args, len(data.classes), data.preprocessing.channels)
    if config.image_size != data.preprocessing.image_size:
        raise SystemExit(f"--image-size {config.image_size} disagrees with the data ({data.preprocessing.image_size})")
    model = ViT(config)
    if args.init == "mimetic":
        model.mimetic_init_(torch.Generator().manual_seed(args.seed))
    return model


def resume(
    args: argparse.Namespace, model: ViT, optimizer: torch.optim.Optimizer, device: torch.device
) -> tuple[History, int]:
    """History and first epoch from <output>.state.pt, with model and optimizer restored."""
    state = torch.load(state_path(args.output), map_location=device, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return History(state["epochs"], state["best_accuracy"], state["best_epoch"]), int(state["epoch"]) + 1


@dataclass
class Schedule:
    total_steps: int
    warmup_steps: int
    steps_per_epoch: int


def classification_loss(logits: Tensor, y: Tensor, label_smoothing: float) -> Tensor:
    """Cross-entropy over the labelled images; an image labelled NO_SHAPE (a shape-less background) is trained
    towards equal probabilities instead, weighted OUTLIER_WEIGHT (outlier exposure, Hendrycks et al. 2019)."""
    known = y != NO_SHAPE
    if bool(known.all()):
        return F.cross_entropy(logits, y, label_smoothing=label_smoothing)
    total = F.cross_entropy(logits[known], y[known], label_smoothing=label_smoothing, reduction="sum")
    total = total - OUTLIER_WEIGHT * F.log_softmax(logits[~known], dim=-1).mean(dim=-1).sum()
    return total / y.numel()


def train_epoch(
    args: argparse.Namespace,
    net: nn.Module,
    model: ViT,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[Any],
    schedule: Schedule,
    epoch: int,
    device: torch.device,
    ddp: Distributed,
) -> tuple[float, float]:
    """One pass over the training data -> (mean loss, accuracy) over all processes."""
    net.train()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    labelled = torch.zeros((), device=device, dtype=torch.long)
    seen = 0
    bar = tqdm(loader, desc=f"epoch {epoch}/{args.epochs}", disable=args.no_progress or not ddp.is_main)
    for i, (x, y) in enumerate(bar):
        lr = lr_at((epoch - 1) * schedule.steps_per_epoch + i, schedule.total_steps, schedule.warmup_steps, args.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device):
            logits = net(x)
            loss = classification_loss(logits.float(), y, args.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip_grad > 0:
            nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], args.clip_grad)
        optimizer.step()
        loss_sum += loss.detach() * y.numel()
        correct += (logits.argmax(1) == y).sum()  # an outlier (label NO_SHAPE) is never correct, nor counted
        labelled += (y != NO_SHAPE).sum()
        seen += y.numel()
        if i % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}")
    stats = torch.stack([loss_sum, correct, labelled.float(), torch.tensor(float(seen), device=device)])
    if ddp.enabled:
        dist.all_reduce(stats)
    return float(stats[0] / stats[3]), float(stats[1] / stats[2])


def main(argv: list[str] | None = None) -> History:
    args = parse_args(argv)
    ddp = setup_distributed()
    device = resolve_device(args.device, ddp.local_rank if ddp.enabled else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed + ddp.rank)
    source = load_source(args.init_from) if args.init_from else None
    data = load_data(args, ddp, source)
    model = build_model(args, data, source).to(device)
    train_loader = make_loader(data.train, args, ddp, train=True)
    test_loader = make_loader(data.test, args, ddp, train=False)
    optimizer = torch.optim.AdamW(
        param_groups(model, args.weight_decay, args.layer_decay), lr=args.lr, betas=(0.9, 0.999)
    )
    n = len(train_loader)
    schedule = Schedule(args.epochs * n, int(args.warmup_epochs * n), n)
    history, start_epoch = resume(args, model, optimizer, device) if args.resume else (History(), 1)
    net: nn.Module = (
        DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None) if ddp.enabled else model
    )
    if ddp.is_main:
        sizes = f"{len(data.train)} train / {len(data.test)} test images"  # type: ignore[arg-type]
        print(f"{args.dataset}: {sizes}, {len(data.classes)} classes")
        print(f"ViT {param_count_str(model.num_parameters())} params {model.config} on {device} x{ddp.world_size}")
        if source is not None:
            print(f"fine-tuning from {args.init_from} ({source.identity}), layer decay {args.layer_decay}")
    started = time.monotonic()
    for epoch in range(start_epoch, args.epochs + 1):
        if isinstance(train_loader.sampler, DistributedSampler):
            train_loader.sampler.set_epoch(epoch)
        train_loss, train_acc = train_epoch(args, net, model, optimizer, train_loader, schedule, epoch, device, ddp)
        test_acc = evaluate_accuracy(model, test_loader, device, ddp)
        record = {
            "epoch": epoch,
            "train_loss": train_loss,
            "train_accuracy": train_acc,
            "test_accuracy": test_acc,
            "elapsed_s": round(time.monotonic() - started, 1),
        }
        history.epochs.append(record)
        if ddp.is_main:
            end_of_epoch(args, model, optimizer, history, record, data, source, started)
    if ddp.enabled:
        dist.destroy_process_group()
    if ddp.is_main:
        print(f"best test accuracy {history.best_accuracy:.4f} (epoch {history.best_epoch}) -> {args.output}")
        if history.best_epoch:
            add_reference(args, data, device)
    return history


def add_reference(args: argparse.Namespace, data: DataBundle, device: torch.device) -> None:
    """Reference statistics of the best checkpoint's embeddings, from the held-out split (in-distribution images,
    labelled, preprocessed as served), written into it for out-of-distribution scores (model/reference/)."""
    best = load_checkpoint(args.output, device)
    loader = DataLoader(data.test, batch_size=args.batch_size, num_workers=0)
    reference = from_labelled(best.model, loader, best.config.num_classes, device, args.ood_score)
    described = f"{reference.images} {args.dataset} test images, labelled"
    training = {**best.training, "reference": described}
    save_checkpoint(args.output, best.model, best.classes, best.preprocessing, training, reference=reference)
    print(f"reference statistics from {described} -> {args.output}")


def end_of_epoch(
    args: argparse.Namespace,
    model: ViT,
    optimizer: torch.optim.Optimizer,
    history: History,
    record: dict[str, float],
    data: DataBundle,
    source: Checkpoint | None,
    started: float,
) -> None:
    """Print the epoch, keep the best checkpoint, and write metrics, curves and the resumable state."""
    print(
        f"epoch {record['epoch']}: train loss {record['train_loss']:.4f} acc {record['train_accuracy']:.4f} | "
        f"test acc {record['test_accuracy']:.4f} | {record['elapsed_s']:.0f}s",
        flush=True,
    )
    if record["test_accuracy"] > history.best_accuracy:
        history.best_accuracy, history.best_epoch = record["test_accuracy"], int(record["epoch"])
        training = summary(args, history, started, source)
        save_checkpoint(args.output, model, data.classes, data.preprocessing, training)
    write_artifacts(args, model, optimizer, history, int(record["epoch"]))


def summary(args: argparse.Namespace, history: History, started: float, source: Checkpoint | None) -> dict[str, Any]:
    """The training record a checkpoint carries."""
    record = {
        "dataset": args.dataset,
        "epochs": history.best_epoch,
        "epochs_planned": args.epochs,
        "seed": args.seed,
        "test_accuracy": round(history.best_accuracy, 6),
        "train_samples": args.shapes_train if args.dataset == "shapes" else None,
        **({"train_outliers": args.shapes_outliers} if args.shapes_outliers else {}),
        "batch_size": args.batch_size,
        "lr": args.lr,
        "warmup_epochs": args.warmup_epochs,
        "weight_decay": args.weight_decay,
        "label_smoothing": args.label_smoothing,
        "init": args.init if source is None else "init_from",
        "train_time_s": round(time.monotonic() - started, 1),
    }
    if source is not None:
        record["init_from"] = {"checkpoint": Path(source.path).name, "version": source.version}
        record |= {"layer_decay": args.layer_decay, "freeze_backbone": args.freeze_backbone}
        if "converted_from" in source.training:
            record["init_from"]["converted_from"] = source.training["converted_from"]
    return record


def write_artifacts(
    args: argparse.Namespace, model: ViT, optimizer: torch.optim.Optimizer, history: History, epoch: int
) -> None:
    base = args.output
    base.parent.mkdir(parents=True, exist_ok=True)
    metrics = {"epochs": history.epochs, "best_accuracy": history.best_accuracy, "best_epoch": history.best_epoch}
    base.with_name(base.stem + ".metrics.json").write_text(json.dumps(metrics, indent=2))
    save_plot(history, base.with_name(base.stem + ".curves.png"))
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epochs": history.epochs,
            "best_accuracy": history.best_accuracy,
            "best_epoch": history.best_epoch,
            "epoch": epoch,
        },
        state_path(base),
    )


def cli(argv: list[str]) -> None:
    """`python -m model.train`: training, or with --backbone a head taught by example (model/teach.py)."""
    if any(a == "--backbone" or a.startswith("--backbone=") for a in argv):
        from model.teach import main as teach

        teach(argv)
    else:
        main(argv)


if __name__ == "__main__":
    cli(sys.argv[1:])
