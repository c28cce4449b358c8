# syntax=docker/dockerfile:1
# The shapegate gateway image (also runs the simulator: `shapegate sim`).
#
#   docker build -t shapegate:0.1.0 .
#   docker run -p 8000:8000 -v $PWD/configs/demo.yaml:/etc/shapegate/policy.yaml:ro shapegate:0.1.0
#
# Two stages: the build stage installs the package and its wheels into a virtualenv; the final
# stage copies only that virtualenv onto a fresh slim Python, so no pip cache, no build
# front-end and no compiler reach production. Every dependency ships manylinux wheels (the slim
# build stage has no compiler either: a dependency that needs one fails the build, loudly).
# The image counts with gigatoken (the `[gigatoken]` extra: the fastest exact tokenizer, which
# brings numpy); a plain `pip install shapegate` counts with tiktoken.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/shapegate
WORKDIR /src
# Dependencies first, from pyproject.toml alone, so a code change does not reinstall them.
COPY pyproject.toml README.md ./
RUN mkdir gateway engine_pool \
    && touch gateway/__init__.py engine_pool/__init__.py \
    && /opt/shapegate/bin/pip install '.[gigatoken]' \
    && /opt/shapegate/bin/pip uninstall --yes shapegate
COPY gateway ./gateway
COPY engine_pool ./engine_pool
RUN /opt/shapegate/bin/pip install --no-deps . \
    && /opt/shapegate/bin/pip uninstall --yes pip setuptools wheel

FROM ${PYTHON_IMAGE} AS runtime
# A fixed numeric uid, so Kubernetes' runAsNonRoot can check it without a passwd lookup.
RUN groupadd --system --gid 10001 shapegate \
    && useradd --system --uid 10001 --gid shapegate --no-create-home --shell /usr/sbin/nologin shapegate
COPY --from=build /opt/shapegate /opt/shapegate
# Example policies and the simulator's engine profiles ship inside the package (gateway/configs/,
# the repository's configs/ links to it); /app/configs points at them
# (`--profile /app/configs/engines/...`), and the demo policy is the default.
RUN configs="$(/opt/shapegate/bin/python -c 'from gateway.shipped import configs_dir; print(configs_dir())')" \
    && mkdir -p /app /etc/shapegate \
    && ln -s "$configs" /app/configs \
    && cp "$configs/demo.yaml" /etc/shapegate/policy.yaml
ENV PATH=/opt/shapegate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    SHAPEGATE_SERVER__HOST=0.0.0.0
WORKDIR /app
USER 10001:10001
EXPOSE 8000
# Liveness only (/healthz); orchestrators route on /readyz.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
ENTRYPOINT ["shapegate"]
CMD ["serve", "--config", "/etc/shapegate/policy.yaml"]
