# syntax=docker/dockerfile:1.7
# A GPU worker: leases prefix groups from Redis and runs the engine with Triton cascade attention.
# Build from the repository root:  docker build -f docker/worker.Dockerfile -t prefixgrove-worker .
# Run with an NVIDIA device (NVIDIA Container Toolkit): docker run --gpus 1 ...

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION
ARG TORCH_INDEX
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md* ./
COPY services/ services/
COPY kernels/ kernels/
COPY operator/ operator/
COPY proto/ proto/
RUN pip install ".[services]"

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# NOTE: Triton compiles a small C launcher per kernel signature at run time: it needs a C compiler
# and Python's headers in the image, not only at build time.
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp TRITON_CACHE_DIR=/tmp/triton \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=build /opt/venv /opt/venv
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp prefixgrove \
    && mkdir -p /tmp/triton && chown 10001:10001 /tmp/triton
# A volume mounted on /tmp/triton (compose's kernel cache) starts with this directory's owner.
USER 10001:10001
EXPOSE 9091
HEALTHCHECK --interval=20s --timeout=5s --start-period=300s --retries=3 CMD \
  python -c "import os, urllib.request; \
urllib.request.urlopen('http://127.0.0.1:%s/metrics' % os.environ.get('PREFIXGROVE_METRICS_PORT', '9091'), timeout=4)"
ENTRYPOINT ["prefixgrove"]
CMD ["serve", "worker", "--device", "cuda", "--host", "0.0.0.0", "--metrics-port", "9091"]
