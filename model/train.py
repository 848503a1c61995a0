"""Train a ViT and write a self-describing checkpoint.

    python -m model.train --dataset shapes --epochs 12 --output weights/vit-shapes.safetensors
    torchrun --nproc_per_node 4 -m model.train --dataset cifar10 --download ...   # data-parallel

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
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from model.checkpoint import save_checkpoint
from model.data import DATASETS, DEFAULT_GEOMETRY, DataOptions, build_data
from model.vit import POS_EMBED_KINDS, PRESETS, ViT, ViTConfig, param_count_str


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
    d.add_argument("--shapes-train", type=int, default=50_000, help="shapes: training samples")
    d.add_argument("--shapes-test", type=int, default=5_000, help="shapes: test samples")
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=sorted(PRESETS), default="micro", help="size preset (default: micro)")
    m.add_argument("--image-size", type=int, help="input side (default: per dataset)")
    m.add_argument("--patch-size", type=int, help="patch side (default: per dataset)")
    m.add_argument("--dim", type=int, help="overrides the preset")
    m.add_argument("--depth", type=int, help="overrides the preset")
    m.add_argument("--heads", type=int, help="overrides the preset")
    m.add_argument("--mlp-ratio", type=float, help="overrides the preset")
    m.add_argument("--dropout", type=float, default=0.0)
    m.add_argument("--pos-embed", choices=POS_EMBED_KINDS, default="learned")
    m.add_argument(
        "--init",
        choices=("mimetic", "timm"),
        default="mimetic",
        help="attention init: mimetic (local attention from the start; default) or plain timm trunc-normal",
    )
    o = p.add_argument_group("optimisation")
    o.add_argument("--epochs", type=int, default=12)
    o.add_argument("--batch-size", type=int, default=128, help="per process")
    o.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    o.add_argument("--weight-decay", type=float, default=0.05)
    o.add_argument("--warmup-epochs", type=float, default=1.0)
    o.add_argument("--label-smoothing", type=float, default=0.1)
    o.add_argument("--clip-grad", type=float, default=1.0, help="max gradient norm (0: off)")
    r = p.add_argument_group("run")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    r.add_argument("--workers", type=int, default=2, help="data loader processes")
    r.add_argument("--output", type=Path, default=Path("runs/vit.safetensors"), help="checkpoint path")
    r.add_argument("--resume", action="store_true", help="continue from <output>.state.pt")
    r.add_argument("--no-progress", action="store_true", help="no progress bars (logs and CI)")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace, num_classes: int, channels: int) -> ViTConfig:
    image_size, patch_size = DEFAULT_GEOMETRY[args.dataset]
    size = dict(PRESETS[args.preset])
    for key in ("dim", "depth", "heads", "mlp_ratio"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    return ViTConfig(
        image_size=args.image_size or image_size,
        patch_size=args.patch_size or patch_size,
        in_channels=channels,
        num_classes=num_classes,
        dropout=args.dropout,
        pos_embed=args.pos_embed,
        **size,
    )


def setup_distributed() -> Distributed:
    """Join the process group when launched by torchrun; a plain launch is a group of one."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Distributed()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Distributed(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def resolve_device(name: str, ddp: Distributed) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and ddp.enabled:
        name = f"cuda:{ddp.local_rank}"
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def param_groups(model: ViT, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: biases, norms, the CLS token and positions are left alone."""
    skip = model.no_weight_decay()
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


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


def main(argv: list[str] | None = None) -> History:
    args = parse_args(argv)
    ddp = setup_distributed()
    device = resolve_device(args.device, ddp)
    torch.manual_seed(args.seed + ddp.rank)
    opts = DataOptions(
        dataset=args.dataset,
        data_dir=args.data_dir,
        download=args.download and ddp.is_main,
        image_size=args.image_size,
        channels=args.channels,
        randaugment=args.randaugment,
        shapes_train=args.shapes_train,
        shapes_test=args.shapes_test,
        seed=args.seed,
    )
    if ddp.enabled and args.download:  # rank 0 downloads first; the others then read the files
        if ddp.is_main:
            build_data(opts)
        dist.barrier()
    data = build_data(opts)
    config = build_config(args, len(data.classes), data.preprocessing.channels)
    if config.image_size != data.preprocessing.image_size:
        raise SystemExit(f"--image-size {config.image_size} disagrees with the data ({data.preprocessing.image_size})")
    model = ViT(config)
    if args.init == "mimetic":
        model.mimetic_init_(torch.Generator().manual_seed(args.seed))
    model = model.to(device)
    train_loader = make_loader(data.train, args, ddp, train=True)
    test_loader = make_loader(data.test, args, ddp, train=False)
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.999))
    steps_per_epoch = len(train_loader)
    total_steps, warmup_steps = args.epochs * steps_per_epoch, int(args.warmup_epochs * steps_per_epoch)
    history, start_epoch = History(), 1
    if args.resume:
        state = torch.load(state_path(args.output), map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        history = History(state["epochs"], state["best_accuracy"], state["best_epoch"])
        start_epoch = int(state["epoch"]) + 1
    net: nn.Module = (
        DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None) if ddp.enabled else model
    )
    if ddp.is_main:
        sizes = f"{len(data.train)} train / {len(data.test)} test images"  # type: ignore[arg-type]
        print(f"{args.dataset}: {sizes}, {len(data.classes)} classes")
        print(f"ViT {param_count_str(model.num_parameters())} params {config} on {device} x{ddp.world_size}")
    started = time.monotonic()
    for epoch in range(start_epoch, args.epochs + 1):
        if isinstance(train_loader.sampler, DistributedSampler):
            train_loader.sampler.set_epoch(epoch)
        net.train()
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device)
        seen = 0
        bar = tqdm(train_loader, desc=f"epoch {epoch}/{args.epochs}", disable=args.no_progress or not ddp.is_main)
        for i, (x, y) in enumerate(bar):
            step = (epoch - 1) * steps_per_epoch + i
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total_steps, warmup_steps, args.lr)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device):
                logits = net(x)
                loss = F.cross_entropy(logits.float(), y, label_smoothing=args.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if args.clip_grad > 0:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
            loss_sum += loss.detach() * y.numel()
            correct += (logits.argmax(1) == y).sum()
            seen += y.numel()
            if i % 20 == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
        stats = torch.stack([loss_sum, correct, torch.tensor(float(seen), device=device)])
        if ddp.enabled:
            dist.all_reduce(stats)
        test_acc = evaluate_accuracy(model, test_loader, device, ddp)
        record = {
            "epoch": epoch,
            "train_loss": float(stats[0] / stats[2]),
            "train_accuracy": float(stats[1] / stats[2]),
            "test_accuracy": test_acc,
            "elapsed_s": round(time.monotonic() - started, 1),
        }
        history.epochs.append(record)
        if ddp.is_main:
            print(
                f"epoch {epoch}: train loss {record['train_loss']:.4f} acc {record['train_accuracy']:.4f} | "
                f"test acc {test_acc:.4f} | {record['elapsed_s']:.0f}s",
                flush=True,
            )
            if test_acc > history.best_accuracy:
                history.best_accuracy, history.best_epoch = test_acc, epoch
                save_checkpoint(args.output, model, data.classes, data.preprocessing, summary(args, history, started))
            write_artifacts(args, model, optimizer, history, epoch)
    if ddp.enabled:
        dist.destroy_process_group()
    if ddp.is_main:
        print(f"best test accuracy {history.best_accuracy:.4f} (epoch {history.best_epoch}) -> {args.output}")
    return history


def summary(args: argparse.Namespace, history: History, started: float) -> dict[str, Any]:
    """The training record a checkpoint carries."""
    return {
        "dataset": args.dataset,
        "epochs": history.best_epoch,
        "epochs_planned": args.epochs,
        "seed": args.seed,
        "test_accuracy": round(history.best_accuracy, 6),
        "train_samples": args.shapes_train if args.dataset == "shapes" else None,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "init": args.init,
        "train_time_s": round(time.monotonic() - started, 1),
    }


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


if __name__ == "__main__":
    main()
