# syntax=docker/dockerfile:1
# The SARA image: the `sara` CLI with the workers' runtime (PyTorch), used by every
# component of the Helm chart (operator, router, prefill and decode workers).
#
#   docker build -t REGISTRY/sara:0.1.0 .                       # CPU PyTorch
#   docker build -t REGISTRY/sara:0.1.0-cu128 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # CUDA PyTorch
#
# Runs as the non-root user 10001 with a read-only root filesystem in mind: nothing is
# written outside /tmp (HOME points there).

ARG PYTHON_IMAGE=python:3.12-slim

FROM ${PYTHON_IMAGE} AS build
# Where PyTorch comes from: the CPU wheels by default; a CUDA index for GPU workers.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Must match the pin of the `workers` extra in pyproject.toml.
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/sara
WORKDIR /src
COPY pyproject.toml README.md ./
COPY queueing/ queueing/
COPY sim/ sim/
COPY controller/ controller/
COPY workers/ workers/
COPY cli/ cli/
# PyTorch first, from its own index, so the project's install finds the pin satisfied
# and never pulls the default (CUDA) wheel from PyPI for a CPU image.
RUN /opt/sara/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && /opt/sara/bin/pip install ".[workers]" \
 && /opt/sara/bin/sara --help >/dev/null

FROM ${PYTHON_IMAGE}
ARG UID=10001
RUN groupadd --system --gid "${UID}" sara \
 && useradd --system --uid "${UID}" --gid "${UID}" --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin sara
COPY --from=build /opt/sara /opt/sara
ENV PATH=/opt/sara/bin:${PATH} \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
# router, operator REST API, worker metrics/health
EXPOSE 8000 8080 9400
ENTRYPOINT ["sara"]
CMD ["--help"]
