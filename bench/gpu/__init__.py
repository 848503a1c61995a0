"""The GPU benchmark: ceilings, raw forward (eager, compiled, CUDA graphs), preprocessing, and served throughput
against LitServe. Run it through `bash bench/gpu.sh run PARTS...` on a GPU machine (it installs what it needs).

    python -m bench.gpu --out DIR tests smoke ceilings decode raw served --peer   # what gpu-h100.md holds
    python -m bench.gpu --out DIR served --models vit-b16 --variants cpu-decode gpu-decode
    python -m bench.gpu --report DIR --name gpu-h100       # bench/results/gpu-h100.json and .md

Parts, each writing DIR/<part>.json (and a log) as it finishes, so a run cut short keeps what it measured:
  tests     the GPU tests (tests/app/test_cuda.py) under pytest
  smoke     the service on VIT_DEVICE=auto: /v1/model, /predict (with a map), V2, printed
  ceilings  the card's measured bf16 matmul rate and device-memory bandwidth
  raw       FLOPs per image, and the forward rate of ViT-S/16 and ViT-B/16 in bf16 at batch 1 to 512:
            eager, torch.compile, and compiled + CUDA graphs; then JPEG bytes to probabilities with no serving
            (the service's predictor fed batches of 256 JPEGs), for each GPU decoder, one and two batches in
            flight
  decode    preprocessing rate of 500x375 JPEGs: PIL on N CPU threads, and nvJPEG + tensor resize on the GPU
  hwdecode  nvImageCodec's decoders (the hardware JPEG engines, the CUDA decoder, splits between them): img/s
            alone and beside a CUDA-graphed ViT-B/16 forward, pixels against nvJPEG's and the CPU path's, and
            which kinds of JPEG the hardware engines take
  engines   the JPEG engines beside a forward: a CUPTI trace of where their time goes, nvImageCodec's options,
            the forward on fewer SMs (green contexts), at half duty, or a spin kernel in its place, the engines in
            a process of their own, and DALI's mixed decoder (bench/gpu/engines.py)
  served    the service under `hey` (/predict multipart, V2 binary with several images per request), per
            variant, and LitServe with the same model and batch settings as the peer
  profile   at saturation: the per-batch timeline from the service's own statistics (input, forward, output,
            cycle, and which bound holds), and py-spy samples of the served processes, all threads and those
            holding the GIL
"""
