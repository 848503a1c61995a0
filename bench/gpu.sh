#!/usr/bin/env bash
# The GPU benchmark and tests, in two steps:
#
#   bash bench/gpu.sh prepare            # here, with the registries: wheels into .whl/, hey into .gpu/
#   bash bench/gpu.sh run PARTS... -- ARGS  # on the GPU machine, from a clean copy of the tree plus .whl and .gpu
#
# The GPU machine has no network and its own torch (2.11 with CUDA 13): the web stack and the load
# generator travel as wheels and a static binary and are installed with --no-deps beside its torch.
# PARTS: tests, smoke, ceilings, raw, decode, hwdecode, engines, served, profile (see python -m bench.gpu
# --help); results go to $OUT.
#
# DALI (VIT_DECODE=dali, the engines part's DALI section) is larger than one call may carry (64 MiB with the
# tree), so it travels in parts over calls to one warm machine, before the run:
#
#   bash bench/gpu.sh prepare-dali       # here: DALI 2.4 for Python 3.12, trimmed, as .dali/part-NN (+ manifest)
#   bash bench/gpu.sh receive .dali/part-00   # there, one call per part, carrying that part (and the manifest)
#   bash bench/gpu.sh run ...            # there: installs DALI when every part has arrived, else runs without
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

# DALI 2.4 and the pure-Python packages it imports (its nvCOMP, loaded only by decompression operators, stays)
DALI_WHEELS=(nvidia-dali-cuda130==2.4.0 optree==0.20.0 makefun==1.16.0 astunparse==1.6.3 gast==0.7.0 libcst==1.9.0 nvtx==0.2.17
  six==1.17.0)

RECEIVED=/tmp/dali-received  # where the GPU machine keeps DALI's parts between calls

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
prepare-dali)
  # DALI's wheel without the builds for other Pythons and its C++ headers, and the pure-Python packages it
  # imports, as one xz archive cut into parts that fit a call beside the tree.
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$work/wheels" "${DALI_WHEELS[@]}"
  mkdir -p "$work/site"
  for wheel in "$work"/wheels/*.whl; do (cd "$work/site" && python3 -m zipfile -e "$wheel" .); done
  rm -rf "$work"/site/nvidia/dali/include "$work"/site/nvidia/dali/test
  find "$work/site" -name '*.cpython-3*' ! -name '*cpython-312-*' -delete
  rm -rf .dali && mkdir .dali
  grep -qx '/.dali/' .git/info/exclude || echo /.dali/ >>.git/info/exclude
  tar -C "$work/site" -cf - . | xz -T0 -6 >"$work/dali.tar.xz"
  split -b 50M -d -a 2 "$work/dali.tar.xz" .dali/part-
  (cd .dali && sha256sum "$work/dali.tar.xz" | cut -d' ' -f1 >sha256 && ls part-* >parts)
  ls -la .dali
  ;;
receive)
  # On the GPU machine: keep a carried part outside the tree, which each call copies afresh (an ignored folder
  # in it does not outlive the call).
  shift
  mkdir -p "$RECEIVED"
  for part in "$@"; do cp "$part" "$RECEIVED/"; done
  cp .dali/parts .dali/sha256 "$RECEIVED/" 2>/dev/null || true
  ls -la "$RECEIVED"
  ;;
run)
  shift
  : "${OUT:?set OUT to the folder the results go to}"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  if [ -f "$RECEIVED/parts" ] && (cd "$RECEIVED" && ls $(cat parts) >/dev/null 2>&1); then
    (cd "$RECEIVED" && cat $(cat parts) >/tmp/dali.tar.xz)
    if [ "$(sha256sum /tmp/dali.tar.xz | cut -d' ' -f1)" = "$(cat "$RECEIVED/sha256")" ]; then
      tar -C /tmp/site -xJf /tmp/dali.tar.xz && echo "DALI installed from $(wc -l <"$RECEIVED/parts") parts"
    else
      echo "DALI's parts do not join to the prepared archive: running without DALI" >&2
    fi
  else
    echo "DALI's parts have not all arrived (bash bench/gpu.sh receive): running without DALI" >&2
  fi
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
  echo "usage: bash bench/gpu.sh prepare | prepare-dali | receive PART... | run PARTS... [options]" >&2
  exit 2
  ;;
esac
