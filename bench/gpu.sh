#!/usr/bin/env bash
# The GPU benchmark and tests, in two steps:
#
#   bash bench/gpu.sh prepare            # here, with the registries: wheels into .whl/, hey into .gpu/
#   bash bench/gpu.sh run PARTS... -- ARGS  # on the GPU machine, from a clean copy of the tree plus .whl and .gpu
#
# The GPU machine has no network and its own torch (2.11 with CUDA 13): the web stack and the load
# generator travel as wheels and a static binary and are installed with --no-deps beside its torch.
# PARTS: tests, smoke, ceilings, raw, decode, hwdecode, served, profile (see python -m bench.gpu --help); results go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

# The service's web stack, the test plugins and the peer (LitServe), pinned as in requirements*.lock.
WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.3 pydantic-core==2.50.4 pydantic-settings==2.16.3
  python-dotenv==1.2.4 annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7
  opentelemetry-api==1.45.2 uvicorn==0.54.0 httptools==0.9.0 python-multipart==0.0.34 fastapi-offline==1.7.7
  protobuf==6.33.6 grpcio==1.85.1 asgi-lifespan==2.1.0 sniffio==1.3.1 pytest-asyncio==1.5.0
  litserve==0.2.19 pyzmq==27.3.0 py-spy==0.4.3
  nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.0.3.75
)

case "${1:-}" in
prepare)
  mkdir -p .whl .gpu
  grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >>.git/info/exclude
  grep -qx '/.gpu/' .git/info/exclude || echo /.gpu/ >>.git/info/exclude
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${WHEELS[@]}"
  (cd .gpu && apt-get download hey && dpkg -x hey_*.deb unpacked && cp unpacked/usr/bin/hey . && rm -rf unpacked hey_*.deb)
  du -sh .whl .gpu
  ;;
run)
  shift
  : "${OUT:?set OUT to the folder the results go to}"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.gpu:/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)" | tee -a "$OUT/gpu.txt"
  echo "$(nproc) CPU cores: $(lscpu | sed -n 's/^Model name: *//p')" | tee -a "$OUT/gpu.txt"
  python3 -m bench.gpu --out "$OUT" "$@"
  # A device returns a few files from $OUT: the parts' JSON (the profile's summary included) stay files, and the
  # py-spy stacks and the servers' logs travel as one archive.
  (cd "$OUT" && shopt -s nullglob && extras=(profile-*.txt servers.log) &&
    if [ ${#extras[@]} -gt 0 ]; then tar czf stacks-and-logs.tar.gz "${extras[@]}" && rm -f "${extras[@]}"; fi)
  ;;
*)
  echo "usage: bash bench/gpu.sh prepare | run PARTS... [options]" >&2
  exit 2
  ;;
esac
