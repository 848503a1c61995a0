"""What the card computes: its bf16 matmul and copy ceilings, and the raw forward rate of each model."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu.common import MODELS, median_ms
from model.vit import ViT, ViTConfig


def ceilings() -> dict[str, Any]:
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = median_ms(lambda: a @ b, 1.0)
    elements = 2**30  # 1 GiB of float32 read, 1 GiB written
    src = torch.randn(elements // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), 1.0)
    result = {
        "matmul_bf16_tflops": 2 * n**3 / ms / 1e9,
        "copy_tb_per_s": 2 * src.numel() * 4 / copy_ms / 1e9,
        "gpu": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
    }
    print(f"ceilings: bf16 matmul {result['matmul_bf16_tflops']:.0f} TFLOP/s, copy {result['copy_tb_per_s']:.2f} TB/s")
    return result


def model_on_gpu(config: ViTConfig, seed: int = 0) -> ViT:
    torch.manual_seed(seed)
    return ViT(config).to("cuda", torch.bfloat16).eval()


def flops_per_image(model: ViT, config: ViTConfig) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(1, 3, config.image_size, config.image_size, device="cuda", dtype=torch.bfloat16)
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        model.forward_with_embedding(x)
    return float(counter.get_total_flops())


def check_close(fn: Callable[[torch.Tensor], Any], model: ViT, config: ViTConfig) -> float:
    """‖fn(x) - fp32(x)‖ / ‖fp32(x)‖ on fresh random input: the bf16 path against the fp32 model."""
    x = torch.randn(8, 3, config.image_size, config.image_size, device="cuda")
    reference = ViT(config).to("cuda").eval()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.inference_mode():
        want = reference.forward_with_embedding(x)[0].double()
        got = fn(x.bfloat16())[0].double()
    return float((got - want).norm() / want.norm())


def raw(models: list[str], batches: list[int], compile_batches: list[int]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name in models:
        config = MODELS[name]
        model = model_on_gpu(config)

        def eager(x: torch.Tensor, model: ViT = model) -> tuple[torch.Tensor, torch.Tensor]:
            logits, embedding, _ = model.forward_with_embedding(x)
            return logits, embedding

        flops = flops_per_image(model, config)
        started = time.perf_counter()
        compiled = torch.compile(eager)
        rows: dict[str, dict[int, float]] = {"eager": {}, "compiled": {}, "eager+graphs": {}, "compiled+graphs": {}}
        errors = {"eager": check_close(eager, model, config)}
        with torch.inference_mode():
            for bs in batches:
                xs = [
                    torch.randn(bs, 3, config.image_size, config.image_size, device="cuda", dtype=torch.bfloat16)
                    for _ in range(3)
                ]
                turn = iter(range(10**9))
                rows["eager"][bs] = bs / median_ms(lambda xs=xs, t=turn: eager(xs[next(t) % 3])) * 1e3
                rows["eager+graphs"][bs] = bs / graph_ms(eager, xs[0]) * 1e3
                if bs in compile_batches:
                    rows["compiled"][bs] = bs / median_ms(lambda xs=xs, t=turn, f=compiled: f(xs[next(t) % 3])) * 1e3
                    rows["compiled+graphs"][bs] = bs / graph_ms(compiled, xs[0]) * 1e3
                print(
                    f"  {name} batch {bs:>4}: "
                    + "  ".join(f"{k} {v[bs]:8.0f}" for k, v in rows.items() if bs in v)
                    + " img/s",
                    flush=True,
                )
        errors["compiled"] = check_close(compiled, model, config)
        result[name] = {
            "gflops_per_image": flops / 1e9,
            "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "img_per_s": rows,
            "relative_error_vs_fp32": errors,
            "compile_and_runs_s": time.perf_counter() - started,
        }
        best = max(max(v.values()) for v in rows.values() if v)
        print(
            f"  {name}: {flops / 1e9:.2f} GFLOP/image, best {best:.0f} img/s = "
            f"{best * flops / 1e12:.0f} TFLOP/s; rel. error vs fp32 {errors}"
        )
        del model, compiled
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return result


def graph_ms(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> float:
    """Milliseconds per replay of `fn(x)` captured as one CUDA graph (NaN where capture fails)."""
    try:
        return captured_ms(fn, x)
    except RuntimeError as e:
        print(f"  CUDA graph capture failed: {e}")
        return float("nan")


def captured_ms(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> float:
    return median_ms(capture(fn, x.clone()).replay)


def capture(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> torch.cuda.CUDAGraph:
    """`fn(x)` as one CUDA graph, after three warm-up calls on a side stream (capture wants the kernels chosen)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x)
    return graph
