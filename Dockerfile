FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY astraflow ./astraflow
COPY schemas ./schemas
COPY topology ./topology
RUN pip install --no-cache-dir -e .
ENV ASTRAFLOW_SCHEMAS=/app/schemas
