# syntax=docker/dockerfile:1
# The one kube-vgpu image: `kube-vgpu extender`, `kube-vgpu webhook`, `kube-vgpu device-plugin` and
# `kube-vgpu certs` differ only by subcommand (manifests/base). Build from the repository root:
#   docker build -t ghcr.io/kube-vgpu/kube-vgpu:0.1.0 --build-arg REVISION=$(git rev-parse HEAD) .
# The base is pinned by version; to pin it by digest as well, append @sha256:... to both FROM lines
# (`docker buildx imagetools inspect python:3.11.14-slim-bookworm` prints it).
# Checked statically by tests/manifests/test_dockerfile.py; no container engine runs in CI, so the build itself
# has not been executed there.

# --- stage 1: build the wheel ----------------------------------------------------------------------------------
FROM python:3.11.14-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md requirements.lock ./
COPY kube_vgpu/ kube_vgpu/
COPY extender/ extender/
COPY webhook/ webhook/
COPY deviceplugin/ deviceplugin/
COPY manifests/ manifests/
RUN pip wheel --no-deps --wheel-dir /wheels . \
 && cp requirements.lock /wheels/

# --- stage 2: the runtime --------------------------------------------------------------------------------------
FROM python:3.11.14-slim-bookworm
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="kube-vgpu" \
      org.opencontainers.image.description="Share NVIDIA GPUs on Kubernetes: scheduler extender, admission webhook and device plugin" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/kube-vgpu/kube-vgpu" \
      org.opencontainers.image.documentation="https://github.com/kube-vgpu/kube-vgpu/tree/main/docs" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11.14-slim-bookworm"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# uid/gid 65532 as in the manifests' securityContext (runAsNonRoot needs a numeric USER to verify)
RUN groupadd --system --gid 65532 kube-vgpu \
 && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home \
            --shell /usr/sbin/nologin kube-vgpu
# the wheel's dependencies (grpcio, cryptography, orjson, ...) come as manylinux wheels: no compiler needed; exactly
# the locked versions, hash-checked, then the wheel itself without resolving anything else
COPY --from=build /wheels/ /tmp/wheels/
RUN pip install --require-hashes -r /tmp/wheels/requirements.lock \
 && pip install --no-deps /tmp/wheels/kube_vgpu-*.whl \
 && rm -rf /tmp/wheels \
 && kube-vgpu --help > /dev/null
USER 65532:65532
ENTRYPOINT ["kube-vgpu"]
CMD ["--help"]
