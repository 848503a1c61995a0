# syntax=docker/dockerfile:1
# The ViT service: one `python -m app` process per container, HTTP and gRPC over one engine (batching
# lives inside the process; more processes would split batches and load the model once each). Runs on a GPU when the container
# gets one (docker-compose.yml reserves it), else on the CPU.

ARG PYTHON_VERSION=3.11

# Dependencies first, in their own stage and layer: a code change does not reinstall torch.
FROM python:${PYTHON_VERSION}-slim AS deps
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
COPY requirements.lock /tmp/requirements.lock
RUN /opt/venv/bin/pip install -r /tmp/requirements.lock

# `docker build --target ray .`: the same service and batch runner plus Ray (the dashboard and job
# submission KubeRay uses, and Ray Data), for deploy/ray. KubeRay starts `ray start` in it itself.
FROM deps AS ray-deps
COPY requirements-ray.lock /tmp/requirements-ray.lock
RUN /opt/venv/bin/pip install -r /tmp/requirements-ray.lock

FROM python:${PYTHON_VERSION}-slim AS ray
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# KubeRay's probes of the Ray head and workers call wget
RUN apt-get update && apt-get install -y --no-install-recommends wget && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 vit
COPY --from=ray-deps /opt/venv /opt/venv
WORKDIR /srv
COPY pyproject.toml ./
COPY model/ model/
COPY app/ app/
COPY weights/ weights/
USER vit

# The default target: the service.
FROM python:${PYTHON_VERSION}-slim AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIT_WEIGHTS=/srv/weights/vit-shapes.safetensors
# the ONNX graph cache's folder (VIT_ONNX_CACHE), owned by the user, so a volume mounted there starts writable
RUN useradd --create-home --uid 10001 vit && install -d -o vit -g vit /home/vit/.cache /home/vit/.cache/vit-serve
COPY --from=deps /opt/venv /opt/venv
WORKDIR /srv
COPY pyproject.toml ./
COPY model/ model/
COPY app/ app/
COPY weights/ weights/
USER vit
EXPOSE 8000
# the Open Inference Protocol over gRPC (VIT_GRPC_PORT)
EXPOSE 8001
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health/ready', timeout=2).status != 200)"]
STOPSIGNAL SIGTERM
CMD ["python", "-m", "app", "--host", "0.0.0.0", "--port", "8000"]
