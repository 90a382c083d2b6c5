# syntax=docker/dockerfile:1.7
# The kopf operator: runs BatchJobs against the planner and scales the workers. It needs neither torch
# nor transformers, so the package goes in without its core dependencies and the operator extra's
# requirements are read from pyproject.toml (one list to maintain).
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t prefixgrove-operator .

ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md* ./
RUN python -c "import tomllib; \
print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['operator']))" \
    > /tmp/operator-requirements.txt \
    && pip install -r /tmp/operator-requirements.txt
COPY services/ services/
COPY kernels/ kernels/
COPY operator/ operator/
COPY proto/ proto/
RUN pip install --no-deps .

FROM python:${PYTHON_VERSION}-slim
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
COPY --from=build /opt/venv /opt/venv
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp prefixgrove
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["kopf", "run", "--standalone", "--module=prefixgrove_operator.handlers", \
            "--liveness=http://0.0.0.0:8080/healthz"]
CMD ["--all-namespaces"]
