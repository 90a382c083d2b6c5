# syntax=docker/dockerfile:1.7
# The planner: gRPC API, validation, tokenization, prefix grouping. CPU only; torch is needed for the
# tokenizer presets, so the small CPU build is installed before the project can pull the CUDA one.
# Build from the repository root:  docker build -f docker/planner.Dockerfile -t prefixgrove-planner .

ARG PYTHON_VERSION=3.12
ARG TORCH_VERSION=2.11.0

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VERSION
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md* ./
COPY services/ services/
COPY kernels/ kernels/
COPY operator/ operator/
COPY proto/ proto/
RUN pip install ".[services]"

FROM python:${PYTHON_VERSION}-slim
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
COPY --from=build /opt/venv /opt/venv
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp prefixgrove
USER 10001:10001
EXPOSE 50051 9090
# The health service answers without the bearer token, so this works with auth on.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 CMD \
  python -c "import grpc, os, sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
ch = grpc.insecure_channel('127.0.0.1:' + os.environ.get('PREFIXGROVE_PORT', '50051')); \
r = g.HealthStub(ch).Check(h.HealthCheckRequest(), timeout=4); sys.exit(r.status != h.HealthCheckResponse.SERVING)"
ENTRYPOINT ["prefixgrove"]
CMD ["serve", "planner", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9090"]
