# syntax=docker/dockerfile:1
# The one kube-vgpu image: `kube-vgpu extender`, `kube-vgpu webhook`, `kube-vgpu device-plugin` and
# `kube-vgpu certs` differ only by subcommand (manifests/base). It also carries the limiter, HAMi-core's
# libvgpu.so, under /opt/kube-vgpu/limiter/ (libvgpu.so, libvgpu.so.sha256, VERSION) for the node installer.
# Build from the repository root (docs/install.md "Building the image"):
#   docker build -t ghcr.io/kube-vgpu/kube-vgpu:0.1.0 --build-arg REVISION=$(git rev-parse HEAD) .
# The base is pinned by version; to pin it by digest as well, append @sha256:... to BASE_IMAGE
# (`docker buildx imagetools inspect python:3.11.14-slim-bookworm` prints it). Any base with python3 (>= 3.11, with
# the venv module) at the same path in both stages works: tests/manifests/test_image_build.py builds this file on a
# Debian bookworm root filesystem made by debootstrap, where python3 is /usr/bin/python3.
# Where the limiter comes from is LIMITER_STAGE: limiter-build (default) compiles HAMi-core at a pinned commit against
# the CUDA headers of NVIDIA's CUDA development image; limiter-prebuilt takes limiter/libvgpu.so from the context.
# (buildah 1.28 skips a stage named only by an ARG default: with buildah, pass --build-arg LIMITER_STAGE=... always.)

ARG BASE_IMAGE=python:3.11.14-slim-bookworm
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:12.9.1-devel-ubuntu22.04
ARG LIMITER_STAGE=limiter-build

# --- stage: the limiter from source ----------------------------------------------------------------------------
# HAMi-core at a pinned commit: the one Project-HAMi/HAMi's libvgpu submodule pointed at in August 2026. build.sh is
# upstream's own build (cmake, with the hooks HAMi enables); the CUDA stub libraries of the -devel image satisfy
# -lcuda/-lnvidia-ml at link time, so no GPU or driver is needed to build.
FROM ${CUDA_DEVEL_IMAGE} AS limiter-build
ARG HAMI_CORE_REPOSITORY=https://github.com/Project-HAMi/HAMi-core.git
ARG HAMI_CORE_COMMIT=a26e57e0061efed98d32310a8a7986935dc9098e
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates cmake git make \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src/hami-core
RUN git init -q . \
 && git remote add origin "${HAMI_CORE_REPOSITORY}" \
 && git fetch -q --depth 1 origin "${HAMI_CORE_COMMIT}" \
 && git checkout -q FETCH_HEAD \
 && bash ./build.sh \
 && mkdir -p /limiter \
 && cp build/libvgpu.so /limiter/libvgpu.so \
 && printf 'hami-core-%.12s\n' "${HAMI_CORE_COMMIT}" > /limiter/VERSION
WORKDIR /limiter
RUN sha256sum libvgpu.so > libvgpu.so.sha256

# --- stage: a limiter built elsewhere --------------------------------------------------------------------------
# --build-arg LIMITER_STAGE=limiter-prebuilt: limiter/libvgpu.so from the build context, described by
# LIMITER_VERSION (your own HAMi-core build, or, in tests/manifests/test_image_build.py, a labelled placeholder).
FROM ${BASE_IMAGE} AS limiter-prebuilt
# one word (letters, digits, ".", "_", "-"; at most 50): the node's version directory and its limiter label
ARG LIMITER_VERSION=prebuilt
WORKDIR /limiter
COPY limiter/libvgpu.so libvgpu.so
RUN printf '%s\n' "${LIMITER_VERSION}" > VERSION \
 && sha256sum libvgpu.so > libvgpu.so.sha256

# --- the chosen limiter ----------------------------------------------------------------------------------------
FROM ${LIMITER_STAGE} AS limiter

# --- stage: build the wheel and the virtual environment ---------------------------------------------------------
# The venv lives at /opt/kube-vgpu/venv here and in the runtime stage; its bin/python links to the base's python3,
# which is at the same path in both stages because both stages are the same base. Compilers never reach the runtime.
FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md requirements.lock ./
COPY kube_vgpu/ kube_vgpu/
COPY extender/ extender/
COPY webhook/ webhook/
COPY deviceplugin/ deviceplugin/
COPY manifests/ manifests/
# the dependencies (grpcio, cryptography, orjson, ...) come as manylinux wheels: exactly the locked versions,
# hash-checked, then the wheel itself without resolving anything else; numpy's own test suite (~17 MB) is dropped. Behind a TLS-intercepting proxy, hand pip the
# proxy's CA bundle as a build secret (--secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt); it is not kept.
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && python3 -m venv /opt/kube-vgpu/venv \
 && /opt/kube-vgpu/venv/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/kube-vgpu/venv/bin/pip install --only-binary=:all: --require-hashes -r requirements.lock \
 && /opt/kube-vgpu/venv/bin/pip install --no-deps /wheels/kube_vgpu-*.whl \
 && find /opt/kube-vgpu/venv/lib -path '*/site-packages/numpy/*' -type d -name tests -prune -exec rm -rf {} + \
 && /opt/kube-vgpu/venv/bin/python -m pip uninstall -q -y pip setuptools \
 && /opt/kube-vgpu/venv/bin/kube-vgpu --help > /dev/null

# --- stage: the runtime ----------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG BASE_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="kube-vgpu" \
      org.opencontainers.image.description="Share NVIDIA GPUs on Kubernetes: scheduler extender, admission webhook and device plugin" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/kube-vgpu/kube-vgpu" \
      org.opencontainers.image.documentation="https://github.com/kube-vgpu/kube-vgpu/tree/main/docs" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
ENV PATH=/opt/kube-vgpu/venv/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# uid/gid 65532 as in the manifests' securityContext (runAsNonRoot needs a numeric USER to verify)
RUN groupadd --system --gid 65532 kube-vgpu \
 && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home \
            --shell /usr/sbin/nologin kube-vgpu
COPY --from=build /opt/kube-vgpu/venv/ /opt/kube-vgpu/venv/
COPY --from=limiter /limiter/ /opt/kube-vgpu/limiter/
USER 65532:65532
ENTRYPOINT ["kube-vgpu"]
CMD ["--help"]
